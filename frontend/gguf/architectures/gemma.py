"""llama.cpp's gemma2 and gemma3 (Gemma 3's text model): four norms a layer, stored as 1 + w,
GELU, logit soft-caps, and the attention scale, layer kinds and local RoPE base that llama.cpp
fixes rather than reading from the file (llama-model.cpp)."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value

# Gemma 3's sliding layers rotate with base 10000.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


class Gemma(Architecture):
    bias_field = "attention_bias"
    one_plus_norms = True
    # llama.cpp's ffn_norm is HF's pre-feed-forward norm, not the post-attention one.
    layer_names = (
        ("post_attention_norm", "post_attention_layernorm"),
        ("ffn_norm", "pre_feedforward_layernorm"),
        ("post_ffw_norm", "post_feedforward_layernorm"),
    )
    # The 27B model's layers: it scales attention by (hidden / heads) ** -0.5, the others by
    # head_dim ** -0.5.
    layers_of_27b: int
    # Every global_every-th layer attends in full; the others slide.
    global_every: int

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        gelu = "gelu_pytorch_tanh"
        num_layers = config["num_hidden_layers"]
        query_pre_attn_scalar = config["head_dim"]
        if num_layers == self.layers_of_27b:
            query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
        layer_types = [
            "full_attention" if (i + 1) % self.global_every == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
        sliding_window = metadata.key("attention.sliding_window")
        if sliding_window is None:
            architecture = metadata.architecture
            raise ValueError(
                f"GGUF has no {architecture}.attention.sliding_window, which every "
                f"{architecture} model has (its sliding layers' window)"
            )
        soft_caps = {
            name: None if metadata.key(name) is None else float32_value(metadata.key(name))
            for name in ("attn_logit_softcapping", "final_logit_softcapping")
        }
        config.update(
            {
                "hidden_act": gelu,
                "hidden_activation": gelu,
                "query_pre_attn_scalar": query_pre_attn_scalar,
                "sliding_window": int(sliding_window),
                "layer_types": layer_types,
                **soft_caps,
            }
        )


class Gemma2(Gemma):
    hf_architecture = "Gemma2ForCausalLM"
    model_type = "gemma2"
    layers_of_27b = 46
    global_every = 2


class Gemma3(Gemma):
    hf_architecture = "Gemma3ForCausalLM"
    model_type = "gemma3_text"
    layers_of_27b = 62
    global_every = 6

    def add_rope(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        # The global layers take the GGUF's RoPE base and scaling; llama.cpp gives the sliding
        # layers a base of 10000 and no scaling, as HF's Gemma 3 does by default.
        super().add_rope(config, metadata)
        config["rope_local_base_freq"] = _GEMMA3_LOCAL_ROPE_THETA
        config["rope_parameters"] = {
            "full_attention": config["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        }
