"""llama.cpp's gpt-oss: biases and a sink per head on the attention, a router with a bias; the
experts' stacked gate, up (or fused gate_up) and down tensors, MXFP4 in OpenAI's files,
restacked as HF keeps them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedserve.frontend.gguf import rope
from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value


class GptOss(Architecture):
    hf_architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    bias_field = "attention_bias"
    layer_names = (
        ("post_attention_norm", "post_attention_layernorm"),
        ("attn_sinks", "self_attn.sinks"),
        ("ffn_gate_inp", "mlp.router"),
        # Interim names, restacked by joined_tensors.
        ("ffn_gate_exps", "mlp.experts.gate"),
        ("ffn_up_exps", "mlp.experts.up"),
        ("ffn_gate_up_exps", "mlp.experts.gate_up"),
        ("ffn_down_exps", "mlp.experts.down"),
    )
    expert_projections = ()

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Every layer sparse (the router's rows are the experts), the experts' size, top-k,
        the window on the even layers (llama.cpp's fixed pattern, HF's default)."""
        key = metadata.key
        top_k = key("expert_used_count")
        if top_k is None:
            raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
        window = key("attention.sliding_window")
        if window is None:
            raise ValueError("GGUF gpt-oss has no attention.sliding_window")
        intermediate = key("expert_feed_forward_length", key("feed_forward_length"))
        config.update(
            {
                "num_local_experts": metadata.tensor_shapes["blk.0.ffn_gate_inp.weight"][0],
                "num_experts_per_tok": int(top_k),
                "intermediate_size": int(intermediate),
                "sliding_window": int(window),
            }
        )

    def rope_scaling(self, metadata: GGUFMetadata) -> dict[str, Any] | None:
        # llama.cpp writes YaRN's factor and original context, and fixes the rest to
        # gpt-oss's (its config's beta_fast 32, beta_slow 1, no truncation).
        key = metadata.key
        return {
            **(rope.scaling_from_keys(key) or {}),
            "beta_fast": float32_value(key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float32_value(key("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }

    def joined_tensors(
        self, tensors: Iterator[tuple[str, np.ndarray]], config: dict[str, Any]
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The experts as HF stacks them: llama.cpp's gate and up ([experts, intermediate,
        hidden] each, or one gate_up of gate rows then up rows) interleaved column by column
        into ``gate_up_proj`` [experts, hidden, 2 x intermediate] (biases likewise), its down
        [experts, hidden, intermediate] transposed into ``down_proj``; the sinks unsuffixed."""
        halves: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        for name, tensor in tensors:
            if name.endswith(".self_attn.sinks.weight"):
                yield name.removesuffix(".weight"), tensor
                continue
            stem, _, rest = name.partition(".mlp.experts.")
            if not rest:
                yield name, tensor
                continue
            projection, kind = rest.split(".")
            prefix = f"{stem}.mlp.experts."
            bias = "_bias" if kind == "bias" else ""
            if projection == "down":
                yield (
                    prefix + "down_proj" + bias,
                    np.ascontiguousarray(tensor.swapaxes(-1, -2) if not bias else tensor),
                )
                continue
            if projection == "gate_up":
                gate, up = np.split(tensor, 2, axis=1 if not bias else -1)
                pair = {"gate": gate, "up": up}
            else:
                pair = halves.setdefault((prefix, kind), {})
                pair[projection] = tensor
                if len(pair) < 2:
                    continue
                del halves[(prefix, kind)]
            gate, up = pair["gate"], pair["up"]
            if not bias:  # [experts, rows, hidden] -> HF's [experts, hidden, rows]
                gate, up = gate.swapaxes(-1, -2), up.swapaxes(-1, -2)
            interleaved = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=gate.dtype)
            interleaved[..., 0::2], interleaved[..., 1::2] = gate, up
            yield prefix + "gate_up_proj" + bias, interleaved
        if halves:
            missing = ", ".join(
                f"{prefix}{kind}: {sorted(pair)}" for (prefix, kind), pair in halves.items()
            )
            raise ValueError(
                f"GGUF gpt-oss has an expert gate or up tensor without the other: {missing}"
            )
