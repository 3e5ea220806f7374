"""AllenAI's OLMo 2 (``Olmo2ForCausalLM``): Llama's attention and gated MLP with the norms
moved after them (each sublayer's output is normalised, then added to the residual: no norm
before a sublayer) and an RMSNorm over the whole query and key projections (all heads at
once, before RoPE), which tensor-parallel ranks compute from a sum of squares over the
ranks (``ShardedRMSNorm``). OLMo 3 (``Olmo3ForCausalLM``) is OLMo 2 with three sliding-window
layers to each full one, each kind with its own RoPE settings (YaRN on the full ones).
LG AI's EXAONE 4 (``Exaone4ForCausalLM``) has OLMo 2's layer with Qwen3's per-head query and
key norms and Llama's norm arithmetic; with a window, three windowed layers to each global one,
and the global ones attend without RoPE."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.basic import (
    RMSNorm,
    ScaledInFloat32RMSNorm,
    ShardedRMSNorm,
    norm_query_and_key_heads,
)
from pagedserve.gpu_worker.layers.mlp import GatedMLP
from pagedserve.gpu_worker.layers.rope_config import olmo3_layer_rope_parameters
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.gpu_worker.layers.self_attention import SelfAttention
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import StackedDecoderLM
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


class Olmo2Attention(SelfAttention):
    """With RMSNorms over the whole query and key projections (this rank's slice of each,
    its sum of squares summed over the ranks) before RoPE."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        sliding_window: int = 0,
    ) -> None:
        hf = config.hf_config
        super().__init__(
            config,
            rotary,
            dtype,
            parallel,
            bias=bool(hf.get("attention_bias")),
            sliding_window=sliding_window,
        )
        eps = hf.get("rms_norm_eps", 1e-5)
        query_rows, kv_rows, _ = self.qkv_proj.component_rows
        # KV heads shared by several ranks (fewer heads than ranks) count once in the sum.
        kv_replicas = max(1, parallel.size // config.num_kv_heads)
        self.q_norm = ShardedRMSNorm(
            config.num_heads * config.head_size, query_rows, eps, dtype, parallel
        )
        self.k_norm = ShardedRMSNorm(
            config.num_kv_heads * config.head_size, kv_rows, eps, dtype, parallel, kv_replicas
        )

    def normalize_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(query), self.k_norm(key)


class Exaone4Attention(SelfAttention):
    """With an RMSNorm over each query and key head (one weight of head size, replicated)
    before RoPE, and RoPE on the layers that have it (``rotary`` None: a global layer)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        parallel: TensorParallel,
        sliding_window: int = 0,
    ) -> None:
        super().__init__(config, rotary, dtype, parallel, bias=False, sliding_window=sliding_window)
        eps = config.hf_config.get("rms_norm_eps", 1e-5)
        self.q_norm = RMSNorm(config.head_size, eps, dtype)
        self.k_norm = RMSNorm(config.head_size, eps, dtype)

    def normalize_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm_query_and_key_heads(self.q_norm, self.k_norm, query, key, self.head_size)


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        parallel: TensorParallel,
        layer_index: int,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        eps = hf.get("rms_norm_eps", 1e-5)
        window = config.layer_sliding_windows[layer_index]
        exaone = config.architecture == "Exaone4ForCausalLM"
        if exaone:
            self.self_attn = Exaone4Attention(config, rotary, dtype, parallel, window)
        else:
            assert rotary is not None
            self.self_attn = Olmo2Attention(config, rotary, dtype, parallel, window)
        # OLMo 2 scales the float32 normalised value before rounding; EXAONE 4 as Llama.
        norm = RMSNorm if exaone else ScaledInFloat32RMSNorm
        self.post_attention_layernorm = norm(config.hidden_size, eps, dtype)
        self.mlp = GatedMLP(
            config.hidden_size,
            hf["intermediate_size"],
            False,
            hf.get("hidden_act", "silu"),
            dtype,
            parallel,
        )
        self.post_feedforward_layernorm = norm(config.hidden_size, eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """HF's order: ``h = h + norm(attn(h))``, then ``h = h + norm(mlp(h))``."""
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2ForCausalLM(StackedDecoderLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, parallel)
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(config, rotary, dtype, parallel, index)
            for index, rotary in enumerate(_layer_rotaries(config))
        )
        eps = config.hf_config.get("rms_norm_eps", 1e-5)
        norm = RMSNorm if config.architecture == "Exaone4ForCausalLM" else ScaledInFloat32RMSNorm
        self.norm = norm(config.hidden_size, eps, dtype)


def _layer_rotaries(config: ModelConfig) -> list[RotaryEmbedding | None]:
    """Each layer's RoPE: one for OLMo 2 (and EXAONE 4's layers that rotate, None for the
    others); one per layer kind for OLMo 3, shared by the layers of that kind."""
    hf = config.hf_config
    positions = config.max_position_embeddings
    if config.architecture != "Olmo3ForCausalLM":
        rotary = RotaryEmbedding(config.head_size, positions, rope_parameters(hf))
        rotates = config.spec.rope_layers(hf)
        return [rotary if rotated else None for rotated in rotates]
    layer_types = config.spec.layer_types(hf)
    by_kind = {
        kind: RotaryEmbedding(config.head_size, positions, olmo3_layer_rope_parameters(hf, kind))
        for kind in sorted(set(layer_types))
    }
    return [by_kind[kind] for kind in layer_types]
