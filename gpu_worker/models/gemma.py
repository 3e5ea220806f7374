"""The Gemma family: Gemma, Gemma 2 and Gemma 3 text (GQA, RoPE, RMSNorm scaling by
``1 + w``, embeddings scaled by sqrt(hidden_size), gated tanh-GELU MLP, LM head tied by
default).

Gemma 2 adds norms around both sublayers' outputs (four per layer), an attention scale of
``query_pre_attn_scalar ** -0.5``, sliding-window layers between the global ones, and tanh
soft-caps on the attention logits (in the attention ops) and on the final logits. Gemma 3
keeps that layer, adds an RMSNorm over each query and key head and gives its sliding layers
a RoPE of their own; its soft-caps are optional.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.gpu_worker.layers.basic import GemmaRMSNorm, norm_query_and_key_heads
from pagedserve.gpu_worker.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.gpu_worker.layers.mlp import GatedMLP
from pagedserve.gpu_worker.layers.rope_config import layer_type_rope_parameters, rope_parameters
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import CausalLM, load_fused_checkpoint
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel

GEMMA2 = "Gemma2ForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
# Gemma 2's decoder layer: four norms, query_pre_attn_scalar, soft-capping fields.
GEMMA2_LAYER = (GEMMA2, GEMMA3)


class GemmaAttention(nn.Module):
    """Over this rank's query and KV heads (all of them without tensor parallelism)."""

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
        bias = bool(hf.get("attention_bias"))
        # One GEMM for q, k and v: rows [q | k | v], filled from the three checkpoint tensors.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_size,
            config.num_heads,
            config.num_kv_heads,
            bias,
            dtype,
            parallel,
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_size, config.hidden_size, bias, dtype, parallel
        )
        gemma3 = config.architecture == GEMMA3
        # Each rank holds whole heads, so the per-head norm weights are replicated, not split.
        eps = hf.get("rms_norm_eps", 1e-6)
        self.q_norm = GemmaRMSNorm(config.head_size, eps) if gemma3 else None
        self.k_norm = GemmaRMSNorm(config.head_size, eps) if gemma3 else None
        self.head_size = config.head_size
        self.rotary = rotary
        gemma2_layer = config.architecture in GEMMA2_LAYER
        scale = hf["query_pre_attn_scalar"] ** -0.5 if gemma2_layer else config.head_size**-0.5
        # GemmaConfig has no soft-cap; model_config checked the field of the others.
        logits_soft_cap = (hf.get("attn_logit_softcapping") if gemma2_layer else None) or 0.0
        self.attention = PagedAttention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            config.head_size,
            scale,
            config.layer_sliding_windows[layer_index],
            float(logits_soft_cap),
        )
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = norm_query_and_key_heads(
                self.q_norm, self.k_norm, query, key, self.head_size
            )
        self.rotary(positions, query, key)
        output = self.attention(query, key, value, self.key_cache, self.value_cache, metadata)
        return self.o_proj(output)


def _activation_name(config: ModelConfig) -> str:
    """Gemma 2 and 3 read ``hidden_activation``; Gemma reads ``hidden_act``, where the legacy
    ``"gelu"`` of the original releases means the tanh approximation (GemmaConfig)."""
    if config.architecture in GEMMA2_LAYER:
        return config.hf_config["hidden_activation"]
    name = config.hf_config["hidden_act"]
    return "gelu_pytorch_tanh" if name == "gelu" else name


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        layer_index: int,
    ) -> None:
        super().__init__()
        eps = config.hf_config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = GemmaAttention(config, rotary, dtype, parallel, layer_index)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.hf_config["intermediate_size"],
            False,
            _activation_name(config),
            dtype,
            parallel,
        )
        # Gemma 2 and 3 also norm each sublayer's output before its residual add: there
        # post_attention_layernorm norms the attention output, and pre_feedforward_layernorm
        # is the norm of the residual before the MLP (Gemma's post_attention_layernorm).
        sandwich = config.architecture in GEMMA2_LAYER
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps) if sandwich else None
        self.post_feedforward_layernorm = (
            GemmaRMSNorm(config.hidden_size, eps) if sandwich else None
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous layer's output and the running residual sum (None before
        the first layer); returns this layer's. Each residual add is fused with the norm
        that follows it: ``residual += out; normed = norm(residual)``, HF's arithmetic."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        if self.pre_feedforward_layernorm is None:
            self.post_attention_layernorm.add_and_norm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)
        self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(CausalLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype, parallel
        )
        # HF multiplies the embeddings by sqrt(hidden_size) held as a float32 scalar and
        # rounded to the model's dtype.
        self.register_buffer(
            "embed_scale",
            torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype),
            persistent=False,
        )
        layer_rotaries = _layer_rotaries(config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, layer_rotaries[layer_index], dtype, parallel, layer_index)
            for layer_index in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, hf.get("rms_norm_eps", 1e-6))
        self.activation_dtype = dtype
        self.tie_word_embeddings = bool(hf["tie_word_embeddings"])
        # An untied LM head is a vocabulary table of its own, split the same way.
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, parallel)
        )
        self.final_logit_softcapping: float | None = (
            hf.get("final_logit_softcapping") if config.architecture in GEMMA2_LAYER else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        self.norm.add_and_norm(hidden, residual)
        return hidden

    @property
    def logits_table(self) -> VocabParallelEmbedding:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.logits_table.logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        # HF caps the LM head's output in the model's dtype, whose values the float32
        # logits hold exactly.
        capped = torch.tanh(logits.to(self.activation_dtype) / cap) * cap
        return capped.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if name.endswith("norm.weight"):  # every norm: the checkpoint's w -> 1 + w
                return GemmaRMSNorm.scale_from_checkpoint(tensor, self.activation_dtype)
            return tensor

        load_fused_checkpoint(self, weights, convert=convert)


def _layer_rotaries(config: ModelConfig) -> list[RotaryEmbedding]:
    """Each layer's RoPE: Gemma's and Gemma 2's one for all; Gemma 3's sliding layers share
    one and its global layers another (own base, and the RoPE scaling if the config has one)."""
    hf = config.hf_config
    if config.architecture != GEMMA3:
        rotary = RotaryEmbedding(
            config.head_size, config.max_position_embeddings, rope_parameters(hf)
        )
        return [rotary] * config.num_layers
    layer_types = config.spec.layer_types(hf)
    by_type = {
        layer_type: RotaryEmbedding(
            config.head_size,
            config.max_position_embeddings,
            layer_type_rope_parameters(hf, layer_type),
        )
        for layer_type in set(layer_types)
    }
    return [by_type[layer_type] for layer_type in layer_types]
