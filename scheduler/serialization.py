"""Explicit msgpack encoding of every message that crosses a process boundary.

A frame is one msgpack array: a type tag, then the message's fields in a fixed order::

    [tag, field_0, field_1, ...]

Nested messages (a ``NewRequestData`` inside a ``StepPlan``, ``SamplingParams`` inside
it) are encoded the same way minus the tag: their position says what they are. Each type
has a hand-written pack / unpack pair; there is no pickle, no reflection over arbitrary
objects, and nothing but the types in ``MESSAGE_TAGS`` can be encoded.

Encoding choices, and why:

- ``StepPlan.cached_requests`` is sent column-wise (ids, new block ids, computed counts,
  scheduled counts as four parallel arrays): at hundreds of running requests that packs
  and unpacks faster than one small array per request, and rebuilding the dataclasses is
  a single ``map``.
- ``OutputBatch.deltas`` likewise: eleven columns (one per ``RequestOutputDelta`` field),
  the logprob columns decoded entry by entry only when a request asked for them.
- Swap pairs are sent flat, ``[src0, dst0, src1, dst1, ...]``, and decoded with ``zip``:
  they come back as ``tuple[int, int]`` (msgpack itself has no tuple).
- Floats are msgpack float64, so they round-trip exactly.

What the decoder checks: the tag, the number of fields of every (nested) message, the
type of every scalar field and of every per-request column, and ``SamplingParams``'s own
validation. It does not check each element of token-id, block-id or logprob lists (that
would cost a Python-level pass per token); those only have to be lists. The checks guard
against a peer built from another version, a truncated frame or a frame from the wrong
socket, not against a hostile peer: every process of an engine is trusted. An
``AddRequest`` that fails them after its id was read raises a ``DecodeError`` that names
the request, so the scheduler refuses it alone (a field the frontend's checks let through
is that request's problem, not the server's).

Tags are part of the wire format: never renumber or reuse one.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from operator import attrgetter
from types import MappingProxyType
from typing import Any, TypeVar

import msgpack

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import (
    AbortRequest,
    AddRequest,
    EngineError,
    EngineStats,
    GetStats,
    LoadLoRA,
    OutputBatch,
    Progress,
    Ready,
    ResetPrefixCache,
    Shutdown,
    StartEngine,
    StartStructuredOutput,
    StartWorker,
    StopSample,
    UnloadLoRA,
    WorkerSpec,
)
from pagedserve.scheduler.messages import (
    CachedRequestData,
    NewRequestData,
    PromptLogprobsChunk,
    RequestOutputDelta,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.scheduler.structured_output import GrammarVocabulary

Message = (
    StepPlan
    | StepResult
    | RequestOutputDelta
    | AddRequest
    | AbortRequest
    | StopSample
    | EngineError
    | Shutdown
    | Ready
    | OutputBatch
    | Progress
    | GetStats
    | EngineStats
    | ResetPrefixCache
    | LoadLoRA
    | UnloadLoRA
    | StartEngine
    | StartStructuredOutput
    | StartWorker
    | WorkerSpec
    | SchedulerConfig
    | NewRequestData
    | CachedRequestData
    | TokenLogprobs
    | PromptLogprobsChunk
    | SamplingParams
    | StructuredOutputsParams
    | GrammarVocabulary
    | PoolingParams
)
MessageT = TypeVar("MessageT")


class DecodeError(ValueError):
    """A frame that is not a well-formed message: bad msgpack, unknown tag, wrong number
    or type of fields. The message names the message type and the field.

    ``request_id``: set when the frame is an ``AddRequest`` whose id could be read, so a
    receiver can refuse that one request instead of failing as a whole."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


# The fields each type puts on the wire, in wire order. A test checks that these match
# the dataclasses' fields, so adding a field to a message without encoding it fails.
WIRE_FIELDS: dict[type, tuple[str, ...]] = {
    TokenLogprobs: ("token_ids", "logprobs"),
    PromptLogprobsChunk: ("first_position", "entries"),
    SamplingParams: (
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "ignore_eos",
        "stop_token_ids",
        "logprobs",
        "prompt_logprobs",
        "n",
        "best_of",
        "beam_width",
        "length_penalty",
        "early_stopping",
        "structured_outputs",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "bad_words_token_ids",
        "stop",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "detokenize",
    ),
    StructuredOutputsParams: (
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "disable_any_whitespace",
    ),
    GrammarVocabulary: (
        "tokenizer_json",
        "vocab_size",
        "eos_token_ids",
        "think_start_token_id",
        "think_end_token_ids",
        "think_lead_token_ids",
    ),
    NewRequestData: (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "block_ids",
        "num_computed_tokens",
        "num_scheduled_tokens",
        "sampling_params",
        "eos_token_ids",
        "lora_id",
        "pooling_params",
    ),
    PoolingParams: ("normalize", "dimensions", "task", "use_activation", "pooling_type"),
    CachedRequestData: (
        "request_id",
        "new_block_ids",
        "num_computed_tokens",
        "num_scheduled_tokens",
    ),
    StepPlan: (
        "step_id",
        "new_requests",
        "cached_requests",
        "finished_request_ids",
        "swap_out",
        "swap_in",
        "copy_blocks",
        "token_bitmasks",
        "spec_token_ids",
        "load_loras",
        "unload_lora_ids",
        "window_freed_blocks",
        "draft_guesses",
    ),
    StepResult: (
        "step_id",
        "request_ids",
        "sampled_token_ids",
        "logprobs",
        "prompt_logprobs",
        "embeddings",
        "draft_token_ids",
        "failed_requests",
    ),
    RequestOutputDelta: (
        "request_id",
        "new_token_ids",
        "finished",
        "finish_reason",
        "logprobs",
        "prompt_logprobs",
        "num_cached_tokens",
        "index",
        "cumulative_logprob",
        "embedding",
        "queue_time_s",
    ),
    AddRequest: (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "arrival_time_s",
        "eos_token_ids",
        "cache_namespace",
        "lora_id",
        "priority",
        "pooling_params",
    ),
    AbortRequest: ("request_id",),
    StopSample: ("request_id", "index"),
    EngineError: ("request_id", "message", "code"),
    Shutdown: (),
    Ready: ("component", "pid", "info"),
    OutputBatch: ("deltas",),
    Progress: ("waiting_on", "waiting_s"),
    GetStats: (),
    EngineStats: ("stats", "integrity_error"),
    ResetPrefixCache: (),
    LoadLoRA: ("lora_id", "name", "path"),
    UnloadLoRA: ("lora_id",),
    SchedulerConfig: (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "enable_chunked_prefill",
        "watermark_fraction",
        "preemption_mode",
        "allocation_policy",
        "num_speculative_tokens",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "speculative_method",
        "speculative_disable_by_batch_size",
        "scheduling_policy",
        "max_loras",
        "sliding_window",
        "model_task",
        "long_rope_switch",
    ),
    WorkerSpec: (
        "model_path",
        "dtype",
        "block_size",
        "num_blocks",
        "kv_cache_bytes",
        "device",
        "swap_space_bytes",
        "cuda_graph_max_batch",
        "cuda_graph_max_len",
        "lora_modules",
        "enable_lora",
        "quantization",
        "kv_cache_dtype",
        "speculative_model",
        "num_speculative_tokens",
        "speculative_method",
    ),
    StartEngine: (
        "frontend_pid",
        "input_endpoint",
        "output_endpoint",
        "ipc_dir",
        "scheduler_config",
        "seed",
        "enable_prefix_caching",
        "world_size",
        "worker",
    ),
    StartStructuredOutput: ("grammar_vocabulary", "disable_any_whitespace"),
    StartWorker: (
        "rank",
        "world_size",
        "scheduler_pid",
        "broadcast",
        "result_endpoint",
        "worker",
        "distributed_init_method",
    ),
}


# ---------------------------------------------------------------- decode-side checks


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _fields(value: object, type_name: str) -> list:
    """``value`` as the field array of ``type_name``, or a ``DecodeError``."""
    count = _FIELD_COUNTS[type_name]
    if type(value) is not list or len(value) != count:
        raise DecodeError(
            f"{type_name}: expected an array of {count} fields, got {_describe(value)}"
        )
    return value


def _check(value: Any, expected: type | tuple[type, ...], where: str) -> Any:
    # ``type() is``, not ``isinstance``: bool is an int subclass, and a bool where a count
    # belongs is a malformed frame.
    if type(value) is expected or (type(expected) is tuple and type(value) in expected):
        return value
    names = (
        expected.__name__
        if type(expected) is type
        else " or ".join("None" if t is type(None) else t.__name__ for t in expected)
    )
    raise DecodeError(f"{where}: expected {names}, got {_describe(value)}")


def _check_column(column: Any, element_type: type, length: int, where: str) -> list:
    """A per-request column: a list of ``length`` values, all of ``element_type``."""
    _check(column, list, where)
    if len(column) != length:
        raise DecodeError(f"{where}: expected {length} entries, got {len(column)}")
    # NOTE: one C-level pass over the column (``map(type, ...)``), not a Python loop.
    found = set(map(type, column))
    if found and found != {element_type}:
        wrong = sorted(t.__name__ for t in found if t is not element_type)
        raise DecodeError(f"{where}: expected only {element_type.__name__}, found {wrong}")
    return column


def _check_column_of(column: Any, element_types: tuple[type, ...], length: int, where: str) -> list:
    """``_check_column`` for a column whose elements may be of several types."""
    _check(column, list, where)
    if len(column) != length:
        raise DecodeError(f"{where}: expected {length} entries, got {len(column)}")
    wrong = set(map(type, column)).difference(element_types)
    if wrong:
        raise DecodeError(f"{where}: unexpected {sorted(t.__name__ for t in wrong)}")
    return column


def _check_pairs(flat: Any, where: str) -> list[tuple[int, int]]:
    _check(flat, list, where)
    if len(flat) % 2:
        raise DecodeError(f"{where}: expected (src, dst) pairs, got {len(flat)} numbers")
    _check_column(flat, int, len(flat), where)
    return list(zip(flat[0::2], flat[1::2]))


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
    )


# ---------------------------------------------------------------- scheduler <-> frontend


def _pack_request_output_delta(delta: RequestOutputDelta) -> list:
    return [
        delta.request_id,
        delta.new_token_ids,
        delta.finished,
        delta.finish_reason,
        _pack_optional_logprobs(delta.logprobs),
        _pack_optional_logprobs(delta.prompt_logprobs),
        delta.num_cached_tokens,
        delta.index,
        delta.cumulative_logprob,
        delta.embedding,
        delta.queue_time_s,
    ]


def _unpack_request_output_delta(value: Any) -> RequestOutputDelta:
    (
        request_id,
        new_token_ids,
        finished,
        finish_reason,
        logprobs,
        prompt_logprobs,
        num_cached_tokens,
        index,
        cumulative_logprob,
        embedding,
        queue_time_s,
    ) = _fields(value, "RequestOutputDelta")
    return RequestOutputDelta(
        request_id=_check(request_id, str, "RequestOutputDelta.request_id"),
        new_token_ids=_check(new_token_ids, list, "RequestOutputDelta.new_token_ids"),
        finished=_check(finished, bool, "RequestOutputDelta.finished"),
        finish_reason=_check(finish_reason, (str, type(None)), "RequestOutputDelta.finish_reason"),
        logprobs=_unpack_optional_logprobs(logprobs, "RequestOutputDelta.logprobs"),
        prompt_logprobs=_unpack_optional_logprobs(
            prompt_logprobs, "RequestOutputDelta.prompt_logprobs"
        ),
        num_cached_tokens=_check(
            num_cached_tokens, (int, type(None)), "RequestOutputDelta.num_cached_tokens"
        ),
        index=_check(index, int, "RequestOutputDelta.index"),
        cumulative_logprob=_check(
            cumulative_logprob, (float, type(None)), "RequestOutputDelta.cumulative_logprob"
        ),
        embedding=_check(embedding, (bytes, type(None)), "RequestOutputDelta.embedding"),
        queue_time_s=_check(queue_time_s, (float, type(None)), "RequestOutputDelta.queue_time_s"),
    )


def _pack_add_request(request: AddRequest) -> list:
    return [
        request.request_id,
        request.prompt_token_ids,
        _pack_sampling_params(request.sampling_params),
        # An int arrival time (a test's 0) would otherwise arrive as an int.
        float(request.arrival_time_s),
        # A frozenset or a tuple from the caller travels as the list msgpack knows.
        list(request.eos_token_ids),
        request.cache_namespace,
        request.lora_id,
        request.priority,
        _pack_optional_flat(request.pooling_params),
    ]


def _unpack_add_request(value: Any) -> AddRequest:
    (
        request_id,
        prompt_token_ids,
        sampling_params,
        arrival_time_s,
        eos_token_ids,
        cache_namespace,
        lora_id,
        priority,
        pooling_params,
    ) = _fields(value, "AddRequest")
    _check(request_id, str, "AddRequest.request_id")
    try:
        # A few ids: checked one by one, unlike the prompt's tokens.
        _check(eos_token_ids, list, "AddRequest.eos_token_ids")
        _check_column(eos_token_ids, int, len(eos_token_ids), "AddRequest.eos_token_ids")
        return AddRequest(
            request_id=request_id,
            prompt_token_ids=_check(prompt_token_ids, list, "AddRequest.prompt_token_ids"),
            sampling_params=_unpack_sampling_params(sampling_params),
            arrival_time_s=_check(arrival_time_s, float, "AddRequest.arrival_time_s"),
            eos_token_ids=eos_token_ids,
            cache_namespace=_check(
                cache_namespace, (str, type(None)), "AddRequest.cache_namespace"
            ),
            lora_id=_check(lora_id, int, "AddRequest.lora_id"),
            priority=_check(priority, int, "AddRequest.priority"),
            pooling_params=_unpack_optional_flat(pooling_params, PoolingParams),
        )
    except Exception as error:
        # Decoding changes no state, so whatever a field's value made fail (a check, or a
        # dataclass's own validation tripping over an unexpected type) ends only this
        # request: the receiver can name it.
        message = str(error) if isinstance(error, DecodeError) else f"AddRequest: {error!r}"
        raise DecodeError(message, request_id=request_id) from error


def _unpack_abort_request(value: Any) -> AbortRequest:
    (request_id,) = _fields(value, "AbortRequest")
    return AbortRequest(_check(request_id, str, "AbortRequest.request_id"))


def _unpack_engine_error(value: Any) -> EngineError:
    request_id, message, code = _fields(value, "EngineError")
    return EngineError(
        request_id=_check(request_id, (str, type(None)), "EngineError.request_id"),
        message=_check(message, str, "EngineError.message"),
        code=_check(code, str, "EngineError.code"),
    )


def _unpack_shutdown(value: Any) -> Shutdown:
    _fields(value, "Shutdown")
    return Shutdown()


def _unpack_ready(value: Any) -> Ready:
    component, pid, info = _fields(value, "Ready")
    return Ready(
        component=_check(component, str, "Ready.component"),
        pid=_check(pid, int, "Ready.pid"),
        info=_check(info, dict, "Ready.info"),
    )


def _pack_output_batch(batch: OutputBatch) -> list:
    deltas = batch.deltas
    # NOTE: a Python loop per request and column, as for a plan's running requests.
    return [
        [
            [delta.request_id for delta in deltas],
            [delta.new_token_ids for delta in deltas],
            [delta.finished for delta in deltas],
            [delta.finish_reason for delta in deltas],
            [_pack_optional_logprobs(delta.logprobs) for delta in deltas],
            [_pack_optional_logprobs(delta.prompt_logprobs) for delta in deltas],
            [delta.num_cached_tokens for delta in deltas],
            [delta.index for delta in deltas],
            [delta.cumulative_logprob for delta in deltas],
            [delta.embedding for delta in deltas],
            [delta.queue_time_s for delta in deltas],
        ]
    ]


def _unpack_output_batch(value: Any) -> OutputBatch:
    (columns,) = _fields(value, "OutputBatch")
    num_columns = len(WIRE_FIELDS[RequestOutputDelta])
    if type(columns) is not list or len(columns) != num_columns:
        raise DecodeError(
            f"OutputBatch.deltas: expected {num_columns} columns, got {_describe(columns)}"
        )
    (
        request_ids,
        new_token_ids,
        finished,
        finish_reasons,
        logprobs,
        prompt_logprobs,
        num_cached_tokens,
        indices,
        cumulative_logprobs,
        embeddings,
        queue_times_s,
    ) = columns
    where = "OutputBatch.deltas."
    count = len(_check(request_ids, list, where + "request_id"))
    _check_column(request_ids, str, count, where + "request_id")
    _check_column(new_token_ids, list, count, where + "new_token_ids")
    _check_column(finished, bool, count, where + "finished")
    _check_column_of(finish_reasons, (str, type(None)), count, where + "finish_reason")
    _check_column_of(logprobs, (list, type(None)), count, where + "logprobs")
    _check_column_of(prompt_logprobs, (list, type(None)), count, where + "prompt_logprobs")
    _check_column_of(num_cached_tokens, (int, type(None)), count, where + "num_cached_tokens")
    _check_column(indices, int, count, where + "index")
    _check_column_of(cumulative_logprobs, (float, type(None)), count, where + "cumulative_logprob")
    _check_column_of(embeddings, (bytes, type(None)), count, where + "embedding")
    _check_column_of(queue_times_s, (float, type(None)), count, where + "queue_time_s")
    # Logprobs are rare: decoded entry by entry only where present.
    if any(entry is not None for entry in logprobs):
        logprobs = [_unpack_optional_logprobs(entry, where + "logprobs") for entry in logprobs]
    if any(entry is not None for entry in prompt_logprobs):
        prompt_logprobs = [
            _unpack_optional_logprobs(entry, where + "prompt_logprobs") for entry in prompt_logprobs
        ]
    # NOTE: one dataclass __init__ per request: most of the decode time.
    return OutputBatch(
        list(
            map(
                RequestOutputDelta,
                request_ids,
                new_token_ids,
                finished,
                finish_reasons,
                logprobs,
                prompt_logprobs,
                num_cached_tokens,
                indices,
                cumulative_logprobs,
                embeddings,
                queue_times_s,
            )
        )
    )


# ---------------------------------------------------------------- start-up and control

# Field types of the messages whose fields are all scalars, strings or dicts: one table
# instead of a hand-written unpacker each (none of them is on a hot path).
_OPTIONAL_INT = (int, type(None))
_FLAT_FIELD_TYPES: dict[type, tuple[type | tuple[type, ...], ...]] = {
    GetStats: (),
    ResetPrefixCache: (),
    LoadLoRA: (int, str, str),
    UnloadLoRA: (int,),
    StopSample: (str, int),
    Progress: (str, (float, int)),
    EngineStats: (dict, (str, type(None))),
    SchedulerConfig: (
        int,
        int,
        int,
        bool,
        float,
        (str, type(None)),
        str,
        int,
        int,
        int,
        str,
        int,
        str,
        int,
        int,
        str,
        int,
    ),
    WorkerSpec: (
        str,
        str,
        int,
        _OPTIONAL_INT,
        _OPTIONAL_INT,
        str,
        int,
        int,
        int,
        list,
        bool,
        (str, type(None)),
        str,
        (str, type(None)),
        int,
        str,
    ),
    StructuredOutputsParams: (
        (str, type(None)),
        (str, type(None)),
        (list, type(None)),
        (str, type(None)),
        bool,
        bool,
    ),
    GrammarVocabulary: (str, int, list, _OPTIONAL_INT, (list, type(None))),
    PoolingParams: (bool, _OPTIONAL_INT, str, bool, str),
}


def _pack_flat(message: Any) -> list:
    return [getattr(message, name) for name in WIRE_FIELDS[type(message)]]


def _unpack_flat(value: Any, message_type: type) -> Any:
    type_name = message_type.__name__
    fields = _fields(value, type_name)
    for name, field_value, expected in zip(
        WIRE_FIELDS[message_type], fields, _FLAT_FIELD_TYPES[message_type]
    ):
        _check(field_value, expected, f"{type_name}.{name}")
    try:
        # Config dataclasses validate their ranges themselves.
        return message_type(*fields)
    except (TypeError, ValueError) as error:
        raise DecodeError(f"{type_name}: {error}") from error


def _pack_optional_flat(message: Any) -> list | None:
    return None if message is None else _pack_flat(message)


def _unpack_optional_flat(value: Any, message_type: type) -> Any:
    return None if value is None else _unpack_flat(value, message_type)


def _flat_codec(message_type: type) -> tuple[type, Callable[[Any], list], Callable[[Any], Any]]:
    return message_type, _pack_flat, lambda value: _unpack_flat(value, message_type)


def _pack_start_engine(start: StartEngine) -> list:
    fields = _pack_flat(start)
    fields[4] = _pack_flat(start.scheduler_config)
    fields[8] = _pack_flat(start.worker)
    return fields


def _unpack_start_engine(value: Any) -> StartEngine:
    fields = _fields(value, "StartEngine")
    expected = (int, str, str, str, list, int, bool, int, list)
    for name, field_value, field_type in zip(WIRE_FIELDS[StartEngine], fields, expected):
        _check(field_value, field_type, f"StartEngine.{name}")
    fields[4] = _unpack_flat(fields[4], SchedulerConfig)
    fields[8] = _unpack_flat(fields[8], WorkerSpec)
    return StartEngine(*fields)


def _pack_start_structured_output(start: StartStructuredOutput) -> list:
    return [_pack_optional_flat(start.grammar_vocabulary), start.disable_any_whitespace]


def _unpack_start_structured_output(value: Any) -> StartStructuredOutput:
    vocabulary, disable_any_whitespace = _fields(value, "StartStructuredOutput")
    _check(vocabulary, (list, type(None)), "StartStructuredOutput.grammar_vocabulary")
    _check(disable_any_whitespace, bool, "StartStructuredOutput.disable_any_whitespace")
    return StartStructuredOutput(
        _unpack_optional_flat(vocabulary, GrammarVocabulary), disable_any_whitespace
    )


def _pack_start_worker(start: StartWorker) -> list:
    fields = _pack_flat(start)
    fields[5] = _pack_flat(start.worker)
    return fields


def _unpack_start_worker(value: Any) -> StartWorker:
    fields = _fields(value, "StartWorker")
    expected = (int, int, int, dict, str, list, (str, type(None)))
    for name, field_value, field_type in zip(WIRE_FIELDS[StartWorker], fields, expected):
        _check(field_value, field_type, f"StartWorker.{name}")
    fields[5] = _unpack_flat(fields[5], WorkerSpec)
    return StartWorker(*fields)


# ---------------------------------------------------------------- the tag table

# tag -> (type, pack, unpack). Ordered by how often each crosses a boundary.
_CODECS: dict[int, tuple[type, Callable[[Any], list], Callable[[Any], Any]]] = {
    1: (StepPlan, _pack_step_plan, _unpack_step_plan),
    2: (StepResult, _pack_step_result, _unpack_step_result),
    3: (RequestOutputDelta, _pack_request_output_delta, _unpack_request_output_delta),
    4: (AddRequest, _pack_add_request, _unpack_add_request),
    5: (AbortRequest, lambda m: [m.request_id], _unpack_abort_request),
    6: (EngineError, lambda m: [m.request_id, m.message, m.code], _unpack_engine_error),
    7: (Shutdown, lambda m: [], _unpack_shutdown),
    8: (Ready, lambda m: [m.component, m.pid, m.info], _unpack_ready),
    9: (NewRequestData, _pack_new_request, _unpack_new_request),
    10: (CachedRequestData, _pack_cached_request, _unpack_cached_request),
    11: (TokenLogprobs, _pack_token_logprobs, _unpack_token_logprobs),
    12: (PromptLogprobsChunk, _pack_prompt_logprobs_chunk, _unpack_prompt_logprobs_chunk),
    13: (SamplingParams, _pack_sampling_params, _unpack_sampling_params),
    14: (OutputBatch, _pack_output_batch, _unpack_output_batch),
    15: _flat_codec(GetStats),
    16: _flat_codec(EngineStats),
    17: _flat_codec(ResetPrefixCache),
    18: (StartEngine, _pack_start_engine, _unpack_start_engine),
    19: (StartWorker, _pack_start_worker, _unpack_start_worker),
    20: _flat_codec(WorkerSpec),
    21: _flat_codec(SchedulerConfig),
    22: _flat_codec(StopSample),
    23: _flat_codec(LoadLoRA),
    24: _flat_codec(UnloadLoRA),
    25: _flat_codec(PoolingParams),
    26: (StartStructuredOutput, _pack_start_structured_output, _unpack_start_structured_output),
    27: _flat_codec(Progress),
}

#: Each encodable type and its wire tag.
MESSAGE_TAGS: MappingProxyType[type, int] = MappingProxyType(
    {message_type: tag for tag, (message_type, _, _) in _CODECS.items()}
)
_PACKERS = {message_type: (tag, pack) for tag, (message_type, pack, _) in _CODECS.items()}
_FIELD_COUNTS = {message_type.__name__: len(names) for message_type, names in WIRE_FIELDS.items()}


def encode(message: Message) -> bytes:
    """One message as a msgpack frame ``[tag, fields...]``.

    Raises ``TypeError`` for a type without a tag (subclasses included: the decoder
    could not rebuild them) or a field value msgpack cannot hold (e.g. a numpy scalar).
    """
    entry = _PACKERS.get(type(message))
    if entry is None:
        raise TypeError(
            f"cannot encode {type(message).__name__}: not a message type "
            f"(encodable: {', '.join(sorted(t.__name__ for t in MESSAGE_TAGS))})"
        )
    tag, pack = entry
    try:
        return msgpack.packb([tag, *pack(message)])
    except (TypeError, ValueError, OverflowError) as error:
        raise TypeError(f"cannot encode {type(message).__name__}: {error}") from error


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in one frame made by ``encode``; ``DecodeError`` if it is not one."""
    try:
        frame = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as error:
        raise DecodeError(f"not a msgpack frame ({len(data)} bytes): {error}") from error
    if type(frame) is not list or not frame or type(frame[0]) is not int:
        raise DecodeError(f"expected an array [tag, fields...], got {_describe(frame)}")
    codec = _CODECS.get(frame[0])
    if codec is None:
        known = ", ".join(f"{tag}={t.__name__}" for tag, (t, _, _) in _CODECS.items())
        raise DecodeError(f"unknown message tag {frame[0]} (known tags: {known})")
    return codec[2](frame[1:])


def decode_as(data: bytes | bytearray | memoryview, expected_type: type[MessageT]) -> MessageT:
    """``decode``, and a ``DecodeError`` unless the frame holds an ``expected_type``: for
    a channel that carries one type (workers only ever receive ``StepPlan``)."""
    message = decode(data)
    if type(message) is not expected_type:
        raise DecodeError(
            f"expected a {expected_type.__name__} frame, got a {type(message).__name__}"
        )
    return message
