"""Chunked attention (Llama 4's RoPE layers) through ``PagedAttention`` and the step's
``chunked`` view, against a float64 reference of HF's chunked mask: query position ``p``
sees keys ``j`` with ``j // C == p // C`` and ``j <= p`` (masking_utils' ``chunked_overlay``
and ``causal_mask_function``), over the decode kernel, the paged prefill kernel and the
gathered SDPA prefill."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu_worker.layers.attention import AttentionMetadata, PagedAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64
# (cached tokens before this step, new tokens): decodes first, at chunk boundaries and
# inside chunks; then prefills starting at 0, mid-chunk, one token before a boundary, on a
# boundary, and one spanning several chunks.
SEQUENCES = [(0, 1), (15, 1), (16, 1), (47, 1), (0, 40), (10, 30), (31, 2), (16, 16), (5, 70)]


def _reference(query, keys, values, positions, chunk_size, scale):
    """float64 attention of each query (position ``p``) over its sequence's ``keys`` /
    ``values`` [positions, kv_heads, head] at the positions of its chunk up to ``p``."""
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty(len(positions), NUM_HEADS, HEAD_SIZE, dtype=torch.float64)
    for row, position in enumerate(positions):
        first = position // chunk_size * chunk_size if chunk_size else 0
        k = keys[first : position + 1].double().repeat_interleave(group, dim=1)
        v = values[first : position + 1].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", query[row].double(), k) * scale
        out[row] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.mark.parametrize("gathered", [False, True], ids=["kernel", "sdpa"])
@pytest.mark.parametrize(("block_size", "chunk_size"), [(8, 16), (16, 16), (8, 32)])
def test_chunked_attention_matches_reference(block_size, chunk_size, gathered):
    generator = torch.Generator().manual_seed(block_size * 100 + chunk_size)
    blocks_needed = [-(-(cached + new) // block_size) for cached, new in SEQUENCES]
    num_blocks = sum(blocks_needed) + 1
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0 stays unused
    key_cache = torch.zeros(num_blocks, NUM_KV_HEADS, block_size, HEAD_SIZE)
    value_cache = torch.zeros_like(key_cache)
    sequences, queries, keys, values, expected = [], [], [], [], []
    scale = HEAD_SIZE**-0.5
    used = 0
    for (cached, new), count in zip(SEQUENCES, blocks_needed, strict=True):
        block_ids = order[used : used + count].tolist()
        used += count
        total = cached + new
        seq_keys = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
        seq_values = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
        # The cached part is already in the pool; before this step's first chunk it is NaN:
        # a token that reads across its chunk's start turns NaN.
        first_chunk_start = cached // chunk_size * chunk_size
        for position in range(cached):
            block, offset = block_ids[position // block_size], position % block_size
            poisoned = position < first_chunk_start
            key_cache[block, :, offset] = float("nan") if poisoned else seq_keys[position]
            value_cache[block, :, offset] = float("nan") if poisoned else seq_values[position]
        seq_query = torch.randn(new, NUM_HEADS, HEAD_SIZE, generator=generator)
        sequences.append((block_ids, cached, new))
        queries.append(seq_query)
        keys.append(seq_keys[cached:])
        values.append(seq_values[cached:])
        positions = list(range(cached, total))
        expected.append(_reference(seq_query, seq_keys, seq_values, positions, chunk_size, scale))
    metadata, _ = AttentionMetadata.for_sequences(
        sequences, block_size, torch.device("cpu"), gathered, attention_chunk_size=chunk_size
    )
    assert metadata.chunked is not None
    attention = PagedAttention(
        NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, scale, attention_chunk_size=chunk_size
    )
    out = attention(
        torch.cat(queries).flatten(1),
        torch.cat(keys).flatten(1),
        torch.cat(values).flatten(1),
        key_cache,
        value_cache,
        metadata,
    )
    torch.testing.assert_close(
        out.view(-1, NUM_HEADS, HEAD_SIZE).double(), torch.cat(expected), atol=2e-5, rtol=2e-5
    )


def test_chunked_view_splits_sequences_at_chunk_starts():
    # One decode at position 20 and one prefill of positions 5..37 with chunks of 16: the
    # decode's view starts at block 2 (position 16); the prefill splits into 5..15, 16..31,
    # 32..37, each over its chunk's blocks.
    decode_blocks, prefill_blocks = [10, 11, 12], [20, 21, 22, 23, 24]
    metadata, _ = AttentionMetadata.for_sequences(
        [(decode_blocks, 20, 1), (prefill_blocks, 5, 33)],
        8,
        torch.device("cpu"),
        False,
        attention_chunk_size=16,
    )
    view = metadata.chunked
    assert view is not None
    assert view.num_decode_tokens == 1
    assert view.slot_mapping is metadata.slot_mapping
    assert view.decode_seq_lens.tolist() == [5]
    assert view.decode_block_tables[0, :1].tolist() == [12]
    assert view.prefill_seq_lens.tolist() == [16, 16, 6]
    assert view.prefill_query_start_loc.tolist() == [0, 11, 27, 33]
    assert view.prefill_block_tables[:, :2].tolist() == [[20, 21], [22, 23], [24, 0]]
    assert view.prefill_max_query_len == 16


def test_chunk_size_must_be_a_multiple_of_the_block_size():
    with pytest.raises(
        ValueError, match="attention_chunk_size=12 must be a multiple of block_size=8"
    ):
        AttentionMetadata.for_sequences(
            [([1, 2], 0, 10)], 8, torch.device("cpu"), False, attention_chunk_size=12
        )


def test_chunked_layer_without_the_view_is_refused():
    metadata, _ = AttentionMetadata.for_sequences([([1], 0, 3)], 8, torch.device("cpu"), False)
    attention = PagedAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, 0.1, attention_chunk_size=16)
    cache = torch.zeros(2, NUM_KV_HEADS, 8, HEAD_SIZE)
    rows = torch.zeros(3, NUM_HEADS * HEAD_SIZE)
    kv_rows = torch.zeros(3, NUM_KV_HEADS * HEAD_SIZE)
    with pytest.raises(ValueError, match="chunked view"):
        attention(rows, kv_rows, kv_rows, cache, cache.clone(), metadata)
