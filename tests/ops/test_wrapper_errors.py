"""Bad input gets an exception whose message names the argument, the value and the limit."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu_worker import ops

from .cases import fused_qkv, paged_case, query_start_loc


@pytest.fixture
def decode():
    """Valid decode arguments (fp32, 4 heads over 2 kv heads, head 64, block 8)."""
    generator = torch.Generator().manual_seed(0)
    case = paged_case([5, 17], 2, 8, 64, torch.float32, generator)
    query, key, value = fused_qkv(2, 4, 2, 64, torch.float32, generator)
    return {
        "query": query,
        "key_cache": case.key_cache,
        "value_cache": case.value_cache,
        "block_tables": case.block_tables,
        "seq_lens": case.seq_lens,
        "scale": 0.125,
        "key": key,
        "value": value,
    }


def _decode(args: dict, **changes) -> torch.Tensor:
    args = {**args, **changes}
    extra = {k: args[k] for k in ("out", "partition_size") if k in args}
    return ops.paged_attention_decode(
        args["query"],
        args["key_cache"],
        args["value_cache"],
        args["block_tables"],
        args["seq_lens"],
        args["scale"],
        **extra,
    )


def _prefill(args: dict, query_lens: list[int], **changes) -> torch.Tensor:
    args = {**args, **changes}
    return ops.paged_prefill_attention(
        args["query"],
        args["key_cache"],
        args["value_cache"],
        args["block_tables"],
        args.get("query_start_loc", query_start_loc(query_lens)),
        args["seq_lens"],
        args["scale"],
        max_query_len=args.get("max_query_len"),
    )


def test_valid_arguments_pass(decode):
    assert torch.isfinite(_decode(decode)).all()


def test_wrong_query_dtype(decode):
    with pytest.raises(TypeError, match="query has dtype torch.float64; supported"):
        _decode(decode, query=decode["query"].double())


def test_query_dtype_must_match_cache(decode):
    with pytest.raises(TypeError, match="query has dtype torch.bfloat16 but the cache holds"):
        _decode(decode, query=decode["query"].bfloat16())


def test_non_contiguous_cache(decode):
    transposed = decode["key_cache"].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match="key_cache .* must have contiguous num_kv_heads"):
        _decode(decode, key_cache=transposed)


def test_non_contiguous_query_heads(decode):
    query = decode["query"].transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="query .* must have contiguous num_heads, head_size"):
        _decode(decode, query=query)


@pytest.mark.parametrize("head_size", [32, 72, 160])
def test_unsupported_head_size(head_size):
    cache = torch.zeros(4, 2, 8, head_size)
    query = torch.zeros(1, 2, head_size)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    message = f"head_size {head_size} .* not supported; supported: 64, 80, 96, 128, 192, 256"
    with pytest.raises(ValueError, match=message):
        ops.paged_attention_decode(query, cache, cache, tables, lens, 1.0)


def test_unsupported_block_size(decode):
    cache = torch.zeros(4, 2, 12, 64)
    with pytest.raises(ValueError, match=r"block_size 12 .* supported: 8, 16, 32"):
        _decode(decode, key_cache=cache, value_cache=cache)


def test_gqa_heads_must_divide(decode):
    query = torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match="query has 3 heads, .* multiple of .* num_kv_heads 2"):
        _decode(decode, query=query)


def test_block_tables_dtype(decode):
    with pytest.raises(TypeError, match="block_tables has dtype torch.int64; expected torch.int32"):
        _decode(decode, block_tables=decode["block_tables"].long())


def test_seq_lens_shape(decode):
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[num_seqs\] = \[2\]"):
        _decode(decode, seq_lens=torch.ones(3, dtype=torch.int32))


def test_seq_len_beyond_block_table(decode):
    too_long = torch.tensor([5, 10_000], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 10000 is outside \[0, "):
        _decode(decode, seq_lens=too_long)


def test_block_table_entry_outside_cache(decode):
    tables = decode["block_tables"].clone()
    tables[1, 2] = 999
    with pytest.raises(ValueError, match=r"block_tables\[1\]\[2\] = 999 is not a block"):
        _decode(decode, block_tables=tables)


@pytest.mark.parametrize("partition_size", [-8, 12, 4])
def test_partition_size_must_be_a_multiple_of_block_size(decode, partition_size):
    with pytest.raises(ValueError, match=f"multiple of block_size 8, got {partition_size}"):
        _decode(decode, partition_size=partition_size)


def test_out_shape_and_dtype(decode):
    with pytest.raises(ValueError, match=r"out has shape \(2, 4, 32\)"):
        _decode(decode, out=torch.empty(2, 4, 32))
    with pytest.raises(TypeError, match="out has dtype torch.float16"):
        _decode(decode, out=torch.empty(2, 4, 64, dtype=torch.float16))


def test_non_cpu_tensor(decode):
    with pytest.raises(ValueError, match="query is on meta; only CPU and CUDA tensors"):
        _decode(decode, query=torch.empty(2, 4, 64, device="meta"))


def test_not_a_tensor(decode):
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor, got list"):
        _decode(decode, seq_lens=[5, 17])


def test_prefill_query_start_loc_must_end_at_num_tokens(decode):
    query = torch.zeros(6, 4, 64)
    loc = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"query_start_loc\[2\] = 5 must equal num_tokens 6"):
        _prefill(decode, [], query=query, query_start_loc=loc)


def test_prefill_query_longer_than_sequence(decode):
    query = torch.zeros(8, 4, 64)
    with pytest.raises(
        ValueError, match=r"query length .* = 6 is outside \[0, seq_lens\[0\] = 5\]"
    ):
        _prefill(decode, [6, 2], query=query)


@pytest.mark.parametrize(
    ("max_query_len", "error", "message"),
    [
        (-1, ValueError, r"max_query_len must be in \[0, num_tokens = 2\], got -1"),
        (3, ValueError, r"max_query_len must be in \[0, num_tokens = 2\], got 3"),
        (True, TypeError, "max_query_len must be None or an int, got bool"),
    ],
)
def test_prefill_max_query_len(decode, max_query_len, error, message):
    with pytest.raises(error, match=message):
        _prefill(decode, [1, 1], max_query_len=max_query_len)


def test_prefill_query_start_loc_dtype(decode):
    loc = torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="query_start_loc has dtype torch.int64"):
        _prefill(decode, [], query_start_loc=loc)


def test_reshape_and_cache_slot_mapping_dtype(decode):
    with pytest.raises(TypeError, match="slot_mapping has dtype torch.int32; expected torch.int64"):
        ops.reshape_and_cache(
            decode["key"],
            decode["value"],
            decode["key_cache"],
            decode["value_cache"],
            torch.zeros(2, dtype=torch.int32),
        )


def test_reshape_and_cache_key_heads(decode):
    with pytest.raises(
        ValueError, match=r"key must be .* num_heads=2, head_size=64 .* \(2, 3, 64\)"
    ):
        ops.reshape_and_cache(
            torch.zeros(2, 3, 64),
            decode["value"],
            decode["key_cache"],
            decode["value_cache"],
            torch.zeros(2, dtype=torch.int64),
        )


def test_copy_blocks_needs_the_contiguous_pool():
    pool = torch.zeros(4, 2, 2, 1, 8, 64)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        ops.copy_blocks(pool[:, 1], torch.tensor([[0, 1]]))


def test_copy_blocks_mapping_shape():
    with pytest.raises(ValueError, match=r"block_mapping must have shape \[num_pairs, 2\]"):
        ops.copy_blocks(torch.zeros(4, 8), torch.tensor([0, 1]))


def test_swap_blocks_geometry_must_match():
    with pytest.raises(ValueError, match=r"dst_kv_cache blocks have shape \(9,\)"):
        ops.swap_blocks(torch.zeros(4, 8), torch.zeros(2, 9), torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="dst_kv_cache has dtype torch.bfloat16"):
        ops.swap_blocks(torch.zeros(4, 8), torch.zeros(2, 8).bfloat16(), torch.tensor([[0, 1]]))


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_set_num_threads_rejects(value, error):
    with pytest.raises(error, match="num_threads"):
        ops.set_num_threads(value)
