"""The packed linear (csrc/ops.h ``linear_packed``, through
``layers/packed_weights.PanelWeight``) on every kernel variant this CPU runs, in float32,
bfloat16 and float16: the product against a float64 reference, every row count around the
register tiles, tails of panels, feature blocks, biases and strided inputs; each row's result
independent of the batch and the thread count; the C++ argument checks."""

from __future__ import annotations

import pytest
import torch

from pagedserve import _C_cpu
from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.packed_weights import PANEL_WIDTH, PanelWeight

# (out_features, in_features): one output, a panel tail (17, 100), whole panels, one feature,
# several feature blocks with a short last one (1100, 2049), the embedded model's shapes.
SHAPES = [(1, 1), (17, 3), (48, 64), (100, 1100), (33, 2049), (576, 576), (1536, 576)]
# Around the register tiles (4 generic, 6 AVX2, 12 AVX-512 rows) and the row blocks.
ROW_COUNTS = [1, 2, 5, 6, 7, 11, 12, 13, 25, 64, 300]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(
        x.double(), weight.double(), None if bias is None else bias.double()
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_product_matches_float64_reference(isa, dtype, out_features, in_features):
    generator = torch.Generator().manual_seed(out_features * 7919 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = PanelWeight(weight)
    assert packed.panels.shape == (-(-out_features // PANEL_WIDTH), in_features, PANEL_WIDTH)
    assert packed.panels.dtype == dtype
    for rows in ROW_COUNTS:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        for b in (None, bias):
            got = packed.linear(x, b)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            expected = _reference(x, weight, b)
            # float32 sums of in_features products of unit normals: error ~ sqrt(K) float32
            # ulp; a 16-bit output is that sum rounded once (at most one ulp of the dtype off
            # the float64 value rounded).
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(
                got.double(), expected, atol=2e-5 * in_features**0.5 + eps, rtol=eps
            )


def test_padding_columns_and_layout():
    weight = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    packed = PanelWeight(weight)
    assert packed.shape == (3, 5) and packed.dtype == torch.float32
    assert packed.panels.shape == (1, 5, PANEL_WIDTH)
    assert torch.equal(packed.panels[0, :, :3], weight.T)
    assert not packed.panels[0, :, 3:].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rows_and_leading_dims(isa, dtype):
    weight = torch.randn(40, 24).to(dtype)
    packed = PanelWeight(weight)
    assert packed.linear(torch.empty(0, 24, dtype=dtype), None).shape == (0, 40)
    x = torch.randn(2, 3, 24).to(dtype)
    got = packed.linear(x, None)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.view(6, 40), packed.linear(x.view(6, 24), None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_give_the_contiguous_result(isa, dtype):
    weight = torch.randn(50, 70).to(dtype)
    bias = torch.randn(50).to(dtype)
    packed = PanelWeight(weight)
    wide = torch.randn(9, 150).to(dtype)
    rows = wide[:, 10:80]  # row stride 150
    assert torch.equal(packed.linear(rows, bias), packed.linear(rows.contiguous(), bias))
    column_major = torch.randn(70, 9).to(dtype).T  # unit row stride: copied first
    assert torch.equal(
        packed.linear(column_major, bias), packed.linear(column_major.contiguous(), bias)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 576), (100, 1100), (1600, 64)])
def test_each_row_is_the_same_whatever_the_batch_and_threads(
    isa, restore_threads, dtype, out_features, in_features
):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = PanelWeight(weight)
    x = torch.randn(200, in_features, generator=generator).to(dtype)
    ops.set_num_threads(2)
    batch = packed.linear(x, bias)
    for begin, end in [(0, 1), (7, 8), (199, 200), (3, 40), (50, 200)]:
        assert torch.equal(packed.linear(x[begin:end], bias), batch[begin:end])
    ops.set_num_threads(1)
    assert torch.equal(packed.linear(x, bias), batch)
    ops.set_num_threads(3)  # more threads than cores: the split changes, the bits do not
    assert torch.equal(packed.linear(x, bias), batch)


def test_wrapper_refuses_what_the_kernel_cannot_take():
    packed = PanelWeight(torch.randn(8, 4))
    with pytest.raises(
        ValueError, match=r"torch.float32 CPU tensor \[\.\.\., 4\], got torch.float64"
    ):
        packed.linear(torch.randn(2, 4, dtype=torch.float64), None)
    with pytest.raises(ValueError, match=r"got torch.float32 cpu \(2, 5\)"):
        packed.linear(torch.randn(2, 5), None)
    with pytest.raises(
        ValueError, match=r"bias .* contiguous torch.float32 \[8\], got torch.float32 \(4,\)"
    ):
        packed.linear(torch.randn(2, 4), torch.randn(4))


def test_kernel_checks_its_arguments():
    out, x, panels = torch.empty(2, 16), torch.randn(2, 4), PanelWeight(torch.randn(16, 4)).panels
    args = [out.data_ptr(), 16, x.data_ptr(), 4, panels.data_ptr(), 0]
    with pytest.raises(ValueError, match="num_rows -1 must be >= 0"):
        _C_cpu.linear_packed(*args, -1, 4, 16, 0)
    with pytest.raises(ValueError, match="in_features 0 must be >= 1"):
        _C_cpu.linear_packed(*args, 2, 0, 16, 0)
    with pytest.raises(ValueError, match="out_features 0 must be >= 1"):
        _C_cpu.linear_packed(*args, 2, 4, 0, 0)
    bad_stride = [out.data_ptr(), 16, x.data_ptr(), 3, panels.data_ptr(), 0]
    with pytest.raises(ValueError, match="x_row_stride 3 must be >= 4"):
        _C_cpu.linear_packed(*bad_stride, 2, 4, 16, 0)
    with pytest.raises(ValueError, match=r"dtype code 3 is not supported"):
        _C_cpu.linear_packed(*args, 2, 4, 16, 3)
