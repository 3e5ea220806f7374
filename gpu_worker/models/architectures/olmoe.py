"""AllenAI's OLMoE (``OlmoeForCausalLM``): Llama with norms over the whole query and key
projections (as OLMo 2's, Llama's arithmetic), an optional ``clip_qkv``, and experts in every
layer. HF has no OLMoE classifier."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec
from pagedserve.gpu_worker.models.architecture import (
    PROJECTION_NORM,
    Architecture,
    checked_experts,
    num_experts,
)


class Olmoe(Architecture):
    has_classifier = False
    lora = True
    qk_norm = PROJECTION_NORM
    clips_qkv = True
    # OlmoeConfig's (OLMoE-1B-7B's experts).
    config_defaults = dict(
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
    )

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        """Every layer: ``num_experts`` (default 64) of ``intermediate_size``, top
        ``num_experts_per_tok`` (default 8), renormalised with ``norm_topk_prob``."""
        count, field = num_experts(hf_config, 64)
        spec = checked_experts(
            hf_config,
            num_experts=count,
            num_experts_field=field,
            top_k=hf_config["num_experts_per_tok"],
            intermediate_field="intermediate_size",
            renormalize=bool(hf_config["norm_topk_prob"]),
            weights_in_float32=False,
        )
        return (spec,) * hf_config["num_hidden_layers"]
