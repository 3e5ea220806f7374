"""OPT, the paper's model family: learned positions, LayerNorm, ReLU MLP, biases."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.gpu_worker.layers.basic import LayerNorm, Linear, activation
from pagedserve.gpu_worker.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import CausalLM, WeightLoader
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel

# OPT's position table starts with two rows reserved by fairseq; position p uses row p + 2.
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    """Over this rank's heads (all of them without tensor parallelism)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(config.hf_config.get("enable_bias", True))
        self.qkv_proj = QKVParallelLinear(
            hidden, config.head_size, config.num_heads, config.num_heads, bias, dtype, parallel
        )
        self.out_proj = RowParallelLinear(hidden, hidden, bias, dtype, parallel)
        num_heads = self.qkv_proj.num_heads
        self.attention = PagedAttention(
            num_heads, num_heads, config.head_size, config.head_size**-0.5
        )
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        query, key, value = self.qkv_proj(hidden).chunk(3, dim=-1)
        output = self.attention(query, key, value, self.key_cache, self.value_cache, metadata)
        return self.out_proj(output)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel) -> None:
        super().__init__()
        hf = config.hf_config
        hidden = config.hidden_size
        bias = bool(hf.get("enable_bias", True))
        affine = bool(hf.get("layer_norm_elementwise_affine", True))
        self.norm_before = bool(hf.get("do_layer_norm_before", True))
        self.self_attn = OPTAttention(config, dtype, parallel)
        self.self_attn_layer_norm = LayerNorm(hidden, 1e-5, affine, dtype)
        self.fc1 = ColumnParallelLinear(hidden, [hf["ffn_dim"]], bias, dtype, parallel)
        self.fc2 = RowParallelLinear(hf["ffn_dim"], hidden, bias, dtype, parallel)
        self.final_layer_norm = LayerNorm(hidden, 1e-5, affine, dtype)
        self.act = activation(hf.get("activation_function", "relu"))

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden
        if self.norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, metadata)
        if not self.norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.norm_before:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.norm_before:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTForCausalLM(CausalLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        hf = config.hf_config
        hidden = config.hidden_size
        projection = hf.get("word_embed_proj_dim", hidden)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, projection, dtype, parallel)
        # Positions, norms and the projections are small: every rank holds all of them.
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden, dtype=dtype
        )
        self.embed_positions.weight.requires_grad_(False)
        self.project_in = Linear(projection, hidden, False, dtype) if projection != hidden else None
        self.project_out = (
            Linear(hidden, projection, False, dtype) if projection != hidden else None
        )
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, dtype, parallel) for _ in range(config.num_layers)
        )
        has_final_norm = bool(hf.get("do_layer_norm_before", True)) and not hf.get(
            "_remove_final_layer_norm", False
        )
        affine = bool(hf.get("layer_norm_elementwise_affine", True))
        self.final_layer_norm = LayerNorm(hidden, 1e-5, affine, dtype) if has_final_norm else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden, metadata)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden

    @property
    def logits_table(self) -> VocabParallelEmbedding:
        # OPT always ties the LM head to the token embedding.
        return self.embed_tokens

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_table.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        fused = {"q_proj": 0, "k_proj": 1, "v_proj": 2}  # parts of qkv_proj
        for name, tensor in weights:
            if name == "lm_head.weight":
                continue
            name = name.removeprefix("model.").removeprefix("decoder.")
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                part = fused[parts[-2]]
                parts[-2] = "qkv_proj"
                loader.load(".".join(parts), tensor, part)
            else:
                loader.load(name, tensor)
        loader.check_complete()
