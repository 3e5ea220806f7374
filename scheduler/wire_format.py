"""What crosses a process boundary, declared: every message type's fields in wire order
(``WIRE_FIELDS``), and the checks a decoder makes of a frame's fields (``DecodeError``).
``serialization.py`` encodes and decodes with the codecs of ``step_codecs.py`` and
``engine_codecs.py``, which build on these."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

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
        "launched_ahead",
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
        "async_scheduling",
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
        "executor_backend",
        "ray_address",
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
        "remote_reader",
        "reader_index",
        "device",
        "ranks_on_host",
    ),
}

_FIELD_COUNTS = {message_type.__name__: len(names) for message_type, names in WIRE_FIELDS.items()}


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


# ---------------------------------------------------------------- messages of scalars

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
        bool,
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
