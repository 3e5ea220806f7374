"""The CUDA emulator itself (csrc/cuda_emu/cuda_emu.h): kernels with known results, and kernels
that break CUDA's rules on purpose, which it must report rather than run quietly."""

from __future__ import annotations

import json

import pytest
import torch

from cuda_emu.build import emulator_selftest, translate

pytestmark = pytest.mark.slow  # the first use compiles (~15 s)

SCHEDULES = ["forward", "reverse", "random:1", "random:2"]
INVALID_CONFIGURATION = 9  # cudaErrorInvalidConfiguration
INVALID_VALUE = 1  # cudaErrorInvalidValue


@pytest.fixture(scope="module")
def selftest():
    return emulator_selftest()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_barrier_orders_shared_memory(selftest, monkeypatch, schedule):
    monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_SCHEDULE", schedule)
    values = torch.randn(128)
    out = torch.empty(128)
    selftest.neighbour(values.data_ptr(), out.data_ptr(), True)
    assert torch.equal(out, values.roll(-1))


def test_a_missing_barrier_gives_wrong_results_under_some_schedule(selftest, monkeypatch):
    values = torch.randn(128)
    wrong = 0
    for schedule in SCHEDULES:
        monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_SCHEDULE", schedule)
        out = torch.empty(128)
        selftest.neighbour(values.data_ptr(), out.data_ptr(), False)
        wrong += not torch.equal(out, values.roll(-1))
    # Forward order reads every neighbour before it is written (the poison, NaN), reverse
    # order all but one after: the schedules disagree, as a GPU's warps would.
    assert wrong == len(SCHEDULES)


def test_warp_shuffles(selftest):
    values = torch.randn(128)
    xor_sum, down_sum, broadcast = torch.empty(128), torch.empty(128), torch.empty(128)
    selftest.warp_ops(
        values.data_ptr(), xor_sum.data_ptr(), down_sum.data_ptr(), broadcast.data_ptr()
    )
    warps = values.view(4, 32)
    sums = warps.double().sum(1)
    # A butterfly leaves the same sum in every lane (a + b = b + a bit for bit).
    assert torch.equal(xor_sum.view(4, 32), xor_sum.view(4, 32)[:, :1].expand(4, 32))
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(xor_sum.view(4, 32)[:, 0].double(), sums, **tolerance)
    torch.testing.assert_close(down_sum.view(4, 32)[:, 0].double(), sums, **tolerance)
    assert torch.equal(broadcast.view(4, 32), warps[:, 5:6].expand(4, 32))


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        # Half of each warp shuffles with a full mask; the other half has gone on and exited.
        ("divergent_shuffle", r"__shfl_xor_sync at .*selftest_kernels.cu:\d+ .* names lane 16"),
        ("shuffle_after_exit", r"names lane 3, which has exited"),
        ("barrier_in_one_warp", r"threads wait at different __syncthreads"),
    ],
)
def test_broken_kernels_are_reported(selftest, kernel, message):
    out = torch.zeros(64)
    fault = r"emulated kernel fault in block \(0, 0, 0\).*"
    with pytest.raises(RuntimeError, match=fault + message):
        getattr(selftest, kernel)(out.data_ptr())


def test_shared_memory_nobody_wrote_reads_as_nan(selftest):
    out = torch.zeros(64)
    selftest.read_unwritten_shared(out.data_ptr())
    assert torch.all(out[:32] == 1.0) and torch.all(out[32:].isnan())


def test_launch_configurations_are_checked(selftest):
    out = torch.zeros(6)
    assert selftest.launch_config(2, 3, 32, 128, False, out.data_ptr()) == 0
    assert torch.all(out == sum(range(32)))  # every block of the 2 x 3 grid ran
    for grid_x, grid_y, threads in [(0, 1, 32), (1, 70000, 32), (1, 1, 0), (1, 1, 2048)]:
        code = selftest.launch_config(grid_x, grid_y, threads, 0, False, out.data_ptr())
        assert code == INVALID_CONFIGURATION, (grid_x, grid_y, threads)
    # Above 48 KiB of dynamic shared memory a kernel must opt in, and at most to 227 KiB.
    assert selftest.launch_config(1, 1, 64, 64 * 1024, False, out.data_ptr()) == (
        INVALID_CONFIGURATION
    )
    assert selftest.launch_config(1, 1, 64, 64 * 1024, True, out.data_ptr()) == 0
    assert selftest.launch_config(1, 1, 64, 228 * 1024, True, out.data_ptr()) == INVALID_VALUE


@pytest.mark.parametrize(("stride", "efficiency"), [(1, 1.0), (2, 0.5), (8, 0.125), (100, 0.125)])
def test_load_statistics_count_sectors_per_warp_load(
    selftest, monkeypatch, tmp_path, stride, efficiency
):
    stats_path = tmp_path / "loads.jsonl"
    monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_LOAD_STATS", str(stats_path))
    n = 200  # 3 full blocks of 64 threads and one of 8: 7 warp-wide loads (one of 8 lanes)
    values = torch.randn(n * stride)
    out = torch.empty(n)
    selftest.strided_loads(values.data_ptr(), out.data_ptr(), n, stride)
    assert torch.equal(out, values[::stride])
    (line,) = stats_path.read_text().splitlines()
    stats = json.loads(line)
    assert stats["kernel"] == "strided_loads_kernel" and stats["grid"] == [4, 1, 1]
    assert stats["requests"] == 7 and stats["requested_bytes"] == 4 * n
    # A float per lane: 32 lanes in 4 sectors when contiguous (the tensor starts on a 32-byte
    # boundary), one sector per lane at a stride of 32 bytes or more.
    assert stats["requested_bytes"] / (32 * stats["sectors"]) == pytest.approx(efficiency)


def test_16_bit_conversions_equal_torch_bit_for_bit(selftest):
    generator = torch.Generator().manual_seed(0)
    special = torch.tensor(
        [0.0, -0.0, 1.0, -2.5, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-40, 1e-30]
        + [float("inf"), float("-inf"), 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8]
    )
    values = torch.cat([special, torch.randn(4000, generator=generator) * 300])
    half_bits = torch.empty(values.numel(), dtype=torch.int16)
    bfloat16_bits = torch.empty(values.numel(), dtype=torch.int16)
    selftest.convert(
        values.data_ptr(), values.numel(), half_bits.data_ptr(), bfloat16_bits.data_ptr()
    )
    assert torch.equal(half_bits, values.half().view(torch.int16))
    assert torch.equal(bfloat16_bits, values.bfloat16().view(torch.int16))
    nan = torch.tensor([float("nan")])
    selftest.convert(nan.data_ptr(), 1, half_bits.data_ptr(), bfloat16_bits.data_ptr())
    assert half_bits[:1].view(torch.float16).isnan().all()
    assert bfloat16_bits[:1].view(torch.bfloat16).isnan().all()


def test_translation_of_launches_and_shared_memory_keeps_line_numbers():
    source = """__global__ void k(float* out) {
  extern __shared__ float buffer[];
  __shared__ float tile[4][kWidth + 1];
}
void launch(int tile) {
  switch (tile) {
    case 4:
      k<T, 4><<<grid, 128, 0, stream>>>(out);
      break;
    default:
      other_kernel<decltype(v)::value>
          <<<dim3(1, 2), 64>>>();
  }
}
"""
    translated = translate(source)
    assert translated.count("\n") == source.count("\n")
    assert "float* buffer = ::pagedserve_emu::dynamic_shared<float>();" in translated
    assert (
        "static float tile[4][kWidth + 1]; ::pagedserve_emu::shared_declared(tile, sizeof(tile));"
        in translated
    )
    assert (
        '    case 4:\n      ::pagedserve_emu::Launcher(grid, 128, 0, stream).run("k<T, 4>", '
        "k<T, 4>, out);" in translated
    )
    assert (
        '::pagedserve_emu::Launcher(dim3(1, 2), 64).run("other_kernel<decltype(v)::value>", '
        "other_kernel<decltype(v)::value>\n          );" in translated
    )
    with pytest.raises(ValueError, match="__shared__ declaration"):
        translate("__shared__ float x = 0;")
