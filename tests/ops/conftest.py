"""Fixtures shared by the op tests: the kernel variant and the thread count."""

from __future__ import annotations

import pytest
import torch

from pagedserve import _C_cpu
from pagedserve.gpu_worker import ops


def _available_isas() -> list[str]:
    current = _C_cpu.isa()
    available = []
    for name in ("generic", "avx2", "avx512"):
        try:
            _C_cpu.force_isa(name)
        except ValueError:
            continue
        available.append(name)
    _C_cpu.force_isa(current)
    return available


@pytest.fixture(params=_available_isas())
def isa(request: pytest.FixtureRequest):
    """Runs the test once per kernel variant this CPU and build support."""
    previous = _C_cpu.isa()
    _C_cpu.force_isa(request.param)
    yield request.param
    _C_cpu.force_isa(previous)


@pytest.fixture
def restore_threads():
    yield
    ops.set_num_threads(torch.get_num_threads())
