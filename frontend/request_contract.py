"""The checks both APIs make of a request beyond ``SamplingParams``' own, in one place.

gRPC (``grpc_convert.py``, ``grpc_server.py``) and HTTP (``openai_protocol.py``) call these,
so a value is accepted or refused the same way whichever API carries it, with the same limit
in the message (the API names the field its own way: ``sampling.top_k`` or ``top_k``). The
bounds themselves are declared in ``scheduler/request_limits.py``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pagedserve.scheduler.request_limits import (
    LOGIT_BIAS_API_LIMIT,
    MAX_ID_CHARS,
    check_length,
    loads_json,
)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_chat_role(role: object, name: str) -> str:
    """A chat message's role, one of ``CHAT_ROLES``; ``ValueError`` naming ``name``."""
    if role not in CHAT_ROLES:
        raise ValueError(f"{name} must be one of {', '.join(CHAT_ROLES)}; got {role!r:.100}")
    return role


def check_output_room(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    prompt_field: str,
    max_tokens_field: str,
) -> None:
    """``ValueError`` for a request whose prompt and ``max_tokens`` do not fit the context
    window together, as OpenAI's API and vLLM's server refuse it (the offline engine stops
    such a request at the window instead)."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"{prompt_field}: {num_prompt_tokens} prompt tokens leave no room to generate "
            f"in the model's context window of {max_model_len} tokens"
        )
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"{max_tokens_field}={max_tokens}: the model's context window is {max_model_len} "
            f"tokens and {prompt_field} takes {num_prompt_tokens}, which leaves at most "
            f"{max_model_len - num_prompt_tokens}"
        )


def clamped_logit_bias(name: str, bias: dict[int, Any]) -> dict[int, float]:
    """A request's ``logit_bias`` values, each a finite number clamped to
    [-LOGIT_BIAS_API_LIMIT, LOGIT_BIAS_API_LIMIT] as vLLM's server clamps them; ``ValueError``
    / ``TypeError`` naming ``name[token id]``. The keys are checked by ``SamplingParams``."""
    clamped = {}
    for token_id, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}[{token_id!r}] must be a number, got {value!r:.100}")
        try:
            value = float(value)
        except OverflowError:  # an integer past float's range
            value = math.copysign(math.inf, value)
        if not math.isfinite(value):
            raise ValueError(f"{name}[{token_id!r}] must be a finite number, got {value}")
        clamped[token_id] = min(LOGIT_BIAS_API_LIMIT, max(-LOGIT_BIAS_API_LIMIT, value))
    return clamped


def check_id_text(name: str, value: str) -> str:
    """A client's id or label (request id, cache namespace, user): at most
    ``MAX_ID_CHARS`` characters, since it is logged and kept with the request."""
    check_length(name, len(value), MAX_ID_CHARS, "characters")
    return value


def decode_json(name: str, data: str | bytes, field_prefix: str | None = None) -> Any:
    """JSON text a request carries (the HTTP body, or a field holding JSON), decoded no
    deeper than ``MAX_JSON_DEPTH`` and its strings Unicode text; ``ValueError`` naming
    ``name`` (or the field within it: ``field_prefix``, as ``check_json_value``)."""
    try:
        return loads_json(name, data, field_prefix)
    except UnicodeDecodeError as error:
        raise ValueError(f"{name} is not UTF-8: {error}") from None
    except ValueError as error:
        if isinstance(error, json.JSONDecodeError):
            raise ValueError(f"{name} is not valid JSON: {error}") from None
        raise
