"""The self-attention block most decoders share: one fused q | k | v projection over this
rank's heads, an optional query / key normalisation (a family's own), RoPE where the layer
has it, paged attention with the layer's window, the output projection (row parallel: one
sum over the ranks)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.gpu_worker.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.parallel import TensorParallel


class SelfAttention(nn.Module):
    """``bias``: on q, k and v (``output_bias`` on the output projection, default the
    same); ``rotary`` None: a layer without position embeddings; ``scale``: the attention
    scores' factor (default 1/sqrt(head size)); ``clip_qkv``: q, k and v clamped to that
    magnitude after the norms (OLMoE's); ``query_scaling`` (``beta``, ``L``): each query
    scaled by ``1 + beta * log(1 + floor(position / L))`` after RoPE (Llama 4's attention
    temperature, Ministral 3's); ``nope_temperature`` (``s``, ``F``): each query scaled by
    ``1 + s * log(1 + floor((position + 1) / F))`` (Llama 4's layers without RoPE);
    ``attention_chunk_size`` > 0: each token attends only within its chunk (Llama 4's layers
    with RoPE). A family with query / key norms overrides ``normalize_qk`` (before RoPE) or
    ``normalize_rotated_qk`` (after it)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        parallel: TensorParallel,
        *,
        bias: bool,
        output_bias: bool | None = None,
        sliding_window: int = 0,
        scale: float | None = None,
        clip_qkv: float | None = None,
        query_scaling: tuple[float, int] | None = None,
        nope_temperature: tuple[float, int] | None = None,
        attention_chunk_size: int = 0,
    ) -> None:
        super().__init__()
        head_size = config.head_size
        self.head_size = head_size
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_size,
            config.num_heads,
            config.num_kv_heads,
            bias,
            dtype,
            parallel,
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_heads * head_size,
            config.hidden_size,
            bias if output_bias is None else output_bias,
            dtype,
            parallel,
        )
        self.rotary = rotary
        self.attention = PagedAttention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_size,
            head_size**-0.5 if scale is None else scale,
            sliding_window,
            attention_chunk_size=attention_chunk_size,
        )
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.clip_qkv = clip_qkv
        self.query_scaling = query_scaling
        self.nope_temperature = nope_temperature

    def normalize_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's query / key norms before RoPE; none by default."""
        return query, key

    def normalize_rotated_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's query / key norms after RoPE (Hunyuan's); none by default."""
        return query, key

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, key = self.normalize_qk(query, key)
        if self.clip_qkv is not None:  # OLMoE's: after its norms, before RoPE
            limit = self.clip_qkv
            query, key, value = (rows.clamp(-limit, limit) for rows in (query, key, value))
        if self.rotary is not None:
            self.rotary(positions, query, key)
        query, key = self.normalize_rotated_qk(query, key)
        if self.query_scaling is not None:
            beta, original = self.query_scaling
            # HF's arithmetic: float32 factors, rounded to the queries' dtype.
            factors = 1 + beta * torch.log(1 + torch.floor(positions / original))
            query = query * factors.to(query.dtype)[:, None]
        if self.nope_temperature is not None:
            attn_scale, floor_scale = self.nope_temperature
            # HF's arithmetic: float32 factors, the product in float32, then rounded.
            factors = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))
            factors = factors * attn_scale + 1.0
            query = (query * factors[:, None]).to(query.dtype)
        output = self.attention(query, key, value, self.key_cache, self.value_cache, metadata)
        return self.o_proj(output)
