"""Turns a step plan into model inputs, runs the model, samples the next tokens."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.gpu_worker.cuda_graphs import DecodeGraphs
from pagedserve.gpu_worker.decode_batch import DecodeBatch
from pagedserve.gpu_worker.draft_model import DraftModel, DraftRow
from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.gathered_prefill import use_gathered_prefill
from pagedserve.gpu_worker.lora import LoRABatch
from pagedserve.gpu_worker.models.base import CausalLM
from pagedserve.gpu_worker.next_token_drafter import NextTokenDrafter
from pagedserve.gpu_worker.runner_state import (
    CachedRequestState,
    LaunchedStep,
    ModelInputs,
    ScheduledEntry,
)
from pagedserve.gpu_worker.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedserve.gpu_worker.step_events import StepEvent, step_event
from pagedserve.scheduler import fault_injection
from pagedserve.scheduler.messages import (
    NULL_BLOCK,
    PromptLogprobsChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams, derive_seed
from pagedserve.scheduler.step_profile import PROFILE


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        device: torch.device,
        lora_batch: LoRABatch | None = None,
        attention_chunk_size: int = 0,
        latent_attention: bool = False,
        long_rope_switch: int = 0,
        long_rope_offset: int = 0,
    ) -> None:
        """``attention_chunk_size``: the model's (``ModelConfig.attention_chunk_size``; 0:
        no chunked layers), the chunks each step's chunked view cuts at;
        ``latent_attention``: the model's (``ModelConfig.latent_attention``), whether each
        step plans its ``latent_plans``; ``long_rope_switch`` (LongRoPE's original context;
        0: none) and ``long_rope_offset`` (the rotary table's row of the long rotation at
        position 0): the tokens rotated with the long factors are given their position plus
        the offset (``rope_config.long_rope_switch``'s rule)."""
        self.model = model
        self.long_rope_switch = long_rope_switch
        self.long_rope_offset = long_rope_offset
        self.attention_chunk_size = attention_chunk_size
        self.latent_attention = latent_attention
        # Which token rows each LoRA adapter takes in a step (None: no adapters loaded).
        self.lora_batch = lora_batch
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.gathered_prefill = use_gathered_prefill(device)
        self.decode_graphs: DecodeGraphs | None = None  # set by the worker when asked
        # Speculative decoding with a draft model or the model's multi-token-prediction
        # layer: set by the worker when it has one.
        self.draft_model: DraftModel | NextTokenDrafter | None = None
        # What marks a launched step's device work (the stand-in device has its own).
        self.step_event: Callable[[], StepEvent] = lambda: step_event(device)
        # The last launched step's, when it was a step of plain decodes: the next such step
        # over the same sequences is built from it.
        self._last_decodes: DecodeBatch | None = None
        # (plan, its rows in the step in flight) as ``follows`` found them, for ``launch``.
        self._rows_found: tuple[StepPlan, np.ndarray] | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. A new request whose sampling cannot be set up is left out of the
        step and named in ``StepResult.failed_requests``; the others run."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan, in_flight: LaunchedStep | None = None) -> LaunchedStep:
        """Queue a step's forward pass and sampling on the device. With ``in_flight`` (a
        launched step not finished yet, for which ``follows`` holds) the decodes of
        tokens that step samples take them from its device tensor. A step of plain
        decodes runs from arrays (decode_batch.py), the next such step's built from its."""
        started_ns = PROFILE.now()
        decodes = self._decodes(plan, in_flight)
        if decodes is not None:
            PROFILE.lap("apply_plan", started_ns)
            step = self._launch_decodes(plan, *decodes)
        else:
            failed: dict[str, str] = {}
            entries = self._apply_plan(plan, failed)
            PROFILE.lap("apply_plan", started_ns)
            step = self._launch(plan, entries, failed)
        step.launched_ahead = in_flight is not None
        self._last_decodes = step.decode_batch
        return step

    def follows(self, plan: StepPlan, in_flight: LaunchedStep) -> bool:
        """Whether ``plan`` can be launched before ``in_flight``'s tokens reach the host: it
        only decodes plain sequences (``CachedRequestState.plain_decode``), each the token
        it sampled in ``in_flight`` or one already known, and needs nothing else of the
        host's (no new request, draft, grammar, adapter change, swap or copy)."""
        if not self._decodes_only(plan):
            return False
        batch = in_flight.decode_batch
        if batch is not None:
            rows = batch.rows_for(plan.cached_requests)
            if rows is not None:
                self._rows_found = (plan, rows)
                return True
        return self._source_rows(plan, in_flight.single_rows()) is not None

    def _decodes_only(self, plan: StepPlan) -> bool:
        """Whether the plan may be a step of plain decodes, as far as the plan and the
        model say (``_source_rows`` checks its requests)."""
        return not (
            self.draft_model is not None
            or self.long_rope_switch
            or self.lora_batch is not None
            or self.attention_chunk_size
            or self.latent_attention
            or not plan.cached_requests
            or plan.new_requests
            or plan.spec_token_ids
            or plan.token_bitmasks
            or plan.load_loras
            or plan.unload_lora_ids
            or plan.swap_in
            or plan.swap_out
            or plan.copy_blocks
            or plan.window_freed_blocks
        )

    def _source_rows(self, plan: StepPlan, rows: dict[str, int]) -> list[int] | None:
        """For a plan of plain decodes (``_decodes_only``), each one's row of the step
        before (whose sampled token it decodes; ``rows``), or -1 where that token is
        already in its state; None when a request is not a plain decode."""
        source_rows = []
        for cached in plan.cached_requests:
            state = self.requests.get(cached.request_id)
            if state is None or cached.num_scheduled_tokens != 1 or not state.plain_decode:
                return None
            num_known = len(state.token_ids)
            if cached.num_computed_tokens == num_known:
                row = rows.get(cached.request_id)
                if row is None:
                    return None
                source_rows.append(row)
            elif cached.num_computed_tokens + 1 == num_known > state.num_prompt_tokens:
                source_rows.append(-1)
            else:
                return None
        return source_rows

    def _decodes(
        self, plan: StepPlan, in_flight: LaunchedStep | None
    ) -> tuple[DecodeBatch, torch.Tensor] | None:
        """A plan of plain decodes as a ``DecodeBatch`` and its input tokens (on the
        device), its requests' states updated (finished ones dropped, new blocks added);
        None, and nothing changed, for any other plan."""
        if not self._decodes_only(plan):
            return None
        device = self.device
        last = self._last_decodes
        if last is not None and last.sampled is not None:
            # The last step's sequences going on: its arrays, rows selected.
            found, self._rows_found = self._rows_found, None
            if (
                found is not None
                and found[0] is plan
                and in_flight is not None
                and last is in_flight.decode_batch
            ):
                rows = found[1]
            else:
                rows = last.rows_for(plan.cached_requests)
            if rows is not None:
                for request_id in plan.finished_request_ids:
                    self.requests.pop(request_id, None)
                batch = last.next(plan.cached_requests, rows)
                return batch, last.sampled[torch.from_numpy(rows).to(device)]
        rows = {} if in_flight is None else in_flight.single_rows()
        source_rows = self._source_rows(plan, rows)
        if source_rows is None:
            return None
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        request_ids = [cached.request_id for cached in plan.cached_requests]
        states = [self.requests[request_id] for request_id in request_ids]
        for cached, state in zip(plan.cached_requests, states):
            state.block_ids.extend(cached.new_block_ids)
        pending = np.array(source_rows, dtype=np.int64) >= 0
        batch = DecodeBatch.build(
            request_ids,
            states,
            [cached.num_computed_tokens for cached in plan.cached_requests],
            pending.astype(np.int64),
        )
        input_ids = torch.tensor(
            [0 if row >= 0 else state.token_ids[-1] for row, state in zip(source_rows, states)],
            dtype=torch.int64,
            device=device,
        )
        if pending.any():
            assert in_flight is not None and in_flight.sampled is not None
            at = torch.from_numpy(np.flatnonzero(pending)).to(device)
            source = torch.tensor([row for row in source_rows if row >= 0], device=device)
            input_ids[at] = in_flight.sampled.token_ids.to(device)[source]
        return batch, input_ids

    def _launch_decodes(
        self, plan: StepPlan, batch: DecodeBatch, input_ids: torch.Tensor
    ) -> LaunchedStep:
        step = LaunchedStep(plan, {}, [], self.step_event(), decode_batch=batch)
        started_ns = PROFILE.now()
        width = int(batch.table_lens.max())
        metadata, positions = AttentionMetadata.for_decodes(
            batch.block_tables[:, :width], batch.positions, self.block_size, self.device
        )
        started_ns = PROFILE.lap("prepare_inputs", started_ns)
        with torch.inference_mode():
            hidden = None
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.run(input_ids, positions, metadata)
            if hidden is None:
                hidden = self.model(input_ids, positions, metadata)
            started_ns = PROFILE.lap("forward", started_ns)
            logits = self.model.compute_logits(hidden[: len(batch.request_ids)])
            step.sampled = self.sampler(logits, batch.sampling_batch())
        batch.sampled = step.sampled.token_ids
        step.event = self.step_event()
        PROFILE.lap("sample", started_ns)
        return step

    def _launch(
        self, plan: StepPlan, entries: list[ScheduledEntry], failed: dict[str, str]
    ) -> LaunchedStep:
        step = LaunchedStep(plan, failed, entries, self.step_event())
        if not entries:
            return step
        started_ns = PROFILE.now()
        step.samples = [entry.samples for entry in entries]
        inputs = self._prepare_inputs(entries)
        step.inputs = inputs
        if self.lora_batch is not None:
            self.lora_batch.groups = self._lora_groups(entries)
        started_ns = PROFILE.lap("prepare_inputs", started_ns)
        with torch.inference_mode():
            hidden = None
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
            if hidden is None:
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
            step.hidden = hidden
            started_ns = PROFILE.lap("forward", started_ns)
            for entry, rows in inputs.pooling_entries:
                if entry.samples:
                    step.embeddings[entry.request_id] = _pooled(self.model, hidden[rows], entry)
                else:  # a per-token request's chunk: its rows wait for the last
                    entry.state.pooled_rows.append(hidden[rows].clone())
            step.prompt_logprobs = {
                entry.request_id: self._prompt_logprobs(hidden, entry, first_row)
                for entry, first_row in inputs.prompt_logprob_entries
            }
            if inputs.sampling_entries:
                logits = self.model.compute_logits(hidden[inputs.logits_indices])
                if not all(state.plain_sampling for state in inputs.sampling_states):
                    # NOTE: the sampler's extras (penalties, bans, grammars, beams) run on
                    # the host: this copy waits for the forward pass.
                    logits = logits.cpu()
                step.sampled = self.sampler(
                    logits,
                    self._sampling_batch(
                        inputs.sampling_entries,
                        inputs.sampling_states,
                        inputs.sample_seeds,
                        plan.token_bitmasks,
                    ),
                )
        step.event = self.step_event()
        PROFILE.lap("sample", started_ns)
        return step

    def finish(self, step: LaunchedStep) -> StepResult:
        """The launched step's result, once its device work is done; its sampled tokens
        join their sequences. Steps finish in the order they were launched."""
        started_ns = PROFILE.now()
        step.event.synchronize()
        started_ns = PROFILE.lap("device_wait", started_ns)
        plan, inputs, sampled = step.plan, step.inputs, step.sampled
        if step.decode_batch is not None:
            assert sampled is not None
            batch = step.decode_batch
            token_ids = sampled.token_ids.tolist()
            for state, token_id in zip(batch.states, token_ids):
                state.token_ids.append(token_id)
            result = StepResult(
                plan.step_id,
                list(batch.request_ids),
                token_ids,
                logprobs=_token_logprobs(sampled, batch.states),
            )
        elif inputs is None:
            result = StepResult(step_id=plan.step_id)
        elif sampled is None:
            # Prefill chunks that sample nothing still score their prompt positions.
            result = StepResult(
                plan.step_id,
                prompt_logprobs=step.prompt_logprobs,
                embeddings=step.embeddings,
                draft_token_ids=self._draft(
                    step.entries, step.samples, plan.draft_guesses, step.hidden
                ),
            )
        else:
            token_ids = sampled.token_ids.tolist()
            rows = _emitted_rows(inputs.sampling_entries, token_ids)
            logprobs = _token_logprobs(sampled, inputs.sampling_states)
            result = StepResult(
                plan.step_id,
                [inputs.sampling_entries[row].request_id for row in rows],
                [token_ids[row] for row in rows],
                logprobs=[logprobs[row] for row in rows] if logprobs else [],
                prompt_logprobs=step.prompt_logprobs,
                embeddings=step.embeddings,
                draft_token_ids=self._draft(
                    step.entries, step.samples, plan.draft_guesses, step.hidden
                ),
            )
        result.failed_requests = step.failed
        result.launched_ahead = step.launched_ahead
        PROFILE.lap("result_build", started_ns)
        return result

    def _draft(
        self,
        entries: list[ScheduledEntry],
        samples: list[bool],
        guesses: bool,
        hidden: torch.Tensor,
    ) -> dict[str, list[int]]:
        """The draft model's pass over what the target kept of this step, and, when the
        plan wants ``guesses``, its guesses for the sequences that sampled and may
        speculate (``draft_model.py``); none without a draft model. Runs after the sampled
        tokens joined the states. A pooling request's prompt runs through it too: its
        blocks may serve a later prompt's prefix."""
        if self.draft_model is None:
            return {}
        rows = []
        hidden_row = 0  # the entry's first row in the step's hidden states
        for entry, samples_now in zip(entries, samples):
            state = entry.state
            params = state.sampling_params
            sampled = samples_now and state.pooling_params is None
            rows.append(
                DraftRow(
                    entry.request_id,
                    state.token_ids,
                    state.block_ids,
                    entry.num_computed_tokens,
                    # A sampled token's K/V is computed by the next step (rejected drafts'
                    # by none: the sampled token replaced the first).
                    len(state.token_ids) - 1
                    if sampled
                    else entry.num_computed_tokens + entry.num_scheduled_tokens,
                    guesses
                    and sampled
                    and params.num_sequences == 1
                    and not params.use_beam_search,
                    hidden_row,
                )
            )
            hidden_row += entry.num_scheduled_tokens  # its drafts' rows included
        return self.draft_model.propose(rows, hidden)

    def _apply_plan(self, plan: StepPlan, failed: dict[str, str]) -> list[ScheduledEntry]:
        """The step's entries; new requests that cannot join the batch go to ``failed``."""
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        entries = []
        for new in plan.new_requests:
            why = _sampling_setup_error(new.sampling_params)
            if why is not None:
                failed[new.request_id] = why
                continue
            state = CachedRequestState(
                list(new.token_ids),
                new.num_prompt_tokens,
                list(new.block_ids),
                new.sampling_params,
                list(new.eos_token_ids),
                new.lora_id,
                new.pooling_params,
            )
            self.requests[new.request_id] = state
            entries.append(
                ScheduledEntry(
                    new.request_id,
                    state,
                    new.num_computed_tokens,
                    new.num_scheduled_tokens,
                    plan.spec_token_ids.get(new.request_id, []),
                )
            )
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            entries.append(
                ScheduledEntry(
                    cached.request_id,
                    state,
                    cached.num_computed_tokens,
                    cached.num_scheduled_tokens,
                    plan.spec_token_ids.get(cached.request_id, []),
                )
            )
        for request_id, num_freed in plan.window_freed_blocks.items():
            # Blocks behind the sliding window, back in the pool: no op reads them again.
            self.requests[request_id].block_ids[:num_freed] = [NULL_BLOCK] * num_freed
        # Decodes first: the attention layer runs the decode kernel on that prefix.
        entries.sort(key=lambda entry: entry.num_scheduled_tokens != 1)
        return entries

    def _prepare_inputs(self, entries: list[ScheduledEntry]) -> ModelInputs:
        input_ids: list[int] = []
        logits_indices = []
        sampling_entries = []
        sampling_states = []
        sample_seeds: list[int | None] = []
        prompt_logprob_entries = []
        pooling_entries = []
        for entry in entries:
            start = entry.num_computed_tokens
            state = entry.state
            token_ids = state.token_ids
            if (
                entry.num_scheduled_tokens == 1
                and start + 1 == len(token_ids) > state.num_prompt_tokens
                and not entry.spec_token_ids
                and state.pooling_params is None
            ):
                # The common case, a decode past its first output token: one input, one
                # sample, no prompt positions to score (the general path below agrees).
                input_ids.append(token_ids[start])
                logits_indices.append(len(input_ids) - 1)
                sampling_entries.append(entry)
                sampling_states.append(state)
                sample_seeds.append(None)
                continue
            end = start + entry.num_scheduled_tokens
            if entry.prompt_logprob_positions:
                prompt_logprob_entries.append((entry, len(input_ids)))
            input_ids.extend(entry.state.token_ids[start:end])
            if entry.spec_token_ids:
                input_ids.extend(entry.spec_token_ids)
            if entry.spec_token_ids:
                # A row per position: the last known token's, then each draft's.
                num_rows = len(entry.spec_token_ids) + 1
                logits_indices.extend(range(len(input_ids) - num_rows, len(input_ids)))
                sampling_entries.extend([entry] * num_rows)
                sampling_states.extend(entry.draft_states())
                sample_seeds.extend([None] * num_rows)
            elif entry.state.pooling_params is not None and (
                entry.samples or entry.state.pooling_params.per_token
            ):
                # This step's rows of the prompt (all of it for MEAN and CLS pooling; a
                # per-token request's every chunk, kept until its last).
                pooling_entries.append(
                    (entry, slice(len(input_ids) - entry.num_scheduled_tokens, len(input_ids)))
                )
            elif entry.samples:
                num_samples = entry.state.num_samples
                logits_indices.extend([len(input_ids) - 1] * num_samples)
                sampling_entries.extend([entry] * num_samples)
                sampling_states.extend([entry.state] * num_samples)
                if num_samples == 1:
                    sample_seeds.append(None)
                else:
                    seed = entry.state.sampling_params.seed
                    sample_seeds.extend(
                        None if seed is None else derive_seed(seed, index)
                        for index in range(num_samples)
                    )

        device = self.device
        metadata, positions = AttentionMetadata.for_sequences(
            [
                (entry.state.block_ids, entry.num_computed_tokens, entry.num_scheduled_tokens)
                for entry in entries
            ],
            self.block_size,
            device,
            self.gathered_prefill,
            self.attention_chunk_size,
            self.latent_attention,
        )
        if self.long_rope_switch:
            positions = positions + self._long_rope_rows(entries, device)
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions,
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            sampling_entries=sampling_entries,
            sampling_states=sampling_states,
            sample_seeds=sample_seeds,
            prompt_logprob_entries=prompt_logprob_entries,
            pooling_entries=pooling_entries,
        )

    def _long_rope_rows(self, entries: list[ScheduledEntry], device: torch.device) -> torch.Tensor:
        """Each input token's offset into the rotary table: ``long_rope_offset`` for the
        tokens of a sequence longer than LongRoPE's original context (rotated with the long
        factors throughout: the scheduler has it computed again from its first token when
        it grows past, as HF's Phi-3 does), else 0."""
        offsets = [
            self.long_rope_offset if len(entry.state.token_ids) > self.long_rope_switch else 0
            for entry in entries
        ]
        counts = [entry.num_scheduled_tokens for entry in entries]
        return torch.tensor(np.repeat(offsets, counts), dtype=torch.int64, device=device)

    def _lora_groups(self, entries: list[ScheduledEntry]) -> list[tuple[int, torch.Tensor | None]]:
        """Each adapter's token rows in this step's inputs (entries in input order)."""
        rows: dict[int, list[int]] = {}
        start = 0
        for entry in entries:
            end = start + entry.num_scheduled_tokens
            if entry.state.lora_id:
                rows.setdefault(entry.state.lora_id, []).extend(range(start, end))
            start = end
        if len(rows) == 1 and len(next(iter(rows.values()))) == start:
            return [(next(iter(rows)), None)]  # one adapter has every token: no indexing
        return [
            (lora_id, torch.tensor(token_rows, dtype=torch.int64, device=self.device))
            for lora_id, token_rows in rows.items()
        ]

    def _sampling_batch(
        self,
        entries: list[ScheduledEntry],
        states: list[CachedRequestState],
        sample_seeds: list[int | None],
        token_bitmasks: dict[str, bytes],
    ) -> SamplingBatch:
        # Every row of an entry drawing several samples starts from the same grammar state.
        grammar_rows = (
            [row for row, entry in enumerate(entries) if entry.request_id in token_bitmasks]
            if token_bitmasks
            else []
        )
        params = [state.sampling_params for state in states]
        seeds = [(p.seed or 0) if seed is None else seed for p, seed in zip(params, sample_seeds)]
        # float64 holds each setting exactly (top_k and num_logprobs are small integers).
        settings = np.array([state.sampler_row for state in states], dtype=np.float64).reshape(
            len(states), 5
        )
        num_known = np.array([len(state.token_ids) for state in states], dtype=np.int64)
        num_prompt = np.array([state.num_prompt_tokens for state in states], dtype=np.int64)
        penalized: list[int] = []
        biased: list[int] = []
        restricted: list[int] = []
        banned: list[int] = []
        beams: list[int] = []
        banned_token_ids: list[np.ndarray] = []
        if not all(state.plain_sampling for state in states):
            penalized = [row for row, p in enumerate(params) if p.has_penalties]
            biased = [row for row, p in enumerate(params) if p.logit_bias]
            restricted = [row for row, p in enumerate(params) if p.allowed_token_ids]
            banned_token_ids = [_banned_token_ids(state) for state in states]
            banned = [row for row, token_ids in enumerate(banned_token_ids) if token_ids.size]
            beams = [row for row, p in enumerate(params) if p.use_beam_search]
        return SamplingBatch(
            temperatures=settings[:, 0].astype(np.float32),
            top_k=settings[:, 1].astype(np.int64),
            top_p=settings[:, 2].astype(np.float32),
            min_p=settings[:, 3].astype(np.float32),
            seeds=np.array(seeds, dtype=np.uint64),
            output_positions=num_known - num_prompt,
            num_logprobs=settings[:, 4].astype(np.int64),
            penalty_rows=np.array(penalized, dtype=np.int64),
            repetition_penalties=np.array(
                [params[r].repetition_penalty for r in penalized], dtype=np.float32
            ),
            presence_penalties=np.array(
                [params[r].presence_penalty for r in penalized], dtype=np.float32
            ),
            frequency_penalties=np.array(
                [params[r].frequency_penalty for r in penalized], dtype=np.float32
            ),
            penalty_prompt_tokens=[
                np.array(states[r].token_ids[: states[r].num_prompt_tokens], dtype=np.int64)
                for r in penalized
            ],
            penalty_output_tokens=[
                np.array(states[r].token_ids[states[r].num_prompt_tokens :], dtype=np.int64)
                for r in penalized
            ],
            banned_rows=np.array(banned, dtype=np.int64),
            banned_token_ids=[banned_token_ids[r] for r in banned],
            bias_rows=np.array(biased, dtype=np.int64),
            bias_token_ids=[np.fromiter(params[r].logit_bias, dtype=np.int64) for r in biased],
            bias_values=[
                np.fromiter(params[r].logit_bias.values(), dtype=np.float32) for r in biased
            ],
            beam_rows=np.array(beams, dtype=np.int64),
            allowed_rows=np.array(restricted, dtype=np.int64),
            allowed_token_ids=[
                np.array(params[r].allowed_token_ids, dtype=np.int64) for r in restricted
            ],
            grammar_rows=np.array(grammar_rows, dtype=np.int64),
            allowed_token_bits=np.frombuffer(
                b"".join(_row_bitmasks(entries, grammar_rows, token_bitmasks)),
                dtype=np.uint8,
            ).reshape(len(grammar_rows), -1)
            if grammar_rows
            else np.empty((0, 0), dtype=np.uint8),
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, entry: ScheduledEntry, first_row: int
    ) -> PromptLogprobsChunk:
        positions = entry.prompt_logprob_positions
        rows = slice(
            first_row + positions.start - entry.num_computed_tokens,
            first_row + positions.stop - entry.num_computed_tokens,
        )
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]).cpu(), dim=-1)
        targets = torch.tensor(
            entry.state.token_ids[positions.start + 1 : positions.stop + 1], dtype=torch.int64
        )
        chosen = logprobs.gather(1, targets[:, None])
        top_k = entry.state.sampling_params.prompt_logprobs
        top_values, top_ids = logprobs.topk(top_k, dim=-1)
        ids = torch.cat((targets[:, None], top_ids), dim=1).tolist()
        values = torch.cat((chosen, top_values), dim=1).tolist()
        return PromptLogprobsChunk(
            first_position=positions.start + 1,
            entries=[TokenLogprobs(i, v) for i, v in zip(ids, values)],
        )


def _pooled(model: CausalLM, hidden_rows: torch.Tensor, entry: ScheduledEntry) -> bytes:
    """One vector from the final-norm hidden states of the prompt tokens this step computed
    (``hidden_rows``, its last token's last), as little-endian float32 bytes. An embedding:
    the last token's state, the mean of all (MEAN) or the first (CLS), cut to
    ``dimensions``, then L2-normalized (the order of vLLM and OpenAI's Matryoshka
    embeddings). A classification: the classifier head's logits at the last token, through
    a softmax over the labels (a sigmoid for one label, as vLLM's classifier pooler does)
    unless ``use_activation`` is off."""
    params = entry.state.pooling_params
    if params.per_token:
        return _pooled_rows(model, torch.cat([*entry.state.pooled_rows, hidden_rows]), params)
    if params.pooling_type != "LAST" and entry.num_computed_tokens != 0:
        # The engine runs such a model without chunks or prefix-cache hits.
        raise RuntimeError(
            f"{entry.request_id}: {params.pooling_type} pooling needs the whole prompt in one "
            f"step, but {entry.num_computed_tokens} tokens were computed before"
        )
    hidden_row = hidden_rows[-1]
    if params.task == "classify":
        logits = model.classify(hidden_row[None, :])[0]
        if params.use_activation:
            logits = torch.sigmoid(logits) if logits.numel() == 1 else logits.softmax(dim=0)
        return logits.cpu().numpy().astype("<f4").tobytes()
    if params.pooling_type == "MEAN":
        vector = hidden_rows.float().mean(dim=0)
    elif params.pooling_type == "CLS":
        vector = hidden_rows[0].float()
    else:
        vector = hidden_row.float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
    # NOTE: a device-to-host copy per pooled request (one vector of hidden_size floats).
    return vector.cpu().numpy().astype("<f4").tobytes()


def _pooled_rows(model: CausalLM, hidden_rows: torch.Tensor, params: PoolingParams) -> bytes:
    """A per-token task's matrix, a row per prompt token (``hidden_rows``: every prompt
    token's final-norm hidden state), as little-endian float32 bytes row after row: each
    row cut to ``dimensions`` and L2-normalized ("token_embed"), or the classifier head's
    logits through its activation ("token_classify")."""
    if params.base_task == "classify":
        rows = model.classify(hidden_rows)
        if params.use_activation:
            rows = torch.sigmoid(rows) if rows.shape[1] == 1 else rows.softmax(dim=1)
    else:
        rows = hidden_rows.float()
        if params.dimensions is not None:
            rows = rows[:, : params.dimensions]
        if params.normalize:
            rows = torch.nn.functional.normalize(rows, p=2.0, dim=1)
    # NOTE: a device-to-host copy of prompt tokens x values per request.
    return rows.cpu().numpy().astype("<f4").tobytes()


_NO_TOKENS = np.empty(0, dtype=np.int64)


def _sampling_setup_error(params: SamplingParams) -> str | None:
    """Why a request's sampling settings cannot join a batch's arrays (the conversions
    ``_sampling_batch`` makes, done once for this request alone), or None. The frontend's
    checks keep every value inside them; this keeps a value that slipped through from
    failing the whole batch."""
    try:
        fault_injection.check("sampling_setup", params.seed)
        np.array(
            [
                params.temperature,
                params.top_p,
                params.min_p,
                params.repetition_penalty,
                params.presence_penalty,
                params.frequency_penalty,
                *(params.logit_bias or {}).values(),
            ],
            dtype=np.float32,
        )
        np.array(
            [
                params.top_k,
                *params.stop_token_ids,
                *(params.logit_bias or ()),
                *(params.allowed_token_ids or ()),
            ],
            dtype=np.int64,
        )
        np.array([params.seed or 0], dtype=np.uint64)
    except Exception as error:
        return f"its sampling settings cannot be set up: {type(error).__name__}: {error}"
    return None


def _banned_token_ids(state: CachedRequestState) -> np.ndarray:
    """Tokens a sequence may not pick now: before min_tokens its stop tokens and EOS; and
    the last token of each bad word whose other tokens end its output."""
    params = state.sampling_params
    short = state.num_output_tokens < params.min_tokens
    if not short and not params.bad_words_token_ids:
        return _NO_TOKENS
    banned: set[int] = set()
    if short:
        banned.update(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(state.eos_token_ids)
    token_ids, num_output_tokens = state.token_ids, state.num_output_tokens
    for word in params.bad_words_token_ids or ():
        before = len(word) - 1  # the tokens that must end the output already
        if before <= num_output_tokens and token_ids[len(token_ids) - before :] == word[:-1]:
            banned.add(word[-1])
    return np.array(sorted(banned), dtype=np.int64) if banned else _NO_TOKENS


def _row_bitmasks(
    entries: list[ScheduledEntry], rows: list[int], token_bitmasks: dict[str, bytes]
) -> list[bytes]:
    """Each grammar row's allowed-token mask: its entry's (every sample of a request that
    draws several starts from the same state), or for a speculating entry the mask of
    that row's position (StepPlan.token_bitmasks holds one per position)."""
    masks = []
    for row in rows:
        entry = entries[row]
        mask = token_bitmasks[entry.request_id]
        if entry.spec_token_ids:
            first_row = row
            while first_row > 0 and entries[first_row - 1] is entry:
                first_row -= 1
            size = len(mask) // (len(entry.spec_token_ids) + 1)
            position = row - first_row
            mask = mask[position * size : (position + 1) * size]
        masks.append(mask)
    return masks


def _emitted_rows(entries: list[ScheduledEntry], token_ids: list[int]) -> list[int]:
    """The rows whose tokens the step emits, and each sequence's tokens appended: every
    row of a request drawing several samples (the first continues this sequence); of a
    speculating entry's rows, those whose sampled token agreed with the draft at that
    position, then the first that did not (or the one after the last draft)."""
    rows = []
    row = 0
    while row < len(entries):
        entry = entries[row]
        drafts = entry.spec_token_ids
        if drafts:
            for position in range(len(drafts) + 1):
                rows.append(row + position)
                entry.state.token_ids.append(token_ids[row + position])
                if position == len(drafts) or token_ids[row + position] != drafts[position]:
                    break
            row += len(drafts) + 1
            continue
        entry.state.token_ids.append(token_ids[row])
        rows.append(row)
        row += 1
        while row < len(entries) and entries[row] is entry:
            rows.append(row)
            row += 1
    return rows


def _token_logprobs(
    sampled: SamplerOutput, states: list[CachedRequestState]
) -> list[TokenLogprobs | None]:
    if sampled.logprobs is None:
        return []
    ids = sampled.logprob_token_ids.tolist()
    values = sampled.logprobs.tolist()
    result: list[TokenLogprobs | None] = []
    for row, state in enumerate(states):
        k = state.num_logprobs
        result.append(None if k < 0 else TokenLogprobs(ids[row][: k + 1], values[row][: k + 1]))
    return result
