"""Paged attention over the KV cache for a batch mixing decode and prefill tokens."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.gathered_prefill import (
    GatheredPrefillPlan,
    PrefillPlan,
    plan_gathered_prefill,
    plan_prefill,
    prefill_attention,
)


@dataclass
class AttentionMetadata:
    """Where each token of the step reads and writes the cache.

    Tokens are laid out decode requests first (one token each), then prefill requests
    (a chunk each)::

        tokens:  d0 d1 d2 | p0 p0 p0 p0 | p1 p1
                 decodes  | prefill 0   | prefill 1
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]; slot = block_id * block_size + offset
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [num_decodes], tokens in cache incl. the new one
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    prefill_query_start_loc: torch.Tensor  # int32 [num_prefills + 1], offsets within prefill
    prefill_seq_lens: torch.Tensor  # int32 [num_prefills], tokens in cache incl. new ones
    prefill_max_query_len: int | None = None  # most new tokens of one prefill (host-side)
    # Set: prefills run as one torch attention call over gathered K/V (gathered_prefill.py).
    prefill_plan: PrefillPlan | None = None

    # The same step seen by layers of chunked attention (``attention_chunk_size``): each
    # sequence cut where its chunks begin, one virtual sequence per chunk it has new tokens in,
    # whose block table starts at the chunk's first block. Same tokens in the same order (the
    # slot mapping is shared); None when the model has no such layer.
    chunked: AttentionMetadata | None = None
    # The step's decodes, then its prefills, each as one padded batch over K/V gathered out
    # of the blocks (latent_attention.py's MLA): (first token, end token, plan) each, apart
    # so a decode is not padded to a prefill's queries; None when the model has no such layer.
    latent_plans: list[tuple[int, int, GatheredPrefillPlan]] | None = None

    @classmethod
    def for_sequences(
        cls,
        sequences: list[tuple[list[int], int, int]],
        block_size: int,
        device: torch.device,
        gathered_prefill: bool,
        attention_chunk_size: int = 0,
        latent_attention: bool = False,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """The metadata of a batch of ``sequences``, each ``(block_ids, first position,
        new tokens)``, the one-token ones first, and the new tokens' positions (int64, on
        ``device``); ``gathered_prefill``: plan the prefills' torch path
        (``use_gathered_prefill``); ``attention_chunk_size`` > 0 (a multiple of
        ``block_size``): also the ``chunked`` view of the step; ``latent_attention``: also
        the ``latent_plans`` of its decodes and its prefills."""
        num_decodes = sum(1 for _, _, num_tokens in sequences if num_tokens == 1)
        block_tables, seq_lens, query_lens, positions, slots = _step_arrays(sequences, block_size)
        # NOTE: on a GPU, eight small host-to-device copies (the GPU is idle here: the previous
        # pass ended in a synchronization); one pinned staging buffer would batch them.
        metadata = cls._from_host(
            torch.from_numpy(slots).to(device),
            num_decodes,
            block_tables,
            seq_lens,
            query_lens,
            block_size,
            device,
            gathered_prefill,
        )
        if latent_attention:
            metadata.latent_plans = []
            if num_decodes:
                first = slice(0, num_decodes)
                plan = plan_gathered_prefill(
                    block_tables[first], query_lens[first], seq_lens[first], block_size, device
                )
                metadata.latent_plans.append((0, num_decodes, plan))
            if num_decodes < len(sequences):
                plan = (
                    metadata.prefill_plan.padded
                    if metadata.prefill_plan is not None
                    else plan_gathered_prefill(
                        block_tables[num_decodes:],
                        query_lens[num_decodes:],
                        seq_lens[num_decodes:],
                        block_size,
                        device,
                    )
                )
                metadata.latent_plans.append((num_decodes, int(query_lens.sum()), plan))
        if attention_chunk_size:
            metadata.chunked = cls._chunked(
                metadata.slot_mapping,
                num_decodes,
                block_tables,
                seq_lens,
                query_lens,
                attention_chunk_size,
                block_size,
                device,
                gathered_prefill,
            )
        return metadata, torch.from_numpy(positions).to(device)

    @classmethod
    def for_decodes(
        cls,
        block_tables: np.ndarray,
        positions: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """``for_sequences`` of one-token sequences given as arrays (gpu_worker/decode_batch.py):
        each row's block table (int32, zero-padded) and the position of its token (int64)."""
        num_rows = len(positions)
        rows = np.arange(num_rows)
        slots = block_tables[rows, positions // block_size].astype(np.int64) * block_size
        slots += positions % block_size
        metadata = cls._from_host(
            torch.from_numpy(slots).to(device),
            num_rows,
            block_tables,
            (positions + 1).astype(np.int32),
            np.ones(num_rows, dtype=np.int32),
            block_size,
            device,
            gathered_prefill=False,  # no prefill
        )
        return metadata, torch.from_numpy(positions).to(device)

    @classmethod
    def _from_host(
        cls,
        slot_mapping: torch.Tensor,
        num_decodes: int,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_lens: np.ndarray,
        block_size: int,
        device: torch.device,
        gathered_prefill: bool,
    ) -> AttentionMetadata:
        """The metadata of sequences given by host-side arrays, the first ``num_decodes``
        of them one token each."""
        prefill_query_lens = query_lens[num_decodes:]
        prefill_start_loc = np.zeros(len(prefill_query_lens) + 1, dtype=np.int32)
        np.cumsum(prefill_query_lens, out=prefill_start_loc[1:])
        return cls(
            slot_mapping=slot_mapping,
            num_decode_tokens=num_decodes,
            decode_block_tables=torch.from_numpy(block_tables[:num_decodes]).to(device),
            decode_seq_lens=torch.from_numpy(seq_lens[:num_decodes]).to(device),
            prefill_block_tables=torch.from_numpy(block_tables[num_decodes:]).to(device),
            prefill_query_start_loc=torch.from_numpy(prefill_start_loc).to(device),
            prefill_seq_lens=torch.from_numpy(seq_lens[num_decodes:]).to(device),
            prefill_max_query_len=int(prefill_query_lens.max()) if len(prefill_query_lens) else 0,
            prefill_plan=plan_prefill(
                block_tables[num_decodes:],
                prefill_query_lens,
                seq_lens[num_decodes:],
                block_size,
                device,
            )
            if gathered_prefill and len(prefill_query_lens)
            else None,
        )

    @classmethod
    def _chunked(
        cls,
        slot_mapping: torch.Tensor,
        num_decodes: int,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_lens: np.ndarray,
        chunk_size: int,
        block_size: int,
        device: torch.device,
        gathered_prefill: bool,
    ) -> AttentionMetadata:
        """Chunked attention as plain causal attention over virtual sequences: a token at
        position ``p`` sees positions ``c * chunk_size`` to ``p``, ``c = p // chunk_size``
        (HF's chunked mask). A sequence whose new tokens span chunks ``c0 .. c1`` becomes one
        virtual sequence per chunk: that chunk's new tokens as its queries, the chunk's
        tokens up to the last of them as its context, its block table from block
        ``c * chunk_size / block_size`` on. Tokens keep their order, so the slot mapping and
        the output rows are the step's own."""
        if chunk_size % block_size:
            raise ValueError(
                f"attention_chunk_size={chunk_size} must be a multiple of block_size={block_size}"
            )
        blocks_per_chunk = chunk_size // block_size
        tables, virtual_seq_lens, virtual_query_lens = [], [], []
        # NOTE: a loop per (sequence, chunk); a prefill of n tokens spans n / chunk_size + 2
        # chunks at most.
        for row in range(len(seq_lens)):
            end = int(seq_lens[row])
            start = end - int(query_lens[row])
            for chunk in range(start // chunk_size, (end - 1) // chunk_size + 1):
                chunk_start = chunk * chunk_size
                queries_end = min(end, chunk_start + chunk_size)
                tables.append(block_tables[row, chunk * blocks_per_chunk :])
                virtual_seq_lens.append(queries_end - chunk_start)
                virtual_query_lens.append(queries_end - max(start, chunk_start))
        width = max(1, max(len(table) for table in tables))
        virtual_tables = np.zeros((len(tables), width), dtype=np.int32)
        for row, table in enumerate(tables):
            virtual_tables[row, : len(table)] = table
        # A decode's one token makes one virtual sequence: the first num_decodes rows.
        return cls._from_host(
            slot_mapping,
            num_decodes,
            virtual_tables,
            np.asarray(virtual_seq_lens, dtype=np.int32),
            np.asarray(virtual_query_lens, dtype=np.int32),
            block_size,
            device,
            gathered_prefill,
        )


class PagedAttention:
    """Writes the step's K/V into their slots, then attends over each request's blocks
    (all of them, or with ``sliding_window`` > 0 the last ``sliding_window`` positions up to
    each token's own, as HF's sliding-window layers), with each logit ``s`` soft-capped to
    ``c * tanh(s / c)`` when ``logits_soft_cap`` ``c`` > 0 (Gemma 2), and each query head's
    sink logit joining its softmax when ``sinks`` (float32 [num_heads], this rank's heads)
    is set (gpt-oss; the model sets it to its parameter, which loading fills in place).
    With ``attention_chunk_size`` > 0 each token attends only within its chunk of that many
    positions (Llama 4's chunked layers), through the step's ``chunked`` view."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int = 0,
        logits_soft_cap: float = 0.0,
        attention_chunk_size: int = 0,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window  # tokens; 0: full attention
        self.logits_soft_cap = logits_soft_cap  # 0.0: off
        self.attention_chunk_size = attention_chunk_size  # tokens; 0: no chunks
        self.sinks: torch.Tensor | None = None

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``query`` [num_tokens, num_heads * head_size], ``key``/``value`` [num_tokens,
        num_kv_heads * head_size]; returns [num_tokens, num_heads * head_size]."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        ops.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        if self.attention_chunk_size:
            if metadata.chunked is None:
                raise ValueError(
                    "a layer of chunked attention needs the step's chunked view "
                    "(AttentionMetadata.for_sequences with attention_chunk_size)"
                )
            metadata = metadata.chunked

        output = torch.empty_like(query, memory_format=torch.contiguous_format)
        num_decode = metadata.num_decode_tokens
        if num_decode:
            ops.paged_attention_decode(
                query[:num_decode],
                key_cache,
                value_cache,
                metadata.decode_block_tables,
                metadata.decode_seq_lens,
                self.scale,
                out=output[:num_decode],
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                sinks=self.sinks,
            )
        if num_decode < num_tokens and metadata.prefill_plan is not None:
            prefill_attention(
                query[num_decode:],
                key_cache,
                value_cache,
                metadata.prefill_plan,
                self.scale,
                out=output[num_decode:],
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                sinks=self.sinks,
            )
        elif num_decode < num_tokens:
            ops.paged_prefill_attention(
                query[num_decode:],
                key_cache,
                value_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_seq_lens,
                self.scale,
                out=output[num_decode:],
                max_query_len=metadata.prefill_max_query_len,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                sinks=self.sinks,
            )
        return output.view(num_tokens, self.num_heads * self.head_size)


def padded_block_tables(tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Block tables as one int32 array, a row each, zero-padded to the longest; and each
    table's length (int64). One pass over the ids, no loop per row."""
    table_lens = np.fromiter(map(len, tables), np.int64, len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int64, int(table_lens.sum()))
    block_tables = np.zeros((len(tables), int(table_lens.max())), dtype=np.int32)
    block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = flat
    return block_tables, table_lens


def _step_arrays(
    sequences: list[tuple[list[int], int, int]], block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The host arrays of a step's sequences (``for_sequences``): block tables (int32, one
    row each, zero-padded), sequence and query lengths (int32), and each new token's
    position and slot (int64). Array operations over the whole batch: a step of a few
    hundred sequences costs tens of microseconds, not a loop's milliseconds."""
    num_sequences = len(sequences)
    block_tables, _ = padded_block_tables([s[0] for s in sequences])
    starts = np.fromiter((s[1] for s in sequences), np.int64, num_sequences)
    query_lens = np.fromiter((s[2] for s in sequences), np.int64, num_sequences)
    # Each new token's sequence, and its offset among that sequence's new tokens.
    rows = np.repeat(np.arange(num_sequences), query_lens)
    first_token = np.cumsum(query_lens) - query_lens
    positions = starts[rows] + np.arange(len(rows)) - first_token[rows]
    slots = block_tables[rows, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    seq_lens = (starts + query_lens).astype(np.int32)
    return block_tables, seq_lens, query_lens.astype(np.int32), positions, slots
