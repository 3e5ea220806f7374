"""The fused elementwise ops against the torch expressions they replace: bit for bit.

rms_norm, fused_add_rms_norm and rotary_embedding match torch exactly on every kernel variant.
silu_and_mul matches exactly where the variant runs torch's own exp (the variant torch's CPU
capability names) and within a few float32 ulp elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import _C_cpu
from pagedserve.gpu_worker import fused_ops

from . import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUM_TOKENS = [1, 7, 300]  # 300 tokens take the multi-threaded path
EPS = 1e-6
# (num_heads, num_kv_heads, head_size): the embedded model's, a half head of 40 (a vector and
# a tail), and a wide one.
ROTARY_SHAPES = [(9, 3, 64), (4, 2, 80), (8, 1, 128)]
MAX_POSITIONS = 2048
# silu_and_mul's largest difference where it runs another exp than torch's (measured over 6M
# values: 4 ulp for float32, none for bf16/fp16, whose rounding absorbs it).
SILU_MAX_ULP_ELSEWHERE = {torch.float32: 4, torch.bfloat16: 1, torch.float16: 1}


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Integers in the order of the float values: neighbours differ by one ulp."""
    bits = t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).long()
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def _max_ulp(actual: torch.Tensor, expected: torch.Tensor) -> int:
    return int((_ordered_bits(actual) - _ordered_bits(expected)).abs().max())


def _assert_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if not torch.equal(actual, expected):
        mismatched = int((actual != expected).sum())
        pytest.fail(
            f"{mismatched} of {actual.numel()} values differ, by up to "
            f"{_max_ulp(actual, expected)} ulp"
        )


def _rows(
    num_tokens: int, width: int, dtype: torch.dtype, generator: torch.Generator, strided: bool
) -> torch.Tensor:
    """Random [num_tokens, width] rows; strided: a view into wider rows, as a fused output."""
    full = torch.randn(num_tokens, width + 24 if strided else width, generator=generator)
    rows = full[:, 8 : 8 + width] if strided else full
    return (rows * 3).to(dtype)


def _empty_rows(num_tokens: int, width: int, dtype: torch.dtype, strided: bool) -> torch.Tensor:
    if strided:
        return torch.full((num_tokens, width + 16), float("nan"), dtype=dtype)[:, 16:]
    return torch.empty(num_tokens, width, dtype=dtype)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("hidden_size", [576, 100])  # 100: leftover vectors and a scalar tail
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf(isa, dtype, num_tokens, hidden_size, strided):
    generator = torch.Generator().manual_seed(num_tokens)
    x = _rows(num_tokens, hidden_size, dtype, generator, strided)
    weight = (1 + torch.randn(hidden_size, generator=generator) / 4).to(dtype)
    out = _empty_rows(num_tokens, hidden_size, dtype, not strided)

    fused_ops.rms_norm(out, x, weight, EPS)

    _assert_identical(out, reference.rms_norm(x, weight, EPS))


def test_rms_norm_in_place_on_a_long_row(isa):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8200, generator=generator)  # > 16 groups: the sum cascades a level up
    weight = torch.randn(8200, generator=generator)
    expected = reference.rms_norm(x, weight, EPS)
    fused_ops.rms_norm(x, x, weight, EPS)
    _assert_identical(x, expected)


def test_rms_norm_accepts_uncommon_valid_arguments():
    """An integer eps and rows that share memory (read-only x) take the checked slow path."""
    row = torch.randn(1, 576, generator=torch.Generator().manual_seed(4))
    weight = torch.nn.Parameter(torch.randn(576), requires_grad=False)
    out = torch.empty(3, 576)
    fused_ops.rms_norm(out, row.expand(3, 576), weight, 0)
    _assert_identical(out, reference.rms_norm(row, weight.data, 0).expand(3, 576))


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_add_then_norm(isa, dtype, num_tokens, strided):
    generator = torch.Generator().manual_seed(num_tokens)
    x = _rows(num_tokens, 576, dtype, generator, strided)
    residual = _rows(num_tokens, 576, dtype, generator, not strided)
    weight = (1 + torch.randn(576, generator=generator) / 4).to(dtype)
    expected_residual = residual + x
    expected_x = reference.rms_norm(expected_residual, weight, EPS)

    fused_ops.fused_add_rms_norm(x, residual, weight, EPS)

    _assert_identical(residual, expected_residual)
    _assert_identical(x, expected_x)


def _rotary_tables(head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [MAX_POSITIONS, head_size // 2] tables, as layers.rotary builds them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.arange(MAX_POSITIONS, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def _fused_qkv_rows(num_tokens, num_heads, num_kv_heads, head_size, dtype, generator):
    """qkv [T, (H + 2 KVH) D] and its query / key column views."""
    q_width, kv_width = num_heads * head_size, num_kv_heads * head_size
    qkv = (torch.randn(num_tokens, q_width + 2 * kv_width, generator=generator) * 2).to(dtype)
    return qkv, qkv[:, :q_width], qkv[:, q_width : q_width + kv_width]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size"), ROTARY_SHAPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_matches_hf(isa, dtype, num_tokens, num_heads, num_kv_heads, head_size):
    generator = torch.Generator().manual_seed(num_tokens)
    cos, sin = _rotary_tables(head_size)
    qkv, query, key = _fused_qkv_rows(
        num_tokens, num_heads, num_kv_heads, head_size, dtype, generator
    )
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=generator)
    positions[0] = MAX_POSITIONS - 1
    expected_query = reference.rotate_half(query, cos, sin, positions, head_size)
    expected_key = reference.rotate_half(key, cos, sin, positions, head_size)
    value_before = qkv[:, query.shape[1] + key.shape[1] :].clone()

    fused_ops.rotary_embedding(positions, query, key, cos, sin)

    _assert_identical(query, expected_query)
    _assert_identical(key, expected_key)
    _assert_identical(qkv[:, query.shape[1] + key.shape[1] :], value_before)


def test_rotary_embedding_rejects_a_position_past_the_table():
    generator = torch.Generator().manual_seed(2)
    cos, sin = _rotary_tables(64)
    qkv, query, key = _fused_qkv_rows(3, 9, 3, 64, torch.float32, generator)
    before = qkv.clone()
    positions = torch.tensor([0, MAX_POSITIONS, 5])
    with pytest.raises(ValueError, match=r"positions\[1\] = 2048 is outside \[0, 2048\)"):
        fused_ops.rotary_embedding(positions, query, key, cos, sin)
    _assert_identical(qkv, before)  # nothing written


def _torch_runs_this_variant() -> bool:
    """Whether torch's elementwise kernels run the same SIMD width and exp as ours now."""
    names = {"AVX512": "avx512", "AVX2": "avx2", "DEFAULT": "generic"}
    return names.get(torch.backends.cpu.get_cpu_capability()) == _C_cpu.isa()


def _assert_silu_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if _torch_runs_this_variant():
        _assert_identical(actual, expected)
        return
    # Another exp than torch's: libm's expf against SLEEF's, each within 1 ulp of exp.
    assert _max_ulp(actual, expected) <= SILU_MAX_ULP_ELSEWHERE[actual.dtype]


@pytest.mark.parametrize("strided", [False, True])
# 1536: the embedded model's; 100 and 7: columns torch runs through its scalar loop.
@pytest.mark.parametrize("intermediate_size", [1536, 100, 7])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(isa, dtype, num_tokens, intermediate_size, strided):
    generator = torch.Generator().manual_seed(num_tokens)
    x = _rows(num_tokens, 2 * intermediate_size, dtype, generator, strided)
    out = _empty_rows(num_tokens, intermediate_size, dtype, not strided)

    fused_ops.silu_and_mul(out, x)

    _assert_silu_close(out, reference.silu_and_mul(x))


def test_silu_and_mul_over_the_whole_exp_range(isa):
    """Gates from exp(-gate) overflowing (gate < -100) to underflowing (gate > 104)."""
    gate = torch.linspace(-120, 120, 4096).view(2, 2048)
    x = torch.cat((gate, torch.randn(2, 2048, generator=torch.Generator().manual_seed(3))), 1)
    out = torch.empty(2, 2048)
    fused_ops.silu_and_mul(out, x)
    _assert_silu_close(out, reference.silu_and_mul(x))


# --- wrapper errors: the message names the argument, the value and the limit ------------------


def _norm_args(dtype: torch.dtype = torch.float32) -> dict:
    return {
        "out": torch.empty(4, 576, dtype=dtype),
        "x": torch.zeros(4, 576, dtype=dtype),
        "weight": torch.ones(576, dtype=dtype),
        "eps": EPS,
    }


def _rms_norm(**changes) -> None:
    args = {**_norm_args(), **changes}
    fused_ops.rms_norm(args["out"], args["x"], args["weight"], args["eps"])


def test_rms_norm_rejects_an_unsupported_dtype():
    with pytest.raises(TypeError, match="x has dtype torch.float64; supported: torch.float32"):
        _rms_norm(x=torch.zeros(4, 576, dtype=torch.float64))


def test_rms_norm_rejects_a_weight_of_another_dtype_or_size():
    with pytest.raises(TypeError, match="weight has dtype torch.bfloat16 but x has torch.float32"):
        _rms_norm(weight=torch.ones(576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"weight must have shape \[hidden_size\] = \[576\]"):
        _rms_norm(weight=torch.ones(512))


def test_rms_norm_rejects_bad_shapes_and_strides():
    with pytest.raises(ValueError, match=r"x must be 2-D \[num_tokens, hidden_size\]"):
        _rms_norm(x=torch.zeros(4, 9, 64))
    with pytest.raises(ValueError, match=r"out has shape \(3, 576\) but x has \(4, 576\)"):
        _rms_norm(out=torch.empty(3, 576))
    with pytest.raises(ValueError, match="x .* must have contiguous hidden_size"):
        _rms_norm(x=torch.zeros(576, 4).t())
    with pytest.raises(ValueError, match="out rows overlap: token stride 0 < row size 576"):
        _rms_norm(out=torch.empty(1, 576).expand(4, 576))


@pytest.mark.parametrize(("eps", "error"), [(-1e-6, ValueError), ("1e-6", TypeError)])
def test_rms_norm_rejects_a_bad_eps(eps, error):
    with pytest.raises(error, match="eps must be"):
        _rms_norm(eps=eps)


def test_fused_add_rms_norm_rejects_a_residual_of_another_dtype():
    args = _norm_args()
    with pytest.raises(TypeError, match="residual has dtype torch.float16 but x has"):
        fused_ops.fused_add_rms_norm(
            args["x"], torch.zeros(4, 576, dtype=torch.float16), args["weight"], EPS
        )


def _rotary(**changes) -> None:
    cos, sin = _rotary_tables(64)
    _, query, key = _fused_qkv_rows(2, 9, 3, 64, torch.float32, torch.Generator())
    args = {"positions": torch.tensor([0, 1]), "query": query, "key": key, "cos": cos, "sin": sin}
    args.update(changes)
    fused_ops.rotary_embedding(
        args["positions"], args["query"], args["key"], args["cos"], args["sin"]
    )


def test_rotary_embedding_rejects_bad_arguments():
    with pytest.raises(TypeError, match="cos has dtype torch.float64; expected torch.float32"):
        _rotary(cos=torch.zeros(16, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sin has shape \(16, 32\) but cos has \(2048, 32\)"):
        _rotary(sin=torch.zeros(16, 32))
    with pytest.raises(ValueError, match="query .* has 600 columns, not a multiple of head_size"):
        _rotary(query=torch.zeros(2, 600))
    with pytest.raises(TypeError, match="key has dtype torch.bfloat16 but query has"):
        _rotary(key=torch.zeros(2, 192, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="positions has dtype torch.int32; expected torch.int64"):
        _rotary(positions=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"positions must have shape \[num_tokens\] = \[2\]"):
        _rotary(positions=torch.tensor([0, 1, 2]))


def test_silu_and_mul_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"x .* has shape \(4, 100\) but out .* has \(4, 60\)"):
        fused_ops.silu_and_mul(torch.empty(4, 60), torch.zeros(4, 100))
    with pytest.raises(TypeError, match="out has dtype torch.bfloat16 but x has torch.float32"):
        fused_ops.silu_and_mul(torch.empty(4, 50, dtype=torch.bfloat16), torch.zeros(4, 100))
    with pytest.raises(TypeError, match="x has dtype torch.int64; supported"):
        fused_ops.silu_and_mul(torch.empty(4, 50), torch.zeros(4, 100, dtype=torch.int64))
