"""Linear layers split over tensor-parallel ranks, and how each takes its share of a
checkpoint tensor.

Column-parallel: rank r holds a block of W's output rows (and of b); its output stays
split, as attention heads or intermediate features. Row-parallel: rank r holds the
matching block of W's input columns; the ranks' partial products are summed::

    column-parallel W [out, in]            row-parallel W [out, in]
    rank 0: rows 0 .. out/N                rank 0: columns 0 .. in/N
    rank 1: rows out/N .. 2 out/N          rank 1: columns in/N .. 2 in/N
    y_r = x W_r^T + b_r  (split)           y = sum_r x_r W_r^T + b  (all_reduce)

Fused projections (q | k | v, gate | up) are split per component: rank r holds its
share of each component, side by side (``[q_r | k_r | v_r]``), never a blind slice of
the fused rows. With one rank every layer is a plain linear over the full weight (packed
for oneDNN on CPU in bfloat16 and float16: packed_weights.py).

Loading: each layer's ``shard_of(attribute, tensor, part)`` takes a full checkpoint
tensor (``part``: which component of a fused layer it is) and returns the row offset in
this rank's parameter and the rows this rank keeps (``models/base.py: WeightLoader``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from pagedserve.gpu_worker.layers.basic import empty_parameter
from pagedserve.gpu_worker.layers.packed_weights import PackableLinear
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


@runtime_checkable
class ShardedWeights(Protocol):
    """A layer whose parameters hold this rank's share of the checkpoint's tensors."""

    def shard_of(
        self, attribute: str, tensor: torch.Tensor, part: int | None
    ) -> tuple[int, torch.Tensor]:
        """(row offset in this rank's ``attribute`` parameter, the rows of ``tensor``,
        the full checkpoint tensor of component ``part``, that this rank keeps)."""


class _ColumnShards(PackableLinear):
    """A column-parallel layer over fused components: ``component_rows[i]`` are the rows
    of component i's full weight that this rank holds, stored in component order."""

    def __init__(
        self,
        in_features: int,
        component_rows: Sequence[range],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.component_rows = list(component_rows)
        self.component_offsets = [0]
        for rows in self.component_rows:
            self.component_offsets.append(self.component_offsets[-1] + len(rows))
        out_features = self.component_offsets[-1]
        self.weight = empty_parameter(out_features, in_features, dtype=dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)

    def shard_of(
        self, attribute: str, tensor: torch.Tensor, part: int | None
    ) -> tuple[int, torch.Tensor]:
        if part is None:
            if len(self.component_rows) != 1:
                raise ValueError(
                    f"a fused layer of {len(self.component_rows)} components loads one "
                    "component at a time; part is missing"
                )
            part = 0
        rows = self.component_rows[part]
        return self.component_offsets[part], tensor[rows.start : rows.stop]


class ColumnParallelLinear(_ColumnShards):
    """``y_r = x W_r^T + b_r`` over ``len(output_sizes)`` fused components (rows ``[c0 |
    c1 | ...]`` of the full weight); rank r holds ``1/N`` of each component's rows. The
    output is this rank's ``[c0_r | c1_r | ...]``."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(in_features, [parallel.shard(size) for size in output_sizes], bias, dtype)


class QKVParallelLinear(_ColumnShards):
    """The fused q | k | v projection, split by heads: rank r holds its query heads and
    its KV heads (replicated when there are fewer KV heads than ranks; see
    ``TensorParallel.kv_heads``). Parts: 0 = q, 1 = k, 2 = v."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        query_heads = parallel.shard(num_heads)
        kv_heads = parallel.kv_heads(num_kv_heads)
        self.num_heads = len(query_heads)  # on this rank
        self.num_kv_heads = len(kv_heads)  # on this rank
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        kv_rows = range(kv_heads.start * head_size, kv_heads.stop * head_size)
        super().__init__(
            hidden_size,
            [range(query_heads.start * head_size, query_heads.stop * head_size), kv_rows, kv_rows],
            bias,
            dtype,
        )


class RowParallelLinear(PackableLinear):
    """``y = sum_r x_r W_r^T + b``: rank r holds columns ``[r in/N, (r+1) in/N)`` of the
    weight and takes the matching split input (the output of a column-parallel layer);
    the partial products are summed over the ranks, then the bias is added once.

    ``reduce_results=False`` returns this rank's partial product unsummed, the bias in rank
    0's only (so the sum holds it once): for a caller that adds several such products and sums
    them over the ranks once, as a mixture-of-experts layer does over its experts."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        parallel: TensorParallel = SINGLE,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.reduce_results = reduce_results
        self.columns = parallel.shard(in_features)
        self.weight = empty_parameter(out_features, len(self.columns), dtype=dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None

    def row_largest(self) -> torch.Tensor:
        """Each row's max |w| over every rank's columns: int8 scales as without tensor
        parallelism. Every rank packs the same layers in the same order, so each reaches
        this collective."""
        return self.parallel.all_reduce_max(super().row_largest())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return self.linear(x, self.bias)
        if not self.reduce_results:
            return self.linear(x, self.bias if self.parallel.rank == 0 else None)
        # NOTE: one all_reduce per call, a synchronisation of every rank.
        output = self.parallel.all_reduce(self.linear(x, None))
        if self.bias is not None:
            output += self.bias
        return output

    def shard_of(
        self, attribute: str, tensor: torch.Tensor, part: int | None
    ) -> tuple[int, torch.Tensor]:
        if attribute == "bias":
            return 0, tensor
        return 0, tensor[:, self.columns.start : self.columns.stop]
