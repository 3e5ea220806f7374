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
from types import MappingProxyType
from typing import Any

import msgpack

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_codecs import (
    _pack_add_request,
    _pack_output_batch,
    _pack_request_output_delta,
    _pack_start_engine,
    _pack_start_structured_output,
    _pack_start_worker,
    _unpack_abort_request,
    _unpack_add_request,
    _unpack_engine_error,
    _unpack_output_batch,
    _unpack_ready,
    _unpack_request_output_delta,
    _unpack_shutdown,
    _unpack_start_engine,
    _unpack_start_structured_output,
    _unpack_start_worker,
)
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
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.step_codecs import (
    _pack_cached_request,
    _pack_new_request,
    _pack_prompt_logprobs_chunk,
    _pack_sampling_params,
    _pack_step_plan,
    _pack_step_result,
    _pack_token_logprobs,
    _unpack_cached_request,
    _unpack_new_request,
    _unpack_prompt_logprobs_chunk,
    _unpack_sampling_params,
    _unpack_step_plan,
    _unpack_step_result,
    _unpack_token_logprobs,
)
from pagedserve.scheduler.wire_format import (
    WIRE_FIELDS,
    DecodeError,
    Message,
    MessageT,
    _describe,
    _flat_codec,
)

__all__ = [
    "MESSAGE_TAGS",
    "WIRE_FIELDS",
    "DecodeError",
    "Message",
    "decode",
    "decode_as",
    "encode",
]

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
