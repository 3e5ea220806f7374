"""Tensor parallelism's NCCL branch on one GPU: a process group of one rank through the
same path as many (``init_tensor_parallel`` with a rendezvous, as the Ray executor forms
it), its collectives on the device, and captured in a CUDA graph as decode graphs capture
them. What one GPU cannot show (several ranks over NCCL) the README names. Skipped without
a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu_worker.parallel import init_tensor_parallel, shutdown_tensor_parallel

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


@pytest.fixture
def group_of_one(tmp_path):
    parallel = init_tensor_parallel(0, 1, f"file://{tmp_path / 'store'}", "cuda:0")
    yield parallel
    shutdown_tensor_parallel()


def test_a_group_of_one_runs_its_collectives_through_nccl(group_of_one):
    assert group_of_one.grouped and torch.distributed.get_backend() == "nccl"
    values = torch.arange(8, dtype=torch.float32, device="cuda")
    assert torch.equal(group_of_one.all_reduce(values.clone()), values)
    assert torch.equal(group_of_one.all_reduce_max(values.clone()), values)
    assert torch.equal(group_of_one.all_gather(values.view(2, 4)), values.view(2, 4))


def test_the_collective_replays_from_a_cuda_graph(group_of_one):
    static = torch.ones(16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up off the capture, as DecodeGraphs does
        group_of_one.all_reduce(static.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = group_of_one.all_reduce(static * 2)
    static.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(result, torch.full_like(result, 6.0))
