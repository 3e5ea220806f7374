"""The request contract: the bounds every field of a request keeps, declared once.

``SamplingParams`` checks its fields against ``INT_LIMITS`` and ``FLOAT_LIMITS``; the HTTP
and gRPC APIs check their own fields (priority, ids, sizes of lists and texts, JSON depth)
with the same helpers and tables, so both APIs accept and refuse the same values with the
same limit in the message. A value inside these bounds always fits the wire (msgpack
int64), the workers' arrays (int64 and float32) and the arithmetic done with it (beam
scores); the engine's own limits (the context window, ``max_logprobs``, the vocabulary,
``max_num_seqs``) are checked against the model after these.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
from dataclasses import dataclass

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1

# Sequences of one request (n, best_of); max_num_seqs bounds them further per engine.
MAX_SEQUENCES_PER_REQUEST = 1024
# A beam step looks at the top (1 + EOS ids) * beam_width tokens of each beam.
MAX_BEAM_WIDTH = 16


@dataclass(frozen=True)
class IntRange:
    low: int
    high: int


@dataclass(frozen=True)
class FloatRange:
    """Finite values in [low, high] (``(low, high]`` when ``low_open``)."""

    low: float
    high: float
    low_open: bool = False

    def describe(self) -> str:
        return f"{'>' if self.low_open else '>='} {self.low} and <= {self.high}"


INT_LIMITS: dict[str, IntRange] = {
    "max_tokens": IntRange(1, INT32_MAX),
    "min_tokens": IntRange(0, INT32_MAX),
    "top_k": IntRange(-1, INT32_MAX),  # -1 and 0: off; past the vocabulary: off too
    "seed": IntRange(0, INT64_MAX),  # the workers' generators take 63-bit seeds
    "logprobs": IntRange(0, INT32_MAX),
    "prompt_logprobs": IntRange(0, INT32_MAX),
    "n": IntRange(1, MAX_SEQUENCES_PER_REQUEST),
    "best_of": IntRange(1, MAX_SEQUENCES_PER_REQUEST),
    "beam_width": IntRange(1, MAX_BEAM_WIDTH),
    "truncate_prompt_tokens": IntRange(-1, INT32_MAX),
    "priority": IntRange(INT32_MIN, INT32_MAX),
    # Every token id a request names (stop_token_ids, allowed_token_ids, logit_bias keys,
    # bad_words_token_ids, prompts as ids); the model's vocabulary bounds them further.
    "token_id": IntRange(0, INT32_MAX),
}

FLOAT_LIMITS: dict[str, FloatRange] = {
    # Below 1e-5 a temperature samples as greedy (vLLM's rule): logits / T would overflow.
    "temperature": FloatRange(0.0, 100.0),
    "top_p": FloatRange(0.0, 1.0, low_open=True),
    "min_p": FloatRange(0.0, 1.0),
    # Logits are divided or multiplied by it in float32.
    "repetition_penalty": FloatRange(0.01, 100.0),
    "presence_penalty": FloatRange(-2.0, 2.0),
    "frequency_penalty": FloatRange(-2.0, 2.0),
    # Beam scores divide by length ** length_penalty: float64 holds it for any length.
    "length_penalty": FloatRange(-10.0, 10.0),
    # The offline API's raw bias (both APIs clamp to +-LOGIT_BIAS_API_LIMIT first).
    "logit_bias": FloatRange(-1e6, 1e6),
}

# Below this a temperature is greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5
# OpenAI's range for a logit_bias value; vLLM's server clamps to it, and so do both APIs.
LOGIT_BIAS_API_LIMIT = 100.0

# Sizes of lists, maps and texts (characters).
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID_LIST = 1 << 18  # allowed_token_ids, logit_bias: up to a large vocabulary
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 1024
MAX_CHOICES = 4096
MAX_ID_CHARS = 256  # request ids, cache salts, user names, LoRA adapter names
# A text prompt that does not ask to be truncated holds at most this many characters per
# token of the context window: no tokenizer's token covers more, so a longer text could
# never fit, and is refused before it is tokenized (seconds and gigabytes for 60 MiB).
MAX_PROMPT_CHARS_PER_TOKEN = 256
# Nesting of a request's JSON (its body, a schema, tool parameters): 64 levels, where
# OpenAI allows 10 in a structured-output schema; deeper input would exhaust the
# recursion of the code that walks it.
MAX_JSON_DEPTH = 64


def check_int(name: str, value: object, limit: str | IntRange) -> int:
    """``value`` as a Python int within ``limit`` (a key of ``INT_LIMITS`` or a range): an
    int, or an integer scalar of another library (numpy's ``int64``, through
    ``__index__``), never a bool. ``TypeError`` / ``ValueError`` name ``name``, the value
    and the bound it broke."""
    bounds = INT_LIMITS[limit] if isinstance(limit, str) else limit
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r:.100}") from None
    if value < bounds.low:
        raise ValueError(f"{name} must be >= {bounds.low}, got {value}")
    if value > bounds.high:
        raise ValueError(f"{name} must be <= {bounds.high}, got {value}")
    return value


def check_float(name: str, value: object, limit: str | FloatRange) -> float:
    """``value`` as a finite float within ``limit`` (a key of ``FLOAT_LIMITS`` or a range):
    Python's int and float, or another library's real scalar (numpy's ``float32``)."""
    bounds = FLOAT_LIMITS[limit] if isinstance(limit, str) else limit
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r:.100}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range
        value = math.copysign(math.inf, value)
    too_low = value <= bounds.low if bounds.low_open else value < bounds.low
    if too_low or value > bounds.high or not math.isfinite(value):
        raise ValueError(f"{name} must be {bounds.describe()}, got {value}")
    return value


def check_length(name: str, size: int, limit: int, unit: str) -> None:
    """``ValueError`` when a list, map or text of ``size`` ``unit`` is longer than
    ``limit``."""
    if size > limit:
        raise ValueError(f"{name} must have at most {limit} {unit}, got {size}")


def check_json_value(name: str, value: object, field_prefix: str | None = None) -> None:
    """``ValueError`` for decoded JSON that nests deeper than ``MAX_JSON_DEPTH``, or holds a
    string that is no Unicode text (a lone surrogate, which JSON's ``\\ud800`` escapes can
    write and no UTF-8 encoder takes). Iterative, so it measures what would overflow a
    recursive walk. An object's error names its field: ``<field_prefix><key>``
    (``field_prefix`` defaults to ``name.``; "" for a request body, whose keys are the
    request's fields)."""
    if not isinstance(value, dict):
        _check_json_tree(name, value, 0)
        return
    prefix = f"{name}." if field_prefix is None else field_prefix
    for key, item in value.items():
        _check_text(name, key)
        _check_json_tree(f"{prefix}{key}", item, 1)


def _check_json_tree(name: str, value: object, depth: int) -> None:
    pending = [(value, depth)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, str):
            _check_text(name, item)
            continue
        if isinstance(item, dict):
            _check_depth(name, level + 1)
            for key in item:
                _check_text(name, key)
            children = item.values()
        elif isinstance(item, list):
            _check_depth(name, level + 1)
            children = item
        else:
            continue
        pending.extend(
            (child, level + 1) for child in children if isinstance(child, (str, dict, list))
        )


def _check_depth(name: str, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{name} nests more than {MAX_JSON_DEPTH} levels deep (the limit)")


def _check_text(name: str, text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"{name} holds a lone surrogate ({text[error.start]!r}) at character "
                f"{error.start}: it is no Unicode text"
            ) from None


def loads_json(name: str, text: str | bytes, field_prefix: str | None = None) -> object:
    """``text`` decoded as JSON, no deeper than ``MAX_JSON_DEPTH`` and all of its strings
    Unicode text; ``ValueError`` naming ``name`` otherwise (``json.JSONDecodeError`` is
    one)."""
    try:
        value = json.loads(text)
    except RecursionError:  # the decoder's own recursion ran out: far past the limit
        raise ValueError(
            f"{name} nests more than {MAX_JSON_DEPTH} levels deep (the limit)"
        ) from None
    check_json_value(name, value, field_prefix)
    return value
