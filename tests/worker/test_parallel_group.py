"""A process group of one rank on the CPU (gloo), through the path many ranks and the Ray
executor take: collectives run through torch.distributed, and give the rank's own values;
without a rendezvous one rank stays on its own, and more than one rank needs one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pagedserve.gpu_worker.parallel import (
    SINGLE,
    init_tensor_parallel,
    shutdown_tensor_parallel,
)


def test_a_group_of_one_runs_its_collectives_through_gloo(tmp_path):
    parallel = init_tensor_parallel(0, 1, f"file://{tmp_path / 'store'}", "cpu")
    try:
        assert parallel.grouped and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        values = torch.arange(6, dtype=torch.float32).view(2, 3)
        assert torch.equal(parallel.all_reduce(values.clone()), values)
        assert torch.equal(parallel.all_reduce_max(values.clone()), values)
        assert torch.equal(parallel.all_gather(values), values)
    finally:
        shutdown_tensor_parallel()
    assert not dist.is_initialized()


def test_without_a_rendezvous_one_rank_is_on_its_own_and_more_are_refused():
    assert init_tensor_parallel(0, 1, None, "cpu") is SINGLE and not SINGLE.grouped
    with pytest.raises(ValueError, match="tensor parallel size 2 needs a rendezvous"):
        init_tensor_parallel(0, 2, None, "cpu")
    with pytest.raises(ValueError, match="ranks run on cpu \\(gloo\\) or cuda \\(nccl\\)"):
        init_tensor_parallel(0, 1, "file:///tmp/never-used", "meta")
