"""AllenAI's OLMo 2 (``Olmo2ForCausalLM``): Llama's attention and gated MLP with the norms
moved after them (each sublayer's output is normalised, then added to the residual: no norm
before a sublayer) and an RMSNorm over the whole query and key projections (all heads at
once, before RoPE), which tensor-parallel ranks compute from a sum of squares over the
ranks (``ShardedRMSNorm``). OLMo 3 (``Olmo3ForCausalLM``) is OLMo 2 with three sliding-window
layers to each full one, each kind with its own RoPE settings (YaRN on the full ones)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.gpu_worker.layers.basic import ScaledInFloat32RMSNorm, ShardedRMSNorm
from pagedserve.gpu_worker.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.gpu_worker.layers.mlp import GatedMLP
from pagedserve.gpu_worker.layers.rope_config import olmo3_layer_rope_parameters
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.model_config import ModelConfig, olmo3_layer_types
from pagedserve.gpu_worker.models.base import CausalLM, load_fused_checkpoint
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


class Olmo2Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        bias = bool(hf.get("attention_bias"))
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
        eps = hf.get("rms_norm_eps", 1e-5)
        query_rows, kv_rows, _ = self.qkv_proj.component_rows
        # KV heads shared by several ranks (fewer heads than ranks) count once in the sum.
        kv_replicas = max(1, parallel.size // config.num_kv_heads)
        self.q_norm = ShardedRMSNorm(config.num_heads * head_size, query_rows, eps, dtype, parallel)
        self.k_norm = ShardedRMSNorm(
            config.num_kv_heads * head_size, kv_rows, eps, dtype, parallel, kv_replicas
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
        query, key = self.q_norm(query), self.k_norm(key)
        self.rotary(positions, query, key)
        output = self.attention(query, key, value, self.key_cache, self.value_cache, metadata)
        return self.o_proj(output)


class Olmo2DecoderLayer(nn.Module):
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
        eps = hf.get("rms_norm_eps", 1e-5)
        self.self_attn = Olmo2Attention(
            config, rotary, dtype, parallel, config.layer_sliding_windows[layer_index]
        )
        self.post_attention_layernorm = ScaledInFloat32RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = GatedMLP(
            config.hidden_size,
            hf["intermediate_size"],
            False,
            hf.get("hidden_act", "silu"),
            dtype,
            parallel,
        )
        self.post_feedforward_layernorm = ScaledInFloat32RMSNorm(config.hidden_size, eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """HF's order: ``h = h + norm(attn(h))``, then ``h = h + norm(mlp(h))``."""
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2ForCausalLM(CausalLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype, parallel
        )
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(config, rotary, dtype, parallel, index)
            for index, rotary in enumerate(_layer_rotaries(config))
        )
        self.norm = ScaledInFloat32RMSNorm(config.hidden_size, hf.get("rms_norm_eps", 1e-5), dtype)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
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


def _layer_rotaries(config: ModelConfig) -> list[RotaryEmbedding]:
    """Each layer's RoPE: one for OLMo 2; one per layer kind for OLMo 3, shared by the
    layers of that kind."""
    hf = config.hf_config
    positions = config.max_position_embeddings
    if config.architecture != "Olmo3ForCausalLM":
        rotary = RotaryEmbedding(config.head_size, positions, rope_parameters(hf))
        return [rotary] * config.num_layers
    layer_types = olmo3_layer_types(hf)
    by_kind = {
        kind: RotaryEmbedding(config.head_size, positions, olmo3_layer_rope_parameters(hf, kind))
        for kind in sorted(set(layer_types))
    }
    return [by_kind[kind] for kind in layer_types]
