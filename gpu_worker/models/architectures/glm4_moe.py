"""Zhipu's GLM-4.5 (``Glm4MoeForCausalLM``): Llama with q/k/v biases (``attention_bias``: none
on the output projection), RoPE over half of each head, optional per-head q/k norms
(``use_qk_norm``), and, from layer ``first_k_dense_replace`` on, experts under DeepSeek-V3's
grouped sigmoid router plus a shared expert; its checkpoints' multi-token-prediction layer is
not loaded (models/glm4_moe.py) but drafts with method "mtp". HF has no classifier of it."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec
from pagedserve.gpu_worker.models.architecture import HEAD_NORM, Architecture
from pagedserve.gpu_worker.models.architectures.deepseek import (
    from_first_dense_replace,
    grouped_router_experts,
)


class Glm4Moe(Architecture):
    model_module = "glm4_moe"
    model_class = "Glm4MoeForCausalLM"
    has_classifier = False
    lora = True
    partial_rotary = True
    next_token_layers = True
    # Glm4MoeConfig's (GLM-4.5's shapes): half of each head rotates, one shared expert.
    config_defaults = dict(
        partial_rotary_factor=0.5,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        n_routed_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1408,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
    )

    def output_bias(self, hf_config: dict[str, Any]) -> bool:
        return False

    def query_norm(self, hf_config: dict[str, Any], rotates: bool) -> str | None:
        return HEAD_NORM if hf_config.get("use_qk_norm") else None

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        return from_first_dense_replace(grouped_router_experts(hf_config), hf_config)
