"""llama.cpp's deepseek2: DeepSeek-V2, and V3 (the file whose router scores by sigmoid).

Multi-head latent attention, RoPE on adjacent pairs in both (llama.cpp's NORM; HF's V2 and
V3's rope_interleave: no permutation). Newer llama.cpp splits HF's kv_b_proj into attn_k_b
(per head, transposed) and attn_v_b, which joined_tensors puts back. Also the experts layout
(routed_experts_config) and shared-expert names GLM-4.5, dots.llm1 and ERNIE 4.5 reuse.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedserve.frontend.gguf import rope
from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.checks import SIGMOID, SOFTMAX
from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value
from pagedserve.frontend.gguf.tensors import layer_of, shared_mlp_names

# The shared experts: one MLP of n_shared_experts experts' rows, ungated.
SHARED_EXPERTS_NAMES = shared_mlp_names("mlp.shared_experts")


class DeepseekV2(Architecture):
    hf_architecture = "DeepseekV2ForCausalLM"
    model_type = "deepseek_v2"
    layer_names = (
        ("attn_q_a", "self_attn.q_a_proj"),
        ("attn_q_a_norm", "self_attn.q_a_layernorm"),
        ("attn_q_b", "self_attn.q_b_proj"),
        ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
        ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
        ("attn_kv_b", "self_attn.kv_b_proj"),
        # Interim names, joined into kv_b_proj by joined_tensors.
        ("attn_k_b", "self_attn.k_b_proj"),
        ("attn_v_b", "self_attn.v_b_proj"),
        *SHARED_EXPERTS_NAMES,
    )
    # Whether the router scores by sigmoid (with a selection bias), V3's, or by softmax.
    sigmoid_router = False

    def variant(self, metadata: GGUFMetadata) -> Architecture:
        return DeepseekV3() if metadata.key("expert_gating_func") == SIGMOID else self

    def check_rope_dim(self, metadata: GGUFMetadata) -> None:
        # key_length is no head's size here; update_config reads the heads' sizes.
        pass

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """The latent attention's sizes and the router. Since its MLA support llama.cpp writes
        the heads' sizes as key_length_mla / value_length_mla (key_length and value_length then
        describe the latent it caches, and head_count_kv is 1); older files give them as
        key_length / value_length. V3 routes by sigmoid over groups, V2 by softmax (llama.cpp's
        default when the file does not say), over groups when it has more than one."""
        key, tensor_shapes = metadata.key, metadata.tensor_shapes
        rope_dim = int(key("rope.dimension_count"))
        kv_lora_rank = int(key("attention.kv_lora_rank"))
        if key("attention.key_length_mla") is not None:
            key_dim = int(key("attention.key_length_mla"))
            value_dim = int(key("attention.value_length_mla"))
        else:
            key_dim = int(key("attention.key_length"))
            value_dim = int(key("attention.value_length"))
        latent_rows = tensor_shapes["blk.0.attn_kv_a_mqa.weight"][0]
        if latent_rows != kv_lora_rank + rope_dim:
            raise ValueError(
                f"GGUF deepseek2 attn_kv_a_mqa has {latent_rows} rows; expected kv_lora_rank "
                f"{kv_lora_rank} + rope.dimension_count {rope_dim}"
            )
        gating = key("expert_gating_func")
        if gating not in (None, SOFTMAX, SIGMOID):
            raise ValueError(
                f"GGUF deepseek2 expert_gating_func={gating} is not supported; supported: "
                f"{SOFTMAX} (softmax, DeepSeek-V2) and {SIGMOID} (sigmoid, DeepSeek-V3)"
            )
        low_rank_query = tensor_shapes.get("blk.0.attn_q_a.weight")
        config.update(
            {
                # HF expands a key and a value per head from the latent.
                "num_key_value_heads": metadata.num_heads,
                # HF's DeepSeek configs: the rotated part's size, which their RoPE reads.
                "head_dim": rope_dim,
                "q_lora_rank": None if low_rank_query is None else low_rank_query[0],
                "kv_lora_rank": kv_lora_rank,
                "qk_nope_head_dim": key_dim - rope_dim,
                "qk_rope_head_dim": rope_dim,
                "v_head_dim": value_dim,
                # HF's attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj
                # (llama.cpp's converter writes none; a file that has them gets them as HF
                # names them).
                "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensor_shapes,
                **routed_experts_config(metadata, sigmoid=self.sigmoid_router),
            }
        )
        if self.sigmoid_router:
            config.update(rope_interleave=True, num_nextn_predict_layers=0)
        else:
            config["topk_method"] = "group_limited_greedy" if config["n_group"] > 1 else "greedy"

    def rope_scaling(self, metadata: GGUFMetadata) -> dict[str, Any] | None:
        """DeepSeek's YaRN as HF has it. llama.cpp's converter stores HF's mscale_all_dim as
        yarn_log_multiplier = 0.1 x it; llama.cpp scales every query-key product by that
        factor squared (HF's yarn_apply_mscale) and rotates without changing magnitudes: HF's
        attention factor when mscale equals mscale_all_dim, as in every DeepSeek checkpoint (1
        without it). beta_fast / beta_slow are 32 / 1 where the file does not say, in both."""
        key = metadata.key
        scaling = rope.scaling_from_keys(key)
        if scaling is None or scaling["rope_type"] != "yarn":
            return scaling
        attention_factor = key("rope.scaling.yarn_attn_factor")
        if attention_factor not in (None, 1.0):
            raise ValueError(
                f"GGUF deepseek2 rope.scaling.yarn_attn_factor={attention_factor} is not "
                "supported (llama.cpp applies it to the rotation and the softmax scale alike); "
                "supported: 1 or none"
            )
        scaling["beta_fast"] = float32_value(key("rope.scaling.yarn_beta_fast", 32.0))
        scaling["beta_slow"] = float32_value(key("rope.scaling.yarn_beta_slow", 1.0))
        mscale = float32_value(float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1)
        if mscale:
            scaling.update(mscale=mscale, mscale_all_dim=mscale)
        else:
            scaling["attention_factor"] = 1.0
        return scaling

    def tensors_without_weights(self, names: list[str], num_layers: int) -> set[str]:
        """Besides the shared layer's: attn_k_b / attn_v_b in a layer that keeps the attn_kv_b
        they were split from (ik_llama.cpp's files): the whole one is converted."""
        skipped = super().tensors_without_weights(names, num_layers)
        with_kv_b = {layer_of(name) for name in names if name.endswith(".attn_kv_b.weight")}
        for name in names:
            layer = layer_of(name)
            split_kv_b = name.endswith((".attn_k_b.weight", ".attn_v_b.weight"))
            if layer is not None and split_kv_b and layer in with_kv_b:
                skipped.add(name)
        return skipped

    def joined_tensors(
        self, tensors: Iterator[tuple[str, np.ndarray]], config: dict[str, Any]
    ) -> Iterator[tuple[str, np.ndarray]]:
        """``kv_b_proj`` from llama.cpp's split of it: ``attn_k_b`` [heads, kv_lora_rank,
        qk_nope_head_dim] (each head's key rows, transposed) and ``attn_v_b`` [heads,
        v_head_dim, kv_lora_rank]. HF's rows are, head by head, its key rows then its value
        rows:

            kv_b_proj [heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank]
              = | k_b[0]^T | v_b[0] | k_b[1]^T | v_b[1] | ...
        """
        heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
        nope = config["qk_nope_head_dim"]
        halves: dict[str, dict[str, np.ndarray]] = {}
        for name, tensor in tensors:
            stem, _, projection = name.rpartition(".self_attn.")
            if projection not in ("k_b_proj.weight", "v_b_proj.weight"):
                yield name, tensor
                continue
            pair = halves.setdefault(stem, {})
            pair[projection] = tensor
            if len(pair) < 2:
                continue
            del halves[stem]
            keys = pair["k_b_proj.weight"].reshape(heads, rank, nope).swapaxes(1, 2)
            values = pair["v_b_proj.weight"].reshape(heads, -1, rank)
            kv_b = np.concatenate([keys, values], axis=1).reshape(-1, rank)
            yield f"{stem}.self_attn.kv_b_proj.weight", kv_b
        if halves:
            raise ValueError(
                "GGUF deepseek2 has attn_k_b or attn_v_b without the other in "
                f"{', '.join(sorted(halves))}"
            )


class DeepseekV3(DeepseekV2):
    hf_architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    sigmoid_router = True


def routed_experts_config(metadata: GGUFMetadata, sigmoid: bool) -> dict[str, Any]:
    """DeepSeek's experts, which GLM-4.5's and dots.llm1's follow: dense layers up to
    leading_dense_block_count, then a router (with a selection bias, exp_probs_b, when it
    scores by sigmoid) over experts whose sizes the tensors give, its weights scaled by
    expert_weights_scale and renormalised when expert_weights_norm says, in
    expert_group_count groups; beside them expert_shared_count experts' rows as one shared
    MLP."""
    architecture, key = metadata.architecture, metadata.key
    tensor_shapes, num_layers = metadata.tensor_shapes, metadata.num_layers
    first_dense = int(key("leading_dense_block_count", 0))
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
    if not sparse or sparse != list(range(first_dense, num_layers)):
        raise ValueError(
            f"GGUF {architecture} has an expert router (ffn_gate_inp) in layers {sparse}; "
            f"expected every layer from leading_dense_block_count={first_dense} to "
            f"{num_layers - 1}"
        )
    if (f"blk.{first_dense}.exp_probs_b.bias" in tensor_shapes) != sigmoid:
        raise ValueError(
            f"GGUF {architecture}: a router scoring by "
            f"{'sigmoid' if sigmoid else 'softmax'} "
            f"{'without' if sigmoid else 'with'} a selection bias (exp_probs_b) is not "
            "supported; supported: sigmoid with the bias (DeepSeek-V3, GLM-4.5, dots.llm1), "
            "softmax without it (DeepSeek-V2)"
        )
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    num_experts, moe_intermediate_size, _ = tensor_shapes[f"blk.{first_dense}.ffn_gate_exps.weight"]
    num_shared = int(key("expert_shared_count", 0))
    shared_rows = tensor_shapes.get(f"blk.{first_dense}.ffn_gate_shexp.weight", (0,))[0]
    if shared_rows != num_shared * moe_intermediate_size:
        raise ValueError(
            f"GGUF {architecture} shared experts (ffn_gate_shexp) have {shared_rows} rows; "
            f"expected expert_shared_count={num_shared} x {moe_intermediate_size}"
        )
    return {
        "n_routed_experts": num_experts,
        "num_experts_per_tok": int(top_k),
        "moe_intermediate_size": moe_intermediate_size,
        "n_shared_experts": num_shared,
        "first_k_dense_replace": first_dense,
        # llama.cpp scales by nothing without the key (DeepSeek-V2 files may lack it).
        "routed_scaling_factor": float32_value(key("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "n_group": int(key("expert_group_count", 1)),
        "topk_group": int(key("expert_group_used_count", 1)),
    }
