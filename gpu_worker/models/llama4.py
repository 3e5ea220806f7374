"""Llama 4's language model (``Llama4ForCausalLM``): Llama's, its experts stacked in the
checkpoint as its HF model holds them (hidden size first), split per expert on loading
(models/architectures/llama4.py says the rest)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.gpu_worker.models.llama import LlamaForCausalLM, split_stacked_experts


class Llama4ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return split_stacked_experts(self.config, weights, hidden_first=True)
