"""Hugging Face's SmolLM3 (``SmolLM3ForCausalLM``): Llama whose every fourth layer
(``no_rope_layers``) attends without RoPE; with ``use_sliding_window``, the layers
``layer_types`` marks ``"sliding_attention"`` slide (without ``layer_types``, its layers
without RoPE)."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import (
    Architecture,
    check_layer_count,
    no_rope_layers,
    sliding_window,
    windows_of,
)


class SmolLM3(Architecture):
    lora = True
    config_defaults = dict(
        tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=2_000_000.0
    )

    def rope_layers(self, hf_config: dict[str, Any]) -> tuple[bool, ...]:
        return no_rope_layers(hf_config)

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        num_layers = hf_config["num_hidden_layers"]
        window = sliding_window(hf_config)
        if not hf_config.get("use_sliding_window", False):
            return (0,) * num_layers
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if window and not rotates else "full_attention"
            for rotates in self.rope_layers(hf_config)
        ]
        check_layer_count(layer_types, num_layers)
        return windows_of(layer_types, window)
