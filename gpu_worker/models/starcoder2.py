"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``), code models: GQA with RoPE and a
sliding window on every layer (when the config sets one), LayerNorm with biases, a plain
two-layer GELU MLP (``c_fc``, ``c_proj``), biases on every projection, a tied LM head."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.gpu_worker.layers.basic import LayerNorm, activation
from pagedserve.gpu_worker.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import CausalLM, load_fused_checkpoint
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


class Starcoder2Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        sliding_window: int,
    ) -> None:
        super().__init__()
        bias = bool(config.hf_config.get("use_bias", True))
        head_size = config.head_size
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
            config.num_heads * head_size, config.hidden_size, bias, dtype, parallel
        )
        self.rotary = rotary
        self.attention = PagedAttention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_size,
            head_size**-0.5,
            sliding_window,
        )
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        self.rotary(positions, query, key)
        output = self.attention(query, key, value, self.key_cache, self.value_cache, metadata)
        return self.o_proj(output)


class Starcoder2MLP(nn.Module):
    """``c_proj(act(c_fc(x)))``: this rank's 1/N of the intermediate features."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel) -> None:
        super().__init__()
        hf = config.hf_config
        bias = bool(hf.get("use_bias", True))
        intermediate = hf["intermediate_size"]
        self.c_fc = ColumnParallelLinear(config.hidden_size, [intermediate], bias, dtype, parallel)
        self.c_proj = RowParallelLinear(intermediate, config.hidden_size, bias, dtype, parallel)
        self.act = activation(hf.get("hidden_act", "gelu_pytorch_tanh"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(hidden)))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        layer_index: int,
    ) -> None:
        super().__init__()
        eps = config.hf_config.get("norm_epsilon", 1e-5)
        hidden = config.hidden_size
        self.input_layernorm = LayerNorm(hidden, eps, True, dtype)
        self.self_attn = Starcoder2Attention(
            config, rotary, dtype, parallel, config.layer_sliding_windows[layer_index]
        )
        self.post_attention_layernorm = LayerNorm(hidden, eps, True, dtype)
        self.mlp = Starcoder2MLP(config, dtype, parallel)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Starcoder2ForCausalLM(CausalLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.config = config
        rotary = RotaryEmbedding(
            config.head_size, config.max_position_embeddings, rope_parameters(hf)
        )
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype, parallel
        )
        self.layers = nn.ModuleList(
            Starcoder2DecoderLayer(config, rotary, dtype, parallel, index)
            for index in range(config.num_layers)
        )
        self.norm = LayerNorm(config.hidden_size, hf.get("norm_epsilon", 1e-5), True, dtype)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", True))
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, parallel)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, metadata)
        return self.norm(hidden)

    @property
    def logits_table(self) -> VocabParallelEmbedding:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_table.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_fused_checkpoint(self, weights)
