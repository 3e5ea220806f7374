"""Zhipu's GLM-4 (``Glm4ForCausalLM``: GLM-4-9B-0414, GLM-4-32B, GLM-Z1): GQA with q/k/v
biases, RoPE on interleaved pairs over the first half of each head (``partial_rotary_factor``
0.5), a norm before and after each sublayer (four RMSNorms a layer), a fused gate/up MLP.
The loader splits the fused gate/up tensor and reorders each head's query and key rows from
interleaved pairs to halves (``pairs_to_halves``), so the ops' partial rotate-half RoPE
applies GLM's rotation."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.basic import RMSNorm
from pagedserve.gpu_worker.layers.mlp import GatedMLP
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, pairs_to_halves
from pagedserve.gpu_worker.layers.self_attention import SelfAttention
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import (
    StackedDecoderLM,
    load_fused_checkpoint,
    split_fused_projections,
)
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


class Glm4DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        eps = hf.get("rms_norm_eps", 1.5625e-07)
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = SelfAttention(
            config,
            rotary,
            dtype,
            parallel,
            bias=bool(hf.get("attention_bias", True)),
            output_bias=False,
        )
        self.post_self_attn_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = GatedMLP(
            hidden, hf["intermediate_size"], False, hf.get("hidden_act", "silu"), dtype, parallel
        )
        self.post_mlp_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), metadata)
        hidden = hidden + self.post_self_attn_layernorm(attended)
        fed = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + self.post_mlp_layernorm(fed)


class Glm4ForCausalLM(StackedDecoderLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, parallel)
        hf = config.hf_config
        self.rotary = self.model_rotary()
        self.stack_layers(lambda _: Glm4DecoderLayer(config, self.rotary, dtype, parallel))
        self.norm = RMSNorm(config.hidden_size, hf.get("rms_norm_eps", 1.5625e-07), dtype)

    def checkpoint_rows(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """Query and key rows from interleaved pairs to halves over the rotated share of
        each head (``rotary.pairs_to_halves``)."""
        if projection in ("q_proj", "k_proj"):
            return pairs_to_halves(tensor, self.config.head_size, self.rotary.rotary_dim)
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def halves_from_pairs(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return self.checkpoint_rows(name.rpartition(".")[0].rpartition(".")[2], tensor)

        load_fused_checkpoint(
            self, split_fused_projections(self.config, weights), convert=halves_from_pairs
        )
