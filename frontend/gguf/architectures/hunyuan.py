"""llama.cpp's hunyuan-dense and hunyuan-moe: Tencent's Hunyuan, Llama with an RMSNorm over
each query and key head after RoPE, which rotates halves (llama.cpp's NEOX, as HF: no
permutation); HF names the norms query_ / key_layernorm. The MoE model puts experts beside a
shared MLP in every layer, under HF's own router and shared-MLP names."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf import rope
from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.checks import (
    ATTENTION_PROJECTIONS,
    SOFTMAX,
    biases_switched,
    check_fixed_router,
    check_per_head_qk_norms,
    experts_in_every_layer,
)
from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value
from pagedserve.frontend.gguf.tensors import shared_mlp_names

_QK_NORM_NAMES = (
    ("attn_q_norm", "self_attn.query_layernorm"),
    ("attn_k_norm", "self_attn.key_layernorm"),
)


class HunyuanDense(Architecture):
    hf_architecture = "HunYuanDenseV1ForCausalLM"
    model_type = "hunyuan_v1_dense"
    bias_field = "attention_bias"
    layer_names = _QK_NORM_NAMES
    # Whether a separate rope.scaling.alpha is read (llama.cpp's hunyuan-moe ignores it).
    reads_rope_alpha = True

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Per-head q/k norms in every layer, the attention's biases all or none
        (attention_bias, set from the tensors). HunyuanVL's XD-RoPE sections are another
        model."""
        architecture, tensor_shapes = metadata.architecture, metadata.tensor_shapes
        num_layers = metadata.num_layers
        check_per_head_qk_norms(architecture, tensor_shapes, num_layers, metadata.head_dim)
        biases_switched(
            architecture, "attention_bias", ATTENTION_PROJECTIONS, tensor_shapes, num_layers
        )
        sections = metadata.key("rope.dimension_sections")
        if sections is not None and any(sections):
            raise ValueError(
                f"GGUF {architecture} rope.dimension_sections={list(sections)} is not supported "
                "(HunyuanVL's XD-RoPE); supported: none"
            )

    def rope_scaling(self, metadata: GGUFMetadata) -> dict[str, Any] | None:
        """Hunyuan's NTK-alpha RoPE, where no rope_freqs or rope factor tensor gives one.
        llama.cpp's converter folds HF's alpha into the base (base x alpha ** (d / (d - 2)),
        written as rope.freq_base, no scaling), which is plain RoPE with that base to HF as
        well. A hunyuan-dense file may instead keep the alpha apart (rope.scaling.alpha,
        HunyuanVL's way), which llama.cpp's hunyuan-dense folds in when loading: HF's "dynamic"
        RoPE with that alpha, as Hunyuan's checkpoints write it. llama.cpp's hunyuan-moe
        ignores the key, so a file with one is refused there, as is an alpha beside another
        scaling."""
        if metadata.rope_freqs is not None or metadata.rope_factors:
            return super().rope_scaling(metadata)
        scaling = rope.scaling_from_keys(metadata.key)
        alpha = metadata.key("rope.scaling.alpha")
        if not alpha:  # absent, or 0: llama.cpp folds nothing in
            return scaling
        if not self.reads_rope_alpha or scaling is not None:
            beside = "" if scaling is None else f" beside rope.scaling.type {scaling['rope_type']}"
            raise ValueError(
                f"GGUF {metadata.architecture} rope.scaling.alpha={alpha}{beside} is not "
                "supported; supported: hunyuan-dense's alpha without another scaling, or none"
            )
        return {"rope_type": "dynamic", "factor": 1.0, "alpha": float32_value(alpha)}


class HunyuanMoe(HunyuanDense):
    hf_architecture = "HunYuanMoEV1ForCausalLM"
    model_type = "hunyuan_v1_moe"
    layer_names = (
        *_QK_NORM_NAMES,
        ("ffn_gate_inp", "mlp.gate.wg"),
        *shared_mlp_names("mlp.shared_mlp"),
    )
    reads_rope_alpha = False

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Besides the dense model's: in every layer experts under a softmax router, top-k
        renormalised (fixed by llama.cpp's graph and HF's model), beside one shared MLP. HF
        gives the experts and the shared MLP both intermediate_size rows (its config's
        moe_intermediate_size and num_shared_expert unread), so the tensors must agree;
        llama.cpp's expert and shared sizes (expert_feed_forward_length,
        expert_shared_feed_forward_length) are not read: the tensors give them."""
        super().update_config(config, metadata)
        architecture, key = metadata.architecture, metadata.key
        tensor_shapes, num_layers = metadata.tensor_shapes, metadata.num_layers
        check_fixed_router(architecture, key, SOFTMAX, renormalize=True)
        num_experts, intermediate_size, top_k = experts_in_every_layer(
            architecture, key, tensor_shapes, num_layers
        )
        for layer in range(num_layers):
            for projection in ("ffn_gate_exps", "ffn_gate_shexp"):
                shape = tensor_shapes.get(f"blk.{layer}.{projection}.weight")
                rows = None if shape is None else shape[-2]
                if rows != intermediate_size:
                    found = "no such tensor" if shape is None else f"{rows} rows"
                    raise ValueError(
                        f"GGUF {architecture} blk.{layer}.{projection}: {found}; expected "
                        f"{intermediate_size} (HF's experts and shared MLP all have "
                        "intermediate_size rows)"
                    )
        config.update(
            {"num_experts": num_experts, "moe_topk": top_k, "intermediate_size": intermediate_size}
        )
