"""llama.cpp's qwen2, qwen3, qwen2moe and qwen3moe: Llama's layers with RoPE on halves as HF
has it (no Q/K permutation); the MoE models' experts."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.metadata import GGUFMetadata


class Qwen2(Architecture):
    hf_architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"


class Qwen3(Architecture):
    hf_architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    bias_field = "attention_bias"


class Qwen2Moe(Architecture):
    hf_architecture = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"
    bias_field = "qkv_bias"
    # Whether the top-k routing weights are renormalised when the GGUF does not say
    # (llama.cpp's graph for the architecture; HF's config default for it).
    default_renormalize = False

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """The expert fields. The sizes come from the tensors (a layer with a router is
        sparse; llama.cpp has no key for dense layers), the routing from the keys."""
        tensor_shapes, num_layers = metadata.tensor_shapes, metadata.num_layers
        sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
        if not sparse:
            raise ValueError(
                f"GGUF architecture {self.model_type!r} has no expert router (ffn_gate_inp) in "
                "any layer"
            )
        top_k = metadata.key("expert_used_count")
        if top_k is None:
            raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
        first = sparse[0]
        num_experts, moe_intermediate_size, _ = tensor_shapes[f"blk.{first}.ffn_gate_exps.weight"]
        config.update(
            {
                "num_experts": num_experts,
                "num_experts_per_tok": int(top_k),
                "moe_intermediate_size": moe_intermediate_size,
                "norm_topk_prob": bool(
                    metadata.key("expert_weights_norm", self.default_renormalize)
                ),
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(num_layers) if i not in sparse],
            }
        )
        shared_gate = tensor_shapes.get(f"blk.{first}.ffn_gate_shexp.weight")
        if shared_gate is not None:
            config["shared_expert_intermediate_size"] = shared_gate[0]


class Qwen3Moe(Qwen2Moe):
    hf_architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    bias_field = "attention_bias"
    default_renormalize = True
