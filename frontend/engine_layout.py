"""Which processes an engine runs in, chosen from its options before anything starts: one
process or a scheduler and workers of their own (``multiprocess``), the workers on this host
or as Ray actors (``distributed_executor_backend``), and whether steps are planned ahead
(``async_scheduling``)."""

from __future__ import annotations

import importlib.util


def choose_multiprocess(
    multiprocess: bool | None, tensor_parallel_size: int, executor_backend: str = "mp"
) -> bool:
    """Tensor parallelism runs one worker process per rank, and Ray's executor one actor
    per rank: unset, ``multiprocess`` follows from the size and the executor (as vLLM
    picks its multi-process executor); ``False`` with either is an error."""
    _check_optional_positive("tensor_parallel_size", tensor_parallel_size)
    if executor_backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray on every node: pip install "
            "'pagedserve[ray]' (docs/operations.md, \"Several nodes\")"
        )
    needs = tensor_parallel_size > 1 or executor_backend == "ray"
    if multiprocess is None:
        return needs
    if not multiprocess and needs:
        reason = (
            f"tensor_parallel_size={tensor_parallel_size} runs one worker process per rank"
            if tensor_parallel_size > 1
            else "distributed_executor_backend='ray' runs the workers as Ray actors"
        )
        raise ValueError(
            f"{reason} and needs multiprocess=True; leave multiprocess unset to have it chosen"
        )
    return bool(multiprocess)


def choose_async_scheduling(async_scheduling: bool | None, multiprocess: bool, device: str) -> bool:
    """Unset, on where it hides time: a worker process whose device runs on its own (a
    GPU). On a CPU the forward is the worker's own work; planning beside it only moves
    the scheduler's work around, and the engine's default stays the synchronous one."""
    if async_scheduling is None:
        return multiprocess and device.startswith("cuda")
    return bool(async_scheduling)


def _check_optional_positive(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
