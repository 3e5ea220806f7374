"""IBM's Granite (``GraniteForCausalLM``): Llama with four scalars (µP's): the embeddings
times ``embedding_multiplier``, attention scores scaled by ``attention_multiplier`` instead of
1/sqrt(head size), each sublayer's output times ``residual_multiplier`` before it joins the
residual, and the logits divided by ``logits_scaling``. Granite MoE adds experts in every
layer (stacked in the checkpoint, split on loading: models/granite.py), Granite MoE Shared a
gated MLP beside them. HF has no Granite classifier."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec
from pagedserve.gpu_worker.models.architecture import Architecture, checked_experts, num_experts


class Granite(Architecture):
    has_classifier = False
    lora = True
    granite_scalars = True
    # GraniteConfig's: its attention scale defaults to 1.0, not 1/sqrt(head size).
    config_defaults = dict(
        embedding_multiplier=1.0,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        attention_multiplier=1.0,
    )


class GraniteMoe(Granite):
    """Every layer: ``num_local_experts`` (default 8) experts of ``intermediate_size``, top
    ``num_experts_per_tok`` (default 2), weighted by the softmax of the top-k logits (the same
    numbers as the others' renormalised top-k probabilities, not the same float32 bits)."""

    model_module = "granite"
    model_class = "GraniteMoeForCausalLM"

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        count, field = num_experts(hf_config, 8)
        spec = checked_experts(
            hf_config,
            num_experts=count,
            num_experts_field=field,
            top_k=hf_config.get("num_experts_per_tok", 2),
            intermediate_field="intermediate_size",
            renormalize=False,
            weights_in_float32=False,
            softmax_over_top_k=True,
        )
        return (self.with_shared_mlp(spec, hf_config),) * hf_config["num_hidden_layers"]

    def with_shared_mlp(self, spec: ExpertsSpec, hf_config: dict[str, Any]) -> ExpertsSpec:
        return spec


class GraniteMoeShared(GraniteMoe):
    def with_shared_mlp(self, spec: ExpertsSpec, hf_config: dict[str, Any]) -> ExpertsSpec:
        """Its shared MLP (gated, ``shared_intermediate_size``; 0: none) is added as is."""
        shared = hf_config.get("shared_intermediate_size", 0)
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(
                f"model: shared_intermediate_size must be an integer >= 0, got {shared!r}"
            )
        return dataclasses.replace(spec, shared_intermediate_size=shared, shared_expert_gated=False)
