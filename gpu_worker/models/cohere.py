"""Cohere's Command R and Aya (``CohereForCausalLM``) and Command R7B / Command A
(``Cohere2ForCausalLM``): one LayerNorm (no bias, mean-centred) before attention and the
gated MLP, which run side by side on it (``h + attn(n) + mlp(n)``), RoPE on interleaved
pairs, the logits times ``logit_scale``, a tied LM head. Command R+ adds a LayerNorm over
each query and key head (``use_qk_norm``). Cohere2's layers slide three to one; its full
attention layers use no position embedding at all.

Interleaved RoPE rotates pairs (2i, 2i+1) of each head; the ops rotate halves (i, i + d/2).
Loading reorders each head's query and key rows (and their norms' weights) so that pair
(2i, 2i+1) lands at (i, i + d/2): the same rotation on the same values, and since queries and
keys are reordered alike their dot products, hence the attention, are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.basic import empty_parameter
from pagedserve.gpu_worker.layers.mlp import GatedMLP
from pagedserve.gpu_worker.layers.rotary import (
    RotaryEmbedding,
    pairs_to_halves,
)
from pagedserve.gpu_worker.layers.self_attention import SelfAttention
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import StackedDecoderLM, load_fused_checkpoint
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


def _cohere_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's CohereLayerNorm over the last dimension: centred and scaled in float32,
    multiplied by the float32 weight, rounded to the activation dtype once."""
    floats = x.float()
    mean = floats.mean(-1, keepdim=True)
    variance = (floats - mean).pow(2).mean(-1, keepdim=True)
    normed = (floats - mean) * torch.rsqrt(variance + eps)
    return (weight.float() * normed).to(x.dtype)


class CohereLayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _cohere_layer_norm(x, self.weight, self.eps)


class HeadLayerNorm(nn.Module):
    """Command R+'s query or key norm: a CohereLayerNorm over each head with weights of its
    own ([heads, head_size]); this rank holds its heads' rows."""

    def __init__(self, heads: range, head_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.head_size, self.eps = heads, head_size, eps
        self.weight = empty_parameter(len(heads), head_size, dtype=dtype)

    def shard_of(
        self, attribute: str, tensor: torch.Tensor, part: int | None
    ) -> tuple[int, torch.Tensor]:
        return 0, tensor[self.heads.start : self.heads.stop]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        heads = rows.reshape(rows.shape[0], -1, self.head_size)
        return _cohere_layer_norm(heads, self.weight, self.eps).view(rows.shape[0], -1)


class CohereAttention(SelfAttention):
    """With Command R+'s per-head query and key LayerNorms when the config asks."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        parallel: TensorParallel,
        sliding_window: int,
    ) -> None:
        """``rotary``: None for a layer without position embeddings (Cohere2's full
        attention layers)."""
        hf = config.hf_config
        super().__init__(
            config,
            rotary,
            dtype,
            parallel,
            bias=bool(hf.get("attention_bias")),
            sliding_window=sliding_window,
        )
        self.q_norm = self.k_norm = None
        if hf.get("use_qk_norm"):
            eps = hf.get("layer_norm_eps", 1e-5)
            head_size = config.head_size
            self.q_norm = HeadLayerNorm(parallel.shard(config.num_heads), head_size, eps, dtype)
            kv_heads = parallel.kv_heads(config.num_kv_heads)
            self.k_norm = HeadLayerNorm(kv_heads, head_size, eps, dtype)

    def normalize_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is None or self.k_norm is None:
            return query, key
        return self.q_norm(query), self.k_norm(key)


class CohereDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        layer_index: int,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        window = config.layer_sliding_windows[layer_index]
        # Cohere2 rotates only in its sliding layers; Cohere everywhere.
        rotates = config.spec.rope_layers(hf)[layer_index]
        self.input_layernorm = CohereLayerNorm(
            config.hidden_size, hf.get("layer_norm_eps", 1e-5), dtype
        )
        self.self_attn = CohereAttention(
            config, rotary if rotates else None, dtype, parallel, window
        )
        self.mlp = GatedMLP(
            config.hidden_size,
            hf["intermediate_size"],
            False,
            hf.get("hidden_act", "silu"),
            dtype,
            parallel,
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attended = self.self_attn(positions, normed, metadata)
        return hidden + attended + self.mlp(normed)


class CohereForCausalLM(StackedDecoderLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, parallel, tie_default=True)
        hf = config.hf_config
        rotary = self.model_rotary()
        self.stack_layers(lambda index: CohereDecoderLayer(config, rotary, dtype, parallel, index))
        self.norm = CohereLayerNorm(config.hidden_size, hf.get("layer_norm_eps", 1e-5), dtype)
        self.logit_scale = float(hf.get("logit_scale") or 1.0)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_table.logits(hidden_states) * self.logit_scale

    def checkpoint_rows(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """Query and key rows from interleaved pairs to halves (``rotary.pairs_to_halves``)."""
        if projection in ("q_proj", "k_proj"):
            return pairs_to_halves(tensor, self.config.head_size, self.config.head_size)
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        head_size = self.config.head_size

        def halves_from_pairs(name: str, tensor: torch.Tensor) -> torch.Tensor:
            module = name.rpartition(".")[0].rpartition(".")[2]
            if module in ("q_norm", "k_norm"):
                return pairs_to_halves(tensor, head_size, head_size, per_head_last=True)
            return self.checkpoint_rows(module, tensor)

        load_fused_checkpoint(self, weights, convert=halves_from_pairs)
