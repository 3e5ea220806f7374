"""The Llama family: Llama, Mistral and Qwen2 (GQA, RoPE, RMSNorm, gated SiLU MLP)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.attention import AttentionMetadata, PagedAttention
from pagedserve.gpu_worker.layers.basic import Linear, RMSNorm, activation
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import CausalLM, WeightLoader


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        hf = config.hf_config
        self.q_size = config.num_heads * config.head_size
        self.kv_size = config.num_kv_heads * config.head_size
        # Qwen2 always has q/k/v biases; Llama and Mistral have them when the config says.
        qkv_bias = config.architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias"))
        # One GEMM for q, k and v: rows [q | k | v], filled from the three checkpoint tensors.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, bool(hf.get("attention_bias")), dtype)
        self.rotary = rotary
        self.attention = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_size, config.head_size**-0.5
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


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hf = config.hf_config
        intermediate = hf["intermediate_size"]
        bias = bool(hf.get("mlp_bias"))
        # Rows [gate | up] in one GEMM.
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate, bias, dtype)
        self.down_proj = Linear(intermediate, config.hidden_size, bias, dtype)
        act_name = hf.get("hidden_act", "silu")
        self.act = None if act_name in ("silu", "swish") else activation(act_name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        if self.act is None:
            # SiLU(gate) * up in one pass (csrc: silu_and_mul), HF's arithmetic.
            product = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            ops.silu_and_mul(product, gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            product = self.act(gate) * up
        return self.down_proj(product)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.hf_config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = LlamaMLP(config, dtype)

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
        self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hf = config.hf_config
        self.config = config
        rotary = RotaryEmbedding(
            config.head_size, config.max_position_embeddings, rope_parameters(hf)
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, hf.get("rms_norm_eps", 1e-6), dtype)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        self.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden_states, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        q_size, kv_size = self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size
        intermediate = self.config.hf_config["intermediate_size"]
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q_size),
            "v_proj": ("qkv_proj", q_size + kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", intermediate),
        }
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints may store a copy of the embedding
            name = name.removeprefix("model.")
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, offset = fused[parts[-2]]
                parts[-2] = target
                loader.load(".".join(parts), tensor, row_offset=offset)
            else:
                loader.load(name, tensor)
        loader.check_complete()
