"""Google's Gemma (``GemmaForCausalLM``), Gemma 2 and Gemma 3 (models/gemma.py): norms that
scale by 1 + w, embeddings times sqrt(hidden size), a GeLU-tanh MLP; Gemma 2 adds four norms
per layer, ``query_pre_attn_scalar``, soft-capped scores and logits and sliding layers;
Gemma 3 per-head q/k norms and RoPE settings per layer type."""

from __future__ import annotations

import math
from typing import Any

from pagedserve.gpu_worker.layers.rope_config import (
    GEMMA3_LAYER_TYPES,
    layer_type_rope_parameters,
)
from pagedserve.gpu_worker.models.architecture import (
    Architecture,
    check_layer_count,
    sliding_window,
    windows_of,
)


class Gemma(Architecture):
    model_module = "gemma"
    model_class = "GemmaForCausalLM"
    lora = True
    config_defaults = dict(
        head_dim=256,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        hidden_act="gelu_pytorch_tanh",
    )

    def check_fields(self, hf_config: dict[str, Any]) -> None:
        super().check_fields(hf_config)
        if hf_config.get("use_bidirectional_attention"):
            raise ValueError(
                "model: use_bidirectional_attention="
                f"{hf_config['use_bidirectional_attention']!r} is not supported: the attention "
                "ops are causal; supported: false or null"
            )


class Gemma2(Gemma):
    """Gemma 2's layer (four norms, query_pre_attn_scalar, sliding layers, soft-capping)."""

    display_name = "Gemma 2"
    config_defaults = dict(
        head_dim=256,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    )

    def check_fields(self, hf_config: dict[str, Any]) -> None:
        super().check_fields(hf_config)
        # HF divides by each cap whenever it is not None: 0 would make every logit NaN.
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = hf_config.get(name)
            if cap is not None and (
                isinstance(cap, bool)
                or not isinstance(cap, (int, float))
                or not math.isfinite(cap)
                or cap <= 0
            ):
                raise ValueError(
                    f"model: {name} must be a positive finite number or null, got {cap!r}"
                )

    def default_layer_types(self, num_layers: int, hf_config: dict[str, Any]) -> list[str]:
        """Gemma2Config's: the even-numbered layers sliding, the odd ones full."""
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]

    def layer_types(self, hf_config: dict[str, Any]) -> list[str]:
        """Each layer's kind, ``"sliding_attention"`` or ``"full_attention"``: the config's
        ``layer_types``, else as the HF config class derives them (transformers 4 configs
        have none)."""
        num_layers = hf_config["num_hidden_layers"]
        layer_types = hf_config.get("layer_types")
        if layer_types is None:
            layer_types = self.default_layer_types(num_layers, hf_config)
        check_layer_count(layer_types, num_layers)
        unknown = sorted(set(layer_types) - set(GEMMA3_LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"model: layer_types holds {', '.join(map(repr, unknown))}, which "
                f"{self.display_name} does not have; "
                f"supported: {', '.join(GEMMA3_LAYER_TYPES)}"
            )
        return list(layer_types)

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        window = sliding_window(hf_config)
        layer_types = self.layer_types(hf_config)
        if window == 0 and "sliding_attention" in layer_types:
            # HF refuses a missing window and masks every key with a window of 0.
            raise ValueError(
                f"model: {self.display_name}'s sliding_attention layers need a "
                f"sliding_window of at least 1 token, got {hf_config.get('sliding_window')!r}"
            )
        return windows_of(layer_types, window)


class Gemma3(Gemma2):
    """Gemma 3's text-only classifier is Gemma3TextForSequenceClassification:
    Gemma3ForSequenceClassification is the multimodal model's."""

    display_name = "Gemma 3"
    config_defaults = dict(
        head_dim=256,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=131_072,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
    )

    rope_per_layer_type = True

    @property
    def classifier_name(self) -> str | None:
        return "Gemma3TextForSequenceClassification"

    def default_layer_types(self, num_layers: int, hf_config: dict[str, Any]) -> list[str]:
        """Gemma3TextConfig's: every ``sliding_window_pattern``-th layer (default 6) full,
        the others sliding."""
        pattern = hf_config.get("sliding_window_pattern", 6)
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]

    def full_attention_rope(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """Its global layers carry its RoPE scaling; its sliding layers never scale."""
        return layer_type_rope_parameters(hf_config, "full_attention")
