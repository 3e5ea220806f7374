"""Tensor parallelism: this process's rank, the process group, and the collectives.

Each rank is one worker process. The parallel layers (``layers/linear.py``,
``layers/vocab_embedding.py``) hold a rank's share of each weight and call the
collectives here; with one rank every collective is the identity, and the layers take
the same arithmetic path as a model that was never split::

    hidden (replicated) -> column-parallel (q/k/v heads, gate/up rows: a shard each)
                        -> attention over this rank's heads only
                        -> row-parallel (o_proj, down_proj: partial sums) -> all_reduce
                        -> hidden (replicated again)

The process group: ``gloo`` on CPU, ``nccl`` on CUDA (one GPU a rank; its collectives
are ordered with the compute stream, and CUDA graphs capture them). The ranks meet at a
file store in the engine's private socket directory when they share the scheduler's host
(no port to pick, nothing left behind: the directory is removed at shutdown), or at a
TCP store on rank 0's host when Ray places them across nodes
(``scheduler/ray_executor.py``). A rank that joined a group runs every collective through
it, even in a group of one (the Ray executor's): the same path as many ranks, on one
device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.model_config import (  # noqa: F401 (re-exported)
    ModelConfig,
    check_tensor_parallel_size,
)

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``: which share of each split dimension this process holds.

    Invariant: every rank calls the same collectives in the same order (they all run the
    same plan through the same model), so no collective waits for a rank that never
    comes.
    """

    rank: int = 0
    size: int = 1
    # In a torch.distributed process group (every collective goes through it, size 1
    # too); False: one rank on its own, every collective the identity.
    grouped: bool = False

    def shard(self, total: int) -> range:
        """This rank's contiguous share of ``total`` items (heads, rows), ``total``
        divisible by ``size`` (``check_tensor_parallel_size``)."""
        per_rank = total // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, num_kv_heads: int) -> range:
        """This rank's KV heads. With fewer KV heads than ranks each head is replicated
        on ``size / num_kv_heads`` consecutive ranks (as vLLM does), so rank r's query
        heads still read the KV head they use without tensor parallelism."""
        if num_kv_heads >= self.size:
            return self.shard(num_kv_heads)
        head = self.rank // (self.size // num_kv_heads)
        return range(head, head + 1)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; every rank gets the same bits."""
        if self.grouped:
            dist.all_reduce(tensor)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise largest of ``tensor`` over the ranks, in place."""
        if self.grouped:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors side by side along the last dimension, on every rank."""
        if not self.grouped:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def init_tensor_parallel(
    rank: int,
    size: int,
    init_method: str | None,
    device: str = "cpu",
    ranks_on_host: int | None = None,
) -> TensorParallel:
    """Join the process group of ``size`` ranks at ``init_method`` (a torch.distributed
    init method; None: one rank on its own, no group) and give this rank its share of the
    CPU cores: the host's divided among ``ranks_on_host`` (default ``size``). ``device``:
    the rank's own ("cuda:1"), whose type picks the backend. Blocks until every rank has
    joined."""
    if init_method is None:
        if size != 1:
            raise ValueError(f"tensor parallel size {size} needs a rendezvous (init_method)")
        return SINGLE
    sharing = size if ranks_on_host is None else ranks_on_host
    if sharing > 1 and torch.device(device).type == "cpu":
        set_threads_per_rank(sharing)
    backend = _BACKENDS.get(torch.device(device).type)
    if backend is None:
        raise ValueError(
            f"tensor parallelism on device {device!r}: ranks run on cpu (gloo) or cuda (nccl)"
        )
    options: dict = {}
    if backend == "nccl":
        # Bound to the rank's GPU at once: NCCL makes its communicator eagerly, on it.
        torch.cuda.set_device(torch.device(device))
        options["device_id"] = torch.device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, **options)
    return TensorParallel(rank, size, grouped=True)


def shutdown_tensor_parallel() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def set_threads_per_rank(size: int) -> None:
    """Ranks on one CPU share its cores: each takes ``cores // size`` threads (at least
    one) for torch's kernels and for the compiled ops, so none oversubscribes. A positive
    ``OMP_NUM_THREADS`` caps each rank further: on cores other jobs share, fewer threads
    than cores is what keeps small matmuls fast (README, "Operating it")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    num_threads = max(1, (cores or 1) // size)
    cap = _omp_num_threads()
    if cap is not None:
        num_threads = min(num_threads, cap)
    set_host_threads(num_threads)


def set_host_threads(num_threads: int) -> None:
    """This process's threads for torch's CPU kernels and the compiled ops."""
    torch.set_num_threads(num_threads)
    ops.set_num_threads(num_threads)


def _omp_num_threads() -> int | None:
    """OMP_NUM_THREADS as a positive count, or ``None`` when unset or not one (OpenMP
    itself ignores such a value, and so do we)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    # OpenMP allows a list for nested levels ("4,2"); the first is the outer team's size.
    first = value.split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None
