"""DeepSeek-V2 and DeepSeek-V3 (and the models built on them: DeepSeek-R1, Kimi K2, ...; and
Zhipu's GLM-4.7-Flash, ``Glm4MoeLiteForCausalLM``, which is V3's layers under GLM's names for
which have experts): Llama's layers with multi-head latent attention (MLA) and, from layer
``first_k_dense_replace`` on (GLM-4.7-Flash: the "sparse" ``mlp_layer_types``), experts under
DeepSeek's grouped router beside shared experts (layers/moe.py).

MLA: each token's keys and values come from one small latent per token, the RMS-normed
``kv_lora_rank`` values of ``kv_a_proj_with_mqa``, expanded per head by ``kv_b_proj`` into the
head's key values without position (``qk_nope_head_dim``) and its value (``v_head_dim``); the
key's rotated values (``qk_rope_head_dim``) are one set shared by all heads. The query comes
from ``q_proj``, or through a low-rank ``q_a_proj`` -> norm -> ``q_b_proj``. RoPE rotates the
last ``qk_rope_head_dim`` of each query and key, on interleaved pairs (V2; V3 with
``rope_interleave``) run as the ops' halves on rows the loader reorders. The softmax scale is
1/sqrt(query-key head size), times YaRN's ``mscale_all_dim`` factor squared.

NOTE: the paged cache holds the expanded keys and values of every head, the value padded with
zeros to the key's size or the key to the value's (``model_config.latent_attention_heads``), as
the attention ops take them: the same attention as HF's, which caches the latent, at more
memory per token (DeepSeek-V3: 128 heads x 192 x 2 values a layer, against the latent's 576).
Attention over the latent itself (absorbing ``kv_b_proj`` into the query and the output) is for
an op that reads a latent cache."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.gpu_worker.layers.basic import Linear, RMSNorm
from pagedserve.gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, pairs_to_halves, rope_parameters
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import (
    StackedDecoderLM,
    load_fused_checkpoint,
    without_next_token_layers,
)
from pagedserve.gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel

# DeepseekV2RMSNorm's default: the latent norms do not take the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def _yarn_mscale(factor: float, weight: float) -> float:
    """YaRN's ``0.1 * weight * ln(factor) + 1`` (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def softmax_scale(hf_config: dict) -> float:
    """1/sqrt(query-key head size), times the square of YaRN's ``mscale_all_dim`` factor when
    the RoPE is scaled (HF's ``yarn_apply_mscale``: DeepSeek scales every query-key product,
    not only the rotated values)."""
    scale = (hf_config["qk_nope_head_dim"] + hf_config["qk_rope_head_dim"]) ** -0.5
    parameters = rope_parameters(hf_config)
    if parameters["rope_type"] != "default" and parameters.get("mscale_all_dim"):
        mscale = _yarn_mscale(parameters["factor"], parameters["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def rope_is_interleaved(config: ModelConfig) -> bool:
    """V2 always rotates interleaved pairs (complex numbers); V3 when ``rope_interleave``."""
    if config.architecture == "DeepseekV2ForCausalLM":
        return True
    return bool(config.hf_config.get("rope_interleave", True))


class MultiHeadLatentAttention(nn.Module):
    """This rank's heads of MLA (the latent projection and norms are replicated: small)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.nope_size = hf["qk_nope_head_dim"]
        self.rope_size = hf["qk_rope_head_dim"]
        self.value_size = hf["v_head_dim"]
        self.latent_size = hf["kv_lora_rank"]
        self.query_key_size = self.nope_size + self.rope_size
        self.head_size = config.head_size  # the cache's: the larger of the two, padded
        self.num_heads = len(parallel.shard(config.num_heads))
        bias = bool(hf.get("attention_bias"))
        hidden = config.hidden_size
        query_rows = [config.num_heads * self.query_key_size]
        q_lora_rank = hf.get("q_lora_rank")
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, query_rows, False, dtype, parallel)
        else:
            self.q_a_proj = Linear(hidden, q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, query_rows, False, dtype, parallel)
        self.kv_a_proj_with_mqa = Linear(hidden, self.latent_size + self.rope_size, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.latent_size, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            self.latent_size,
            [config.num_heads * (self.nope_size + self.value_size)],
            False,
            dtype,
            parallel,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * self.value_size, hidden, bias, dtype, parallel
        )
        self.rotary = rotary
        self.attention = PagedAttention(
            self.num_heads, self.num_heads, self.head_size, softmax_scale(hf)
        )
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_proj is not None:
            query = self.q_proj(hidden)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        query = query.view(num_tokens, self.num_heads, self.query_key_size)
        latent, key_rope = self.kv_a_proj_with_mqa(hidden).split(
            [self.latent_size, self.rope_size], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())
        # The rotated parts, one copy each: the rotary op takes rows of whole heads.
        query_rope = query[..., self.nope_size :].reshape(num_tokens, -1)
        key_rope = key_rope.contiguous()
        self.rotary(positions, query_rope, key_rope)
        expanded = self.kv_b_proj(latent).view(num_tokens, self.num_heads, -1)
        key_nope, value = expanded.split([self.nope_size, self.value_size], dim=-1)
        # Each head as the cache holds it: [nope | rope | zeros], the value [value | zeros].
        shape = (num_tokens, self.num_heads, self.head_size)
        query_rope = query_rope.view(num_tokens, self.num_heads, self.rope_size)
        key_rope = key_rope[:, None, :].expand(-1, self.num_heads, -1)
        key_padding = (0, self.head_size - self.query_key_size)
        queries = F.pad(torch.cat((query[..., : self.nope_size], query_rope), -1), key_padding)
        keys = F.pad(torch.cat((key_nope, key_rope), -1), key_padding)
        values = F.pad(value, (0, self.head_size - self.value_size))
        output = self.attention(
            queries.view(num_tokens, -1),
            keys.view(num_tokens, -1),
            values.view(num_tokens, -1),
            self.key_cache,
            self.value_cache,
            metadata,
        )
        output = output.view(shape)[..., : self.value_size].reshape(num_tokens, -1)
        return self.o_proj(output)


class DeepseekForCausalLM(LlamaForCausalLM):
    """Llama's residual stream (fused adds and norms) over MLA layers."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        StackedDecoderLM.__init__(self, config, dtype, parallel)
        hf = config.hf_config
        # HF's rotary embedding is over the rotated values of a head only.
        rotary = RotaryEmbedding(
            hf["qk_rope_head_dim"], config.max_position_embeddings, rope_parameters(hf)
        )
        self.stack_layers(
            lambda index: LlamaDecoderLayer(
                config,
                rotary,
                dtype,
                parallel,
                index,
                MultiHeadLatentAttention(config, rotary, dtype, parallel),
            )
        )
        self.norm = RMSNorm(config.hidden_size, hf.get("rms_norm_eps", 1e-6), dtype)
        self.embedding_multiplier = None
        self.logits_scaling = None
        self.lm_head_bias = None

    def checkpoint_rows(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rotated query and key rows from interleaved pairs to halves (V2; V3 with
        ``rope_interleave``): each head's last ``qk_rope_head_dim`` query rows, the last
        ``qk_rope_head_dim`` rows of the latent projection."""
        if not rope_is_interleaved(self.config):
            return tensor
        hf = self.config.hf_config
        rope = hf["qk_rope_head_dim"]
        if projection in ("q_proj", "q_b_proj"):
            head = hf["qk_nope_head_dim"] + rope
            return pairs_to_halves(tensor, head, rope, start=hf["qk_nope_head_dim"])
        if projection == "kv_a_proj_with_mqa":
            rows = hf["kv_lora_rank"] + rope
            return pairs_to_halves(tensor, rows, rope, start=hf["kv_lora_rank"])
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rows(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return self.checkpoint_rows(name.rpartition(".")[0].rpartition(".")[2], tensor)

        load_fused_checkpoint(self, without_next_token_layers(self.config, weights), convert=rows)
