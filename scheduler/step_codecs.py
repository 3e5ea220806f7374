"""The codecs of what the scheduler and the workers exchange: ``StepPlan`` and
``StepResult``, and the messages nested in them (new and running requests,
``SamplingParams``, logprobs). Each is a hand-written pack / unpack pair
(``serialization.py`` says why and how)."""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Any

from pagedserve.scheduler.messages import (
    CachedRequestData,
    NewRequestData,
    PromptLogprobsChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.scheduler.wire_format import (
    WIRE_FIELDS,
    DecodeError,
    _check,
    _check_column,
    _check_pairs,
    _describe,
    _fields,
    _pack_flat,
    _pack_optional_flat,
    _unpack_flat,
    _unpack_optional_flat,
)

# ---------------------------------------------------------------- nested types

_sampling_params_fields = attrgetter(*WIRE_FIELDS[SamplingParams])
_STRUCTURED_OUTPUTS_INDEX = WIRE_FIELDS[SamplingParams].index("structured_outputs")
_LOGIT_BIAS_INDEX = WIRE_FIELDS[SamplingParams].index("logit_bias")


def _pack_sampling_params(params: SamplingParams) -> list:
    fields = list(_sampling_params_fields(params))
    if params.structured_outputs is not None:
        fields[_STRUCTURED_OUTPUTS_INDEX] = _pack_flat(params.structured_outputs)
    if params.logit_bias is not None:
        # Two parallel lists: msgpack maps here take only string keys (strict_map_key).
        fields[_LOGIT_BIAS_INDEX] = [list(params.logit_bias), list(params.logit_bias.values())]
    return fields


def _unpack_sampling_params(value: Any) -> SamplingParams:
    fields = _fields(value, "SamplingParams")
    names = WIRE_FIELDS[SamplingParams]
    _check(fields[names.index("ignore_eos")], bool, "SamplingParams.ignore_eos")
    structured = fields[_STRUCTURED_OUTPUTS_INDEX]
    if structured is not None:
        fields[_STRUCTURED_OUTPUTS_INDEX] = _unpack_flat(structured, StructuredOutputsParams)
    bias = fields[_LOGIT_BIAS_INDEX]
    if bias is not None:
        _check(bias, list, "SamplingParams.logit_bias")
        if len(bias) != 2 or len(_check(bias[0], list, "SamplingParams.logit_bias")) != len(
            _check(bias[1], list, "SamplingParams.logit_bias")
        ):
            raise DecodeError(
                "SamplingParams.logit_bias: expected [token ids, biases] of one length"
            )
        fields[_LOGIT_BIAS_INDEX] = dict(zip(bias[0], bias[1]))
    _check(fields[names.index("stop_token_ids")], list, "SamplingParams.stop_token_ids")
    # A bare string would pass the dataclass, which accepts one stop string.
    _check(fields[names.index("stop")], list, "SamplingParams.stop")
    try:
        # The dataclass validates every other field (types and ranges) itself.
        return SamplingParams(*fields)
    except (TypeError, ValueError) as error:
        raise DecodeError(f"SamplingParams: {error}") from error


def _pack_token_logprobs(entry: TokenLogprobs) -> list:
    return [entry.token_ids, entry.logprobs]


def _unpack_token_logprobs(value: Any) -> TokenLogprobs:
    token_ids, logprobs = _fields(value, "TokenLogprobs")
    _check(token_ids, list, "TokenLogprobs.token_ids")
    _check(logprobs, list, "TokenLogprobs.logprobs")
    if len(token_ids) != len(logprobs):
        raise DecodeError(f"TokenLogprobs: {len(token_ids)} token_ids but {len(logprobs)} logprobs")
    return TokenLogprobs(token_ids, logprobs)


def _pack_optional_logprobs(entries: list[TokenLogprobs] | None) -> list | None:
    if entries is None:
        return None
    return [[entry.token_ids, entry.logprobs] for entry in entries]


def _unpack_optional_logprobs(value: Any, where: str) -> list[TokenLogprobs] | None:
    if value is None:
        return None
    return [_unpack_token_logprobs(entry) for entry in _check(value, list, where)]


def _pack_prompt_logprobs_chunk(chunk: PromptLogprobsChunk) -> list:
    return [chunk.first_position, [[e.token_ids, e.logprobs] for e in chunk.entries]]


def _unpack_prompt_logprobs_chunk(value: Any) -> PromptLogprobsChunk:
    first_position, entries = _fields(value, "PromptLogprobsChunk")
    _check(first_position, int, "PromptLogprobsChunk.first_position")
    _check(entries, list, "PromptLogprobsChunk.entries")
    return PromptLogprobsChunk(first_position, [_unpack_token_logprobs(e) for e in entries])


def _pack_new_request(request: NewRequestData) -> list:
    return [
        request.request_id,
        request.token_ids,
        request.num_prompt_tokens,
        request.block_ids,
        request.num_computed_tokens,
        request.num_scheduled_tokens,
        _pack_sampling_params(request.sampling_params),
        request.eos_token_ids,
        request.lora_id,
        _pack_optional_flat(request.pooling_params),
    ]


def _unpack_new_request(value: Any) -> NewRequestData:
    fields = _fields(value, "NewRequestData")
    (
        request_id,
        token_ids,
        num_prompt_tokens,
        block_ids,
        num_computed_tokens,
        num_scheduled_tokens,
        sampling_params,
        eos_token_ids,
        lora_id,
        pooling_params,
    ) = fields
    _check(request_id, str, "NewRequestData.request_id")
    _check(lora_id, int, "NewRequestData.lora_id")
    _check(token_ids, list, "NewRequestData.token_ids")
    _check(num_prompt_tokens, int, "NewRequestData.num_prompt_tokens")
    _check(block_ids, list, "NewRequestData.block_ids")
    _check(num_computed_tokens, int, "NewRequestData.num_computed_tokens")
    _check(num_scheduled_tokens, int, "NewRequestData.num_scheduled_tokens")
    _check(eos_token_ids, list, "NewRequestData.eos_token_ids")
    return NewRequestData(
        request_id,
        token_ids,
        num_prompt_tokens,
        block_ids,
        num_computed_tokens,
        num_scheduled_tokens,
        _unpack_sampling_params(sampling_params),
        eos_token_ids,
        lora_id,
        _unpack_optional_flat(pooling_params, PoolingParams),
    )


def _pack_cached_request(request: CachedRequestData) -> list:
    return [
        request.request_id,
        request.new_block_ids,
        request.num_computed_tokens,
        request.num_scheduled_tokens,
    ]


def _unpack_cached_request(value: Any) -> CachedRequestData:
    request_id, new_block_ids, num_computed_tokens, num_scheduled_tokens = _fields(
        value, "CachedRequestData"
    )
    return CachedRequestData(
        _check(request_id, str, "CachedRequestData.request_id"),
        _check(new_block_ids, list, "CachedRequestData.new_block_ids"),
        _check(num_computed_tokens, int, "CachedRequestData.num_computed_tokens"),
        _check(num_scheduled_tokens, int, "CachedRequestData.num_scheduled_tokens"),
    )


# ---------------------------------------------------------------- scheduler <-> workers


def _pack_step_plan(plan: StepPlan) -> list:
    cached = plan.cached_requests
    return [
        plan.step_id,
        [_pack_new_request(request) for request in plan.new_requests],
        # NOTE: a Python loop per running request; four comprehensions measured faster
        # than one attrgetter pass plus a transpose.
        [
            [request.request_id for request in cached],
            [request.new_block_ids for request in cached],
            [request.num_computed_tokens for request in cached],
            [request.num_scheduled_tokens for request in cached],
        ],
        plan.finished_request_ids,
        list(chain.from_iterable(plan.swap_out)),
        list(chain.from_iterable(plan.swap_in)),
        list(chain.from_iterable(plan.copy_blocks)),
        plan.token_bitmasks,
        plan.spec_token_ids,
        [list(load) for load in plan.load_loras],
        plan.unload_lora_ids,
        plan.window_freed_blocks,
        plan.draft_guesses,
    ]


def _unpack_step_plan(value: Any) -> StepPlan:
    (
        step_id,
        new_requests,
        cached,
        finished,
        swap_out,
        swap_in,
        copies,
        bitmasks,
        drafts,
        load_loras,
        unload_lora_ids,
        window_freed,
        draft_guesses,
    ) = _fields(value, "StepPlan")
    _check(step_id, int, "StepPlan.step_id")
    _check(new_requests, list, "StepPlan.new_requests")
    _check(cached, list, "StepPlan.cached_requests")
    if len(cached) != 4:
        raise DecodeError(f"StepPlan.cached_requests: expected 4 columns, got {_describe(cached)}")
    request_ids, new_block_ids, num_computed, num_scheduled = cached
    num_cached = len(_check(request_ids, list, "StepPlan.cached_requests.request_id"))
    _check_column(request_ids, str, num_cached, "StepPlan.cached_requests.request_id")
    _check_column(new_block_ids, list, num_cached, "StepPlan.cached_requests.new_block_ids")
    _check_column(num_computed, int, num_cached, "StepPlan.cached_requests.num_computed_tokens")
    _check_column(num_scheduled, int, num_cached, "StepPlan.cached_requests.num_scheduled_tokens")
    finished = _check(finished, list, "StepPlan.finished_request_ids")
    _check_column(finished, str, len(finished), "StepPlan.finished_request_ids")
    _check(bitmasks, dict, "StepPlan.token_bitmasks")
    _check_column(list(bitmasks.values()), bytes, len(bitmasks), "StepPlan.token_bitmasks")
    _check(drafts, dict, "StepPlan.spec_token_ids")
    _check_column(list(drafts.values()), list, len(drafts), "StepPlan.spec_token_ids")
    _check_column(
        _check(load_loras, list, "StepPlan.load_loras"),
        list,
        len(load_loras),
        "StepPlan.load_loras",
    )
    for load in load_loras:
        if (
            len(load) != 3
            or not isinstance(load[0], int)
            or not all(isinstance(x, str) for x in load[1:])
        ):
            raise DecodeError(
                f"StepPlan.load_loras: expected [id, name, path], got {_describe(load)}"
            )
    unload_lora_ids = _check(unload_lora_ids, list, "StepPlan.unload_lora_ids")
    _check_column(unload_lora_ids, int, len(unload_lora_ids), "StepPlan.unload_lora_ids")
    _check(draft_guesses, bool, "StepPlan.draft_guesses")
    _check(window_freed, dict, "StepPlan.window_freed_blocks")
    _check_column(
        list(window_freed.values()), int, len(window_freed), "StepPlan.window_freed_blocks"
    )
    return StepPlan(
        step_id=step_id,
        new_requests=[_unpack_new_request(request) for request in new_requests],
        # NOTE: one dataclass __init__ per running request: most of the decode time.
        cached_requests=list(
            map(CachedRequestData, request_ids, new_block_ids, num_computed, num_scheduled)
        ),
        finished_request_ids=finished,
        swap_out=_check_pairs(swap_out, "StepPlan.swap_out"),
        swap_in=_check_pairs(swap_in, "StepPlan.swap_in"),
        copy_blocks=_check_pairs(copies, "StepPlan.copy_blocks"),
        token_bitmasks=bitmasks,
        spec_token_ids=drafts,
        load_loras=[tuple(load) for load in load_loras],
        unload_lora_ids=unload_lora_ids,
        window_freed_blocks=window_freed,
        draft_guesses=draft_guesses,
    )


def _pack_step_result(result: StepResult) -> list:
    return [
        result.step_id,
        result.request_ids,
        result.sampled_token_ids,
        [None if entry is None else [entry.token_ids, entry.logprobs] for entry in result.logprobs],
        {
            request_id: _pack_prompt_logprobs_chunk(chunk)
            for request_id, chunk in result.prompt_logprobs.items()
        },
        result.embeddings,
        result.draft_token_ids,
        result.failed_requests,
        result.launched_ahead,
    ]


def _unpack_step_result(value: Any) -> StepResult:
    (
        step_id,
        request_ids,
        sampled_token_ids,
        logprobs,
        prompt_logprobs,
        embeddings,
        drafts,
        failed,
        launched_ahead,
    ) = _fields(value, "StepResult")
    _check(step_id, int, "StepResult.step_id")
    num_requests = len(_check(request_ids, list, "StepResult.request_ids"))
    _check_column(request_ids, str, num_requests, "StepResult.request_ids")
    _check(sampled_token_ids, list, "StepResult.sampled_token_ids")
    _check(logprobs, list, "StepResult.logprobs")
    _check(prompt_logprobs, dict, "StepResult.prompt_logprobs")
    _check(embeddings, dict, "StepResult.embeddings")
    _check_column(list(embeddings.values()), bytes, len(embeddings), "StepResult.embeddings")
    _check(drafts, dict, "StepResult.draft_token_ids")
    _check_column(list(drafts.values()), list, len(drafts), "StepResult.draft_token_ids")
    _check(failed, dict, "StepResult.failed_requests")
    _check_column(list(failed.values()), str, len(failed), "StepResult.failed_requests")
    _check(launched_ahead, bool, "StepResult.launched_ahead")
    return StepResult(
        step_id=step_id,
        request_ids=request_ids,
        sampled_token_ids=sampled_token_ids,
        logprobs=[None if entry is None else _unpack_token_logprobs(entry) for entry in logprobs],
        prompt_logprobs={
            request_id: _unpack_prompt_logprobs_chunk(chunk)
            for request_id, chunk in prompt_logprobs.items()
        },
        embeddings=embeddings,
        draft_token_ids=drafts,
        failed_requests=failed,
        launched_ahead=launched_ahead,
    )
