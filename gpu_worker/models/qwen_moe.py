"""Qwen3-MoE's model (``Qwen3MoeForCausalLM``): Llama's, reading Qwen3-VL-MoE's stacked
experts as well as per-expert ones (models/architectures/qwen.py says the rest)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.gpu_worker.models.llama import LlamaForCausalLM, split_stacked_experts


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return split_stacked_experts(self.config, weights)
