"""The gated MLP of Llama-style models, ``down(act(gate(x)) * up(x))``: the dense layer's
feed-forward block, and each expert of a mixture-of-experts layer."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.basic import activation
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
            ops.silu_and_mul(product, gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            product = self.act(gate) * up
        return self.down_proj(product)
