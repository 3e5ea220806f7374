"""A step of plain decodes kept as arrays, so that the next step over the same sequences is
built by array operations (vLLM's persistent batch): the rows of the sequences that go on
selected, positions advanced by one, a block appended where the plan gives one, and each
row's input token gathered from the tokens the step sampled, on the device.

A plain decode (``CachedRequestState.plain_decode``) computes one token and samples the
next with nothing but temperature, top-k, top-p, min-p and a seed, so a row needs only
its block table, its position and those settings; the per-request Python work of a step
is then the plan's few new blocks and the sampled tokens appended to their sequences.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.gpu_worker.layers.attention import padded_block_tables
from pagedserve.gpu_worker.sampler import SamplingBatch
from pagedserve.scheduler.messages import CachedRequestData

if TYPE_CHECKING:
    from pagedserve.gpu_worker.runner_state import CachedRequestState

_EMPTY = np.empty(0, dtype=np.int64)
_request_id = operator.attrgetter("request_id")
_num_computed = operator.attrgetter("num_computed_tokens")
_num_scheduled = operator.attrgetter("num_scheduled_tokens")


@dataclass
class DecodeBatch:
    """One step's plain decodes, a row each."""

    request_ids: list[str]
    states: list[CachedRequestState]
    row_of: dict[str, int]
    block_tables: np.ndarray  # int32 [rows, width], zero-padded
    table_lens: np.ndarray  # int64 [rows]
    positions: np.ndarray  # int64 [rows]: the position of the token each row computes
    settings: np.ndarray  # float64 [rows, 5]: CachedRequestState.sampler_row
    seeds: np.ndarray  # uint64 [rows]
    output_positions: np.ndarray  # int64 [rows]: tokens generated before this row's draw
    # The step's sampled tokens (int64 [rows], on the device), once it is launched: the
    # next step's input tokens.
    sampled: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        request_ids: list[str],
        states: list[CachedRequestState],
        positions: list[int],
        num_pending: np.ndarray,
    ) -> DecodeBatch:
        """From the sequences' states: each decodes the token at its position; each has
        ``num_pending`` (0 or 1) sampled tokens not yet in its state."""
        num_rows = len(states)
        block_tables, table_lens = padded_block_tables([s.block_ids for s in states])
        num_known = np.fromiter((len(s.token_ids) for s in states), np.int64, num_rows)
        num_prompt = np.fromiter((s.num_prompt_tokens for s in states), np.int64, num_rows)
        return cls(
            request_ids=request_ids,
            states=states,
            row_of={request_id: row for row, request_id in enumerate(request_ids)},
            block_tables=block_tables,
            table_lens=table_lens,
            positions=np.array(positions, dtype=np.int64),
            settings=np.array([s.sampler_row for s in states], dtype=np.float64).reshape(
                num_rows, 5
            ),
            seeds=np.array([s.sampling_params.seed or 0 for s in states], dtype=np.uint64),
            output_positions=num_known - num_prompt + num_pending,
        )

    def rows_for(self, cached: list[CachedRequestData]) -> np.ndarray | None:
        """Each of ``cached``'s row here, when every one is a sequence of this batch that
        computes one token, the token after this step's (the one this step samples);
        else None."""
        num_rows = len(cached)
        if not num_rows:
            return None
        ids = map(_request_id, cached)
        rows = np.fromiter(map(self.row_of.get, ids, itertools.repeat(-1)), np.int64, num_rows)
        if rows.min() < 0:
            return None
        computed = np.fromiter(map(_num_computed, cached), np.int64, num_rows)
        scheduled = np.fromiter(map(_num_scheduled, cached), np.int64, num_rows)
        if (scheduled != 1).any() or (computed != self.positions[rows] + 1).any():
            return None
        return rows

    def next(self, cached: list[CachedRequestData], rows: np.ndarray) -> DecodeBatch:
        """The batch of the step after this one over ``cached`` (``rows``: ``rows_for``),
        their new blocks added to their states."""
        num_rows = len(cached)
        positions = self.positions[rows] + 1
        block_tables = self.block_tables[rows]
        table_lens = self.table_lens[rows]
        states = [self.states[row] for row in rows.tolist()]
        for index, request in enumerate(cached):
            if request.new_block_ids:
                new = request.new_block_ids
                states[index].block_ids.extend(new)
                end = int(table_lens[index]) + len(new)
                if end > block_tables.shape[1]:
                    wider = np.zeros((num_rows, 2 * end), dtype=np.int32)
                    wider[:, : block_tables.shape[1]] = block_tables
                    block_tables = wider
                block_tables[index, end - len(new) : end] = new
                table_lens[index] = end
        request_ids = list(map(_request_id, cached))
        return DecodeBatch(
            request_ids=request_ids,
            states=states,
            row_of={request_id: row for row, request_id in enumerate(request_ids)},
            block_tables=block_tables,
            table_lens=table_lens,
            positions=positions,
            settings=self.settings[rows],
            seeds=self.seeds[rows],
            output_positions=self.output_positions[rows] + 1,
            sampled=None,
        )

    def sampling_batch(self) -> SamplingBatch:
        """The sampler's settings of the rows (plain: no penalty, ban, bias or grammar)."""
        settings = self.settings
        return SamplingBatch(
            temperatures=settings[:, 0].astype(np.float32),
            top_k=settings[:, 1].astype(np.int64),
            top_p=settings[:, 2].astype(np.float32),
            min_p=settings[:, 3].astype(np.float32),
            seeds=self.seeds,
            output_positions=self.output_positions,
            num_logprobs=settings[:, 4].astype(np.int64),
            penalty_rows=_EMPTY,
            repetition_penalties=np.empty(0, dtype=np.float32),
            presence_penalties=np.empty(0, dtype=np.float32),
            frequency_penalties=np.empty(0, dtype=np.float32),
            penalty_prompt_tokens=[],
            penalty_output_tokens=[],
            banned_rows=_EMPTY,
            banned_token_ids=[],
        )
