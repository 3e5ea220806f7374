"""Tencent's Hunyuan dense models (``HunYuanDenseV1ForCausalLM``): Llama with per-head q/k
norms after RoPE and a fixed NTK stretch of the RoPE base (``alpha``; the ``ntk_alpha`` rope
type). Its MoE models (``HunYuanMoEV1ForCausalLM``) add experts under a float32 softmax
router beside a shared MLP."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.gpu_worker.layers.rope_config import NTK_ALPHA, rope_parameters
from pagedserve.gpu_worker.model_config import ExpertsSpec, GroupedRouting
from pagedserve.gpu_worker.models.architecture import (
    ROTATED_HEAD_NORM,
    Architecture,
    checked_experts,
)


class HunYuanDense(Architecture):
    lora = True
    qk_norm = ROTATED_HEAD_NORM
    extra_rope_types = (NTK_ALPHA,)
    # HunYuanDenseV1Config's.
    config_defaults = dict(rms_norm_eps=1e-5, max_position_embeddings=2048)

    def prepare(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """Its checkpoints label the RoPE "dynamic" with an ``alpha``, which HF's Hunyuan
        model runs as a fixed NTK stretch of the base (``ntk_alpha``: the same frequencies at
        every length), not as dynamic NTK."""
        parameters = rope_parameters(hf_config)
        if parameters["rope_type"] != "dynamic" or not parameters.get("alpha"):
            return hf_config
        alpha = parameters["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise ValueError(f"model: rope alpha must be a positive number, got {alpha!r}")
        return {**hf_config, "rope_parameters": {**parameters, "rope_type": NTK_ALPHA}}


class HunYuanMoe(HunYuanDense):
    config_defaults = dict(
        rms_norm_eps=1e-5, max_position_embeddings=2048, num_experts=1, moe_topk=1
    )

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        """Every layer ``num_experts`` experts of ``intermediate_size``, top ``moe_topk`` by a
        float32 softmax, renormalised, beside a shared MLP of the same size. Per-layer lists
        of the two are taken when all their entries agree."""
        num_layers = hf_config["num_hidden_layers"]
        fields = {}
        for name in ("num_experts", "moe_topk"):
            value = hf_config[name]
            if isinstance(value, list):
                if len(value) != num_layers or len(set(value)) != 1:
                    raise ValueError(
                        f"model: {name} per layer must hold one value for all {num_layers} "
                        f"layers, got {value!r:.200}"
                    )
                value = value[0]
            fields[name] = value
        spec = checked_experts(
            hf_config,
            num_experts=fields["num_experts"],
            num_experts_field="num_experts",
            top_k=fields["moe_topk"],
            intermediate_field="intermediate_size",
            renormalize=True,
            weights_in_float32=True,
        )
        spec = dataclasses.replace(
            spec,
            shared_intermediate_size=spec.intermediate_size,
            shared_expert_gated=False,
            grouped=GroupedRouting(
                sigmoid=False, num_groups=1, top_k_groups=1, routed_scaling_factor=1.0
            ),
        )
        return (spec,) * num_layers

    def checkpoint_name(self, name: str, hf_config: dict[str, Any]) -> str:
        """Its router (``mlp.gate.wg``) and shared MLP (``mlp.shared_mlp``) as ``SparseMoE``
        names them."""
        return name.replace(".mlp.gate.wg.", ".mlp.gate.").replace(
            ".mlp.shared_mlp.", ".mlp.shared_experts."
        )
