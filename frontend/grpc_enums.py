"""The gRPC API's closed vocabularies (its enums: ``ChatRole``, ``ToolChoiceMode``, ...) and
the engine's words for them ("user", "auto", ...). A value's word is its name after the
enum's prefix, in lower case (``CHAT_ROLE_USER``: "user"), so a word the HTTP API takes is
the same word here, and both APIs check it in one place (``request_contract.py``,
``tool_calls.py``, ``chat_template.py``)."""

from __future__ import annotations

from typing import Any

from pagedserve.v1 import generation_pb2 as pb

_UNSPECIFIED = "UNSPECIFIED"

# SamplingParams.early_stopping (HF transformers' values) <-> the proto's EarlyStopping.
EARLY_STOPPING_TO_PROTO: dict[bool | str, int] = {
    False: pb.EARLY_STOPPING_HEURISTIC,
    True: pb.EARLY_STOPPING_IMMEDIATE,
    "never": pb.EARLY_STOPPING_NEVER,
}
EARLY_STOPPING_FROM_PROTO: dict[int, bool | str] = {
    pb.EARLY_STOPPING_UNSPECIFIED: False,
    **{code: value for value, code in EARLY_STOPPING_TO_PROTO.items()},
}
# --kv-cache-dtype's aliases: "fp8" is e4m3, as in vLLM.
_KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def _prefix(enum: Any) -> str:
    """``CHAT_ROLE_`` of ``ChatRole``: its zero value's name without ``UNSPECIFIED``."""
    return enum.Name(0).removesuffix(_UNSPECIFIED)


def words(enum: Any) -> tuple[str, ...]:
    """Every specified value's word, in the proto's order."""
    prefix = _prefix(enum)
    return tuple(name.removeprefix(prefix).lower() for name in enum.keys()[1:])


def word(enum: Any, value: int, field: str) -> str | None:
    """The word ``value`` stands for; None for the enum's ``_UNSPECIFIED``. ``ValueError``
    naming ``field`` for a number the proto does not define (a newer client's)."""
    if value == 0:
        return None
    try:
        name = enum.Name(value)
    except ValueError:
        raise ValueError(
            f"{field} is {value}, which is no {enum.DESCRIPTOR.name} value this server knows "
            f"(it knows {', '.join(enum.keys()[1:])})"
        ) from None
    return name.removeprefix(_prefix(enum)).lower()


def required_word(enum: Any, value: int, field: str) -> str:
    """``word``, refusing ``_UNSPECIFIED`` with a ``ValueError`` naming ``field`` and the
    values it may take."""
    found = word(enum, value, field)
    if found is None:
        raise ValueError(f"{field} is {enum.Name(0)}; set one of {', '.join(enum.keys()[1:])}")
    return found


def value(enum: Any, text: str, field: str) -> int:
    """The enum's value for a word (the client's side of ``word``); ``ValueError`` naming
    ``field`` and the words it takes."""
    if isinstance(text, str) and text in words(enum):
        return enum.Value(_prefix(enum) + text.upper())
    raise ValueError(f"{field} must be one of {', '.join(words(enum))}; got {text!r:.100}")


def kv_cache_dtype_value(kv_cache_dtype: str) -> int:
    """``--kv-cache-dtype`` as ``GetModelInfoResponse`` reports it."""
    name = _KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    return value(pb.KvCacheDtype, name, "kv_cache_dtype")


def quantization_value(quantization: str | None) -> int:
    """``--quantization`` (None: unquantized) as ``GetModelInfoResponse`` reports it."""
    return value(pb.Quantization, quantization or "none", "quantization")
