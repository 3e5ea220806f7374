"""Turns a step plan into model inputs, runs the model, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.models.base import CausalLM
from pagedserve.gpu_worker.sampler import Sampler
from pagedserve.scheduler.messages import StepPlan, StepResult
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker keeps per request between steps, so plans carry only deltas."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class _ScheduledEntry:
    request_id: str
    state: CachedRequestState
    num_computed_tokens: int
    num_scheduled_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the last known token, so a new one is sampled."""
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.state.token_ids)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampling], rows of the hidden states to sample
    sampling_entries: list[_ScheduledEntry]


class ModelRunner:
    def __init__(self, model: CausalLM, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        entries = self._apply_plan(plan)
        if not entries:
            return StepResult(step_id=plan.step_id)
        inputs = self._prepare_inputs(entries)
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            token_ids = self._sample(logits, inputs.sampling_entries).tolist()
        request_ids = []
        for entry, token_id in zip(inputs.sampling_entries, token_ids):
            entry.state.token_ids.append(token_id)
            request_ids.append(entry.request_id)
        return StepResult(plan.step_id, request_ids, token_ids)

    def _apply_plan(self, plan: StepPlan) -> list[_ScheduledEntry]:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        entries = []
        for new in plan.new_requests:
            state = CachedRequestState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.sampling_params
            )
            self.requests[new.request_id] = state
            entries.append(
                _ScheduledEntry(
                    new.request_id, state, new.num_computed_tokens, new.num_scheduled_tokens
                )
            )
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            entries.append(
                _ScheduledEntry(
                    cached.request_id,
                    state,
                    cached.num_computed_tokens,
                    cached.num_scheduled_tokens,
                )
            )
        # Decodes first: the attention layer runs the decode kernel on that prefix.
        entries.sort(key=lambda entry: entry.num_scheduled_tokens != 1)
        return entries

    def _prepare_inputs(self, entries: list[_ScheduledEntry]) -> ModelInputs:
        block_size = self.block_size
        num_decodes = sum(1 for entry in entries if entry.num_scheduled_tokens == 1)
        input_ids: list[int] = []
        positions_parts = []
        slot_parts = []
        logits_indices = []
        sampling_entries = []
        max_blocks = max(len(entry.state.block_ids) for entry in entries)
        block_tables = np.zeros((len(entries), max_blocks), dtype=np.int32)
        seq_lens = np.empty(len(entries), dtype=np.int32)
        query_lens = np.empty(len(entries), dtype=np.int32)
        # NOTE: a loop per request (not per token); numpy does the per-token work.
        for row, entry in enumerate(entries):
            start = entry.num_computed_tokens
            end = start + entry.num_scheduled_tokens
            input_ids.extend(entry.state.token_ids[start:end])
            block_ids = np.asarray(entry.state.block_ids, dtype=np.int64)
            block_tables[row, : len(block_ids)] = block_ids
            positions = np.arange(start, end, dtype=np.int64)
            positions_parts.append(positions)
            slot_parts.append(
                block_ids[positions // block_size] * block_size + positions % block_size
            )
            seq_lens[row] = end
            query_lens[row] = entry.num_scheduled_tokens
            if entry.samples:
                logits_indices.append(len(input_ids) - 1)
                sampling_entries.append(entry)

        prefill_query_lens = query_lens[num_decodes:]
        prefill_start_loc = np.zeros(len(prefill_query_lens) + 1, dtype=np.int32)
        np.cumsum(prefill_query_lens, out=prefill_start_loc[1:])
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(device),
            num_decode_tokens=num_decodes,
            decode_block_tables=torch.from_numpy(block_tables[:num_decodes]).to(device),
            decode_seq_lens=torch.from_numpy(seq_lens[:num_decodes]).to(device),
            prefill_block_tables=torch.from_numpy(block_tables[num_decodes:]).to(device),
            prefill_query_start_loc=torch.from_numpy(prefill_start_loc).to(device),
            prefill_seq_lens=torch.from_numpy(seq_lens[num_decodes:]).to(device),
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.from_numpy(np.concatenate(positions_parts)).to(device),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            sampling_entries=sampling_entries,
        )

    def _sample(self, logits: torch.Tensor, entries: list[_ScheduledEntry]) -> torch.Tensor:
        temperatures = np.array(
            [entry.state.sampling_params.temperature for entry in entries], dtype=np.float32
        )
        seeds = np.array(
            [entry.state.sampling_params.seed or 0 for entry in entries], dtype=np.uint64
        )
        output_positions = np.array(
            [len(entry.state.token_ids) - entry.state.num_prompt_tokens for entry in entries],
            dtype=np.int64,
        )
        return self.sampler(logits, temperatures, seeds, output_positions)
