"""The int8 packed linear (csrc/ops.h ``linear_packed_int8``, through
``layers/packed_weights.Int8PanelWeight``) on every kernel variant this CPU runs, with x in
float32, bfloat16 and float16: the quantization itself (per output feature, max |w| / 127), the
product against a float64 product over the dequantized matrix, row counts around the register
tiles, panel tails, biases; each row's result independent of the batch and the thread count;
the argument checks."""

from __future__ import annotations

import pytest
import torch

from pagedserve import _C_cpu
from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.packed_weights import PANEL_WIDTH, Int8PanelWeight

# One output, a panel tail, whole panels, K past a float32 feature block (the int8 path runs
# every feature in one tile), the embedded model's shapes.
SHAPES = [(1, 1), (17, 3), (48, 64), (33, 2049), (576, 576), (1536, 576)]
ROW_COUNTS = [1, 2, 5, 6, 7, 12, 13, 25, 64, 300]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_quantization_per_output_feature():
    weight = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [0.01, 0.02, -0.0254]])
    packed = Int8PanelWeight(weight)
    assert packed.panels.dtype == torch.int8 and packed.panels.shape == (1, 3, PANEL_WIDTH)
    assert packed.scales.dtype == torch.float32 and packed.scales.shape == (3,)
    torch.testing.assert_close(packed.scales, torch.tensor([2 / 127, 1.0, 0.0254 / 127]))
    values = packed.panels[0, :, :3].T
    assert values[0].tolist() == [64, -127, 32]  # round(1 / (2/127)) = round(63.5) = 64
    assert values[1].tolist() == [0, 0, 0]  # a zero row: zeros, whatever its scale
    assert values[2].tolist() == [50, 100, -127]
    assert not packed.panels[0, :, 3:].any()
    # Every entry within half a step of its scale.
    error = (packed.dequantized() - weight).abs()
    assert (error <= packed.scales[:, None] / 2 + 1e-7).all()
    assert packed.shape == (3, 3) and packed.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_product_matches_the_dequantized_matrix(isa, dtype, out_features, in_features):
    generator = torch.Generator().manual_seed(out_features * 31 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = Int8PanelWeight(weight)
    dequantized = packed.dequantized().double()
    for rows in ROW_COUNTS:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        for b in (None, bias):
            got = packed.linear(x, b)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            expected = torch.nn.functional.linear(
                x.double(), dequantized, None if b is None else b.double()
            )
            # The float32 sum of in_features products of a unit normal and an int8 value (up
            # to 127) times a scale of about max|w| / 127: error ~ sqrt(K) float32 ulp of the
            # terms; 16-bit outputs round once more.
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(
                got.double(), expected, atol=2e-5 * in_features**0.5 + eps, rtol=eps
            )


@pytest.mark.parametrize("dtype", DTYPES)
def test_close_to_the_unquantized_product(isa, dtype):
    """What the quantization costs: per entry at most half a step, so on a layer of the
    embedded model's shape the output moves by a small fraction of its spread."""
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(576, 576, generator=generator) * 0.05).to(dtype)
    x = torch.randn(16, 576, generator=generator).to(dtype)
    got = Int8PanelWeight(weight).linear(x, None).double()
    exact = x.double() @ weight.double().T
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_whatever_the_batch_and_threads(isa, restore_threads, dtype):
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(1600, 200, generator=generator).to(dtype)
    bias = torch.randn(1600, generator=generator).to(dtype)
    packed = Int8PanelWeight(weight)
    x = torch.randn(100, 200, generator=generator).to(dtype)
    ops.set_num_threads(2)
    batch = packed.linear(x, bias)
    for begin, end in [(0, 1), (7, 8), (99, 100), (3, 40)]:
        assert torch.equal(packed.linear(x[begin:end], bias), batch[begin:end])
    ops.set_num_threads(1)
    assert torch.equal(packed.linear(x, bias), batch)
    ops.set_num_threads(3)
    assert torch.equal(packed.linear(x, bias), batch)


def test_leading_dims_strided_rows_and_refusals():
    packed = Int8PanelWeight(torch.randn(40, 24))
    x = torch.randn(2, 3, 24)
    assert torch.equal(packed.linear(x, None).view(6, 40), packed.linear(x.view(6, 24), None))
    wide = torch.randn(5, 50)
    assert torch.equal(
        packed.linear(wide[:, 3:27], None), packed.linear(wide[:, 3:27].clone(), None)
    )
    assert packed.linear(torch.empty(0, 24), None).shape == (0, 40)
    with pytest.raises(
        ValueError, match=r"torch.float32 CPU tensor \[\.\.\., 24\], got torch.bfloat16"
    ):
        packed.linear(torch.randn(2, 24, dtype=torch.bfloat16), None)
    out, rows = torch.empty(2, 40), torch.randn(2, 24)
    with pytest.raises(ValueError, match="weight_scales must be set"):
        _C_cpu.linear_packed_int8(
            out.data_ptr(), 40, rows.data_ptr(), 24, packed.panels.data_ptr(), 0, 0, 2, 24, 40, 0
        )
    with pytest.raises(ValueError, match="in_features 0 must be >= 1"):
        _C_cpu.linear_packed_int8(
            out.data_ptr(), 40, rows.data_ptr(), 24, packed.panels.data_ptr(),
            packed.scales.data_ptr(), 0, 2, 0, 40, 0,
        )  # fmt: skip
