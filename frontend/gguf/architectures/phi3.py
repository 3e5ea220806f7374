"""llama.cpp's phi3: Phi-3, Phi-3.5 and Phi-4, HF's fused qkv_proj and gate_up_proj kept fused
(attn_qkv, ffn_up), its halves-rotating RoPE (no permutation), partly rotated in Phi-4-mini;
LongRoPE's factors as tensors."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.metadata import GGUFMetadata


class Phi3(Architecture):
    hf_architecture = "Phi3ForCausalLM"
    model_type = "phi3"
    partial_rotary = True
    reads_rope_factors = True
    layer_names = (("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj"))

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """What llama.cpp's Phi-3 converter writes besides Llama's keys: the pretraining
        context (LongRoPE's original), the rotated share of each head, and the sliding window
        (0 for Phi-4, which has none)."""
        key = metadata.key
        config.update(
            {
                "original_max_position_embeddings": int(
                    key("rope.scaling.original_context_length", key("context_length"))
                ),
                "sliding_window": int(key("attention.sliding_window", 0)) or None,
            }
        )
        if metadata.rope_dim != metadata.head_dim:
            config["partial_rotary_factor"] = metadata.rope_dim / metadata.head_dim
