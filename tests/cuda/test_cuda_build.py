"""The CUDA module as the CPU machines see it: built whenever nvcc is (so CI compiles the CUDA
code on every run), importable without a GPU, and checking its arguments on the host before it
touches a device. Runs without a GPU."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve.gpu_worker import cuda_ops


def _nvcc() -> str | None:
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )


requires_module = pytest.mark.skipif(
    not cuda_ops.is_built(), reason="pagedserve._C_cuda is not built (no nvcc at install)"
)


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc on this machine")
@pytest.mark.skipif(
    os.environ.get("PAGEDSERVE_BUILD_CUDA", "").upper() in ("0", "OFF", "NO", "FALSE"),
    reason="PAGEDSERVE_BUILD_CUDA switches the CUDA build off",
)
def test_package_holds_the_cuda_module_where_nvcc_exists():
    assert cuda_ops.is_built(), f"nvcc is at {_nvcc()} but pagedserve._C_cuda was not built"


@requires_module
def test_module_imports_without_a_gpu_and_exposes_every_op():
    module = cuda_ops.kernels()
    for name in (
        "reshape_and_cache",
        "plan_paged_attention_decode",
        "paged_attention_decode",
        "paged_prefill_attention",
        "copy_blocks",
        "swap_blocks",
    ):
        assert callable(getattr(module, name)), name


@requires_module
def test_decode_plan_for_a_forced_partition_size_is_host_arithmetic():
    module = cuda_ops.kernels()
    # 64 sequences x 32 heads x ceil(4096 / 512) partitions x (head_size + max + sum) floats.
    assert module.plan_paged_attention_decode(64, 32, 32, 128, 4096, 0, 512, 0) == (
        512,
        64 * 32 * 8 * 130,
    )
    assert module.plan_paged_attention_decode(64, 32, 32, 128, 4096, 0, 0, 0) == (0, 0)
    # A 1000-token sliding window: partitions cover the window only, ceil(1000 / 512) of them.
    assert module.plan_paged_attention_decode(64, 32, 32, 128, 4096, 1000, 512, 0) == (
        512,
        64 * 32 * 2 * 130,
    )


@requires_module
def test_bad_block_mappings_are_rejected_on_the_host():
    module = cuda_ops.kernels()
    mapping = np.array([[0, 3], [1, 3]], dtype=np.int64)
    with pytest.raises(ValueError, match="destination block 3 more than once"):
        module.copy_blocks(0, 10, 1024, mapping.ctypes.data, 0, 2, 0, 0)
    mapping = np.array([[11, 5]], dtype=np.int64)
    with pytest.raises(ValueError, match=r"block_mapping\[0\]\[1\] = 5 is outside \[0, 5\)"):
        module.swap_blocks(0, 12, 0, 5, 1024, mapping.ctypes.data, 1, 0, 0)


@requires_module
def test_unsupported_geometry_is_rejected_before_any_launch():
    module = cuda_ops.kernels()
    # block_size 12: invalid; caches at address 16 (aligned) so only the block size is wrong.
    args = dict(
        out=0, out_token_stride=256, query=0, query_token_stride=256, num_heads=4, scale=0.1,
        key_cache=16, value_cache=16, key_block_stride=4096, value_block_stride=4096,
        num_blocks=8, num_kv_heads=2, block_size=12, head_size=64, dtype=0, block_tables=0,
        block_table_stride=4, max_blocks_per_seq=4, seq_lens=0, num_seqs=1, partition_size=0,
        workspace=0, workspace_floats=0, device=0, stream=0, sliding_window=0,
        logits_soft_cap=0.0, sinks=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="block_size 12 is not supported"):
        module.paged_attention_decode(**args)
    with pytest.raises(ValueError, match="16-byte boundaries"):
        module.paged_attention_decode(**{**args, "block_size": 16, "key_cache": 8})
    with pytest.raises(ValueError, match="partition_size must be 0 or a positive multiple"):
        module.paged_attention_decode(**{**args, "block_size": 16, "partition_size": 24})
    with pytest.raises(ValueError, match="sliding_window -1 must be in"):
        module.paged_attention_decode(**{**args, "block_size": 16, "sliding_window": -1})
    with pytest.raises(ValueError, match=r"logits_soft_cap -1\.0+ must be finite and >= 0"):
        module.paged_attention_decode(**{**args, "block_size": 16, "logits_soft_cap": -1.0})


@requires_module
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_call_that_needs_the_device_fails_cleanly_without_one():
    with pytest.raises(RuntimeError, match="cudaDeviceGetAttribute"):
        cuda_ops.kernels().plan_paged_attention_decode(1, 32, 8, 128, 8192, 0, -1, 0)
