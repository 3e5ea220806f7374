"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``), code models: GQA with RoPE and a
sliding window on every layer (when the config sets one), LayerNorm with biases, a plain
two-layer GELU MLP (``c_fc``, ``c_proj``), biases on every projection, a tied LM head."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.gpu_worker.layers.basic import LayerNorm, activation
from pagedserve.gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding
from pagedserve.gpu_worker.layers.self_attention import SelfAttention
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import PreNormDecoderLayer, StackedDecoderLM
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


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


class Starcoder2DecoderLayer(PreNormDecoderLayer):
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
        self.self_attn = SelfAttention(
            config,
            rotary,
            dtype,
            parallel,
            bias=bool(config.hf_config.get("use_bias", True)),
            sliding_window=config.layer_sliding_windows[layer_index],
        )
        self.post_attention_layernorm = LayerNorm(hidden, eps, True, dtype)
        self.mlp = Starcoder2MLP(config, dtype, parallel)


class Starcoder2ForCausalLM(StackedDecoderLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, parallel, tie_default=True)
        hf = config.hf_config
        rotary = self.model_rotary()
        self.stack_layers(
            lambda index: Starcoder2DecoderLayer(config, rotary, dtype, parallel, index)
        )
        self.norm = LayerNorm(config.hidden_size, hf.get("norm_epsilon", 1e-5), True, dtype)
