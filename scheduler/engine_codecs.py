"""The codecs of what the frontend and the scheduler exchange (requests in, output
batches, errors, stats and control out) and of the start-up messages, among them the
"flat" ones whose fields are all scalars (``serialization.py`` says why and how)."""

from __future__ import annotations

from typing import Any

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import (
    AbortRequest,
    AddRequest,
    EngineError,
    OutputBatch,
    Ready,
    Shutdown,
    StartEngine,
    StartStructuredOutput,
    StartWorker,
    WorkerSpec,
)
from pagedserve.scheduler.messages import (
    RequestOutputDelta,
)
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.step_codecs import (
    _pack_optional_logprobs,
    _pack_sampling_params,
    _unpack_optional_logprobs,
    _unpack_sampling_params,
)
from pagedserve.scheduler.structured_output import GrammarVocabulary
from pagedserve.scheduler.wire_format import (
    WIRE_FIELDS,
    DecodeError,
    _check,
    _check_column,
    _check_column_of,
    _describe,
    _fields,
    _pack_flat,
    _pack_optional_flat,
    _unpack_flat,
    _unpack_optional_flat,
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


def _pack_start_engine(start: StartEngine) -> list:
    fields = _pack_flat(start)
    fields[4] = _pack_flat(start.scheduler_config)
    fields[8] = _pack_flat(start.worker)
    return fields


def _unpack_start_engine(value: Any) -> StartEngine:
    fields = _fields(value, "StartEngine")
    expected = (int, str, str, str, list, int, bool, int, list, str, str)
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
    optional_str, optional_int = (str, type(None)), (int, type(None))
    expected = (int, int, int, dict, str, list, optional_str, bool, optional_int, optional_str,
                optional_int)  # fmt: skip
    for name, field_value, field_type in zip(WIRE_FIELDS[StartWorker], fields, expected):
        _check(field_value, field_type, f"StartWorker.{name}")
    fields[5] = _unpack_flat(fields[5], WorkerSpec)
    return StartWorker(*fields)
