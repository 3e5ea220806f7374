"""Prefill attention through torch's fused kernels over K/V gathered out of the paged cache.

The paged prefill kernels (csrc/) read the blocks in place but run on CUDA cores (and on
the CPU's vector units). On a GPU, torch's fused attention kernels use tensor cores; the
price is a copy of each prefilling sequence's K/V out of its blocks, which is linear in the
context while attention is quadratic in it. All the step's sequences go in one call, in one
of two layouts, both made from one ``PrefillPlan`` on first use:

- packed (``PackedPrefillPlan``): the sequences' keys back to back, [keys, kv_heads, head],
  for FlashAttention-2's variable-length kernel with cumulative lengths: no padding, no mask,
  grouped query heads read as they are. Its causal mask is aligned at the bottom right, so
  query j of a sequence with ``context`` cached tokens before this step sees positions up to
  context + j, as chunked prefill needs. float16 and bfloat16 layers without soft-capping or
  sinks, on CUDA.
- padded (``GatheredPrefillPlan``): one SDPA call over the sequences padded to the longest,
  with a boolean mask: what the packed path does not take (float32, soft-capping, sinks).

Which path a worker takes is ``PAGEDSERVE_PREFILL_ATTENTION`` (read when the model runner
starts, and by each step's plan): ``auto`` (the default: packed where torch has flash
attention on CUDA, else padded; the kernel on the CPU), ``kernel``, ``sdpa`` (padded) or
``varlen`` (packed; refused where torch has no flash attention). The choice is an
environment variable, as vLLM's attention backend is, because it is a property of the
deployment's hardware, not of a request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.scheduler.messages import NULL_BLOCK

PREFILL_ATTENTION_ENV = "PAGEDSERVE_PREFILL_ATTENTION"
PREFILL_ATTENTION_CHOICES = ("auto", "kernel", "sdpa", "varlen")
# What FlashAttention-2's kernels take.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_SIZE = 256


def flash_varlen_available() -> bool:
    """Whether this torch runs FlashAttention-2's variable-length kernel on the CUDA device:
    built with it, and an Ampere or newer GPU (compute capability 8.0)."""
    return (
        torch.cuda.is_available()
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability() >= (8, 0)
    )


def use_gathered_prefill(device: torch.device) -> bool:
    """Whether a worker on ``device`` prefills with this module (see the module docstring).
    Raises ``ValueError`` for an unknown choice, or ``varlen`` where it cannot run."""
    choice = os.environ.get(PREFILL_ATTENTION_ENV, "auto")
    if choice not in PREFILL_ATTENTION_CHOICES:
        raise ValueError(
            f"{PREFILL_ATTENTION_ENV}={choice!r} is not one of {list(PREFILL_ATTENTION_CHOICES)}"
        )
    if choice == "varlen" and not (device.type == "cuda" and flash_varlen_available()):
        raise ValueError(
            f"{PREFILL_ATTENTION_ENV}=varlen needs torch's flash attention on a CUDA device "
            f"(torch {torch.__version__}, device {device}); choose auto, sdpa or kernel"
        )
    if choice == "auto":
        return device.type == "cuda"
    return choice in ("sdpa", "varlen")


@dataclass
class GatheredPrefillPlan:
    """Where one step's prefilling sequences sit in a padded batch; shared by every layer.

    S sequences, padded to Q query rows and K key positions each::

        query_rows [S, Q]   the prefill query token of each padded row (0 for padding)
        key_blocks [S, K]   the cache block of each key position
        key_offsets [S, K]  its offset in the block
        key_valid  [S, K]   position < the sequence's length (padding reads block 0, zeroed)
        mask       [S, 1, Q, K]  causal: query row j of a sequence with `context` cached
                            tokens before this step sits at position context + j
        output_rows [T]     for each of the T prefill tokens, its row in the flattened [S * Q]
        query_positions [S, Q]  context + j, from which window_mask makes windowed masks
        query_valid [S, Q]  j < the sequence's query length (the rest is padding)
    """

    query_rows: torch.Tensor
    key_blocks: torch.Tensor
    key_offsets: torch.Tensor
    key_valid: torch.Tensor
    mask: torch.Tensor
    output_rows: torch.Tensor
    query_positions: torch.Tensor
    query_valid: torch.Tensor
    # Masks of sliding-window layers, made by the first layer of each window and shared by the
    # rest of the step's layers.
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, sliding_window: int) -> torch.Tensor:
        """The causal mask for ``sliding_window`` (tokens; 0: full attention): key position
        ``k`` is visible to query position ``i`` when ``i - sliding_window < k <= i``.

        NOTE: a windowed layer still gathers and masks every key position of the step's
        sequences (the plan is shared with full-attention layers); gathering only the windows
        would need a plan per window."""
        if sliding_window <= 0:
            return self.mask
        mask = self._window_masks.get(sliding_window)
        if mask is None:
            max_keys = self.mask.shape[-1]
            key_positions = torch.arange(max_keys, dtype=torch.int64, device=self.mask.device)
            recent = key_positions > (self.query_positions[:, :, None] - sliding_window)
            # Padding rows keep their causal keys: a row with no visible key would be NaN.
            recent |= ~self.query_valid[:, :, None]
            mask = self.mask & recent[:, None]
            self._window_masks[sliding_window] = mask
        return mask


def plan_gathered_prefill(
    block_tables: np.ndarray,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    device: torch.device,
) -> GatheredPrefillPlan:
    """The plan for prefilling sequences with host-side ``block_tables`` [S, max_blocks],
    ``query_lens`` [S] (new tokens) and ``seq_lens`` [S] (cached tokens incl. the new)."""
    num_seqs = len(query_lens)
    max_query = int(query_lens.max())
    max_keys = int(seq_lens.max())
    query_starts = np.concatenate(([0], np.cumsum(query_lens)[:-1])).astype(np.int64)
    rows = np.arange(max_query, dtype=np.int64)
    query_valid = rows[None, :] < query_lens[:, None]
    query_rows = np.where(query_valid, query_starts[:, None] + rows[None, :], 0)
    positions = np.arange(max_keys, dtype=np.int64)
    block_index = np.minimum(positions // block_size, block_tables.shape[1] - 1)
    blocks = np.take_along_axis(
        block_tables.astype(np.int64), np.broadcast_to(block_index, (num_seqs, max_keys)), axis=1
    )
    # Positions in blocks freed behind a sliding window lie outside every window: they are
    # masked like padding (block 0, then zeroed) rather than read from a reused block.
    key_valid = (positions[None, :] < seq_lens[:, None]) & (blocks != NULL_BLOCK)
    key_blocks = np.where(key_valid, blocks, 0)
    query_positions = (seq_lens - query_lens)[:, None] + rows[None, :]  # [S, Q]
    output_rows = (np.arange(num_seqs, dtype=np.int64)[:, None] * max_query + rows[None, :])[
        query_valid
    ]
    # The [S, K] offsets and the [S, 1, Q, K] mask are made where they are used, from
    # vectors: only the [S, Q] and [S, K] tables cross from the host.
    device_positions = torch.arange(max_keys, dtype=torch.int64, device=device)
    device_query_positions = torch.from_numpy(query_positions).to(device)
    return GatheredPrefillPlan(
        query_rows=torch.from_numpy(query_rows).to(device),
        key_blocks=torch.from_numpy(key_blocks).to(device),
        key_offsets=(device_positions % block_size).expand(num_seqs, max_keys),
        key_valid=torch.from_numpy(key_valid).to(device),
        mask=(device_positions <= device_query_positions[:, :, None])[:, None],
        output_rows=torch.from_numpy(output_rows).to(device),
        query_positions=device_query_positions,
        query_valid=torch.from_numpy(query_valid).to(device),
    )


@dataclass
class PackedPrefillPlan:
    """The step's prefilling sequences that have new tokens, N of them, back to back; K key
    positions in all::

        key_blocks [K]     int64, the cache block of each key position
        key_offsets [K]    int64, its offset in the block
        key_freed [K]      bool, positions in blocks freed behind a sliding window (read as
                           block 0, then zeroed: flash multiplies a masked key's probability,
                           0, by its value, and 0 * NaN is NaN); None when there are none
        cu_query [N + 1]   int32, where each sequence's queries start among the prefill tokens
        cu_key [N + 1]     int32, where its keys start among the K
        max_query, max_key the longest of each (host ints)
    """

    key_blocks: torch.Tensor
    key_offsets: torch.Tensor
    key_freed: torch.Tensor | None
    cu_query: torch.Tensor
    cu_key: torch.Tensor
    max_query: int
    max_key: int


def plan_packed_prefill(
    block_tables: np.ndarray,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    device: torch.device,
) -> PackedPrefillPlan:
    """The packed plan of sequences given as ``plan_gathered_prefill``'s are."""
    keep = query_lens > 0
    tables = block_tables[keep].astype(np.int64)
    key_lens = seq_lens[keep].astype(np.int64)
    new_lens = query_lens[keep].astype(np.int64)
    total = int(key_lens.sum())
    owner = np.repeat(np.arange(len(key_lens)), key_lens)
    starts = np.cumsum(key_lens) - key_lens
    positions = np.arange(total, dtype=np.int64) - np.repeat(starts, key_lens)
    blocks = tables[owner, positions // block_size]
    freed = blocks == NULL_BLOCK
    cu_query = np.zeros(len(new_lens) + 1, dtype=np.int32)
    np.cumsum(new_lens, out=cu_query[1:])
    cu_key = np.zeros(len(key_lens) + 1, dtype=np.int32)
    np.cumsum(key_lens, out=cu_key[1:])
    return PackedPrefillPlan(
        key_blocks=torch.from_numpy(np.where(freed, 0, blocks)).to(device),
        key_offsets=torch.from_numpy(positions % block_size).to(device),
        key_freed=torch.from_numpy(freed).to(device) if freed.any() else None,
        cu_query=torch.from_numpy(cu_query).to(device),
        cu_key=torch.from_numpy(cu_key).to(device),
        max_query=int(new_lens.max(initial=0)),
        max_key=int(key_lens.max(initial=0)),
    )


class PrefillPlan:
    """One step's prefilling sequences for this module: the host arrays, and each layout's
    device tensors, made when a layer first asks for them and shared by the step's other
    layers. ``flash``: layers the packed path takes run there (``plan_prefill``)."""

    def __init__(
        self,
        block_tables: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_size: int,
        device: torch.device,
        flash: bool,
    ) -> None:
        self._arrays = (block_tables, query_lens, seq_lens, block_size, device)
        self.flash = flash

    @cached_property
    def padded(self) -> GatheredPrefillPlan:
        return plan_gathered_prefill(*self._arrays)

    @cached_property
    def packed(self) -> PackedPrefillPlan:
        return plan_packed_prefill(*self._arrays)


def plan_prefill(
    block_tables: np.ndarray,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    device: torch.device,
) -> PrefillPlan:
    """The plan of prefilling sequences with host-side ``block_tables`` [S, max_blocks],
    ``query_lens`` [S] (new tokens) and ``seq_lens`` [S] (cached tokens incl. the new); the
    packed path is used where the environment's choice and torch allow it."""
    choice = os.environ.get(PREFILL_ATTENTION_ENV, "auto")
    flash = device.type == "cuda" and choice in ("auto", "varlen") and flash_varlen_available()
    return PrefillPlan(block_tables, query_lens, seq_lens, block_size, device, flash)


def flash_takes(query: torch.Tensor, logits_soft_cap: float, sinks: torch.Tensor | None) -> bool:
    """Whether the packed path's flash kernel computes this layer's attention."""
    head_size = query.shape[-1]
    return (
        query.dtype in FLASH_DTYPES
        and head_size % 8 == 0
        and head_size <= FLASH_MAX_HEAD_SIZE
        and logits_soft_cap <= 0
        and sinks is None
    )


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the prefill tokens as ``gathered_prefill_attention``'s, through the
    packed path where the plan and the layer allow it, else the padded one."""
    if plan.flash and flash_takes(query, logits_soft_cap, sinks):
        return packed_prefill_attention(
            query, key_cache, value_cache, plan.packed, scale, out, sliding_window
        )
    return gathered_prefill_attention(
        query, key_cache, value_cache, plan.padded, scale, out, sliding_window,
        logits_soft_cap, sinks,
    )  # fmt: skip


def packed_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: PackedPrefillPlan,
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
) -> torch.Tensor:
    """``gathered_prefill_attention`` without soft-capping or sinks, as one call of flash
    attention's variable-length kernel over the packed K/V (``PackedPrefillPlan``)."""

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [K, kv_heads, head_size]: the two indexed dims first, then the slices. A float8
        # cache's rows widen to the query's dtype.
        rows = cache[plan.key_blocks, :, plan.key_offsets, :].to(query.dtype)
        if plan.key_freed is not None:
            rows = rows.masked_fill(plan.key_freed[:, None, None], 0)
        return rows

    attended = flash_varlen(
        query.contiguous(), gather(key_cache), gather(value_cache), plan, scale, sliding_window
    )
    out.copy_(attended)
    return out


def flash_varlen(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: PackedPrefillPlan,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """FlashAttention-2's variable-length forward (torch's own build of it, CUDA only):
    [T, num_heads, head] queries over [K, kv_heads, head] keys and values, causal at the
    bottom right of each sequence; with ``sliding_window`` > 0 key position ``k`` is visible to
    query position ``i`` when ``i - sliding_window < k <= i``."""
    window = {}
    if sliding_window > 0:
        window = {"window_size_left": sliding_window - 1, "window_size_right": 0}
    return torch.ops.aten._flash_attention_forward(
        query, keys, values, plan.cu_query, plan.cu_key, plan.max_query, plan.max_key,
        0.0, True, False, scale=scale, **window,
    )[0]  # fmt: skip


def gathered_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: GatheredPrefillPlan,
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the prefill tokens ``query`` [T, num_heads, head_size] over their
    sequences' cached K/V (``[num_blocks, num_kv_heads, block_size, head_size]``, this step's
    already written), into ``out`` [T, num_heads, head_size]. With ``sliding_window`` > 0
    each token attends only to the last ``sliding_window`` positions up to its own; with
    ``logits_soft_cap`` ``c`` > 0 each logit ``s`` becomes ``c * tanh(s / c)`` first; with
    ``sinks`` (float32 [num_heads]) each head's sink logit joins its softmax (csrc/ops.h)."""
    num_kv_heads, head_size = key_cache.shape[1], key_cache.shape[3]
    num_heads = query.shape[1]
    num_seqs, max_query = plan.query_rows.shape
    padded_query = query[plan.query_rows.view(-1)].view(num_seqs, max_query, num_heads, head_size)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # Two index tensors around a slice: the indexed dims come first, [S, K, kv_heads, D];
        # only the sequences' rows are copied, never the pool.
        # A float8 cache's rows widen to the query's dtype (exactly: e5m2 and e4m3 fit float16
        # and bfloat16 alike).
        rows = cache[plan.key_blocks, :, plan.key_offsets, :].to(query.dtype)
        # Padding reads block 0, whatever it holds: a fused kernel adds the mask as a bias,
        # and NaN + -inf is NaN, so padding must hold finite values.
        rows = rows.masked_fill(~plan.key_valid[:, :, None, None], 0)
        # Each query head's kv head repeated: SDPA's enable_gqa has no fused kernel that also
        # takes a mask (it would fall back to the unfused math path).
        rows = rows.transpose(1, 2)
        group = num_heads // num_kv_heads
        return rows if group == 1 else rows.repeat_interleave(group, dim=1)

    query_rows, keys, values = padded_query.transpose(1, 2), gather(key_cache), gather(value_cache)
    mask = plan.window_mask(sliding_window)
    # attended: [S, num_heads, Q, head_size]
    if logits_soft_cap > 0 or sinks is not None:
        attended = _eager_attention(query_rows, keys, values, mask, scale, logits_soft_cap, sinks)
    else:
        attended = F.scaled_dot_product_attention(
            query_rows, keys, values, attn_mask=mask, scale=scale
        )
    flat = attended.transpose(1, 2).reshape(num_seqs * max_query, num_heads, head_size)
    out.copy_(flat[plan.output_rows])
    return out


def _eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with soft-capped logits (``cap`` > 0) or sinks, which torch's SDPA lacks.
    In float32 this is HF's eager arithmetic: Gemma 2's (``q k^T * scale``, ``/ cap``, tanh,
    ``* cap``, the mask, softmax, ``@ v``) and gpt-oss's (each head's sink logit a last column
    of the scores, the softmax, the column dropped); 16-bit inputs are computed in float32
    too, as the paged kernels (and SDPA's fused kernels) do, and rounded once at the end.
    Shapes as SDPA's.

    NOTE: materializes the float32 [S, num_heads, Q, K] scores, as SDPA's unfused math path
    does; the paged prefill kernel (``PAGEDSERVE_PREFILL_ATTENTION=kernel``) reads the cache
    in place."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if cap > 0:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), value.float()).to(query.dtype)
    sink_column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probabilities = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probabilities, value.float()).to(query.dtype)
