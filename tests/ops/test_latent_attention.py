"""DeepSeek's multi-head latent attention over a paged cache of latents
(``layers/latent_attention.py``) against a float64 reference that expands every head's keys
and values from the latents, as HF's MLA does: the absorbed form gives the same attention;
latents are written into the packed rows and read back, padding slots are skipped, a float8
cache rounds as the ops do, and positions before a sequence's context are never read."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu_worker.layers import latent_attention as latent_attention_module
from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.latent_attention import latent_attention, write_latents

HEADS, NOPE, ROPE, VALUE, LATENT = 4, 16, 8, 12, 24
ROWS = (LATENT + ROPE + 1) // 2  # one KV head: the key row the first half, the value row the rest
# (cached tokens before this step, new tokens): decodes, then prefills.
SEQUENCES = [(0, 1), (9, 1), (17, 1), (0, 13), (5, 20), (16, 3)]


def _reference(q_nope, q_rope, latents, key_ropes, w_uk, w_uv, positions, scale):
    """float64: each head's keys W_UK c and values W_UV c over the positions up to each
    query's own."""
    out = torch.empty(len(positions), HEADS, VALUE, dtype=torch.float64)
    keys_nope = torch.einsum("hnl,kl->khn", w_uk.double(), latents.double())
    values = torch.einsum("hvl,kl->khv", w_uv.double(), latents.double())
    for row, position in enumerate(positions):
        scores = torch.einsum("hn,khn->hk", q_nope[row].double(), keys_nope[: position + 1])
        scores += torch.einsum(
            "hr,kr->hk", q_rope[row].double(), key_ropes[: position + 1].double()
        )
        probabilities = torch.softmax(scores * scale, dim=-1)
        out[row] = torch.einsum("hk,khv->hv", probabilities, values[: position + 1])
    return out


@pytest.mark.parametrize(
    ("block_size", "slice_bytes"), [(4, None), (16, None), (16, 1)], ids=["4", "16", "sliced"]
)
def test_latent_attention_equals_expanded_attention(block_size, slice_bytes, monkeypatch):
    if slice_bytes is not None:  # scores one query row at a time, as a long prefill's are
        monkeypatch.setattr(latent_attention_module, "SCORES_BYTES_PER_SLICE", slice_bytes)
    generator = torch.Generator().manual_seed(block_size)
    w_uk = torch.randn(HEADS, NOPE, LATENT, generator=generator) * 0.3
    w_uv = torch.randn(HEADS, VALUE, LATENT, generator=generator) * 0.3
    needed = [-(-(cached + new) // block_size) for cached, new in SEQUENCES]
    order = (torch.randperm(sum(needed), generator=generator) + 1).tolist()
    key_cache = torch.full((sum(needed) + 1, 1, block_size, ROWS), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))  # never-written slots: NaN
    sequences, new_latents, new_ropes, q_nopes, q_ropes, expected = [], [], [], [], [], []
    scale = (NOPE + ROPE) ** -0.5
    used = 0
    for (cached, new), count in zip(SEQUENCES, needed, strict=True):
        block_ids = order[used : used + count]
        used += count
        total = cached + new
        latents = torch.randn(total, LATENT, generator=generator)
        key_ropes = torch.randn(total, ROPE, generator=generator)
        slots = torch.tensor(
            [block_ids[p // block_size] * block_size + p % block_size for p in range(cached)],
            dtype=torch.int64,
        )
        write_latents(latents[:cached], key_ropes[:cached], key_cache, value_cache, slots)
        q_nope = torch.randn(new, HEADS, NOPE, generator=generator)
        q_rope = torch.randn(new, HEADS, ROPE, generator=generator)
        sequences.append((block_ids, cached, new))
        new_latents.append(latents[cached:])
        new_ropes.append(key_ropes[cached:])
        q_nopes.append(q_nope)
        q_ropes.append(q_rope)
        positions = list(range(cached, total))
        expected.append(
            _reference(q_nope, q_rope, latents, key_ropes, w_uk, w_uv, positions, scale)
        )
    metadata, _ = AttentionMetadata.for_sequences(
        sequences, block_size, torch.device("cpu"), False, latent_attention=True
    )
    assert metadata.latent_plans is not None
    assert [(start, end) for start, end, _ in metadata.latent_plans] == [(0, 3), (3, 39)]
    write_latents(
        torch.cat(new_latents), torch.cat(new_ropes), key_cache, value_cache, metadata.slot_mapping
    )
    query_latent = torch.einsum("thn,hnl->thl", torch.cat(q_nopes), w_uk)
    query_rope = torch.cat(q_ropes)
    summed = torch.cat(
        [
            latent_attention(
                query_latent[start:end], query_rope[start:end], key_cache, value_cache, plan, scale
            )
            for start, end, plan in metadata.latent_plans
        ]
    )
    out = torch.einsum("thl,hvl->thv", summed, w_uv)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_write_latents_packs_rows_skips_padding_and_rounds_to_float8():
    key_cache = torch.zeros(2, 1, 4, ROWS)
    value_cache = torch.zeros_like(key_cache)
    latent = torch.arange(2 * LATENT, dtype=torch.float32).view(2, LATENT)
    key_rope = -torch.arange(2 * ROPE, dtype=torch.float32).view(2, ROPE) - 1
    write_latents(latent, key_rope, key_cache, value_cache, torch.tensor([5, -1]))
    row = torch.cat((key_cache[1, 0, 1], value_cache[1, 0, 1]))
    assert torch.equal(row[: LATENT + ROPE], torch.cat((latent[0], key_rope[0])))
    assert key_cache.count_nonzero() + value_cache.count_nonzero() == LATENT + ROPE - 1  # a 0
    # float8 e4m3: saturated at 448, as ops.reshape_and_cache rounds.
    fp8_key = torch.zeros(1, 1, 4, ROWS, dtype=torch.float8_e4m3fn)
    fp8_value = torch.zeros_like(fp8_key)
    big = torch.full((1, LATENT), 1000.0)
    write_latents(big, torch.zeros(1, ROPE), fp8_key, fp8_value, torch.tensor([0]))
    assert fp8_key[0, 0, 0, 0].float() == 448.0
