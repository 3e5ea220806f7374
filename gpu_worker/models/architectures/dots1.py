"""rednote's dots.llm1 (``Dots1ForCausalLM``): Qwen3 (per-head q/k norms) with DeepSeek-V3's
experts, its ``attention_bias`` on all four projections; its windowed layers run from
``max_window_layers`` on. HF has no dots.llm1 classifier."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec
from pagedserve.gpu_worker.models.architecture import (
    HEAD_NORM,
    Architecture,
    check_layer_count,
    sliding_window,
    windows_of,
)
from pagedserve.gpu_worker.models.architectures.deepseek import (
    from_first_dense_replace,
    grouped_router_experts,
)


class Dots1(Architecture):
    has_classifier = False
    lora = True
    qk_norm = HEAD_NORM
    # Dots1Config's: its windowed layers, from max_window_layers on, are none at 62 layers.
    config_defaults = dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        sliding_window=4096,
        max_window_layers=62,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        num_layers, window = hf_config["num_hidden_layers"], sliding_window(hf_config)
        first_windowed = hf_config["max_window_layers"]
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if window and i >= first_windowed else "full_attention"
            for i in range(num_layers)
        ]
        check_layer_count(layer_types, num_layers)
        return windows_of(layer_types, window)

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        return from_first_dense_replace(grouped_router_experts(hf_config), hf_config)
