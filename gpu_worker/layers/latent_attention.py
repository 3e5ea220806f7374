"""Multi-head latent attention (DeepSeek's MLA) over a paged cache of latents.

Each token's keys and values come from one latent shared by every head: ``c`` (the
normed ``kv_lora_rank`` values) and the rotated key ``k_pe`` (``qk_rope_head_dim``). The
cache keeps only that, ``[c | k_pe]`` per token and layer (DeepSeek-V3: 576 values,
against 128 heads x 192 x 2 expanded), packed in the pool's layout as one KV head whose
key row holds the first half and whose value row holds the second
(``architectures/deepseek.py``, ``latent_cache_head_size``).

Attention never expands the latent: each head's ``kv_b_proj`` rows are absorbed, the key's
into the query and the value's into the output (as vLLM's MLA does)::

    q_nope . (W_UK c)  =  (q_nope W_UK) . c        out = sum_j p_j W_UV c_j = W_UV sum_j p_j c_j

so a head's score over position j is ``(q_lat . c_j + q_pe . k_pe_j) * scale`` and its output
``W_UV`` times the probabilities' sum of the latents: one multi-query attention of heads
``kv_lora_rank + qk_rope_head_dim`` wide over a single KV head. The same numbers as HF's
expanded attention, summed in another order.

The step's decodes, then its prefills, each run as one padded batch over latents gathered
out of the blocks (``AttentionMetadata.latent_plans``: ``GatheredPrefillPlan``s), in float32
whatever the model's dtype, as the paged kernels compute.

The float32 scores are made a slice of query rows at a time, at most
``SCORES_BYTES_PER_SLICE`` each: a long prefill's [sequences, heads, queries, keys] scores
would not fit at once (DeepSeek-V3: 128 heads).

NOTE: torch, not a paged kernel: the gather copies each sequence's latents once per layer (a
576-value row per position, a fraction of what the expanded cache read), padded to the
step's longest context.
"""

from __future__ import annotations

import torch

from pagedserve.gpu_worker.layers.gathered_prefill import GatheredPrefillPlan

# The most float32 scores one slice of query rows makes (256 MiB).
SCORES_BYTES_PER_SLICE = 256 << 20


def write_latents(
    latent: torch.Tensor,
    key_rope: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's ``[latent | key_rope]`` ([num_tokens, L], [num_tokens, R]) into its
    slot of the caches (``[num_blocks, 1, block_size, rows]`` each; a negative slot is a
    padding token, skipped), rounded to a float8 cache as ``ops.reshape_and_cache`` rounds
    (saturating for e4m3)."""
    rows = key_cache.shape[-1]
    packed = torch.cat((latent, key_rope), dim=-1)
    if packed.shape[-1] < 2 * rows:
        packed = torch.nn.functional.pad(packed, (0, 2 * rows - packed.shape[-1]))
    written = slot_mapping >= 0
    if not bool(written.all()):
        packed, slot_mapping = packed[written], slot_mapping[written]
    if key_cache.dtype == torch.float8_e4m3fn:
        packed = packed.clamp(-448.0, 448.0)
    packed = packed.to(key_cache.dtype)
    block_size = key_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, 0, offsets] = packed[:, :rows]
    value_cache[blocks, 0, offsets] = packed[:, rows:]


def latent_attention(
    query_latent: torch.Tensor,
    query_rope: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: GatheredPrefillPlan,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every token of the step over its sequence's cached latents
    (this step's already written): ``query_latent`` [T, heads, L] (the query with the key's
    ``kv_b_proj`` rows absorbed), ``query_rope`` [T, heads, R]; returns the probabilities'
    sums of the latents, [T, heads, L], in the query's dtype."""
    num_tokens, num_heads, latent_size = query_latent.shape
    rope_size = query_rope.shape[-1]
    num_seqs, max_query = plan.query_rows.shape
    rows = plan.query_rows.view(-1)
    q_latent = query_latent[rows].view(num_seqs, max_query, num_heads, latent_size).float()
    q_rope = query_rope[rows].view(num_seqs, max_query, num_heads, rope_size).float()
    # [S, K, 2 * rows]: a key position's latent and rotated key; padding reads block 0,
    # zeroed (a masked NaN would still poison the sums).
    cached = torch.cat(
        (
            key_cache[plan.key_blocks, 0, plan.key_offsets],
            value_cache[plan.key_blocks, 0, plan.key_offsets],
        ),
        dim=-1,
    ).float()
    cached = cached.masked_fill(~plan.key_valid[:, :, None], 0.0)
    latents = cached[..., :latent_size]
    key_rope = cached[..., latent_size : latent_size + rope_size]
    max_keys = latents.shape[1]
    rows_per_slice = max(1, SCORES_BYTES_PER_SLICE // (4 * num_seqs * num_heads * max_keys))
    summed = torch.empty(num_seqs, max_query, num_heads, latent_size, device=latents.device)
    for start in range(0, max_query, rows_per_slice):
        part = slice(start, start + rows_per_slice)
        scores = torch.einsum("sqhl,skl->shqk", q_latent[:, part], latents)
        scores += torch.einsum("sqhr,skr->shqk", q_rope[:, part], key_rope)
        scores *= scale
        scores = scores.masked_fill(~plan.mask[:, :, part], float("-inf"))
        probabilities = torch.softmax(scores, dim=-1)
        summed[:, part] = torch.einsum("shqk,skl->sqhl", probabilities, latents)
    flat = summed.reshape(num_seqs * max_query, num_heads, latent_size)
    return flat[plan.output_rows].to(query_latent.dtype)
