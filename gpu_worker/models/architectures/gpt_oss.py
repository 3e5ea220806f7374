"""OpenAI's gpt-oss (``GptOssForCausalLM``): attention sinks, alternating sliding and full
layers, experts with biases and a clamped SwiGLU in every layer, MXFP4 experts widened on
loading (models/gpt_oss.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec
from pagedserve.gpu_worker.models.architecture import (
    Architecture,
    check_layer_count,
    checked_experts,
    checked_positive_number,
    num_experts,
    sliding_window,
    windows_of,
)


class GptOss(Architecture):
    model_module = "gpt_oss"
    model_class = "GptOssForCausalLM"
    lora = True
    checkpoint_quantizations = ("mxfp4",)
    # GptOssConfig's (gpt-oss-20b's shapes), YaRN included when neither RoPE field is given.
    config_defaults = dict(
        num_hidden_layers=36,
        num_local_experts=128,
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        head_dim=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        num_experts_per_tok=4,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        attention_bias=True,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        """``sliding_window`` on the layers ``layer_types`` marks ``"sliding_attention"``,
        without it the even-numbered ones."""
        num_layers, window = hf_config["num_hidden_layers"], sliding_window(hf_config)
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
        ]
        check_layer_count(layer_types, num_layers)
        return windows_of(layer_types, window)

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        """Every layer: ``num_local_experts`` (default 128) experts of ``intermediate_size``,
        top ``num_experts_per_tok`` (default 4) weighted by the softmax of their logits; a
        router bias, expert biases and the clamped SwiGLU
        ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = ``min(gate, limit)``."""
        count, field = num_experts(hf_config, 128)
        spec = checked_experts(
            hf_config,
            num_experts=count,
            num_experts_field=field,
            top_k=hf_config.get("num_experts_per_tok", 4),
            intermediate_field="intermediate_size",
            renormalize=False,
            weights_in_float32=False,
            softmax_over_top_k=True,
        )
        spec = dataclasses.replace(
            spec,
            router_bias=True,
            expert_bias=True,
            swiglu_alpha=checked_positive_number("swiglu_alpha", hf_config["swiglu_alpha"]),
            swiglu_limit=checked_positive_number("swiglu_limit", hf_config["swiglu_limit"]),
        )
        return (spec,) * hf_config["num_hidden_layers"]
