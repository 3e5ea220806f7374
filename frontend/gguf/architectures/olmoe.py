"""llama.cpp's olmoe: OLMoE, Llama's layers with RMSNorms over the whole query and key
projections (kept whole by llama.cpp, as HF has them), RoPE on halves (llama.cpp's NEOX, as
HF: no permutation), and experts in every layer under Qwen's names."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.checks import (
    SOFTMAX,
    check_fixed_router,
    check_whole_projection_norms,
    experts_in_every_layer,
)
from pagedserve.frontend.gguf.metadata import GGUFMetadata


class Olmoe(Architecture):
    hf_architecture = "OlmoeForCausalLM"
    model_type = "olmoe"
    bias_field = "attention_bias"

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Experts of intermediate_size in every layer under a softmax router whose top-k
        weights are not renormalised, which llama.cpp's OLMoE graph fixes (its converter writes
        neither); q/k norms over the whole projections; no clamp: llama.cpp's converter drops
        HF's clip_qkv and its graph clamps nothing."""
        architecture, key = metadata.architecture, metadata.key
        check_fixed_router(architecture, key, SOFTMAX, renormalize=False)
        clamp = key("attention.clamp_kqv")
        if clamp is not None:
            raise ValueError(
                f"GGUF {architecture} attention.clamp_kqv={clamp} is not supported (llama.cpp's "
                "OLMoE graph clamps nothing); supported: none"
            )
        tensor_shapes, num_layers = metadata.tensor_shapes, metadata.num_layers
        check_whole_projection_norms(architecture, tensor_shapes, num_layers)
        num_experts, intermediate_size, top_k = experts_in_every_layer(
            architecture, key, tensor_shapes, num_layers
        )
        config.update(
            {
                "num_experts": num_experts,
                "num_experts_per_tok": top_k,
                "intermediate_size": intermediate_size,
                "norm_topk_prob": False,
                "clip_qkv": None,
            }
        )
