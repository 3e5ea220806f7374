"""OpenAI's gpt-oss (gpt-oss-20b, gpt-oss-120b): a Llama-shaped decoder whose attention has
biases, a learned sink logit per query head (csrc/ops.h: attention sinks) and a 128-token
window on every other layer (the even-numbered ones), YaRN RoPE, and on every layer a
mixture of experts: a router with a bias picks the top 4 experts, weighted by the softmax of
their logits, each a clamped SwiGLU with biases (``layers/mlp.py``'s ``ClampedSwiGLUMLP``).

The checkpoint stacks each layer's experts: ``gate_up_proj`` [experts, hidden, 2 x
intermediate] with gate and up interleaved column by column (HF's ``[..., ::2]`` and
``[..., 1::2]``), ``down_proj`` [experts, intermediate, hidden], their biases beside them.
OpenAI's published weights hold those two matrices in MXFP4 (``*_blocks``: two 4-bit e2m1
values a byte, 32 to a block; ``*_scales``: one power-of-two exponent, e8m0, per block);
they are widened on loading, exactly (``dequantize_mxfp4``), to the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedserve.gpu_worker.layers.basic import ScaledInFloat32RMSNorm, empty_parameter
from pagedserve.gpu_worker.layers.moe import SparseMoE
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding
from pagedserve.gpu_worker.layers.self_attention import SelfAttention
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import (
    PreNormDecoderLayer,
    StackedDecoderLM,
    load_fused_checkpoint,
)
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel

# The 16 values of a 4-bit e2m1 code (sign, 2 exponent bits, 1 mantissa bit), OCP MX's table.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32)
_E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` uint8 [..., rows, groups, 16] (each byte two codes, the low nibble
    first) and ``scales`` uint8 [..., rows, groups] (each group's exponent + 127) -> float32
    [..., rows, groups * 32]: code value x 2^(scale - 127), exact (every product is a float32).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            "(blocks: [..., groups, 16], scales: [..., groups])"
        )
    table = _E2M1_TABLE.to(blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)
    exponents = scales.to(torch.int32) - _E8M0_BIAS
    values = torch.ldexp(values.flatten(-2), exponents[..., None])
    return values.flatten(-2)


class GptOssAttention(SelfAttention):
    """Self-attention with q/k/v/o biases and this rank's heads' sink logits (``sinks``,
    float32 whatever the model's dtype: the attention ops take them so)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        sliding_window: int,
    ) -> None:
        super().__init__(
            config,
            rotary,
            dtype,
            parallel,
            bias=bool(config.hf_config.get("attention_bias", True)),
            sliding_window=sliding_window,
        )
        self.heads = parallel.shard(config.num_heads)
        self.sinks = empty_parameter(len(self.heads), dtype=torch.float32)
        # The op reads the parameter itself: loading fills it in place.
        self.attention.sinks = self.sinks

    def shard_of(
        self, attribute: str, tensor: torch.Tensor, part: int | None
    ) -> tuple[int, torch.Tensor]:
        """This rank's heads' sinks (``WeightLoader``: the only parameter loaded here)."""
        return 0, tensor[self.heads.start : self.heads.stop]


class GptOssDecoderLayer(PreNormDecoderLayer):
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
        experts = config.layer_experts[layer_index]
        assert experts is not None  # model_config gives every gpt-oss layer its experts
        # HF's GptOssRMSNorm scales the float32 normalised value before rounding.
        self.input_layernorm = ScaledInFloat32RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = GptOssAttention(
            config, rotary, dtype, parallel, config.layer_sliding_windows[layer_index]
        )
        self.post_attention_layernorm = ScaledInFloat32RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = SparseMoE(config.hidden_size, experts, "silu", dtype, parallel)


class GptOssForCausalLM(StackedDecoderLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, parallel)
        hf = config.hf_config
        rotary = self.model_rotary()
        self.stack_layers(lambda index: GptOssDecoderLayer(config, rotary, dtype, parallel, index))
        self.norm = ScaledInFloat32RMSNorm(config.hidden_size, hf.get("rms_norm_eps", 1e-5), dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_fused_checkpoint(self, _per_expert_tensors(weights))
        for layer in self.layers:
            sinks = layer.self_attn.sinks
            if not torch.isfinite(sinks).all():
                raise ValueError("model: a layer's self_attn.sinks holds a non-finite value")


_EXPERT_MATRICES = ("gate_up_proj", "down_proj")


def _per_expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's stacked experts (either form: matrices, or MXFP4 blocks and scales,
    which may come in either order) as each expert's gate / up / down projections and
    biases, under the names ``load_fused_checkpoint`` fuses; the router as the MoE's gate."""
    pending: dict[str, torch.Tensor] = {}  # an MXFP4 half waiting for its other half
    for name, tensor in weights:
        stem, _, attribute = name.rpartition(".mlp.")
        if not stem:
            yield name, tensor
            continue
        prefix = f"{stem}.mlp."
        if attribute.startswith("router."):
            yield prefix + "gate." + attribute.removeprefix("router."), tensor
            continue
        matrix = attribute.removeprefix("experts.")
        if matrix in _EXPERT_MATRICES:
            # HF's layout [experts, in, out]; a projection's weight is [out, in].
            yield from _per_expert(prefix, matrix, "weight", tensor.transpose(1, 2))
        elif matrix.removesuffix("_bias") in _EXPERT_MATRICES:
            yield from _per_expert(prefix, matrix.removesuffix("_bias"), "bias", tensor)
        elif matrix.endswith(("_blocks", "_scales")):
            base, _, kind = matrix.rpartition("_")
            other = f"{prefix}{base}_{'scales' if kind == 'blocks' else 'blocks'}"
            if other not in pending:
                pending[f"{prefix}{matrix}"] = tensor
                continue
            blocks, scales = (tensor, pending.pop(other))
            if kind == "scales":
                blocks, scales = scales, blocks
            if base not in _EXPERT_MATRICES:
                raise ValueError(f"checkpoint tensor {name!r} is not an expert matrix")
            # Dequantized one expert at a time: a float32 copy of all of them is gigabytes.
            yield from _per_expert(
                prefix,
                base,
                "weight",
                (dequantize_mxfp4(b, s) for b, s in zip(blocks, scales, strict=True)),
            )
        else:
            yield name, tensor
    if pending:
        raise ValueError(
            f"checkpoint has MXFP4 tensors without their other half: {', '.join(sorted(pending))}"
        )


def _per_expert(
    prefix: str, matrix: str, kind: str, per_expert: Iterable[torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert's ``kind`` ("weight": its [out, in] matrix, or "bias") of ``matrix``:
    gate_up's interleaved rows split into gate and up; the down bias, which the expert adds
    once over the ranks, as ``down_bias``."""
    for expert, tensor in enumerate(per_expert):
        name = f"{prefix}experts.{expert}"
        if matrix == "down_proj":
            yield (f"{name}.down_bias" if kind == "bias" else f"{name}.down_proj.weight"), tensor
        else:
            yield f"{name}.gate_proj.{kind}", tensor[0::2]
            yield f"{name}.up_proj.{kind}", tensor[1::2]
