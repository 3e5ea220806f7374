"""Llama's model (``LlamaForCausalLM``), which serves every architecture of its family: GQA,
RoPE, RMSNorm and a gated MLP (or experts, layers/moe.py), with what each member changes read
from its description (``config.spec``, models/architectures/): biases, query and key norms,
Granite's scalars, an ungated MLP, interleaved RoPE rows, OLMoE's clipping, Llama 4's
temperatures, checkpoint names. A member that needs more torch code subclasses it in its own
module (phi3.py, granite.py, qwen_moe.py, ernie4_5.py, glm4_moe.py, llama4.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.basic import (
    RMSNorm,
    ShardedRMSNorm,
    WeightlessRMSNorm,
    empty_parameter,
    norm_query_and_key_heads,
)
from pagedserve.gpu_worker.layers.mlp import GatedMLP, UngatedMLP
from pagedserve.gpu_worker.layers.moe import SparseMoE
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, pairs_to_halves
from pagedserve.gpu_worker.layers.self_attention import SelfAttention
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.architecture import (
    HEAD_NORM,
    PROJECTION_NORM,
    ROTATED_HEAD_NORM,
    WEIGHTLESS_ROTATED_HEAD_NORM,
)
from pagedserve.gpu_worker.models.base import (
    StackedDecoderLM,
    load_fused_checkpoint,
)
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


def _granite_scalar(config: ModelConfig, name: str) -> float | None:
    """One of Granite's scalars (the config class's default when the file leaves it out);
    None on the architectures without them."""
    return float(config.hf_config[name]) if config.spec.granite_scalars else None


class LlamaAttention(SelfAttention):
    """Over this rank's query and KV heads (all of them without tensor parallelism); Qwen3's
    per-head query and key norms, Granite's attention scale."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        parallel: TensorParallel,
        sliding_window: int = 0,
        attention_chunk_size: int = 0,
    ) -> None:
        """``rotary``: None for a layer without position embeddings (SmolLM3's and Llama 4's
        NoPE layers)."""
        hf, spec = config.hf_config, config.spec
        super().__init__(
            config,
            rotary,
            dtype,
            parallel,
            bias=spec.qkv_bias(hf),
            output_bias=spec.output_bias(hf),
            sliding_window=sliding_window,
            scale=_granite_scalar(config, "attention_multiplier"),
            clip_qkv=hf.get("clip_qkv") if spec.clips_qkv else None,
            query_scaling=spec.query_scaling(config),
            nope_temperature=spec.nope_temperature(config, rotary is not None),
            attention_chunk_size=attention_chunk_size,
        )
        norm = spec.query_norm(hf, rotary is not None)
        # OLMoE and MiniMax-M2 norm the whole query and key projections (all heads at once;
        # each rank its rows, the sum of squares over the ranks), Llama's arithmetic.
        self.whole_projection_norms = norm == PROJECTION_NORM
        if self.whole_projection_norms:
            eps = hf.get("rms_norm_eps", 1e-5)
            query_rows, kv_rows, _ = self.qkv_proj.component_rows
            kv_replicas = max(1, parallel.size // config.num_kv_heads)
            self.q_norm = ShardedRMSNorm(
                config.num_heads * config.head_size,
                query_rows,
                eps,
                dtype,
                parallel,
                scale_in_float32=False,
            )
            self.k_norm = ShardedRMSNorm(
                config.num_kv_heads * config.head_size,
                kv_rows,
                eps,
                dtype,
                parallel,
                kv_replicas,
                scale_in_float32=False,
            )
            self.query_layernorm = self.key_layernorm = None
            return
        # Each rank holds whole heads, so the per-head norm weights are replicated, not split.
        eps = hf.get("rms_norm_eps", 1e-6)
        per_head_norm = norm == HEAD_NORM
        self.q_norm = RMSNorm(config.head_size, eps, dtype) if per_head_norm else None
        self.k_norm = RMSNorm(config.head_size, eps, dtype) if per_head_norm else None
        # Hunyuan norms each query and key head after RoPE, not before; Llama 4 too, on its
        # layers with RoPE, without learned scales.
        rotated_norm = {ROTATED_HEAD_NORM: RMSNorm, WEIGHTLESS_ROTATED_HEAD_NORM: WeightlessRMSNorm}
        norm_class = rotated_norm.get(norm)  # type: ignore[arg-type]
        self.query_layernorm = norm_class(config.head_size, eps, dtype) if norm_class else None
        self.key_layernorm = norm_class(config.head_size, eps, dtype) if norm_class else None

    def normalize_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is None or self.k_norm is None:
            return query, key
        if self.whole_projection_norms:
            return self.q_norm(query), self.k_norm(key)
        return norm_query_and_key_heads(self.q_norm, self.k_norm, query, key, self.head_size)

    def normalize_rotated_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.query_layernorm is None or self.key_layernorm is None:
            return query, key
        return norm_query_and_key_heads(
            self.query_layernorm, self.key_layernorm, query, key, self.head_size
        )


def _mlp(
    config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel, layer_index: int
) -> nn.Module:
    """The layer's feed-forward block: a gated MLP, or experts where the config puts them."""
    hf, spec = config.hf_config, config.spec
    act_name = hf.get("hidden_act", "silu")
    experts = config.layer_experts[layer_index]
    if experts is not None:
        return SparseMoE(config.hidden_size, experts, act_name, dtype, parallel)
    mlp = UngatedMLP if spec.ungated_mlp else GatedMLP
    width = hf[spec.dense_width_field]  # Llama 4's dense layers have their own width
    return mlp(config.hidden_size, width, spec.mlp_bias(hf), act_name, dtype, parallel)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        layer_index: int,
        self_attn: nn.Module | None = None,
    ) -> None:
        """``self_attn``: a family's own attention over (positions, hidden, metadata)
        (DeepSeek's latent attention); None: Llama's."""
        super().__init__()
        eps = config.hf_config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        if self_attn is None:
            rotates = config.spec.rope_layers(config.hf_config)[layer_index]
            self_attn = LlamaAttention(
                config,
                rotary if rotates else None,
                dtype,
                parallel,
                config.layer_sliding_windows[layer_index],
                config.layer_attention_chunks[layer_index],
            )
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = _mlp(config, dtype, parallel, layer_index)
        self.residual_multiplier = _granite_scalar(config, "residual_multiplier")

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
        if self.residual_multiplier is not None:
            hidden = hidden * self.residual_multiplier
        self.post_attention_layernorm.add_and_norm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier is not None:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class LlamaForCausalLM(StackedDecoderLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, parallel)
        hf = config.hf_config
        rotary = self.model_rotary()
        self.stack_layers(lambda index: LlamaDecoderLayer(config, rotary, dtype, parallel, index))
        self.norm = RMSNorm(config.hidden_size, hf.get("rms_norm_eps", 1e-6), dtype)
        self.embedding_multiplier = _granite_scalar(config, "embedding_multiplier")
        self.logits_scaling = _granite_scalar(config, "logits_scaling")
        # ERNIE 4.5 MoE's LM head has a bias when ``use_bias`` says.
        self.lm_head_bias = (
            empty_parameter(config.vocab_size, dtype=dtype)
            if config.spec.lm_head_bias(hf)
            else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Each layer passes on its output and the running residual (fused adds)."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        self.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.logits_table.logits(hidden_states)
        if self.lm_head_bias is not None:
            logits += self.lm_head_bias.float()
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        return logits

    def checkpoint_rows(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """Query and key rows that rotate interleaved pairs (ERNIE 4.5's, Llama 4's) to halves
        (on Llama 4's layers without RoPE too: a permutation of both, which leaves their dot
        products and norms as they are)."""
        if self.config.spec.interleaved_rope and projection in ("q_proj", "k_proj"):
            return pairs_to_halves(tensor, self.config.head_size, self.config.head_size)
        return tensor

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as this model holds them, once renamed
        (``Architecture.checkpoint_name``): where a member splits or drops some, it
        overrides this."""
        return weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        name_of, hf = self.config.spec.checkpoint_name, self.config.hf_config
        weights = self.checkpoint_tensors((name_of(name, hf), tensor) for name, tensor in weights)

        def rows(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return self.checkpoint_rows(name.rpartition(".")[0].rpartition(".")[2], tensor)

        load_fused_checkpoint(self, weights, rename=_mixtral_names, convert=rows)


def split_stacked_experts(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    hidden_first: bool = False,
) -> Iterable[tuple[str, torch.Tensor]]:
    """A layer's experts stacked in two tensors (Qwen3-VL-MoE's checkpoints:
    ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) as each expert's projections.
    Either orientation, as transformers reads both: its own ([experts, 2 * intermediate,
    hidden] and [experts, hidden, intermediate]) or the published checkpoints' transposed one
    ([experts, hidden, 2 * intermediate], [experts, intermediate, hidden]), told apart by the
    hidden size (where the two sizes are equal, transformers' own, as it reads them), or
    always the transposed one with ``hidden_first`` (Llama 4's, which its HF model holds).
    Gate rows first, HF's ``chunk(2)``."""
    hidden = config.hidden_size
    for name, tensor in weights:
        if name.endswith(".mlp.experts.gate_up_proj"):
            if hidden_first or tensor.shape[-1] != hidden:
                tensor = tensor.transpose(1, 2)
            prefix = name.removesuffix("gate_up_proj")
            for expert, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2, dim=0)
                yield f"{prefix}{expert}.gate_proj.weight", gate
                yield f"{prefix}{expert}.up_proj.weight", up
        elif name.endswith(".mlp.experts.down_proj"):
            if hidden_first or tensor.shape[1] != hidden:
                tensor = tensor.transpose(1, 2)
            prefix = name.removesuffix("down_proj")
            for expert, down in enumerate(tensor):
                yield f"{prefix}{expert}.down_proj.weight", down
        else:
            yield name, tensor


# Mixtral's sparse block and its experts' gate, down and up projections, by their own names.
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _mixtral_names(name: str) -> str:
    """``layers.L.block_sparse_moe.experts.E.w1.weight`` -> ``layers.L.mlp.experts.E.
    gate_proj.weight`` (and w2 -> down_proj, w3 -> up_proj); other names unchanged."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    module, _, attribute = name.rpartition(".")
    parent, _, projection = module.rpartition(".")
    if projection in _MIXTRAL_PROJECTIONS:
        return f"{parent}.{_MIXTRAL_PROJECTIONS[projection]}.{attribute}"
    return name
