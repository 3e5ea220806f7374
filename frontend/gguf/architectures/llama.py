"""llama.cpp's llama: Llama 2 and 3.x, Mistral, and Mixtral (llama with stacked experts)."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.metadata import GGUFMetadata


class Llama(Architecture):
    hf_architecture = "LlamaForCausalLM"
    model_type = "llama"
    # llama.cpp rotates adjacent pairs; its converter interleaves each head's Q/K rows.
    permuted_qk = True
    bias_field = "attention_bias"

    def variant(self, metadata: GGUFMetadata) -> Architecture:
        # llama.cpp converts Mixtral as "llama" with experts (a router in some layer).
        if any(name.endswith(".ffn_gate_inp.weight") for name in metadata.tensor_shapes):
            return Mixtral()
        return self

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        config["mlp_bias"] = False


class Mixtral(Llama):
    """Mixtral, under HF's names (w1 / w3 / w2); Q/K interleaved as Llama's."""

    hf_architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    bias_field = None
    layer_names = (("ffn_gate_inp", "block_sparse_moe.gate"),)
    expert_format = "block_sparse_moe.experts.{expert}.{projection}"
    expert_projections = (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2"))

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Every layer sparse, the experts' size is the intermediate size, top-k renormalised
        (no field: always)."""
        super().update_config(config, metadata)
        top_k = metadata.key("expert_used_count")
        if top_k is None:
            raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
        num_experts, intermediate_size, _ = metadata.tensor_shapes["blk.0.ffn_gate_exps.weight"]
        config.update(
            {
                "num_local_experts": num_experts,
                "num_experts_per_tok": int(top_k),
                "intermediate_size": intermediate_size,
                "sliding_window": None,
            }
        )
