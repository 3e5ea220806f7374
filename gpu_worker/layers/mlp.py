"""The gated MLP of Llama-style models, ``down(act(gate(x)) * up(x))``: the dense layer's
feed-forward block, and each expert of a mixture-of-experts layer; Arcee's ungated
``down(act(up(x)))``; gpt-oss's experts, whose gate is a clamped SwiGLU."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.gpu_worker import fused_ops
from pagedserve.gpu_worker.layers.basic import XIELU, activation, empty_parameter
from pagedserve.gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


class GatedMLP(nn.Module):
    """This rank's ``1/N`` of the intermediate features; ``reduce_results=False`` leaves
    the sum over the ranks to the caller (an expert's output, summed with the others')."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        act_name: str,
        dtype: torch.dtype,
        parallel: TensorParallel = SINGLE,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        # Rows [gate | up] in one GEMM (this rank's share of each).
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, dtype, parallel
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, dtype, parallel, reduce_results
        )
        self.act = None if act_name in ("silu", "swish") else activation(act_name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        if self.act is None:
            # SiLU(gate) * up in one pass (csrc: silu_and_mul), HF's arithmetic.
            product = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            fused_ops.silu_and_mul(product, gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            product = self.act(gate) * up
        return self.down_proj(product)


class UngatedMLP(nn.Module):
    """``down(act(up(x)))`` (HF's NemotronMLP, Arcee's, Apertus's): this rank's ``1/N`` of the
    intermediate features, one sum over the ranks after ``down``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        act_name: str,
        dtype: torch.dtype,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, [intermediate_size], bias, dtype, parallel)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype, parallel)
        # Apertus's xIELU has learned scalars (``act``'s parameters); the others are functions.
        self.act = XIELU(dtype) if act_name == "xielu" else activation(act_name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(hidden)))


class ClampedSwiGLUMLP(nn.Module):
    """A gpt-oss expert: ``down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)) +
    b``, ``g = min(gate, limit)``, with biases on gate, up and down, HF's ``GptOssExperts``
    arithmetic op for op. Rows ``[gate | up]`` (the checkpoint interleaves them; the model
    splits them on loading so each rank takes its share of both). The output is this rank's
    partial sum, left to the caller to sum with the other experts' (as ``GatedMLP`` with
    ``reduce_results=False``); the down bias is added on rank 0 only, so the sum holds it
    once."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        alpha: float,
        limit: float,
        dtype: torch.dtype,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], True, dtype, parallel
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, False, dtype, parallel, reduce_results=False
        )
        self.down_bias = empty_parameter(hidden_size, dtype=dtype)
        self.adds_bias = parallel.rank == 0
        self.alpha = alpha
        self.limit = limit

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        product = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        output = self.down_proj(product)
        return output + self.down_bias if self.adds_bias else output
