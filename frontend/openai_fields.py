"""The checks every OpenAI-style body's fields pass: a JSON object, each field's type and
range, a client's ids, the model it names, its priority. Bad input raises ``CallError``
(``INVALID_ARGUMENT``) naming the field, the value and the limit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.request_contract import check_id_text

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM

logger = logging.getLogger("pagedserve.server")


def invalid_field(message: str, param: str) -> CallError:
    return CallError("INVALID_ARGUMENT", message, param)


def checked_body(body: Any, known: set[str] | frozenset[str], api: str) -> dict:
    """A request body that is a JSON object; the fields ``api`` does not know are ignored,
    and named in the log (vLLM's behaviour: a client's extra fields do not fail it)."""
    if not isinstance(body, dict):
        raise invalid_field(
            f"the request body must be a JSON object, got {type(body).__name__}", ""
        )
    ignored = sorted(set(body) - known)
    if ignored:
        logger.warning("fields ignored (not part of the %s API): %s", api, ", ".join(ignored))
    return body


def typed_field(body: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise invalid_field(f"{name} must be {what}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise invalid_field(f"{name} must be {what}, got {value!r}", name)
    return value


def id_field(body: dict, name: str) -> str | None:
    """A client's id or label (a string of at most ``MAX_ID_CHARS`` characters), or None."""
    value = typed_field(body, name, (str,), "a string")
    if value is not None:
        try:
            check_id_text(name, value)
        except ValueError as error:
            raise invalid_field(str(error), name) from None
    return value


def int_field(body: dict, name: str, minimum: int, maximum: int | None = None) -> int | None:
    value = typed_field(body, name, (int,), "an integer")
    if value is None:
        return None
    if value < minimum or (maximum is not None and value > maximum):
        limit = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise invalid_field(f"{name} must be {limit}, got {value}", name)
    return value


def served_model(body: dict, llm: LLM, served_model_name: str | tuple[str, ...]) -> tuple[str, int]:
    """The ``model`` a request names and its LoRA adapter id (0: the base model).
    ``served_model_name``: the base model's name, or its names (vLLM's several
    ``--served-model-name``s: a request may give any, the answer names the first)."""
    names = (served_model_name,) if isinstance(served_model_name, str) else served_model_name
    model = typed_field(body, "model", (str,), "a string", names[0])
    if model in names:
        return names[0], 0
    lora_id = llm.lora_ids.get(model)
    if lora_id is None:
        served = ", ".join([*map(repr, names), *map(repr, llm.lora_ids)])
        raise CallError(
            "NOT_FOUND",
            f"model {model!r} is not served here; this server serves {served}",
            "model",
        )
    return model, lora_id


def checked_priority(body: dict, llm: LLM) -> int:
    """vLLM's ``priority`` (lower first), checked against the engine's policy."""
    priority = typed_field(body, "priority", (int,), "an integer", 0)
    try:
        llm.check_priority(priority)
    except ValueError as error:
        raise invalid_field(str(error), "priority") from None
    return priority
