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

The paged cache holds the latent and the rotated key alone, as HF's cache does (DeepSeek-V3:
576 values a token and layer, against 128 heads x 192 x 2 expanded), and attention runs over
it with ``kv_b_proj`` absorbed into the query and the output (``layers/latent_attention.py``):
its rows are split once loading is over into each head's key part ``w_uk`` and value part
``w_uv``, and the layer keeps those instead."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.basic import Linear, RMSNorm
from pagedserve.gpu_worker.layers.latent_attention import latent_attention, write_latents
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
    """This rank's heads of MLA (the latent projection and norms are replicated: small, and
    so is the latent cache: every rank's heads read all of it)."""

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
        self.scale = softmax_scale(hf)
        # kv_b_proj's rows per head once loaded (absorb_kv_b_proj): the key part [heads,
        # nope, latent] into the query, the value part [heads, value, latent] into the output.
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def absorb_kv_b_proj(self) -> None:
        """Once loading is over: keep ``kv_b_proj``'s rows as each head's ``w_uk`` and
        ``w_uv``, and drop the layer (attention never expands the latent)."""
        weight = self.kv_b_proj.weight.detach()
        per_head = weight.view(self.num_heads, self.nope_size + self.value_size, self.latent_size)
        self.w_uk = per_head[:, : self.nope_size].contiguous()
        self.w_uv = per_head[:, self.nope_size :].contiguous()
        del self.kv_b_proj

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
        assert self.key_cache is not None and self.value_cache is not None
        assert self.w_uk is not None and self.w_uv is not None, "absorb_kv_b_proj first"
        write_latents(latent, key_rope, self.key_cache, self.value_cache, metadata.slot_mapping)
        if metadata.latent_plans is None:
            raise ValueError(
                "latent attention needs the step's latent_plans "
                "(AttentionMetadata.for_sequences with latent_attention)"
            )
        # The absorbed products in float32 (as the attention itself), rounded once at the end.
        query_latent = torch.einsum(
            "thn,hnl->thl", query[..., : self.nope_size].float(), self.w_uk.float()
        )
        query_rope = query_rope.view(num_tokens, self.num_heads, self.rope_size)
        summed = torch.empty_like(query_latent)
        for start, end, plan in metadata.latent_plans:
            summed[start:end] = latent_attention(
                query_latent[start:end],
                query_rope[start:end],
                self.key_cache,
                self.value_cache,
                plan,
                self.scale,
            )
        output = torch.einsum("thl,hvl->thv", summed, self.w_uv.float())
        return self.o_proj(output.to(hidden.dtype).reshape(num_tokens, -1))


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
        for layer in self.layers:
            layer.self_attn.absorb_kv_b_proj()
