"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): OLMoE's whole-projection q/k norms, RoPE over the
first ``rotary_dim`` values of each head, and Mixtral's experts under a sigmoid router whose
learned bias only chooses. HF has no MiniMax-M2 classifier."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec, GroupedRouting
from pagedserve.gpu_worker.models.architecture import (
    PROJECTION_NORM,
    Architecture,
    checked_experts,
    num_experts,
)


class MiniMaxM2(Architecture):
    has_classifier = False
    partial_rotary = True
    qk_norm = PROJECTION_NORM
    # MiniMaxM2Config's (MiniMax-M2's shapes; its RoPE base when the config gives none).
    config_defaults = dict(
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=196608,
        rope_theta=5_000_000.0,
        num_local_experts=256,
        num_experts_per_tok=8,
        intermediate_size=1536,
        tie_word_embeddings=False,
    )

    def prepare(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """MiniMaxM2Config's reading: RoPE over the first ``rotary_dim`` values of each head."""
        if hf_config.get("rotary_dim") is not None:
            hf_config.setdefault(
                "partial_rotary_factor", hf_config["rotary_dim"] / hf_config["head_dim"]
            )
        return hf_config

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        """Every layer: ``num_local_experts`` (default 256) of ``intermediate_size``, top
        ``num_experts_per_tok`` (default 8) by sigmoid scores plus ``e_score_correction_bias``,
        weighted by their scores renormalised (``GroupedRouting`` of one group, in the
        model's dtype)."""
        count, field = num_experts(hf_config, 256)
        spec = checked_experts(
            hf_config,
            num_experts=count,
            num_experts_field=field,
            top_k=hf_config["num_experts_per_tok"],
            intermediate_field="intermediate_size",
            renormalize=True,
            weights_in_float32=True,
        )
        if spec.num_experts < 2:
            raise ValueError(
                f"model: {field}={spec.num_experts}: the sigmoid router needs at least 2 experts"
            )
        routing = GroupedRouting(True, 1, 1, 1.0, correction_bias=True, router_in_float32=False)
        return (dataclasses.replace(spec, grouped=routing),) * hf_config["num_hidden_layers"]

    def checkpoint_name(self, name: str, hf_config: dict[str, Any]) -> str:
        """Its router bias (``block_sparse_moe.e_score_correction_bias``, transformers 5's
        ``mlp.e_score_correction_bias``) beside its router, as this engine keeps it."""
        for prefix in (".block_sparse_moe.", ".mlp."):
            if name.endswith(prefix + "e_score_correction_bias"):
                return name.replace(
                    prefix + "e_score_correction_bias", ".mlp.gate.e_score_correction_bias"
                )
        return name
