"""llama.cpp's glm4moe: GLM-4.5, Llama's attention with q/k/v biases and per-head q/k norms,
RoPE over the first part of each head on halves (llama.cpp's NEOX, as HF: no permutation),
DeepSeek's experts under a sigmoid router. llama.cpp appends the checkpoint's
multi-token-prediction layer as an extra block (nextn_predict_layers), which is dropped."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.architectures.deepseek2 import (
    SHARED_EXPERTS_NAMES,
    routed_experts_config,
)
from pagedserve.frontend.gguf.checks import SIGMOID
from pagedserve.frontend.gguf.metadata import GGUFMetadata


class Glm4Moe(Architecture):
    hf_architecture = "Glm4MoeForCausalLM"
    model_type = "glm4_moe"
    bias_field = "attention_bias"
    partial_rotary = True
    # post_attention_norm is HF's post_attention_layernorm (the FFN's input norm).
    layer_names = (
        ("post_attention_norm", "post_attention_layernorm"),
        *SHARED_EXPERTS_NAMES,
    )

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """RoPE over rope.dimension_count of each head, q/k norms when the file has them, and
        its sigmoid router (llama.cpp's default for glm4moe); the multi-token-prediction layer
        is not converted."""
        gating = metadata.key("expert_gating_func", SIGMOID)
        if gating != SIGMOID:
            raise ValueError(
                f"GGUF glm4moe expert_gating_func={gating} is not supported; supported: "
                f"{SIGMOID} (sigmoid, GLM-4.5's router)"
            )
        config.update(
            {
                "partial_rotary_factor": metadata.rope_dim / metadata.head_dim,
                "use_qk_norm": "blk.0.attn_q_norm.weight" in metadata.tensor_shapes,
                "num_nextn_predict_layers": 0,
                **routed_experts_config(metadata, sigmoid=True),
            }
        )

    def add_rope(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        super().add_rope(config, metadata)
        # transformers 5 reads the rotated share there; older readers at the top level.
        config["rope_parameters"]["partial_rotary_factor"] = config["partial_rotary_factor"]
