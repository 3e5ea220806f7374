"""Cohere's Command R and Aya (``CohereForCausalLM``) and Command R7B / Command A
(``Cohere2ForCausalLM``, three sliding-window layers with RoPE to each global one without):
one LayerNorm before attention and MLP in parallel, logits scaled (models/cohere.py). HF has
no Cohere classifier."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import (
    Architecture,
    check_layer_count,
    sliding_window,
    windows_of,
)


class Cohere(Architecture):
    model_module = "cohere"
    model_class = "CohereForCausalLM"
    has_classifier = False
    lora = True
    config_defaults = dict(
        rope_theta=500_000.0,
        logit_scale=0.0625,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )


class Cohere2(Cohere):
    config_defaults = dict(
        logit_scale=0.0625,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        sliding_window=4096,
    )

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        """``sliding_window`` on the layers ``layer_types`` marks ``"sliding_attention"``,
        without it all but every ``sliding_window_pattern``-th (4)."""
        num_layers, window = hf_config["num_hidden_layers"], sliding_window(hf_config)
        pattern = hf_config.get("sliding_window_pattern", 4)
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
        check_layer_count(layer_types, num_layers)
        return windows_of(layer_types, window)

    def rope_layers(self, hf_config: dict[str, Any]) -> tuple[bool, ...]:
        """Only its sliding layers rotate."""
        return tuple(window > 0 for window in self.layer_sliding_windows(hf_config))
