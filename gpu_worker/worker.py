"""One worker: the model's weights, the KV cache tensor and the model runner."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.kv_cache import KVCacheSpec
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.model_runner import ModelRunner
from pagedserve.gpu_worker.models import build_model
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel, check_tensor_parallel_size
from pagedserve.gpu_worker.weights import iterate_weights
from pagedserve.scheduler.messages import StepPlan, StepResult

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class Worker:
    """Loads the model and owns the KV cache pools; executes step plans.

    The device pool holds ``num_blocks`` blocks, or as many as fit in ``kv_cache_bytes``;
    the host pool, which receives swapped-out requests, as many as fit in
    ``swap_space_bytes``. With tensor parallelism (``parallel``) it is one rank: it holds
    its share of the weights, and its pools hold its KV heads only, so both byte sizes
    are this rank's.
    """

    def __init__(
        self,
        model_path: Path,
        dtype: str,
        block_size: int,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        device: str = "cpu",
        swap_space_bytes: int = 0,
        kv_cache_bytes_from_free_memory: Callable[[], int] | None = None,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        if device != "cpu":
            raise ValueError(
                f"device must be 'cpu' (the CUDA path is not built yet), got {device!r}"
            )
        self.device = torch.device(device)
        self.model_config = ModelConfig.from_dir(model_path)
        check_tensor_parallel_size(self.model_config, parallel.size)
        torch_dtype = parse_dtype(dtype)
        started = time.monotonic()
        self.model = build_model(self.model_config, torch_dtype, parallel)
        self.model.load_weights(iterate_weights(Path(model_path)))
        self.model.eval()
        logger.info(
            "loaded %s in %.1f s", self.model_config.architecture, time.monotonic() - started
        )

        self.kv_cache_spec = KVCacheSpec(
            num_layers=self.model_config.num_layers,
            num_kv_heads=len(parallel.kv_heads(self.model_config.num_kv_heads)),
            head_size=self.model_config.head_size,
            block_size=block_size,
            dtype=torch_dtype,
        )
        if num_blocks is None:
            if kv_cache_bytes is None:
                if kv_cache_bytes_from_free_memory is None:
                    raise ValueError("either num_blocks or kv_cache_bytes must be given")
                # Measured only now, so the memory the weights took is already gone.
                kv_cache_bytes = kv_cache_bytes_from_free_memory()
            num_blocks = self.kv_cache_spec.num_blocks_for_bytes(kv_cache_bytes)
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_bytes={kv_cache_bytes} holds no block: one block of "
                    f"{block_size} tokens takes {self.kv_cache_spec.bytes_per_block} bytes"
                )
        self.num_blocks = num_blocks
        self.kv_cache = self.kv_cache_spec.allocate(num_blocks, self.device)
        self.num_host_blocks = self.kv_cache_spec.num_blocks_for_bytes(swap_space_bytes)
        # NOTE: on a GPU this pool must be pinned host memory for asynchronous copies.
        self.host_kv_cache = (
            self.kv_cache_spec.allocate(self.num_host_blocks, "cpu")
            if self.num_host_blocks
            else None
        )
        self.model.bind_kv_cache(self.kv_cache)
        self.runner = ModelRunner(self.model, block_size, self.device)

    def execute(self, plan: StepPlan) -> StepResult:
        # Swap-outs first: their device blocks may be refilled by swap-ins or written
        # by this very step.
        if plan.swap_out:
            ops.swap_blocks(self.kv_cache, self.host_kv_cache, _pairs(plan.swap_out))
        if plan.swap_in:
            ops.swap_blocks(self.host_kv_cache, self.kv_cache, _pairs(plan.swap_in))
        return self.runner.execute(plan)


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
