"""Baidu's ERNIE 4.5 (``Ernie4_5ForCausalLM``, the dense models): Llama with one switch for
every projection's bias (``use_bias``) and RoPE on interleaved pairs, run as the ops'
rotate-half on query and key rows the loader reorders. Its MoE models
(``Ernie4_5_MoeForCausalLM``) add experts under a softmax router whose learned bias per
expert only chooses, and shared experts (models/ernie4_5.py reads their tensors). HF has no
ERNIE 4.5 classifier."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec, GroupedRouting
from pagedserve.gpu_worker.models.architecture import Architecture, checked_experts, checked_int


class Ernie4_5(Architecture):
    has_classifier = False
    lora = True
    interleaved_rope = True
    # Ernie4_5Config's: tied embeddings, heads of 128, a RoPE base of 500000.
    config_defaults = dict(
        rope_theta=500000.0,
        tie_word_embeddings=True,
        head_dim=128,
        use_bias=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    )

    def qkv_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("use_bias"))

    def output_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("use_bias"))

    def mlp_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("use_bias"))


class Ernie4_5Moe(Ernie4_5):
    model_module = "ernie4_5"
    model_class = "Ernie4_5MoeForCausalLM"
    # Ernie4_5_MoeConfig's (ERNIE-4.5-21B-A3B's experts), the dense model's otherwise.
    config_defaults = dict(
        rope_theta=500000.0,
        tie_word_embeddings=True,
        use_bias=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        moe_num_experts=64,
        moe_k=6,
        moe_intermediate_size=1536,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        moe_layer_end_index=-1,
        moe_layer_interval=1,
        moe_norm_min=1e-12,
    )

    def lm_head_bias(self, hf_config: dict[str, Any]) -> bool:
        """Its LM head has a bias when ``use_bias`` says (the dense model's never)."""
        return bool(hf_config.get("use_bias"))

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        """``moe_num_experts`` experts of ``moe_intermediate_size``, top ``moe_k`` by their
        softmax probabilities plus a learned bias per expert (which only chooses),
        renormalised and rounded to the model's dtype, beside ``moe_num_shared_experts``
        experts' rows as one shared MLP; sparse at layers ``moe_layer_start_index`` to
        ``moe_layer_end_index`` (-1: the last) whose number + 1 is a multiple of
        ``moe_layer_interval``, dense (``intermediate_size``) elsewhere."""
        num_layers = hf_config["num_hidden_layers"]
        num_experts_field = "num_experts" if "num_experts" in hf_config else "moe_num_experts"
        spec = checked_experts(
            hf_config,
            num_experts=hf_config[num_experts_field],
            num_experts_field=num_experts_field,
            top_k=hf_config.get("num_experts_per_tok", hf_config["moe_k"]),
            intermediate_field="moe_intermediate_size",
            renormalize=True,
            weights_in_float32=False,
        )
        shared = checked_int("moe_num_shared_experts", hf_config["moe_num_shared_experts"], 0)
        start = checked_int("moe_layer_start_index", hf_config["moe_layer_start_index"], 0)
        interval = checked_int("moe_layer_interval", hf_config["moe_layer_interval"], 1)
        end = checked_int("moe_layer_end_index", hf_config["moe_layer_end_index"], -1)
        end = num_layers - 1 if end == -1 else end
        spec = dataclasses.replace(
            spec,
            shared_intermediate_size=spec.intermediate_size * shared,
            shared_expert_gated=False,
            shared_expert_bias=bool(hf_config.get("use_bias")),
            grouped=GroupedRouting(
                sigmoid=False,
                num_groups=1,
                top_k_groups=1,
                routed_scaling_factor=1.0,
                correction_bias=True,
            ),
        )
        return tuple(
            spec if start <= i <= end and (i + 1) % interval == 0 else None
            for i in range(num_layers)
        )
