"""Granite MoE's model (``GraniteMoeForCausalLM``, and Granite MoE Shared's): Llama's with
its stacked expert tensors split per expert on loading (models/architectures/granite.py says
the rest)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.gpu_worker.models.llama import LlamaForCausalLM


class GraniteMoeForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return _split_experts(weights)


# Granite MoE's stacked tensors (the checkpoint's names, and transformers 5's) -> per expert.
_GRANITE_MOE_TENSORS = {
    "block_sparse_moe.input_linear.weight": "gate_up",
    "block_sparse_moe.experts.gate_up_proj": "gate_up",
    "block_sparse_moe.output_linear.weight": "down",
    "block_sparse_moe.experts.down_proj": "down",
    "block_sparse_moe.router.layer.weight": "router",
    "block_sparse_moe.router.weight": "router",
    # Granite MoE Shared's MLP beside the experts: rows [gate | up], then down.
    "shared_mlp.input_linear.weight": "shared_gate_up",
    "shared_mlp.output_linear.weight": "shared_down",
}


def _split_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """Granite MoE's experts as Mixtral-style per-expert projections: the stacked
    [experts, 2 * intermediate, hidden] input tensor split into each expert's gate (its first
    half of rows, HF's ``chunk(2)``) and up, the [experts, hidden, intermediate] output
    tensor into each down projection; the router is the MoE's gate."""
    for name, tensor in weights:
        prefix, kind = next(
            (
                (name.removesuffix(suffix), kind)
                for suffix, kind in _GRANITE_MOE_TENSORS.items()
                if name.endswith(suffix)
            ),
            (name, None),
        )
        if kind == "router":
            yield f"{prefix}mlp.gate.weight", tensor
        elif kind == "gate_up":
            for expert, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2, dim=0)
                yield f"{prefix}mlp.experts.{expert}.gate_proj.weight", gate
                yield f"{prefix}mlp.experts.{expert}.up_proj.weight", up
        elif kind == "down":
            for expert, down in enumerate(tensor):
                yield f"{prefix}mlp.experts.{expert}.down_proj.weight", down
        elif kind == "shared_gate_up":
            gate, up = tensor.chunk(2, dim=0)
            yield f"{prefix}mlp.shared_experts.gate_proj.weight", gate
            yield f"{prefix}mlp.shared_experts.up_proj.weight", up
        elif kind == "shared_down":
            yield f"{prefix}mlp.shared_experts.down_proj.weight", tensor
        else:
            yield name, tensor
