"""csrc/cuda's kernels, run on the CPU by the CUDA emulator, against the float64 references of
tests/ops: the kernels' logic (indexing, GQA, split-K, masking, tails, vector widths, barriers)
is checked on every machine, not only when a GPU is lent. tests/cuda runs the same kernels on a
GPU; that remains the acceptance for speed and for the GPU's own behaviour.

The calls go through gpu_worker/cuda_ops.py (the wrappers the engine uses) with the emulated
module in place of pagedserve._C_cuda, so their argument lists are checked against the bindings
too. The emulator has one device and no streams: every call is on device 0's default stream.
"""

from __future__ import annotations

import json

import pytest
import torch
from ops import reference
from ops.cases import TOLERANCES, fused_qkv, paged_case, query_start_loc, random_pool

from cuda_emu.build import emulated_kernels
from pagedserve.gpu_worker import cuda_ops, ops

pytestmark = pytest.mark.slow  # the first use compiles the kernels (~25 s)

HEAD_SIZES = [64, 80, 96, 128, 192, 256]
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_heads, num_kv_heads): plain multi-head, GQA groups of 3 and 4, and a group of 16 (the
# decode kernel's wide variant: two warps of 8 heads sharing staged rows).
HEAD_LAYOUTS = [(4, 4), (6, 2), (8, 2), (16, 1)]
SCHEDULES = ["forward", "reverse", "random:7"]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """cuda_ops calling the emulated kernels, for this module's tests."""
    module = emulated_kernels()
    saved = cuda_ops._module, cuda_ops._stream
    cuda_ops._module = module
    cuda_ops._stream = lambda device: (0, 0)  # the emulator's device 0, default stream
    yield module
    cuda_ops._module, cuda_ops._stream = saved


def _cache_args(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
    return ops._check_caches(key_cache, value_cache).args


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected, **TOLERANCES[dtype])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- decode ------------------------------------------------------------------------------------


def _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator)
    query, _, _ = fused_qkv(len(seq_lens), num_heads, num_kv_heads, head_size, dtype, generator)
    return case, query


def _decode(
    case,
    query,
    scale,
    partition_size=-1,
    out=None,
    sliding_window=0,
    logits_soft_cap=0.0,
    sinks=None,
):
    out = torch.empty_like(query) if out is None else out
    _, num_kv_heads, block_size, head_size = case.key_cache.shape
    cuda_ops.paged_attention_decode(
        out,
        query,
        case.block_tables,
        case.seq_lens,
        scale,
        sliding_window,
        logits_soft_cap,
        0 if sinks is None else sinks.data_ptr(),
        partition_size,
        _cache_args(case.key_cache, case.value_cache),
        num_kv_heads,
        head_size,
        block_size,
    )
    return out


def _decode_reference(case, query, scale):
    return reference.decode_attention(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale
    )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(dtype, head_size, block_size):
    # Every layout over the grid of dtypes, head sizes and block sizes (not every product).
    layout = HEAD_LAYOUTS[(HEAD_SIZES.index(head_size) + BLOCK_SIZES.index(block_size)) % 3]
    num_heads, num_kv_heads = layout
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    case, query = _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, head_size, dtype)
    scale = head_size**-0.5
    expected = _decode_reference(case, query, scale)
    for partition_size in (0, 2 * block_size, -1):
        _assert_close(_decode(case, query, scale, partition_size), expected, dtype)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_gqa_groups(dtype, layout):
    num_heads, num_kv_heads = layout
    case, query = _decode_inputs([7, 64, 130], num_heads, num_kv_heads, 16, 128, dtype, seed=1)
    expected = _decode_reference(case, query, 0.09)
    for partition_size in (0, 32):
        _assert_close(_decode(case, query, 0.09, partition_size), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_on_long_contexts(dtype):
    # Lengths below, at and across 512-token partitions, and one far longer than the rest.
    seq_lens = [1, 511, 512, 513, 1400]
    case, query = _decode_inputs(seq_lens, 8, 2, 16, 64, dtype, seed=2)
    expected = _decode_reference(case, query, 0.088)
    single = _decode(case, query, 0.088, 0)
    split = _decode(case, query, 0.088, 512)
    for out in (single, split):
        _assert_close(out, expected, dtype)
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(split, single, **tolerance)


def test_split_k_with_more_partitions_than_reduction_threads():
    # 2100 tokens in partitions of 8: 263 partitions, more than the reduction's 128 threads.
    case, query = _decode_inputs([2100, 9], 4, 1, 8, 64, torch.float32, seed=9)
    _assert_close(_decode(case, query, 0.1, 8), _decode_reference(case, query, 0.1), torch.float32)


def test_automatic_choice_splits_when_few_sequences_have_long_contexts(kernels):
    # One sequence of 8 kv heads and 8192 tokens: far too few thread blocks for one pass on the
    # emulated H200's 132 multiprocessors.
    partition, workspace = kernels.plan_paged_attention_decode(1, 32, 8, 128, 8192, 0, -1, 0)
    assert partition > 0 and workspace == 1 * 32 * (8192 // partition) * (128 + 2)
    assert kernels.plan_paged_attention_decode(64, 32, 32, 128, 256, 0, -1, 0) == (0, 0)
    assert kernels.plan_paged_attention_decode(1, 32, 8, 128, 8192, 0, 0, 0) == (0, 0)
    # The automatic choice runs through the wrapper's workspace too.
    case, query = _decode_inputs([1300, 20], 8, 2, 16, 64, torch.float32, seed=5)
    _assert_close(_decode(case, query, 0.1), _decode_reference(case, query, 0.1), torch.float32)


def test_decode_zero_length_sequence_gives_zeros():
    case, query = _decode_inputs([5, 0, 17], 4, 2, 8, 64, torch.float32)
    for partition_size in (0, 8):
        out = _decode(case, query, 0.125, partition_size)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        _assert_close(out, _decode_reference(case, query, 0.125), torch.float32)


def test_decode_writes_into_strided_out_only():
    case, query = _decode_inputs([9, 40], 6, 2, 16, 80, torch.bfloat16)
    buffer = torch.full((2, 8 * 80), 7.0, dtype=torch.bfloat16)
    out = buffer[:, 80 : 7 * 80].view(2, 6, 80)
    _decode(case, query, 0.1, out=out)
    _assert_close(out, _decode_reference(case, query, 0.1), torch.bfloat16)
    assert torch.all(buffer[:, :80] == 7.0) and torch.all(buffer[:, 7 * 80 :] == 7.0)


@pytest.mark.parametrize("num_heads", [8, 24])
def test_decode_is_the_same_under_every_schedule(monkeypatch, num_heads):
    # Threads of a block share memory only through barriers and shuffles: any order of the
    # threads between them gives the same bits. 24 / 2: the wide kernel's staged rows.
    case, query = _decode_inputs([300, 5, 77], num_heads, 2, 16, 96, torch.float16, seed=6)
    results = []
    for schedule in SCHEDULES:
        monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_SCHEDULE", schedule)
        results.append((_decode(case, query, 0.1, 0), _decode(case, query, 0.1, 64)))
    for single, split in results[1:]:
        assert torch.equal(single, results[0][0]) and torch.equal(split, results[0][1])


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_reads_the_cache_in_whole_sectors(dtype, head_size, monkeypatch, tmp_path):
    # The kernels' claim (attention_kernels.cu, prefill_kernels.cu): each warp-wide load covers
    # contiguous spans of a block's rows, so every 32-byte sector the K/V reads touch is used
    # whole, the condition for reading the cache near the memory bandwidth (tools/bench_cuda.py
    # measures the rest on a GPU).
    stats_path = tmp_path / "loads.jsonl"
    monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_LOAD_STATS", str(stats_path))
    for block_size in BLOCK_SIZES:
        case, query = _decode_inputs([257, 300, 31], 8, 2, block_size, head_size, dtype)
        _decode(case, query, 0.1, 0)
        _decode(case, query, 0.1, 64)
        case, query, loc, max_len = _prefill_inputs(
            [0, 40], [50, 20], 4, 2, block_size, head_size, dtype
        )
        _prefill(case, query, loc, 0.1, max_len)
    launches = [json.loads(line) for line in stats_path.read_text().splitlines()]
    decode = [launch for launch in launches if launch["kernel"].startswith("decode_kernel")]
    prefill = [launch for launch in launches if launch["kernel"].startswith("prefill_kernel")]
    assert len(decode) == 2 * len(BLOCK_SIZES) and len(prefill) == len(BLOCK_SIZES)
    for launch in decode + prefill:
        assert launch["requested_bytes"] == launch["sectors"] * 32, launch
    # Decode reads each token's K and V rows of each kv head once.
    tokens = 2 * (257 + 300 + 31)
    element = torch.tensor([], dtype=dtype).element_size()
    assert decode[0]["requested_bytes"] == tokens * 2 * head_size * element


def _decode_launches(stats_path) -> list[dict]:
    launches = [json.loads(line) for line in stats_path.read_text().splitlines()]
    return [launch for launch in launches if launch["kernel"].startswith("decode_")]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(4, 4), (6, 2), (8, 2), (32, 8), (16, 2), (8, 1), (16, 1), (48, 1), (64, 2), (96, 1)],
)
def test_grouped_query_decode_reads_each_kv_byte_once(
    num_heads, num_kv_heads, monkeypatch, tmp_path
):
    # Issue 37: the query heads of a group share one pass over their kv head's rows, single
    # pass and split-K alike. Groups of 1 to 8 (Llama 3's 32 / 8 among them) fit one thread
    # block's tile; groups of 9 to 64 (StarCoder's 48 / 1) take the wide kernel, whose warps
    # share rows staged in shared memory. A group above 64 takes ceil(group / 64) passes.
    stats_path = tmp_path / "loads.jsonl"
    monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_LOAD_STATS", str(stats_path))
    seq_lens = [70, 33]
    case, query = _decode_inputs(seq_lens, num_heads, num_kv_heads, 16, 64, torch.float16)
    expected = _decode_reference(case, query, 0.1)
    _assert_close(_decode(case, query, 0.1, 0), expected, torch.float16)
    _assert_close(_decode(case, query, 0.1, 32), expected, torch.float16)
    decode = [launch for launch in _decode_launches(stats_path) if "reduce" not in launch["kernel"]]
    assert len(decode) == 2
    passes = -(-(num_heads // num_kv_heads) // 64)
    kv_bytes = num_kv_heads * sum(seq_lens) * 2 * 64 * 2  # K and V rows, float16
    for launch in decode:
        assert launch["requested_bytes"] == passes * kv_bytes, launch
        assert launch["requested_bytes"] == launch["sectors"] * 32, launch


@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_wide_groups_match_reference_in_whole_sectors(head_size, monkeypatch, tmp_path):
    # The wide kernel (groups above 8) over every head size, the dtypes and block sizes in
    # turn (each twice), single pass and split-K: the reference's output, whole 32-byte
    # sectors (the rows are staged by consecutive threads), each K/V row read once.
    index = HEAD_SIZES.index(head_size)
    dtype, block_size = DTYPES[index % 3], BLOCK_SIZES[(index // 3 + index) % 3]
    stats_path = tmp_path / "loads.jsonl"
    monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_LOAD_STATS", str(stats_path))
    seq_lens = [1, block_size + 3, 90]
    case, query = _decode_inputs(seq_lens, 24, 2, block_size, head_size, dtype, seed=11)
    scale = head_size**-0.5
    expected = _decode_reference(case, query, scale)
    for partition_size in (0, 2 * block_size):
        _assert_close(_decode(case, query, scale, partition_size), expected, dtype)
    element = torch.tensor([], dtype=dtype).element_size()
    for launch in _decode_launches(stats_path):
        if launch["kernel"].startswith("decode_wide_kernel"):
            assert launch["requested_bytes"] == launch["sectors"] * 32, launch
            assert launch["requested_bytes"] == 2 * sum(seq_lens) * 2 * head_size * element


# --- prefill -----------------------------------------------------------------------------------


def _prefill_inputs(prior, q_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prior, q_lens)]
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator)
    query, _, _ = fused_qkv(sum(q_lens), num_heads, num_kv_heads, head_size, dtype, generator)
    return case, query, query_start_loc(q_lens), max(q_lens)


def _prefill(
    case, query, loc, scale, max_query_len, sliding_window=0, logits_soft_cap=0.0, sinks=None
):
    out = torch.empty_like(query)
    cuda_ops.paged_prefill_attention(
        out,
        query,
        case.block_tables,
        loc,
        case.seq_lens,
        scale,
        sliding_window,
        logits_soft_cap,
        0 if sinks is None else sinks.data_ptr(),
        max_query_len,
        _cache_args(case.key_cache, case.value_cache),
    )
    return out


def _prefill_reference(case, query, loc, scale):
    return reference.attention(
        query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, scale
    )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_mixed_batch_matches_reference(dtype, head_size, block_size):
    layout = HEAD_LAYOUTS[(HEAD_SIZES.index(head_size) + BLOCK_SIZES.index(block_size)) % 4]
    num_heads, num_kv_heads = layout
    # Plain prefill, a decode (q_len 1) with context, chunked prefill over cached context,
    # a prefill of exactly one block plus one token, and a single-token prompt.
    prior = [0, 13, block_size, 50, 0]
    q_lens = [37, 1, block_size + 1, 30, 1]
    case, query, loc, max_len = _prefill_inputs(
        prior, q_lens, num_heads, num_kv_heads, block_size, head_size, dtype
    )
    scale = head_size**-0.5
    _assert_close(
        _prefill(case, query, loc, scale, max_len),
        _prefill_reference(case, query, loc, scale),
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_a_few_hundred_tokens_with_gqa(dtype):
    case, query, loc, max_len = _prefill_inputs([0, 120], [150, 90], 9, 3, 16, 64, dtype, seed=3)
    _assert_close(
        _prefill(case, query, loc, 0.125, max_len),
        _prefill_reference(case, query, loc, 0.125),
        dtype,
    )


def test_prefill_skips_sequences_without_new_tokens():
    case, query, loc, max_len = _prefill_inputs([10, 4, 0], [3, 0, 5], 4, 2, 8, 64, torch.float32)
    _assert_close(
        _prefill(case, query, loc, 0.125, max_len),
        _prefill_reference(case, query, loc, 0.125),
        torch.float32,
    )


def test_prefill_of_single_tokens_equals_decode():
    prior = [0, 7, 31, 100]
    case, query, loc, _ = _prefill_inputs(prior, [1] * 4, 8, 2, 16, 96, torch.float32, seed=4)
    prefill = _prefill(case, query, loc, 0.1, 1)
    torch.testing.assert_close(prefill, _decode(case, query, 0.1, 0), atol=1e-5, rtol=1e-5)


def test_prefill_is_the_same_under_every_schedule(monkeypatch):
    case, query, loc, max_len = _prefill_inputs(
        [0, 20], [40, 9], 8, 2, 16, 256, torch.bfloat16, seed=8
    )
    results = []
    for schedule in SCHEDULES:
        monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_SCHEDULE", schedule)
        results.append(_prefill(case, query, loc, 0.07, max_len))
    assert all(torch.equal(result, results[0]) for result in results[1:])


# --- sliding window ----------------------------------------------------------------------------
# Query position i sees keys i - W < j <= i (HF transformers' sliding-window mask); the reference
# is tests/ops/reference.py's. Windows below a block, of one block, across blocks, equal to the
# longest context (100) and past every context.

WINDOWS = [1, 5, "block", 24, 100, 1000]


def _poison_before(case, seq: int, first_position: int, whole_blocks: bool) -> None:
    """NaN into sequence ``seq``'s K/V before ``first_position`` (only whole blocks before its
    block with ``whole_blocks``): a kernel that reads them, even masked, gives NaN."""
    block_size = case.key_cache.shape[2]
    end = first_position // block_size * block_size if whole_blocks else first_position
    for position in range(end):
        block = int(case.block_tables[seq, position // block_size])
        case.key_cache[block, :, position % block_size] = float("nan")
        case.value_cache[block, :, position % block_size] = float("nan")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_window_matches_reference(dtype, block_size):
    layout = HEAD_LAYOUTS[(DTYPES.index(dtype) + BLOCK_SIZES.index(block_size)) % 4]
    num_heads, num_kv_heads = layout
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    for window in WINDOWS:
        window = block_size if window == "block" else window
        case, query = _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, 64, dtype)
        expected = reference.decode_attention(
            query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, window
        )
        # Positions before each window are never read: NaN there would show in the output.
        for seq, seq_len in enumerate(seq_lens):
            _poison_before(case, seq, max(0, seq_len - window), whole_blocks=False)
        for partition_size in (0, block_size, 2 * block_size, -1):
            out = _decode(case, query, 0.125, partition_size, sliding_window=window)
            _assert_close(out, expected, dtype)


@pytest.mark.parametrize("window", [17, 512, 700])
def test_split_k_with_window_skips_partitions_outside_it(window, monkeypatch, tmp_path):
    # Partitions count from each window's start: the grid holds ceil(min(window, context) / 64)
    # of them, and the kernels read each attended token's K and V rows once, no other.
    seq_lens = [1, 63, 65, 700, 1400]
    case, query = _decode_inputs(seq_lens, 8, 2, 16, 64, torch.float32, seed=2)
    expected = reference.decode_attention(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.088, window
    )
    stats_path = tmp_path / "loads.jsonl"
    monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_LOAD_STATS", str(stats_path))
    split = _decode(case, query, 0.088, 64, sliding_window=window)
    single = _decode(case, query, 0.088, 0, sliding_window=window)
    _assert_close(split, expected, torch.float32)
    torch.testing.assert_close(split, single, atol=1e-6, rtol=1e-6)
    launches = [json.loads(line) for line in stats_path.read_text().splitlines()]
    decode = [launch for launch in launches if launch["kernel"].startswith("decode_kernel")]
    max_blocks = case.block_tables.shape[1]
    assert decode[0]["grid"][0] == -(-min(window, max_blocks * 16) // 64)
    attended = sum(min(n, window) for n in seq_lens)
    for launch in decode:  # 2 kv heads, K and V, 64 float32 elements
        assert launch["requested_bytes"] == attended * 2 * 2 * 64 * 4, launch


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_window_matches_reference(dtype, block_size):
    layout = HEAD_LAYOUTS[(DTYPES.index(dtype) + BLOCK_SIZES.index(block_size)) % 4]
    num_heads, num_kv_heads = layout
    # Plain prefill past the window, a decode with context, chunked prefill over cached context,
    # one block plus one token, a one-token prompt.
    prior = [0, 13, block_size, 50, 0]
    q_lens = [37, 1, block_size + 1, 30, 1]
    for window in WINDOWS:
        window = block_size if window == "block" else window
        case, query, loc, max_len = _prefill_inputs(
            prior, q_lens, num_heads, num_kv_heads, block_size, 64, dtype
        )
        expected = reference.attention(
            query,
            case.key_cache,
            case.value_cache,
            case.block_tables,
            loc,
            case.seq_lens,
            0.125,
            window,
        )
        for seq, context in enumerate(prior):  # whole blocks before the first query's window
            _poison_before(case, seq, max(0, context - window + 1), whole_blocks=True)
        _assert_close(_prefill(case, query, loc, 0.125, max_len, window), expected, dtype)


@pytest.mark.parametrize("window", [3, 40])
def test_prefill_with_window_reads_only_each_tiles_windows(window, monkeypatch, tmp_path):
    # A tile of 32 rows reads keys from its first row's window start to its last row's position.
    prior, q_lens, group, head_size = [0, 100], [150, 40], 3, 64
    case, query, loc, max_len = _prefill_inputs(
        prior, q_lens, 3 * group, 3, 16, head_size, torch.float32, seed=3
    )
    stats_path = tmp_path / "loads.jsonl"
    monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_LOAD_STATS", str(stats_path))
    out = _prefill(case, query, loc, 0.125, max_len, window)
    expected = reference.attention(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        loc,
        case.seq_lens,
        0.125,
        window,
    )
    _assert_close(out, expected, torch.float32)
    keys = 0
    for context, q_len in zip(prior, q_lens):
        rows = q_len * group
        for first_row in range(0, rows, 32):
            first = context + first_row // group
            last = context + (min(first_row + 32, rows) - 1) // group
            keys += last + 1 - max(0, first - window + 1)
    (launch,) = [json.loads(line) for line in stats_path.read_text().splitlines()]
    # The cache's 16-byte loads: 3 kv heads, K and V rows of float32.
    assert launch["requested_bytes"] == keys * 3 * 2 * head_size * 4, launch


def test_window_is_the_same_under_every_schedule(monkeypatch):
    case, query = _decode_inputs([300, 5, 77], 8, 2, 16, 96, torch.float16, seed=6)
    prefill_case, prefill_query, loc, max_len = _prefill_inputs(
        [0, 20], [40, 9], 8, 2, 16, 128, torch.bfloat16, seed=8
    )
    results = []
    for schedule in SCHEDULES:
        monkeypatch.setenv("PAGEDSERVE_CUDA_EMU_SCHEDULE", schedule)
        results.append(
            (
                _decode(case, query, 0.1, 0, sliding_window=50),
                _decode(case, query, 0.1, 32, sliding_window=50),
                _prefill(prefill_case, prefill_query, loc, 0.07, max_len, 13),
            )
        )
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, results[0]))


# Logit soft-capping (Gemma 2): each logit s becomes cap * tanh(s / cap) before the mask; the
# kernels apply it to base-2 logits with the cap scaled by log2(e). (cap, scale, window) as in
# tests/ops/test_soft_cap_ops.py: caps that saturate, bend the tails, and Gemma 2's 50 over
# logits of standard deviation 8, with and without a window.

SOFT_CAPS = [(1.0, 0.125, 0), (5.0, 0.125, 24), (50.0, 1.0, 0), (50.0, 1.0, 5)]


def _capped_reference(reference_fn, args, cap, window):
    """The reference with the cap, checked to differ from the uncapped one far beyond the
    float32 tolerance: a kernel that ignores the cap fails."""
    expected = reference_fn(*args, sliding_window=window, logits_soft_cap=cap)
    uncapped = reference_fn(*args, sliding_window=window)
    assert (expected - uncapped).abs().max() > 100 * TOLERANCES[torch.float32]["atol"]
    return expected


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_soft_cap_matches_reference(dtype, block_size):
    layout = HEAD_LAYOUTS[(DTYPES.index(dtype) + BLOCK_SIZES.index(block_size)) % 4]
    num_heads, num_kv_heads = layout
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    case, query = _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    for cap, scale, window in SOFT_CAPS:
        args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale)
        expected = _capped_reference(reference.decode_attention, args, cap, window)
        for partition_size in (0, block_size, 2 * block_size, -1):
            out = _decode(case, query, scale, partition_size, None, window, cap)
            _assert_close(out, expected, dtype)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_soft_cap_matches_reference(dtype, block_size):
    layout = HEAD_LAYOUTS[(DTYPES.index(dtype) + BLOCK_SIZES.index(block_size)) % 4]
    num_heads, num_kv_heads = layout
    prior = [0, 13, block_size, 50, 0]
    q_lens = [37, 1, block_size + 1, 30, 1]
    case, query, loc, max_len = _prefill_inputs(
        prior, q_lens, num_heads, num_kv_heads, block_size, 64, dtype
    )
    for cap, scale, window in SOFT_CAPS:
        args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
        expected = _capped_reference(reference.attention, (*args, scale), cap, window)
        _assert_close(_prefill(case, query, loc, scale, max_len, window, cap), expected, dtype)


def test_split_k_with_soft_cap_equals_single_pass():
    # Each partition's max and sum are of capped logits; the reduction combines them as usual.
    case, query = _decode_inputs([1, 63, 65, 700, 1400], 8, 2, 16, 64, torch.float32, seed=2)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.5)
    for window in (0, 300):
        expected = _capped_reference(reference.decode_attention, args, 50.0, window)
        split = _decode(case, query, 0.5, 64, None, window, 50.0)
        single = _decode(case, query, 0.5, 0, None, window, 50.0)
        _assert_close(split, expected, torch.float32)
        torch.testing.assert_close(split, single, atol=1e-6, rtol=1e-6)


def test_bad_soft_cap_is_refused_before_any_launch(kernels):
    case, query = _decode_inputs([5], 4, 2, 8, 64, torch.float32)
    loc = query_start_loc([1])
    for cap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="logits_soft_cap .* must be finite and >= 0"):
            _decode(case, query, 0.1, 0, None, 0, cap)
        with pytest.raises(ValueError, match="logits_soft_cap .* must be finite and >= 0"):
            _prefill(case, query, loc, 0.1, 1, 0, cap)


# Attention sinks (gpt-oss): each head's sink logit joins its softmax as a key whose value is
# zero; a single pass folds it into the normalization, split-K's reduction adds it as one more
# partition. Sinks of std 3 over logits of std 1 lie both below and above a row's max.


def _sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(100 + seed)) * 3.0


def _sink_reference(reference_fn, args, sinks, **options):
    """The reference with the sinks, checked to differ from the one without far beyond the
    float32 tolerance: a kernel that ignores the sinks fails."""
    expected = reference_fn(*args, sinks=sinks, **options)
    without = reference_fn(*args, **options)
    assert (expected - without).abs().max() > 100 * TOLERANCES[torch.float32]["atol"]
    return expected


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_sinks_matches_reference(dtype, block_size):
    num_heads, num_kv_heads = HEAD_LAYOUTS[(DTYPES.index(dtype) + block_size // 8) % 4]
    seq_lens = [0, 1, block_size + 1, 3 * block_size - 1, 100]
    case, query = _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    sinks = _sinks(num_heads)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    for window in (0, 5):
        expected = _sink_reference(reference.decode_attention, args, sinks, sliding_window=window)
        for partition_size in (0, block_size, 2 * block_size):
            out = _decode(case, query, 0.125, partition_size, None, window, 0.0, sinks)
            assert torch.equal(out[0], torch.zeros_like(out[0]))  # seq_len 0: zeros still
            _assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_sinks_matches_reference(dtype):
    prior, q_lens = [0, 13, 16, 50, 0], [37, 1, 17, 30, 1]
    case, query, loc, max_len = _prefill_inputs(prior, q_lens, 8, 2, 16, 64, dtype)
    sinks = _sinks(8, seed=1)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, 0.125)
    for window, cap in ((0, 0.0), (7, 0.0), (0, 2.0)):
        expected = _sink_reference(
            reference.attention, args, sinks, sliding_window=window, logits_soft_cap=cap
        )
        out = _prefill(case, query, loc, 0.125, max_len, window, cap, sinks)
        _assert_close(out, expected, dtype)


# --- cache ops ---------------------------------------------------------------------------------


def _reshape_and_cache(key, value, key_cache, value_cache, slots):
    cuda_ops.reshape_and_cache(key, value, slots, _cache_args(key_cache, value_cache))


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_slots(dtype, head_size, block_size):
    generator = torch.Generator().manual_seed(0)
    num_blocks, num_kv_heads, num_tokens = 12, 2, 23
    pool = random_pool(num_blocks, num_kv_heads, block_size, head_size, dtype, generator)
    key_cache, value_cache = pool[:, 1, 0], pool[:, 1, 1]
    _, key, value = fused_qkv(num_tokens, 6, num_kv_heads, head_size, dtype, generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[3, 11, 22]] = -1  # padding tokens
    expected_key, expected_value = reference.reshape_and_cache(
        key, value, key_cache, value_cache, slots
    )
    other_layer = pool[:, 0].clone()

    _reshape_and_cache(key, value, key_cache, value_cache, slots)

    assert _same_bytes(key_cache, expected_key)
    assert _same_bytes(value_cache, expected_value)
    assert _same_bytes(pool[:, 0], other_layer)


def test_reshape_and_cache_from_unaligned_views():
    # Keys starting one element into their buffer: the kernel falls back to 2-byte copies.
    generator = torch.Generator().manual_seed(1)
    pool = random_pool(4, 2, 8, 80, torch.float16, generator, num_layers=1)
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    buffer = torch.randn(5, 1 + 4 * 160, generator=generator).to(torch.float16)
    key = buffer[:, 1 : 1 + 160].view(5, 2, 80)
    value = buffer[:, 1 + 160 : 1 + 320].view(5, 2, 80)
    slots = torch.tensor([0, 9, -1, 31, 17])
    expected_key, expected_value = reference.reshape_and_cache(
        key, value, key_cache, value_cache, slots
    )
    _reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert _same_bytes(key_cache, expected_key) and _same_bytes(value_cache, expected_value)


def _copy_blocks(pool, mapping):
    cuda_ops.copy_blocks(pool, mapping, ops._block_bytes(pool))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_whole_blocks_exactly(dtype):
    generator = torch.Generator().manual_seed(3)
    pool = random_pool(10, 1, 16, 64, dtype, generator, num_layers=3)
    pool.view(-1).view(torch.int16)[:64] = 0x7F81  # NaN payloads arithmetic could change
    pool.view(-1)[100] = -0.0
    mapping = torch.tensor([[0, 5], [2, 7], [0, 9]])
    expected = reference.copy_blocks(pool, pool, mapping)
    _copy_blocks(pool, mapping)
    assert _same_bytes(pool, expected)


def test_copy_blocks_of_large_blocks_spread_over_chunks():
    generator = torch.Generator().manual_seed(4)
    pool = random_pool(40, 4, 16, 128, torch.bfloat16, generator)  # 64 KiB blocks: 4 chunks
    mapping = torch.stack([torch.arange(0, 20), torch.arange(20, 40)], dim=1)
    expected = reference.copy_blocks(pool, pool, mapping)
    _copy_blocks(pool, mapping)
    assert _same_bytes(pool, expected)


def test_copy_blocks_rejects_bad_mappings_before_any_launch():
    pool = random_pool(10, 1, 8, 64, torch.float32, torch.Generator().manual_seed(5))
    before = pool.clone()
    with pytest.raises(ValueError, match="destination block 3 more than once"):
        _copy_blocks(pool, torch.tensor([[0, 3], [1, 3]]))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_in_runs(dtype):
    # The emulator's "device" is host memory: this checks the runs of consecutive pairs that
    # make one copy each, and the bytes.
    generator = torch.Generator().manual_seed(6)
    device_pool = random_pool(12, 2, 8, 80, dtype, generator)
    host_pool = random_pool(6, 2, 8, 80, dtype, generator)
    swap_out = torch.tensor([[11, 0], [3, 4], [4, 5], [7, 2]])  # (3, 4), (4, 5): one run
    expected_host = reference.copy_blocks(device_pool, host_pool, swap_out)
    cuda_ops.swap_blocks(device_pool, host_pool, swap_out, ops._block_bytes(device_pool))
    assert _same_bytes(host_pool, expected_host)
    swap_in = torch.tensor([[0, 1], [4, 6], [2, 2]])
    expected_device = reference.copy_blocks(host_pool, device_pool, swap_in)
    cuda_ops.swap_blocks(host_pool, device_pool, swap_in, ops._block_bytes(host_pool))
    assert _same_bytes(device_pool, expected_device)
