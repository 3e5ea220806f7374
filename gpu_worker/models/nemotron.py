"""NVIDIA's Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron): GQA with RoPE over part of
each head (``partial_rotary_factor``, default half), LayerNorm1P (a LayerNorm with a bias whose
scale is ``1 + w``; the loader adds the 1, in the model's dtype, as HF adds it), and an ungated
squared-ReLU MLP (``up_proj``, ``down_proj``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedserve.gpu_worker.layers.basic import LayerNorm
from pagedserve.gpu_worker.layers.mlp import UngatedMLP
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding
from pagedserve.gpu_worker.layers.self_attention import SelfAttention
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import (
    PreNormDecoderLayer,
    StackedDecoderLM,
    load_fused_checkpoint,
)
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel

# The norms whose checkpoint weight is w of a scale 1 + w.
_ONE_PLUS_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "norm.weight")


class NemotronDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        eps, hidden = hf["norm_eps"], config.hidden_size
        self.input_layernorm = LayerNorm(hidden, eps, True, dtype)
        self.self_attn = SelfAttention(
            config, rotary, dtype, parallel, bias=bool(hf.get("attention_bias"))
        )
        self.post_attention_layernorm = LayerNorm(hidden, eps, True, dtype)
        self.mlp = UngatedMLP(
            hidden,
            hf["intermediate_size"],
            bool(hf.get("mlp_bias")),
            hf["hidden_act"],
            dtype,
            parallel,
        )


class NemotronForCausalLM(StackedDecoderLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, parallel)
        self.dtype = dtype
        rotary = self.model_rotary()
        self.stack_layers(lambda _: NemotronDecoderLayer(config, rotary, dtype, parallel))
        self.norm = LayerNorm(config.hidden_size, config.hf_config["norm_eps"], True, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def one_plus(name: str, tensor: torch.Tensor) -> torch.Tensor:
            # HF adds 1 to the weight in its own dtype at every call: the same sum, rounded once.
            return tensor.to(self.dtype) + 1.0 if name.endswith(_ONE_PLUS_NORMS) else tensor

        load_fused_checkpoint(self, weights, convert=one_plus)
