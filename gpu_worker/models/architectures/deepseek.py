"""DeepSeek-V2 and DeepSeek-V3 (and the models built on them), and Zhipu's GLM-4.7-Flash
(``Glm4MoeLiteForCausalLM``: V3's layers under GLM's names for which have experts): Llama's
layers with multi-head latent attention, whose cache holds one latent per token
(models/deepseek.py), and experts under DeepSeek's grouped router beside shared experts.
The grouped router (``grouped_router_experts``) is GLM-4.5's and dots.llm1's too. HF has no
GLM-4.7-Flash classifier."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec, GroupedRouting
from pagedserve.gpu_worker.models.architecture import Architecture, checked_experts, checked_int

_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def latent_cache_head_size(hf_config: dict[str, Any]) -> int:
    """The KV cache's head size for multi-head latent attention, whose cache holds one latent
    per token and layer, ``kv_lora_rank + qk_rope_head_dim`` values, as one KV head whose key
    row holds the first half and whose value row the rest (rounded up:
    ``layers/latent_attention.py``), as HF caches it (DeepSeek-V3: 576 values, 288 a row)."""
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"):
        value = hf_config.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model: {name} must be a positive integer, got {value!r}")
    if hf_config["qk_rope_head_dim"] % 2:
        raise ValueError(
            f"model: qk_rope_head_dim={hf_config['qk_rope_head_dim']} must be even (RoPE "
            "rotates pairs)"
        )
    q_lora_rank = hf_config.get("q_lora_rank")
    if q_lora_rank is not None and (
        isinstance(q_lora_rank, bool) or not isinstance(q_lora_rank, int) or q_lora_rank < 1
    ):
        raise ValueError(
            f"model: q_lora_rank must be a positive integer or null, got {q_lora_rank!r}"
        )
    return -(-(hf_config["kv_lora_rank"] + hf_config["qk_rope_head_dim"]) // 2)


def grouped_router_experts(hf_config: dict[str, Any], v2: bool = False) -> ExpertsSpec:
    """The experts of DeepSeek-V2 / V3, GLM-4.5, GLM-4.7-Flash and dots.llm1:
    ``n_routed_experts`` experts of ``moe_intermediate_size``, the top
    ``num_experts_per_tok`` of the grouped router (``GroupedRouting``: V2's ``topk_method``,
    the others' sigmoid scores), plus ``n_shared_experts`` experts' rows as one shared MLP;
    all but V2's weights renormalised when ``norm_topk_prob`` says, V2's never (its router
    ignores the field)."""
    method = hf_config.get("topk_method", "greedy") if v2 else "noaux_tc"
    if v2 and method not in _V2_TOPK_METHODS:
        raise ValueError(
            f"model: topk_method={method!r} is not a DeepSeek-V2 router; "
            f"supported: {', '.join(_V2_TOPK_METHODS)}"
        )
    num_experts = hf_config.get("n_routed_experts")
    shared = checked_int("n_shared_experts", hf_config.get("n_shared_experts"), 0)
    spec = checked_experts(
        hf_config,
        num_experts=num_experts,
        num_experts_field="n_routed_experts",
        top_k=hf_config.get("num_experts_per_tok"),
        intermediate_field="moe_intermediate_size",
        renormalize=not v2 and bool(hf_config.get("norm_topk_prob")),
        weights_in_float32=True,
    )
    if method == "greedy":
        num_groups = top_k_groups = 1
    else:
        num_groups = checked_int("n_group", hf_config.get("n_group"), 1)
        top_k_groups = checked_int("topk_group", hf_config.get("topk_group"), 1)
        if num_experts % num_groups:
            raise ValueError(
                f"model: n_routed_experts={num_experts} must divide into n_group={num_groups} "
                "equal groups"
            )
        if top_k_groups > num_groups:
            raise ValueError(f"model: topk_group={top_k_groups} exceeds n_group={num_groups}")
        per_group = num_experts // num_groups
        if method == "noaux_tc" and per_group < 2:
            raise ValueError(
                f"model: n_routed_experts / n_group = {per_group}: each group needs at least "
                "2 experts (a group ranks by the sum of its two best)"
            )
        if spec.top_k > top_k_groups * per_group:
            raise ValueError(
                f"model: num_experts_per_tok={spec.top_k} exceeds the "
                f"{top_k_groups * per_group} experts of topk_group={top_k_groups} groups of "
                f"{per_group}"
            )
    scale = hf_config.get("routed_scaling_factor")
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"model: routed_scaling_factor must be a positive number, got {scale!r}")
    return dataclasses.replace(
        spec,
        shared_intermediate_size=spec.intermediate_size * shared,
        shared_expert_gated=False,
        grouped=GroupedRouting(
            sigmoid=not v2,
            num_groups=num_groups,
            top_k_groups=top_k_groups,
            routed_scaling_factor=float(scale),
            correction_bias=not v2,
        ),
    )


def from_first_dense_replace(
    spec: ExpertsSpec, hf_config: dict[str, Any]
) -> tuple[ExpertsSpec | None, ...]:
    """``spec`` at each layer from ``first_k_dense_replace`` on, a dense MLP before it."""
    first_dense = checked_int("first_k_dense_replace", hf_config.get("first_k_dense_replace"), 0)
    return tuple(spec if i >= first_dense else None for i in range(hf_config["num_hidden_layers"]))


class DeepseekV2(Architecture):
    model_module = "deepseek"
    model_class = "DeepseekForCausalLM"
    latent_attention = True
    v2 = True
    # DeepseekV2Config's (DeepSeek-V2's shapes, less its experts per token, which every
    # checkpoint gives).
    config_defaults = dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        moe_intermediate_size=1407,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        first_k_dense_replace=0,
    )

    def cache_head(self, hf_config: dict[str, Any]) -> tuple[int, int] | None:
        return latent_cache_head_size(hf_config), 1

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        return from_first_dense_replace(grouped_router_experts(hf_config, self.v2), hf_config)


class DeepseekV3(DeepseekV2):
    v2 = False
    next_token_layers = True
    # DeepseekV3Config's.
    config_defaults = dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        rope_interleave=True,
    )


class Glm4MoeLite(DeepseekV3):
    has_classifier = False
    # Glm4MoeLiteConfig's (GLM-4.7-Flash's shapes): heads of 192 + 64, values of 256; which
    # layers have experts is mlp_layer_types (by default all but the first).
    config_defaults = dict(
        rms_norm_eps=1e-5,
        max_position_embeddings=202752,
        intermediate_size=10240,
        kv_lora_rank=512,
        q_lora_rank=768,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=4,
        moe_intermediate_size=1536,
        routed_scaling_factor=1.8,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        rope_interleave=True,
    )

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        spec = grouped_router_experts(hf_config)
        return tuple(spec if sparse else None for sparse in _mlp_layer_types(hf_config))

    def next_token_layer_fields(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """Its multi-token-prediction layer is sparse."""
        if isinstance(hf_config.get("mlp_layer_types"), list):
            return {**hf_config, "mlp_layer_types": [*hf_config["mlp_layer_types"], "sparse"]}
        return hf_config


def _mlp_layer_types(hf_config: dict[str, Any]) -> list[bool]:
    """Whether each layer's MLP is a sparse one, from Glm4MoeLiteConfig's ``mlp_layer_types``
    ("dense" / "sparse" per layer; HF's default: the first dense, the rest sparse; HF reads
    no ``first_k_dense_replace`` for this model)."""
    num_layers = hf_config["num_hidden_layers"]
    types = hf_config.get("mlp_layer_types")
    if types is None:
        return [index > 0 for index in range(num_layers)]
    if (
        not isinstance(types, list)
        or len(types) != num_layers
        or not set(types) <= {"dense", "sparse"}
    ):
        raise ValueError(
            f"model: mlp_layer_types must list 'dense' or 'sparse' for each of the "
            f"{num_layers} layers, got {types!r:.200}"
        )
    return [kind == "sparse" for kind in types]
