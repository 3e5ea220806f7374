"""llama.cpp's minimax-m2: MiniMax-M2, OLMoE's whole-projection q/k norms, RoPE on halves over
the first rope.dimension_count values of each head (llama.cpp's NEOX, as HF: no
permutation), and in every layer Mixtral's experts under a sigmoid router whose selection
bias (exp_probs_b) is HF's block_sparse_moe.e_score_correction_bias."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.architectures.llama import Mixtral
from pagedserve.frontend.gguf.checks import (
    SIGMOID,
    check_fixed_router,
    check_whole_projection_norms,
    experts_in_every_layer,
)
from pagedserve.frontend.gguf.metadata import GGUFMetadata


class MiniMaxM2(Architecture):
    hf_architecture = "MiniMaxM2ForCausalLM"
    model_type = "minimax_m2"
    partial_rotary = True
    layer_names = Mixtral.layer_names
    expert_format = Mixtral.expert_format
    expert_projections = Mixtral.expert_projections
    unsuffixed_names = (("exp_probs_b.bias", "block_sparse_moe.e_score_correction_bias"),)

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """RoPE over the first rope.dimension_count values of each head (HF's rotary_dim), q/k
        norms over the whole projections, and experts of intermediate_size in every layer
        under a sigmoid router with a selection bias (exp_probs_b) and its top-k weights
        renormalised: HF's only MiniMax-M2 router, and llama.cpp's graph's, so a file that
        does not name its gating function is read as that one (llama.cpp's converter writes it
        from the checkpoint's scoring_func)."""
        architecture, key = metadata.architecture, metadata.key
        tensor_shapes, num_layers = metadata.tensor_shapes, metadata.num_layers
        check_fixed_router(architecture, key, SIGMOID, renormalize=True)
        check_whole_projection_norms(architecture, tensor_shapes, num_layers)
        unbiased = [
            i for i in range(num_layers) if f"blk.{i}.exp_probs_b.bias" not in tensor_shapes
        ]
        if unbiased:
            raise ValueError(
                f"GGUF minimax-m2 has no router selection bias (exp_probs_b) in layers "
                f"{unbiased}; every MiniMax-M2 router has one"
            )
        num_experts, intermediate_size, top_k = experts_in_every_layer(
            architecture, key, tensor_shapes, num_layers
        )
        config.update(
            {
                "num_local_experts": num_experts,
                "num_experts_per_tok": top_k,
                "intermediate_size": intermediate_size,
                "rotary_dim": metadata.rope_dim,
            }
        )

    def add_rope(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        super().add_rope(config, metadata)
        # As transformers 5 saves MiniMax-M2's: the share there, rotary_dim at the top level.
        config["rope_parameters"]["partial_rotary_factor"] = metadata.rope_dim / metadata.head_dim
