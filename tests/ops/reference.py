"""Plain-torch references for the ops of pagedserve.gpu_worker.ops.

Attention is computed in float64 from the same (possibly 16-bit) inputs the kernels read,
one sequence at a time, from K/V gathered through the block table.
"""

from __future__ import annotations

import math

import torch


def gather_sequence(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """``cache`` [num_blocks, num_kv_heads, block_size, head_size] -> the sequence's
    [seq_len, num_kv_heads, head_size]."""
    block_size = cache.shape[2]
    num_blocks = math.ceil(seq_len / block_size)
    blocks = cache[block_table_row[:num_blocks].long()]  # [n, kv_heads, block_size, head]
    return blocks.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:seq_len]


def attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention (float64) with the semantics of paged_prefill_attention.

    With ``sliding_window`` W > 0, query position i sees keys j with i - W < j <= i: HF
    transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``) and
    ``causal_mask_function`` (``kv_idx <= q_idx``) of masking_utils. With ``logits_soft_cap``
    c > 0, each logit s becomes c * tanh(s / c) before the mask (HF's Gemma 2 eager
    attention). With ``sinks`` [num_heads], each head's sink joins the softmax as a last
    column, dropped after it (HF's gpt-oss eager attention)."""
    num_tokens, num_heads, head_size = query.shape
    group = num_heads // key_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64)
    for s in range(block_tables.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len, q_len = int(seq_lens[s]), end - start
        if q_len == 0 or seq_len == 0:
            continue
        q = query[start:end].double()
        k = gather_sequence(key_cache, block_tables[s], seq_len).double()
        v = gather_sequence(value_cache, block_tables[s], seq_len).double()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap > 0:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        query_pos = torch.arange(seq_len - q_len, seq_len).view(q_len, 1)
        key_pos = torch.arange(seq_len).view(1, seq_len)
        hidden = key_pos > query_pos
        if sliding_window > 0:
            hidden |= key_pos <= query_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is None:
            weights = scores.softmax(dim=-1)
        else:
            column = sinks.double().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            weights = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, v)
    return out


def varlen_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_query: torch.Tensor,
    cu_key: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """FlashAttention-2's variable-length causal attention (float64): sequence s's queries
    ``query[cu_query[s]:cu_query[s + 1]]`` [q, num_heads, head] over its keys and values
    ``[cu_key[s]:cu_key[s + 1]]`` [k, kv_heads, head], the mask aligned at the bottom right
    (query j at position k - q + j), with ``sliding_window`` as ``attention``'s. A masked
    key's probability, 0, still multiplies its value, as the kernel's matrix product does: a
    NaN value there gives NaN."""
    num_heads = query.shape[1]
    group = num_heads // keys.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s in range(len(cu_query) - 1):
        q_start, q_end = int(cu_query[s]), int(cu_query[s + 1])
        k_start, k_end = int(cu_key[s]), int(cu_key[s + 1])
        q_len, k_len = q_end - q_start, k_end - k_start
        q = query[q_start:q_end].double()
        k = keys[k_start:k_end].double().repeat_interleave(group, dim=1)
        v = values[k_start:k_end].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        query_pos = torch.arange(k_len - q_len, k_len).view(q_len, 1)
        key_pos = torch.arange(k_len).view(1, k_len)
        hidden = key_pos > query_pos
        if sliding_window > 0:
            hidden |= key_pos <= query_pos - sliding_window
        weights = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", weights, v)
    return out


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention_decode: one query token per sequence (zeros where seq_len is 0)."""
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window,
        logits_soft_cap,
        sinks,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns copies of the caches with each non-padding token written to its slot."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, :, offset] = key[token]
        value_cache[block, :, offset] = value[token]
    return key_cache, value_cache


def copy_blocks(
    src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, block_mapping: torch.Tensor
) -> torch.Tensor:
    """Returns a copy of ``dst_kv_cache`` with each (src, dst) block copied from the source."""
    result = dst_kv_cache.clone()
    for src, dst in block_mapping.tolist():
        result[dst] = src_kv_cache[src]
    return result


# --- the torch expressions the fused elementwise ops replace (HF's modeling code) ------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, round to x's dtype, scale by the weight."""
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def rotate_half(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, head_size: int
) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` on ``[num_tokens, heads * head_size]`` rows, with
    float32 ``[max_positions, head_size // 2]`` tables cast to x's dtype first."""
    num_tokens = x.shape[0]
    c = cos[positions].to(x.dtype).unsqueeze(1)
    s = sin[positions].to(x.dtype).unsqueeze(1)
    x = x.reshape(num_tokens, -1, head_size)
    x1, x2 = x[..., : head_size // 2], x[..., head_size // 2 :]
    return torch.cat((x1 * c + (-x2) * s, x2 * c + x1 * s), dim=-1).reshape(num_tokens, -1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
