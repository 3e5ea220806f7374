"""Mistral (``MistralForCausalLM``): Llama with ``sliding_window`` (when set) on every layer.
Ministral 3 adds Llama 4's attention temperature (queries scaled by position) and YaRN;
Mixtral adds experts in every layer (layers/moe.py)."""

from __future__ import annotations

import math
from typing import Any

from pagedserve.gpu_worker.layers.rope_config import rope_parameters
from pagedserve.gpu_worker.model_config import ExpertsSpec, ModelConfig
from pagedserve.gpu_worker.models.architecture import (
    Architecture,
    checked_experts,
    num_experts,
    sliding_window,
)


class Mistral(Architecture):
    """Its config ignores ``layer_types`` and ``use_sliding_window``."""

    lora = True

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        return (sliding_window(hf_config),) * hf_config["num_hidden_layers"]


class Ministral3(Mistral):
    lora = False
    # Ministral3Config's: YaRN over a 16k original context, and Llama 4's query scaling.
    config_defaults = dict(
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    )

    def query_scaling(self, config: ModelConfig) -> tuple[float, int] | None:
        """Both come from ``rope_parameters`` (``llama_4_scaling_beta``,
        ``original_max_position_embeddings``), which HF requires."""
        parameters = rope_parameters(config.hf_config)
        beta = parameters.get("llama_4_scaling_beta")
        original = parameters.get("original_max_position_embeddings")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
            raise ValueError(
                f"model: rope_parameters.llama_4_scaling_beta must be a finite number, got {beta!r}"
            )
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(
                "model: rope_parameters.original_max_position_embeddings must be an integer "
                f">= 1 (Llama 4's query scaling divides positions by it), got {original!r}"
            )
        return float(beta), original


class Mixtral(Mistral):
    """Every layer: ``num_local_experts`` experts of ``intermediate_size``, top
    ``num_experts_per_tok`` (default 2), renormalised, weighed in float32."""

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        count, field = num_experts(hf_config, 8)
        spec = checked_experts(
            hf_config,
            num_experts=count,
            num_experts_field=field,
            top_k=hf_config.get("num_experts_per_tok", 2),
            intermediate_field="intermediate_size",
            renormalize=True,
            weights_in_float32=True,
        )
        return (spec,) * hf_config["num_hidden_layers"]
