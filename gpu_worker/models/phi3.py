"""Phi-3's model (``Phi3ForCausalLM``): Llama's, its checkpoint's fused ``qkv_proj`` and
``gate_up_proj`` split on loading so that each tensor-parallel rank takes its heads and rows
as from separate tensors (models/architectures/phi3.py says the rest)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.gpu_worker.models.base import split_fused_projections
from pagedserve.gpu_worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return split_fused_projections(self.config, weights)
