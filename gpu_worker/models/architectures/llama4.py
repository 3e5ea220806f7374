"""Meta's Llama 4 (``Llama4ForCausalLM``, the language model of Scout and Maverick): chunked
attention with RoPE on interleaved pairs (reordered on loading) and L2 norms of each query
and key head after RoPE on most layers; global attention without RoPE, its queries scaled by
a temperature growing with the position, on every fourth (``no_rope_layers``); a top-1
expert that scales its input by its sigmoid score beside a shared expert (stacked in the
checkpoint, split on loading: models/llama4.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec, ModelConfig
from pagedserve.gpu_worker.models.architecture import (
    WEIGHTLESS_ROTATED_HEAD_NORM,
    Architecture,
    check_layer_count,
    checked_experts,
    checked_int,
    no_rope_layers,
    num_experts,
)

_LAYER_TYPES = ("chunked_attention", "full_attention")


class Llama4(Architecture):
    model_module = "llama4"
    model_class = "Llama4ForCausalLM"
    has_classifier = False
    interleaved_rope = True
    dense_width_field = "intermediate_size_mlp"
    # Llama4TextConfig's (Llama 4 Scout's shapes).
    config_defaults = dict(
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        head_dim=128,
        max_position_embeddings=131_072,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        use_qk_norm=True,
        no_rope_layer_interval=4,
        attention_chunk_size=8192,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
    )

    def rope_layers(self, hf_config: dict[str, Any]) -> tuple[bool, ...]:
        return no_rope_layers(hf_config, lenient=True)

    def query_norm(self, hf_config: dict[str, Any], rotates: bool) -> str | None:
        return WEIGHTLESS_ROTATED_HEAD_NORM if hf_config["use_qk_norm"] and rotates else None

    def layer_attention_chunks(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        """As Llama4TextConfig derives them: ``layer_types``, else ``"chunked_attention"`` on
        the layers with RoPE when ``attention_chunk_size`` is set (null: no chunks); a chunked
        layer's tokens attend only to the earlier tokens of their own chunk."""
        num_layers = hf_config["num_hidden_layers"]
        chunk = hf_config.get("attention_chunk_size")
        layer_types = hf_config.get("layer_types") or [
            "chunked_attention" if rotates and chunk is not None else "full_attention"
            for rotates in self.rope_layers(hf_config)
        ]
        check_layer_count(layer_types, num_layers)
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"model: layer_types holds {', '.join(map(repr, unknown))}, which Llama 4 does "
                f"not have; supported: {', '.join(_LAYER_TYPES)}"
            )
        if "chunked_attention" in layer_types and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
        ):
            raise ValueError(
                "model: attention_chunk_size must be an integer >= 1 where layer_types has "
                f"chunked_attention layers, got {chunk!r}"
            )
        return tuple(chunk if kind == "chunked_attention" else 0 for kind in layer_types)

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        """At the layers in ``moe_layers``, else at every ``interleave_moe_layer_step``-th
        (default 1: all): ``num_local_experts`` (default 16) of ``intermediate_size``, the top
        ``num_experts_per_tok`` (default 1) by logit, each scaling its input by its logit's
        sigmoid, plus a shared expert of ``intermediate_size``; the other layers have a dense
        MLP of ``intermediate_size_mlp``."""
        num_layers = hf_config["num_hidden_layers"]
        count, field = num_experts(hf_config, 16)
        spec = checked_experts(
            hf_config,
            num_experts=count,
            num_experts_field=field,
            top_k=hf_config["num_experts_per_tok"],
            intermediate_field="intermediate_size",
            renormalize=False,
            weights_in_float32=False,
        )
        spec = dataclasses.replace(
            spec,
            shared_intermediate_size=spec.intermediate_size,
            shared_expert_gated=False,
            sigmoid_scales_input=True,
        )
        moe_layers = hf_config.get("moe_layers")
        if moe_layers is None:
            step = checked_int(
                "interleave_moe_layer_step", hf_config["interleave_moe_layer_step"], 1
            )
            moe_layers = list(range(step - 1, num_layers, step))
        if not isinstance(moe_layers, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
            for i in moe_layers
        ):
            raise ValueError(
                f"model: moe_layers must list layer indices from 0 to {num_layers - 1}, "
                f"got {moe_layers!r:.200}"
            )
        sparse = set(moe_layers)
        if len(sparse) < num_layers:
            checked_int("intermediate_size_mlp", hf_config.get("intermediate_size_mlp"), 1)
        return tuple(spec if i in sparse else None for i in range(num_layers))

    def nope_temperature(self, config: ModelConfig, rotates: bool) -> tuple[float, int] | None:
        """(``attn_scale``, ``floor_scale``) on a layer without RoPE when
        ``attn_temperature_tuning`` says: each query scaled by
        ``1 + attn_scale * log(1 + floor((position + 1) / floor_scale))``, so that queries far
        into a long context sharpen their global attention."""
        hf = config.hf_config
        if rotates or not hf["attn_temperature_tuning"]:
            return None
        scale, floor_scale = hf["attn_scale"], hf["floor_scale"]
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not math.isfinite(scale)
        ):
            raise ValueError(f"model: attn_scale must be a finite number, got {scale!r}")
        return float(scale), checked_int("floor_scale", floor_scale, 1)

    def checkpoint_name(self, name: str, hf_config: dict[str, Any]) -> str:
        """Its feed-forward names (``feed_forward``, its ``router``, its ungated
        ``shared_expert``) as ``SparseMoE`` and ``GatedMLP`` hold them."""
        return (
            name.replace(".feed_forward.router.", ".mlp.gate.")
            .replace(".feed_forward.shared_expert.", ".mlp.shared_experts.")
            .replace(".feed_forward.", ".mlp.")
        )
