"""llama.cpp's granite: Llama (Q/K interleaved) with µP's four scalars as metadata."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value


class Granite(Architecture):
    hf_architecture = "GraniteForCausalLM"
    model_type = "granite"
    permuted_qk = True
    bias_field = "attention_bias"

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """The four scalars, which llama.cpp names *_scale and writes only when set; an
        attention scale it lacks means 1/sqrt(head size) to llama.cpp (HF's default is 1.0)."""
        key = metadata.key
        attention_scale = key("attention.scale")
        config.update(
            {
                "attention_multiplier": (
                    float32_value(attention_scale) if attention_scale else metadata.head_dim**-0.5
                ),
                "embedding_multiplier": float32_value(key("embedding_scale") or 1.0),
                "residual_multiplier": float32_value(key("residual_scale") or 1.0),
                "logits_scaling": float32_value(key("logit_scale") or 1.0),
                "mlp_bias": False,
            }
        )
