"""ERNIE 4.5 MoE's model (``Ernie4_5MoeForCausalLM``): Llama's, reading its router bias and
LM head bias under Baidu's names (models/architectures/ernie4_5.py says the rest)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.gpu_worker.models.llama import LlamaForCausalLM


class Ernie4_5MoeForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return _moe_tensors(weights)


def _moe_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """ERNIE 4.5 MoE's checkpoint as the router holds it: the bias [1, experts] of
    ``mlp.moe_statics`` (Baidu's name; transformers' ``mlp.gate.moe_statics``) as
    ``mlp.gate.e_score_correction_bias`` [experts], the LM head's bias as ``lm_head_bias``;
    without the multi-token-prediction tensors (``mtp_*``), which HF does not load either."""
    for name, tensor in weights:
        if any(part.startswith("mtp") for part in name.split(".")):
            continue
        if name == "lm_head.bias":
            name = "lm_head_bias"
        for stem in (".mlp.gate.moe_statics.", ".mlp.moe_statics."):
            if stem in name:
                name = name.replace(stem, ".mlp.gate.")
                tensor = tensor.reshape(-1)
        yield name, tensor
