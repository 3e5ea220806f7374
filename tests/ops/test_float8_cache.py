"""Float8 KV caches (CPU): e5m2 (``kv_cache_dtype="fp8_e5m2"``) and e4m3 (``"fp8"``). The
writes round exactly as torch's ``.to(torch.float8_e5m2)`` does, and as
``.clamp(-448, 448).to(torch.float8_e4m3fn)`` does (saturating); every e4m3 byte reads back as
torch widens it; the attention ops over either equal the float64 reference over the same (float8)
cache, for query dtypes float32, bfloat16 and float16 on every kernel variant."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.kv_cache import KVCacheSpec

from . import reference
from .cases import TOLERANCES, fused_qkv, paged_case, query_start_loc

FP8 = torch.float8_e5m2
E4M3 = torch.float8_e4m3fn
FLOAT8 = [FP8, E4M3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rounded(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """What the cache stores for ``x``: e4m3 saturates at +-448 where torch's cast gives NaN."""
    return (x.float().clamp(-448, 448) if fp8 == E4M3 else x).to(fp8)


def _fp8_case(seq_lens, num_kv_heads, block_size, head_size, seed=0, fp8=FP8):
    generator = torch.Generator().manual_seed(seed)
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, torch.float32, generator)
    case.pool = case.pool.to(fp8)
    case.key_cache, case.value_cache = case.pool[:, 1, 0], case.pool[:, 1, 1]
    return case, generator


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_e5m2_writes_round_as_torch_does(dtype):
    generator = torch.Generator().manual_seed(3)
    num_tokens, num_kv_heads, head_size, block_size = 7, 2, 64, 8
    _, key, value = fused_qkv(num_tokens, 2, num_kv_heads, head_size, dtype, generator)
    # Values across e5m2's range: ties, subnormals, past the largest finite (57344), and
    # the specials.
    key = key * torch.logspace(-9, 5, head_size, dtype=torch.float64).to(dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 57344.0])
    key[0, 0, : len(special)] = special.to(dtype)
    key[0, 1, :4] = torch.tensor([61440.0, 65504.0, 1.5 * 2.0**-16, 2.0**-17], dtype=dtype)
    spec = KVCacheSpec(1, num_kv_heads, head_size, block_size, FP8)
    pool = spec.allocate(4)
    pool.view(torch.uint8).fill_(0x55)
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    slots = torch.tensor([9, 3, -1, 30, 0, 17, 8], dtype=torch.int64)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for cache, source in ((key_cache, key), (value_cache, value)):
            written = cache[block, :, offset].view(torch.uint8)
            expected = source[t].to(FP8).view(torch.uint8)
            assert torch.equal(written, expected), (t, dtype)
    # The padding token wrote nothing: slot 1 (block 0, offset 1) is untouched.
    assert torch.all(key_cache[0, :, 1].view(torch.uint8) == 0x55)


@pytest.mark.parametrize("dtype", DTYPES)
def test_e4m3_writes_round_as_torch_does_and_saturate(dtype):
    # Every e4m3 value, values between neighbours (ties) and near them, the subnormals, the
    # largest finite (448) and past it, and the specials.
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    values = values[~values.isnan()]
    between = (values.sort().values[1:] + values.sort().values[:-1]) / 2
    special = [448.0, 449.0, 464.0, 479.0, 480.0, 1e6, float("inf"), float("-inf"), float("nan")]
    tiny = [2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, 2.0**-6 * 0.99]
    x = torch.cat([values, between, values * 1.03, values * 0.97, torch.tensor(special + tiny)])
    x = torch.cat([x, -x])
    head_size, block_size = 64, 8
    num_tokens = -(-x.numel() // head_size)
    x = torch.nn.functional.pad(x, (0, num_tokens * head_size - x.numel())).to(dtype)
    key = x.view(num_tokens, 1, head_size)
    spec = KVCacheSpec(1, 1, head_size, block_size, E4M3)
    pool = spec.allocate(-(-num_tokens // block_size))
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    ops.reshape_and_cache(key, key.flip(0), key_cache, value_cache, torch.arange(num_tokens))
    for cache, source in ((key_cache, key), (value_cache, key.flip(0))):
        written = cache.transpose(1, 2).reshape(-1, head_size)[:num_tokens].view(torch.uint8)
        expected = rounded(source.reshape(-1, head_size), E4M3).view(torch.uint8)
        assert torch.equal(written, expected), dtype
        # Saturated, never NaN from a number: only the two NaN inputs (x and -x) stored NaN.
        stored = written.view(E4M3).float()
        assert stored.isnan().sum() == 2 and stored.nan_to_num(0).abs().max() == 448


def test_every_e4m3_byte_reads_back_as_torch_widens_it(isa):
    # A one-token sequence whose value row holds a run of e4m3 bytes, attended with one key:
    # the output is that row, widened (to float32: exact), NaN bytes included.
    spec = KVCacheSpec(1, 1, 64, 8, E4M3)
    pool = spec.allocate(4)
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    key_cache.view(torch.uint8).zero_()
    everything = torch.arange(256, dtype=torch.uint8)
    for start in range(0, 256, 64):
        value_cache.view(torch.uint8)[0, 0, 0] = everything[start : start + 64]
        out = ops.paged_attention_decode(
            torch.zeros(1, 1, 64),
            key_cache,
            value_cache,
            torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            0.125,
        )
        expected = everything[start : start + 64].view(E4M3).float()
        torch.testing.assert_close(out[0, 0], expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_over_a_float8_cache(isa, dtype, head_size, fp8):
    for block_size, layout in ((8, (4, 4)), (16, (6, 2)), (32, (8, 1))):
        num_heads, num_kv_heads = layout
        seq_lens = [1, block_size, block_size + 1, 100]
        case, generator = _fp8_case(seq_lens, num_kv_heads, block_size, head_size, fp8=fp8)
        query, _, _ = fused_qkv(len(seq_lens), num_heads, num_kv_heads, head_size, dtype, generator)
        args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
        expected = reference.decode_attention(*args)
        for partition_size in (0, 2 * block_size):
            out = ops.paged_attention_decode(*args, partition_size=partition_size)
            assert out.dtype == dtype
            _assert_close(out, expected, dtype)
        windowed = ops.paged_attention_decode(*args, sliding_window=20)
        _assert_close(windowed, reference.decode_attention(*args, sliding_window=20), dtype)


@pytest.mark.parametrize("fp8", FLOAT8)
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_a_float8_cache(isa, dtype, head_size, fp8):
    block_size, num_heads, num_kv_heads = 16, 6, 2
    prior, q_lens = [0, 50, block_size, 70, 0], [37, 30, block_size + 1, 1, 1]
    seq_lens = [p + q for p, q in zip(prior, q_lens)]
    case, generator = _fp8_case(seq_lens, num_kv_heads, block_size, head_size, seed=1, fp8=fp8)
    query, _, _ = fused_qkv(sum(q_lens), num_heads, num_kv_heads, head_size, dtype, generator)
    loc = query_start_loc(q_lens)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, 0.1)
    _assert_close(ops.paged_prefill_attention(*args), reference.attention(*args), dtype)
    _assert_close(
        ops.paged_prefill_attention(*args, sliding_window=24),
        reference.attention(*args, sliding_window=24),
        dtype,
    )


@pytest.mark.parametrize("fp8", FLOAT8)
def test_a_layer_written_then_read_equals_the_rounded_reference(fp8):
    # The engine's order: write this step's K/V (rounded), then attend over the cache.
    generator = torch.Generator().manual_seed(5)
    spec = KVCacheSpec(1, 2, 64, 8, fp8)
    pool = spec.allocate(6)
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    query, key, value = fused_qkv(20, 4, 2, 64, torch.bfloat16, generator)
    block_tables = torch.tensor([[4, 1, 5]], dtype=torch.int32)
    positions = torch.arange(20)
    slots = block_tables[0, positions // 8].long() * 8 + positions % 8
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    seq_lens = torch.tensor([20], dtype=torch.int32)
    loc = torch.tensor([0, 20], dtype=torch.int32)
    args = (query, key_cache, value_cache, block_tables, loc, seq_lens, 0.125)
    out = ops.paged_prefill_attention(*args)
    # Reference: plain causal attention over the rounded K/V, in float64.
    k = rounded(key, fp8).double().repeat_interleave(2, dim=1)
    v = rounded(value, fp8).double().repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * 0.125
    scores = scores.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    _assert_close(out, expected, torch.bfloat16)


@pytest.mark.parametrize("fp8", FLOAT8)
def test_blocks_copy_and_swap_as_bytes(fp8):
    spec = KVCacheSpec(2, 2, 64, 8, fp8)
    assert spec.bytes_per_block == 2 * 2 * 2 * 8 * 64  # one byte a value
    pool = spec.allocate(4)
    pool.view(torch.uint8).copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8))
    before = pool.view(torch.uint8).clone()
    ops.copy_blocks(pool, torch.tensor([[0, 3]], dtype=torch.int64))
    assert torch.equal(pool[3].view(torch.uint8), before[0])
    host = spec.allocate(2)
    ops.swap_blocks(pool, host, torch.tensor([[1, 0]], dtype=torch.int64))
    assert torch.equal(host[0].view(torch.uint8), before[1])


def test_float8_cache_arguments_are_checked(monkeypatch):
    case, generator = _fp8_case([9], 2, 8, 64)
    query, key, value = fused_qkv(1, 4, 2, 64, torch.float32, generator)
    with pytest.raises(TypeError, match="value has dtype torch.bfloat16 but key has torch.float32"):
        ops.reshape_and_cache(
            key,
            value.to(torch.bfloat16),
            case.key_cache,
            case.value_cache,
            torch.tensor([0]),
        )
    with pytest.raises(TypeError, match="value_cache has dtype torch.float32 but key_cache has"):
        ops.paged_attention_decode(
            query, case.key_cache, case.value_cache.float(), case.block_tables, case.seq_lens, 0.1
        )
    with pytest.raises(TypeError, match=r"query has dtype torch.float8_e5m2; supported"):
        ops.paged_attention_decode(
            query.to(FP8), case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1
        )
    # The CUDA kernels keep the cache in the activations' dtype.
    monkeypatch.setattr(ops, "_runs_cuda_kernels", lambda tensor: True)
    with pytest.raises(TypeError, match="a float8 cache runs on the CPU only"):
        ops.paged_attention_decode(
            query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1
        )
