"""llama.cpp's olmo2: OLMo 2 (no norm before a sublayer, one after each; q/k norms over all
heads), and OLMo 3, which llama.cpp writes as olmo2 with its window."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf import rope
from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.checks import sliding_layer_types
from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value

# The norms after each sublayer, llama.cpp's post_attention_norm and post_ffw_norm.
POST_NORM_NAMES = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)


class Olmo2(Architecture):
    hf_architecture = "Olmo2ForCausalLM"
    model_type = "olmo2"
    bias_field = "attention_bias"
    layer_names = POST_NORM_NAMES

    def variant(self, metadata: GGUFMetadata) -> Architecture:
        return self if metadata.key("attention.sliding_window") is None else Olmo3()


class Olmo3(Olmo2):
    """An olmo2 file with a sliding window: its window and the layers that slide."""

    hf_architecture = "Olmo3ForCausalLM"
    model_type = "olmo3"

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        config.update(
            {
                "sliding_window": int(metadata.key("attention.sliding_window")),
                "layer_types": sliding_layer_types(
                    metadata.architecture, metadata.key, metadata.num_layers
                ),
            }
        )

    def add_rope(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        # The full layers' scaling, as the Hub's OLMo 3 configs write it (top-level
        # rope_scaling and rope_theta; Olmo3Config gives the sliding layers plain RoPE).
        rope_scaling = rope.scaling_from_keys(metadata.key)
        if rope_scaling is not None:
            # llama.cpp's OLMo 3 converter writes the config's YaRN attention factor.
            attention_factor = metadata.key("rope.scaling.attn_factor")
            if attention_factor is not None:
                rope_scaling["attention_factor"] = float32_value(attention_factor)
            config["rope_scaling"] = rope_scaling
