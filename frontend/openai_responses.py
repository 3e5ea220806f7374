"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``) as vLLM serves it, on the chat machinery: a request's ``input``
items, ``instructions``, ``tools``, ``tool_choice`` and ``text.format`` become a chat
completion body (``openai_protocol.parse_request`` checks and renders it as it does
``/v1/chat/completions``); the chat answer becomes the response's output items
(``responses_output.py``), and stored responses live in ``responses_store.py``.

- ``input``: a string (one user message) or a list of items: messages (``role`` and
  ``content``, a string or ``input_text`` / ``output_text`` parts), ``function_call``
  (an earlier call of the model) and ``function_call_output`` (its result);
  ``reasoning`` items are not sent back to the model.
- ``previous_response_id`` continues a stored response's conversation (its input and
  output; not its ``instructions``, as OpenAI's API does); ``store`` (default true)
  keeps a response for that and for ``GET``, in this server's memory, the most recent
  ``ResponseStore.capacity`` of them (a replica does not see another's).
- Streams (``"stream": true``) send OpenAI's typed events (``response.created``, ...,
  ``response.output_text.delta``, ..., ``response.completed``, or ``response.incomplete``
  for a response cut by ``max_output_tokens``), each ``event: <type>`` with its JSON and a
  ``sequence_number``.
- ``background`` (with ``store``): the call answers at once with the response ``queued``;
  it runs on (``in_progress``) and ends ``completed``, ``incomplete``, ``failed`` (with its
  ``error``) or ``cancelled`` (``POST /v1/responses/{id}/cancel``), which ``GET`` reads
  back. It counts as a call in flight: a draining server waits for it. With ``stream``
  too, the call streams its events as they come, and they are kept (``EventLog``): a client
  that lost the stream reads it again from any event on (``GET
  /v1/responses/{id}?stream=true&starting_after=N``), while it runs and after.

Refused by name: hosted tools (web search, file search, ...), ``truncation: "auto"``,
image and file parts, item references.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.chat_template import with_reasoning_effort
from pagedserve.frontend.openai_fields import checked_body, invalid_field, typed_field
from pagedserve.frontend.openai_prompts import content_text

if TYPE_CHECKING:
    from pagedserve.frontend.responses_store import ResponseStore

# Passed on to the chat request as they are (vLLM's additions among them: sampling,
# structured_outputs beside text.format).
_PASSED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "priority",
    "request_id",
    "cache_salt",
    "user",
    "parallel_tool_calls",
    "stream",
    "chat_template_kwargs",
    "structured_outputs",
)
# Read here, or accepted without effect (``reasoning``: its ``effort`` goes to the chat
# template as chat completions' ``reasoning_effort`` does, the rest is OpenAI's own;
# ``include``: logprobs come with top_logprobs; ``service_tier``, ``prompt_cache_key``,
# ``safety_identifier``: OpenAI's own).
_OWN_FIELDS = {
    "input",
    "instructions",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "text",
    "top_logprobs",
    "store",
    "previous_response_id",
    "metadata",
    "background",
    "truncation",
    "reasoning",
    "include",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "max_tool_calls",
}
KNOWN_FIELDS = _OWN_FIELDS | set(_PASSED_FIELDS)
# The chat request's field -> the Responses request's, for errors.
_FIELD_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
}
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
# OpenAI's limits on a response's metadata.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# A background response's statuses before it ends.
_UNFINISHED = ("queued", "in_progress")


def _check_metadata(metadata: dict) -> None:
    """OpenAI's limits: at most 16 pairs of strings, keys of up to 64 characters, values of
    up to 512."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_field(
            f"metadata must have at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
            "metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise invalid_field(
                f"metadata: key {key[:20]!r}... has {len(key)} characters; keys have at most "
                f"{MAX_METADATA_KEY_CHARS}",
                "metadata",
            )
        if not isinstance(value, str):
            raise invalid_field(
                f"metadata[{key!r}] must be a string, got {value!r:.100}", "metadata"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid_field(
                f"metadata[{key!r}] has {len(value)} characters; values have at most "
                f"{MAX_METADATA_VALUE_CHARS}",
                "metadata",
            )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesCall:
    """A checked Responses request: the chat body it runs as, and how to answer."""

    body: dict  # the Responses request as given
    chat_body: dict
    messages: list[dict]  # the conversation without the instructions
    store: bool
    input_items: list[dict] = field(default_factory=list)  # the request's input, as items
    background: bool = False
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def stream(self) -> bool:
        return bool(self.chat_body.get("stream"))


def prepare(body: Any, store: ResponseStore) -> ResponsesCall:
    """The chat request a Responses ``body`` runs as; ``CallError`` naming the field for
    what is wrong or not served."""
    checked_body(body, KNOWN_FIELDS, "responses")
    background = typed_field(body, "background", (bool,), "a boolean", False)
    store_it = typed_field(body, "store", (bool,), "a boolean", True)
    if background and not store_it:
        raise invalid_field(
            "background=true needs store=true: a background response is read back by GET "
            "/v1/responses/{id}",
            "background",
        )
    if background and store.capacity == 0:
        raise invalid_field(
            "background=true needs the server's response store, which keeps none here "
            "(--responses-store-size 0)",
            "background",
        )
    truncation = typed_field(body, "truncation", (str,), "a string", "disabled")
    if truncation != "disabled":
        raise invalid_field(
            f"truncation={truncation!r:.50}: only 'disabled' is served (an input longer than "
            "the context window is refused, not cut)",
            "truncation",
        )
    _check_metadata(typed_field(body, "metadata", (dict,), "an object", {}))
    messages: list[dict] = []
    previous_id = typed_field(body, "previous_response_id", (str,), "a string")
    if previous_id is not None:
        previous = store.get(previous_id, "previous_response_id")
        if previous.response["status"] in _UNFINISHED:
            raise invalid_field(
                f"previous_response_id: response {previous_id!r:.100} is still "
                f"{previous.response['status']}; continue it once it has ended",
                "previous_response_id",
            )
        messages = copy.deepcopy(previous.messages)
    messages += _input_messages(body.get("input"))
    chat_body: dict[str, Any] = {name: body[name] for name in _PASSED_FIELDS if name in body}
    instructions = typed_field(body, "instructions", (str,), "a string")
    chat_body["messages"] = (
        [{"role": "system", "content": instructions}] if instructions else []
    ) + copy.deepcopy(messages)
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat_body["tools"] = _chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat_body["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    text = typed_field(body, "text", (dict,), "an object", {})
    if text.get("format") is not None:
        response_format = _response_format(text["format"])
        if response_format is not None:
            chat_body["response_format"] = response_format
    reasoning = typed_field(body, "reasoning", (dict,), "an object", {})
    if reasoning.get("effort") is not None:
        try:
            with_reasoning_effort(None, reasoning["effort"], "reasoning.effort")
        except ValueError as error:
            raise invalid_field(str(error), "reasoning.effort") from None
        chat_body["reasoning_effort"] = reasoning["effort"]
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        chat_body["logprobs"] = True
        chat_body["top_logprobs"] = top_logprobs
    return ResponsesCall(
        body=body,
        chat_body=chat_body,
        messages=messages,
        store=store_it,
        input_items=_input_items(body["input"]),
        background=background,
    )


def renamed(error: CallError) -> CallError:
    """A chat request's error with the Responses request's field names."""
    param = error.param or ""
    head = param.split(".")[0].split("[")[0]
    name = _FIELD_NAMES.get(head)
    if name is None:
        return error
    message = error.message
    if message.startswith(head):
        message = name + message[len(head) :]
    return CallError(error.code, message, name + param[len(head) :])


def _input_messages(value: Any) -> list[dict]:
    """``input`` as chat messages."""
    if isinstance(value, str):
        if not value:
            raise invalid_field("input is empty; give a string or a list of items", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid_field(
            f"input must be a string or a non-empty list of items, got {value!r:.200}", "input"
        )
    messages: list[dict] = []
    for position, item in enumerate(value):
        name = f"input[{position}]"
        if not isinstance(item, dict):
            raise invalid_field(f"{name} must be an object, got {item!r:.100}", name)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise invalid_field(
                    f"{name}.role must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r:.50}",
                    f"{name}.role",
                )
            messages.append({"role": role, "content": _content_text(item.get("content"), name)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", name),
                "type": "function",
                "function": {
                    "name": _string(item, "name", name),
                    "arguments": _string(item, "arguments", name, empty_allowed=True),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _content_text(output, name, "output")
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", name), "content": output}
            )
        elif kind == "reasoning":
            continue  # the model's thinking is not sent back to it
        else:
            raise invalid_field(
                f"{name}.type {kind!r:.50} is not served here: give messages, function_call "
                "and function_call_output items",
                f"{name}.type",
            )
    if not messages:
        raise invalid_field("input holds no message to answer", "input")
    return messages


def _input_items(value: str | list) -> list[dict]:
    """A checked ``input`` (``_input_messages`` read it first) as OpenAI lists it back: each
    item whole, with an id (its own, or a new one), text content as typed parts."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for item in copy.deepcopy(value):
        kind = item.setdefault("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}.get(kind, "fco")
        item.setdefault("id", new_id(prefix))
        item.setdefault("status", "completed")
        items.append(item)
    return items


def _string(item: dict, key: str, name: str, empty_allowed: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (value or empty_allowed):
        raise invalid_field(
            f"{name}.{key} must be a {'' if empty_allowed else 'non-empty '}string, got "
            f"{value!r:.100}",
            f"{name}.{key}",
        )
    return value


def _content_text(content: Any, name: str, key: str = "content") -> str:
    return content_text(content, f"{name}.{key}", _TEXT_PARTS)


def _chat_tools(tools: Any) -> list[dict]:
    """Responses' flat function tools as chat's ``{"type": "function", "function": ...}``."""
    if not isinstance(tools, list):
        raise invalid_field(f"tools must be a list, got {tools!r:.100}", "tools")
    chat_tools = []
    for position, tool in enumerate(tools):
        name = f"tools[{position}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid_field(
                f"{name}.type {kind!r:.50} is not served here: only function tools (hosted "
                "tools such as web_search or file_search are OpenAI's own)",
                f"{name}.type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        if "strict" in tool:
            function["strict"] = tool["strict"]
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none", "auto", "required", or what the chat request refuses


def _response_format(format_: Any) -> dict | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    kind = format_.get("type") if isinstance(format_, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        keys = ("name", "schema", "strict", "description")
        schema = {k: format_[k] for k in keys if k in format_}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_field(
        f"text.format must be an object of type text, json_object or json_schema, got "
        f"{format_!r:.100}",
        "text.format",
    )
