"""AllenAI's OLMo 2 (``Olmo2ForCausalLM``): Llama's attention and gated MLP with the norms
after each sublayer and over the whole query and key projections (models/olmo2.py). OLMo 3
(``Olmo3ForCausalLM``) is OLMo 2 with three sliding-window layers to each global one, RoPE
set per layer type."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.layers.rope_config import (
    GEMMA3_LAYER_TYPES,
    olmo3_layer_rope_parameters,
)
from pagedserve.gpu_worker.models.architecture import (
    Architecture,
    check_layer_count,
    sliding_window,
    windows_of,
)


class Olmo2(Architecture):
    model_module = "olmo2"
    model_class = "Olmo2ForCausalLM"
    lora = True
    config_defaults = dict(rms_norm_eps=1e-5, max_position_embeddings=2048)


class Olmo3(Olmo2):
    rope_per_layer_type = True
    config_defaults = dict(rms_norm_eps=1e-5, max_position_embeddings=2048, sliding_window=4096)

    def layer_types(self, hf_config: dict[str, Any]) -> list[str]:
        """Each layer's kind: ``layer_types``, else as Olmo3Config derives them (every fourth
        layer full attention, the others sliding)."""
        num_layers = hf_config["num_hidden_layers"]
        layer_types = hf_config.get("layer_types") or [
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_layers)
        ]
        check_layer_count(layer_types, num_layers)
        unknown = sorted(set(layer_types) - set(GEMMA3_LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"model: layer_types holds {', '.join(map(repr, unknown))}, which OLMo 3 does "
                f"not have; supported: {', '.join(GEMMA3_LAYER_TYPES)}"
            )
        return list(layer_types)

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        return windows_of(self.layer_types(hf_config), sliding_window(hf_config))

    def full_attention_rope(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return olmo3_layer_rope_parameters(hf_config, "full_attention")
