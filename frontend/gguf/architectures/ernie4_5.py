"""llama.cpp's ernie4_5 and ernie4_5-moe: ERNIE 4.5, Llama whose RoPE rotates adjacent pairs in
both llama.cpp (NORM) and HF, so no permutation; use_bias puts biases on every projection
(and, in the MoE model, on the LM head). The MoE model's router selection bias is HF's
moe_statics, [1, experts]."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.architectures.deepseek2 import SHARED_EXPERTS_NAMES
from pagedserve.frontend.gguf.checks import ATTENTION_PROJECTIONS, biases_switched
from pagedserve.frontend.gguf.metadata import GGUFMetadata

# The projections use_bias gives a bias.
_BIASED = (*ATTENTION_PROJECTIONS, "ffn_gate", "ffn_up", "ffn_down")


class Ernie4_5(Architecture):
    hf_architecture = "Ernie4_5ForCausalLM"
    model_type = "ernie4_5"
    bias_field = "use_bias"

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """use_bias: a bias on every projection of every layer, or none; never on the LM head
        of the dense model (HF's Ernie4_5ForCausalLM has none, unlike the MoE model's)."""
        tensor_shapes = metadata.tensor_shapes
        biases_switched("ernie4_5", "use_bias", _BIASED, tensor_shapes, metadata.num_layers)
        if "output.bias" in tensor_shapes:
            raise ValueError(
                "GGUF ernie4_5 has an LM-head bias (output.bias), which HF's dense ERNIE 4.5 "
                "does not have; supported: none"
            )


class Ernie4_5Moe(Architecture):
    hf_architecture = "Ernie4_5_MoeForCausalLM"
    model_type = "ernie4_5_moe"
    bias_field = "use_bias"
    layer_names = SHARED_EXPERTS_NAMES
    unsuffixed_names = (("exp_probs_b.bias", "mlp.moe_statics.e_score_correction_bias"),)
    global_names = (("output.bias", "lm_head.bias"),)

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Experts at the layers from leading_dense_block_count (HF's moe_layer_start_index)
        whose number + 1 is a multiple of interleave_moe_layer_step (moe_layer_interval), up to
        the last layer with a router (llama.cpp keeps no moe_layer_end_index; the tensors show
        where the experts stop); a softmax router with a selection bias per expert, top-k
        renormalised (llama.cpp fixes that router for ERNIE); beside the experts
        expert_shared_count experts' rows as one shared MLP. The shared size llama.cpp writes
        (intermediate_size / KV heads) is not read: the tensors give it."""
        key, tensor_shapes, num_layers = metadata.key, metadata.tensor_shapes, metadata.num_layers
        start, interval = key("leading_dense_block_count"), key("interleave_moe_layer_step")
        if start is None or interval is None or int(interval) < 1:
            raise ValueError(
                "GGUF ernie4_5-moe needs leading_dense_block_count and interleave_moe_layer_step "
                f">= 1 (where the experts are), got {start!r} and {interval!r}"
            )
        start, interval = int(start), int(interval)
        sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
        last = sparse[-1] if sparse else -1
        expected = [i for i in range(start, last + 1) if (i + 1) % interval == 0]
        if not sparse or sparse != expected:
            raise ValueError(
                f"GGUF ernie4_5-moe has an expert router (ffn_gate_inp) in layers {sparse}; "
                f"expected the layers from leading_dense_block_count={start} whose number + 1 "
                f"is a multiple of interleave_moe_layer_step={interval}"
            )
        unbiased = [i for i in sparse if f"blk.{i}.exp_probs_b.bias" not in tensor_shapes]
        if unbiased:
            raise ValueError(
                f"GGUF ernie4_5-moe has no router selection bias (exp_probs_b) in layers "
                f"{unbiased}; every ERNIE 4.5 router has one"
            )
        top_k = key("expert_used_count")
        if top_k is None:
            raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
        first = sparse[0]
        num_experts, moe_intermediate_size, _ = tensor_shapes[f"blk.{first}.ffn_gate_exps.weight"]
        num_shared = int(key("expert_shared_count", 0))
        shared_rows = tensor_shapes.get(f"blk.{first}.ffn_gate_shexp.weight", (0,))[0]
        if shared_rows != num_shared * moe_intermediate_size:
            raise ValueError(
                f"GGUF ernie4_5-moe shared experts (ffn_gate_shexp) have {shared_rows} rows; "
                f"expected expert_shared_count={num_shared} x {moe_intermediate_size}"
            )
        biased = "blk.0.attn_q.bias" in tensor_shapes
        if ("output.bias" in tensor_shapes) != biased:
            raise ValueError(
                f"GGUF ernie4_5-moe has {'' if biased else 'no '}attention biases but "
                f"{'no' if biased else 'an'} LM-head bias (output.bias); HF's use_bias gives "
                "both or neither"
            )
        config.update(
            {
                "moe_num_experts": num_experts,
                "moe_k": int(top_k),
                "moe_intermediate_size": moe_intermediate_size,
                "moe_num_shared_experts": num_shared,
                "moe_layer_start_index": start,
                "moe_layer_end_index": last,
                "moe_layer_interval": interval,
            }
        )

    def fix_tensor(self, name: str, weight: np.ndarray) -> np.ndarray:
        if name.endswith("moe_statics.e_score_correction_bias"):
            # HF's [1, experts], which llama.cpp keeps; a file with the 1 squeezed out converts
            # alike.
            return weight.reshape(1, -1)
        return weight
