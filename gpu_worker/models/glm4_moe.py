"""GLM-4.5's model (``Glm4MoeForCausalLM``): Llama's, without its checkpoint's
multi-token-prediction layer, which only drafting loads (models/architectures/glm4_moe.py says
the rest)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.gpu_worker.models.base import without_next_token_layers
from pagedserve.gpu_worker.models.llama import LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        return without_next_token_layers(self.config, weights)
