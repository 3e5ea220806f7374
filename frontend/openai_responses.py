"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``) as vLLM serves it, on the chat machinery: a request's ``input``
items, ``instructions``, ``tools``, ``tool_choice`` and ``text.format`` become a chat
completion body (``openai_protocol.parse_request`` checks and renders it as it does
``/v1/chat/completions``), and the chat answer becomes the response's output items: the
thinking (a ``reasoning`` item, with ``--reasoning-parser``), the text (a ``message``), the
calls (``function_call`` items).

- ``input``: a string (one user message) or a list of items: messages (``role`` and
  ``content``, a string or ``input_text`` / ``output_text`` parts), ``function_call``
  (an earlier call of the model) and ``function_call_output`` (its result);
  ``reasoning`` items are not sent back to the model.
- ``previous_response_id`` continues a stored response's conversation (its input and
  output; not its ``instructions``, as OpenAI's API does); ``store`` (default true)
  keeps a response for that and for ``GET``, in this server's memory, the most recent
  ``ResponseStore.capacity`` of them (a replica does not see another's).
- Streams (``"stream": true``) send OpenAI's typed events (``response.created``, ...,
  ``response.output_text.delta``, ..., ``response.completed``), each ``event: <type>``
  with its JSON and a ``sequence_number``.
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

import asyncio
import copy
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.chat_template import with_reasoning_effort
from pagedserve.frontend.openai_answers import TokenTexts, chat_logprobs, finish_reason
from pagedserve.frontend.openai_fields import checked_body, invalid_field, typed_field
from pagedserve.frontend.openai_prompts import content_text

if TYPE_CHECKING:
    from pagedserve.frontend.chat_request import ChatAnswerStream
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.openai_protocol import ApiRequest
    from pagedserve.frontend.outputs import RequestOutput

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
DEFAULT_RESPONSES_STORE_SIZE = 1024
# What the stored responses (their inputs, outputs and kept events) may take of the server's
# memory, in all; the oldest that have ended go first.
DEFAULT_RESPONSES_STORE_BYTES = 512 << 20
# OpenAI's limits on a response's metadata.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# A background response's statuses before it ends.
_UNFINISHED = ("queued", "in_progress")
# A failed background response's error code (OpenAI's) by how its call ended.
_ERROR_CODES = {"INVALID_ARGUMENT": "invalid_prompt", "RESOURCE_EXHAUSTED": "rate_limit_exceeded"}


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


def approximate_bytes(value: object) -> int:
    """About how many bytes ``value`` (JSON-like: dicts, lists, strings, numbers) holds:
    its strings' characters, plus 8 per other item. Iterative and linear in the number of
    items, not in the text, so cheap enough on the event loop."""
    total = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += 8
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 8
            pending.extend(item)
        else:
            total += 8
    return total


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- the store


@dataclass
class StoredResponse:
    response: dict  # as GET answers it
    # The conversation so far as chat messages (the instructions left out), for a
    # request that continues it.
    messages: list[dict]
    # The request's own input as items, each with an id (GET .../input_items).
    input_items: list[dict] = field(default_factory=list)


class ResponseStore:
    """The responses kept for ``previous_response_id`` and ``GET``: the most recent
    ``capacity`` (0: none kept) within ``capacity_bytes`` in all (their inputs, outputs and
    kept events, as ``approximate_bytes`` counts them), in this process's memory; and the
    background responses still running (``running``: response id -> its task)."""

    def __init__(
        self,
        capacity: int = DEFAULT_RESPONSES_STORE_SIZE,
        capacity_bytes: int = DEFAULT_RESPONSES_STORE_BYTES,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        if capacity_bytes < 0:
            raise ValueError(f"the response store's bytes must be >= 0, got {capacity_bytes}")
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self.num_bytes = 0
        self.running: dict[str, asyncio.Task] = {}
        # The streamed background responses' events, kept as long as their responses.
        self.event_logs: dict[str, EventLog] = {}

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        response_id = stored.response["id"]
        self._forget_bytes(response_id)
        self._responses[response_id] = stored
        size = approximate_bytes((stored.response, stored.messages, stored.input_items))
        self._bytes[response_id] = size
        self.num_bytes += size
        self._evict()

    def count_events(self, response_id: str, num_bytes: int) -> None:
        """A kept event log grew by ``num_bytes``: count them against the byte limit."""
        if response_id in self._bytes:
            self._bytes[response_id] += num_bytes
            self.num_bytes += num_bytes
            self._evict()

    def _evict(self) -> None:
        while len(self._responses) > self.capacity or self.num_bytes > self.capacity_bytes:
            # The oldest that has ended: a background response still running stays, for its
            # GET and cancel (the store may hold more than its limits while those run).
            evicted = next((key for key in self._responses if key not in self.running), None)
            if evicted is None:
                break
            self._drop(evicted)

    def _drop(self, response_id: str) -> None:
        del self._responses[response_id]
        self.event_logs.pop(response_id, None)
        self._forget_bytes(response_id)

    def _forget_bytes(self, response_id: str) -> None:
        self.num_bytes -= self._bytes.pop(response_id, 0)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        stored = self._responses.get(response_id)
        if stored is None:
            raise CallError(
                "NOT_FOUND",
                f"{param}: no response {response_id!r:.100} is stored here (responses are kept "
                f"with store=true, the most recent {self.capacity}, by the server that made "
                "them)",
                param,
            )
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)

    def event_log(self, response_id: str) -> EventLog:
        """A stored response's events (``CallError`` when it has none kept)."""
        self.get(response_id)
        log = self.event_logs.get(response_id)
        if log is None:
            raise CallError(
                "INVALID_ARGUMENT",
                f"stream: response {response_id!r:.100} was not created with background=true "
                "and stream=true, whose events alone are kept; GET it without stream",
                "stream",
            )
        return log

    async def cancel(self, response_id: str) -> dict:
        """Cancel a background response (``CallError`` for another) and return it as it
        ended: ``cancelled``, or as it was when it had already ended (cancelling is
        idempotent, as OpenAI's)."""
        stored = self.get(response_id)
        if not stored.response.get("background"):
            raise CallError(
                "INVALID_ARGUMENT",
                f"response_id: {response_id!r:.100} was not created with background=true; only "
                "background responses can be cancelled",
                "response_id",
            )
        task = self.running.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return self._responses.get(response_id, stored).response


# ---------------------------------------------------------------- request -> chat


@dataclass
class ResponsesCall:
    """A checked Responses request: the chat body it runs as, and how to answer."""

    body: dict  # the Responses request as given
    chat_body: dict
    messages: list[dict]  # the conversation without the instructions
    store: bool
    input_items: list[dict] = field(default_factory=list)  # the request's input, as items
    background: bool = False
    response_id: str = field(default_factory=lambda: _new_id("resp"))
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
        item.setdefault("id", _new_id(prefix))
        item.setdefault("status", "completed")
        items.append(item)
    return items


def input_items_page(stored: StoredResponse, query: dict[str, str]) -> dict:
    """``GET /v1/responses/{id}/input_items``: OpenAI's list of a response's input items,
    ``order`` "desc" (the default: the last item first) or "asc", at most ``limit`` (1 to
    100, default 20) from the item after ``after`` (or up to ``before``), by id."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_field(f"order must be 'asc' or 'desc', got {order!r:.50}", "order")
    raw_limit = query.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid_field(f"limit must be an integer in [1, 100], got {raw_limit!r:.50}", "limit")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    ids = [item["id"] for item in items]
    for name in ("after", "before"):
        if name in query and query[name] not in ids:
            raise invalid_field(
                f"{name}: response {stored.response['id']!r} has no input item "
                f"{query[name]!r:.100}",
                name,
            )
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(ids)
    items = items[start:end]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


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


# ---------------------------------------------------------------- answers


def _base(call: ResponsesCall, api_request: ApiRequest, status: str, output: list) -> dict:
    """The response object: what the request asked for, echoed, around ``output``."""
    body = call.body
    text_format = (body.get("text") or {}).get("format") or {"type": "text"}
    return {
        "id": call.response_id,
        "object": "response",
        "created_at": call.created_s,
        "status": status,
        "background": call.background,
        "model": api_request.model,
        "output": output,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "store": call.store,
        "temperature": body.get("temperature"),
        "text": {"format": text_format},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"),
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
    }


def _usage(api_request: ApiRequest, output: RequestOutput, llm: LLM) -> dict:
    input_tokens = len(output.prompt_token_ids)
    completion = output.outputs[0]
    output_tokens = len(completion.token_ids)
    reasoning = api_request.chat_reading.reasoning
    reasoning_tokens = (
        0
        if reasoning is None
        else reasoning.num_reasoning_tokens(completion.token_ids, completion.text, llm.tokenizer)
    )
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def _finished(
    response: dict, api_request: ApiRequest, output: RequestOutput, reason: str | None, llm: LLM
) -> dict:
    """``response`` completed (or incomplete, when the output ran out of tokens)."""
    response["usage"] = _usage(api_request, output, llm)
    if reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        for item in response["output"]:
            if item.get("status") == "completed" and item["type"] == "message":
                item["status"] = "incomplete"
    else:
        response["status"] = "completed"
    return response


def _reasoning_item(item_id: str, text: str) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _message_item(item_id: str, text: str, logprobs: list | None, status: str) -> dict:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" or text else [],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _logprobs(api_request: ApiRequest, token_ids, entries, texts: TokenTexts) -> list | None:
    if api_request.logprobs is None or entries is None:
        return None
    return chat_logprobs(list(token_ids), list(entries), api_request.logprobs, texts)["content"]


def whole_response(
    call: ResponsesCall, api_request: ApiRequest, output: RequestOutput, llm: LLM
) -> dict:
    """The answer of a call that did not stream."""
    completion = output.outputs[0]
    reading = api_request.chat_reading
    answer = reading.whole(completion.text, finish_reason(completion))
    items = []
    if answer.reasoning:
        items.append(_reasoning_item(_new_id("rs"), answer.reasoning))
    if answer.content or not answer.tool_calls:
        texts = TokenTexts(llm, api_request.tokens_as_ids)
        logprobs = _logprobs(api_request, completion.token_ids, completion.logprobs, texts)
        items.append(_message_item(_new_id("msg"), answer.content, logprobs, "completed"))
    items += [
        _call_item(_new_id("fc"), c.id, c.name, c.arguments, "completed") for c in answer.tool_calls
    ]
    response = _base(call, api_request, "completed", items)
    return _finished(response, api_request, output, finish_reason(completion), llm)


def unfinished_response(call: ResponsesCall, api_request: ApiRequest, status: str) -> dict:
    """A background response before its output: ``queued`` or ``in_progress``."""
    return _base(call, api_request, status, [])


def ended_response(
    call: ResponsesCall, api_request: ApiRequest, error: CallError | None = None
) -> dict:
    """A background response ended without its output: ``cancelled``, or ``failed`` with
    ``error``."""
    response = _base(call, api_request, "cancelled" if error is None else "failed", [])
    if error is not None:
        response["error"] = {
            "code": _ERROR_CODES.get(error.code, "server_error"),
            "message": error.message,
        }
    return response


class EventLog:
    """A streamed background response's events, in order (an event's index is its
    ``sequence_number``), for each reader to follow from where it starts."""

    def __init__(self, on_grown: Callable[[int], None] | None = None) -> None:
        """``on_grown(num_bytes)``: told how much each addition holds (the store's limit)."""
        self.events: list[dict] = []
        self.ended = False
        self._on_grown = on_grown
        self._grown = asyncio.Event()  # set (and replaced) whenever events come or it ends

    def add(self, events: list[dict]) -> None:
        if events:
            self.events += events
            if self._on_grown is not None:
                self._on_grown(approximate_bytes(events))
            self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[dict]:
        """The events after ``sequence_number`` ``starting_after`` (-1: all), those kept
        and those still to come, until it ends."""
        position = starting_after + 1
        while True:
            grown = self._grown  # before reading: an event added after wakes this one
            while position < len(self.events):
                yield self.events[position]
                position += 1
            if self.ended:
                return
            await grown.wait()


def starting_after(query: dict[str, str], log: EventLog) -> int:
    """``GET .../{id}?stream=true``'s ``starting_after`` (default -1: from the first
    event), an integer from -1 to the last event's sequence number (sent or to come)."""
    text = query.get("starting_after")
    if text is None:
        return -1
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < -1 or (log.ended and value >= len(log.events)):
        raise invalid_field(
            f"starting_after must be an integer from -1 to the last event's sequence number "
            f"({len(log.events) - 1} so far), got {text!r:.50}",
            "starting_after",
        )
    return value


def stored(call: ResponsesCall, response: dict) -> StoredResponse:
    """What the store keeps of a finished response: it, and the conversation with its
    answer (text and calls) as the last turn."""
    assistant: dict[str, Any] = {"role": "assistant", "content": ""}
    calls = []
    for item in response["output"]:
        if item["type"] == "message":
            assistant["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            calls.append(_chat_call(item["call_id"], item["name"], item["arguments"]))
    if calls:
        assistant["tool_calls"] = calls
    return StoredResponse(copy.deepcopy(response), [*call.messages, assistant], call.input_items)


def _chat_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------- streams


class ResponseStream:
    """The typed events of a streamed response, built as its one output grows: each item
    opens (``output_item.added``), grows by deltas and closes (``...done``,
    ``output_item.done``) in the order the model writes them; the last event holds the
    whole response, as the non-streamed answer would be."""

    def __init__(self, call: ResponsesCall, api_request: ApiRequest, llm: LLM) -> None:
        self._call = call
        self._request = api_request
        self._llm = llm
        self._texts = TokenTexts(llm, api_request.tokens_as_ids)
        self._reader: ChatAnswerStream = api_request.chat_reading.stream()
        self._sequence = 0
        self._items: list[dict] = []  # closed items, as the response lists them
        self._open: dict | None = None  # the item being written
        self._open_text = ""
        self._tokens = 0  # output tokens already reported (their logprobs)
        self._calls: dict[int, dict] = {}  # tool call index -> its item, while open
        self._ended = False
        self.response: dict | None = None  # the whole response, once it ended

    def start(self) -> list[dict]:
        response = _base(self._call, self._request, "in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=copy.deepcopy(response)),
        ]

    def chunks(self, output: RequestOutput) -> list[dict]:
        """The events for what changed in ``output``."""
        if self._ended:
            return []
        completion = output.outputs[0]
        reason = finish_reason(completion)
        read = self._reader.feed(completion.text, reason is not None)
        events: list[dict] = []
        if read.reasoning:
            events += self._write("reasoning", read.reasoning)
        if read.content:
            # The logprobs of every token since the last text written (text the
            # detokenizer held back comes with its tokens' logprobs).
            new_entries = None
            if completion.logprobs is not None:
                new_entries = completion.logprobs[self._tokens :]
            logprobs = _logprobs(
                self._request,
                completion.token_ids[self._tokens : self._tokens + len(new_entries or [])],
                new_entries,
                self._texts,
            )
            events += self._write("message", read.content, logprobs)
            self._tokens = len(completion.token_ids)
        for delta in read.tool_calls:
            events += self._call_delta(delta)
        if reason is not None:
            events += self._close()
            response = _base(self._call, self._request, "completed", self._items)
            response = _finished(
                response, self._request, output, self._reader.finish_reason(reason), self._llm
            )
            self.response = response
            # "response.completed" also when the status is "incomplete" (out of tokens), as
            # vLLM sends it: OpenAI's SDK waits for this event to hand over the response.
            events.append(self._event("response.completed", response=copy.deepcopy(response)))
            self._ended = True
        return events

    def failed(self, error: CallError, status: int) -> dict:
        """The event that ends a stream that failed after it began."""
        return self._event("error", code=str(status), message=error.message, param=error.param)

    # ------------------------------------------------------------ items

    def _write(self, kind: str, text: str, logprobs: list | None = None) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._open_item(kind)
        item = self._open
        self._open_text += text
        index = len(self._items)
        if kind == "reasoning":
            events.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    delta=text,
                )  # fmt: skip
            )
        else:
            if logprobs:
                item.setdefault("_logprobs", []).extend(logprobs)
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=logprobs or [],
                )  # fmt: skip
            )
        return events

    def _open_item(self, kind: str) -> list[dict]:
        index = len(self._items)
        if kind == "reasoning":
            self._open = {"id": _new_id("rs"), "type": "reasoning"}
            added = {**self._open, "summary": [], "content": [], "status": "in_progress"}
            return [self._event("response.output_item.added", output_index=index, item=added)]
        self._open = {"id": _new_id("msg"), "type": "message"}
        added = _message_item(self._open["id"], "", None, "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event(
                "response.content_part.added",
                item_id=self._open["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),  # fmt: skip
        ]

    def _close(self) -> list[dict]:
        """Close the item being written (text or thinking), then the calls still open."""
        events = self._close_text()
        for call_index in sorted(self._calls):
            events += self._close_call(call_index)
        return events

    def _close_text(self) -> list[dict]:
        events = []
        index = len(self._items)
        if self._open is not None:
            item_id, text = self._open["id"], self._open_text
            if self._open["type"] == "reasoning":
                item = _reasoning_item(item_id, text)
                events.append(
                    self._event(
                        "response.reasoning_text.done",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        text=text,
                    )  # fmt: skip
                )
            else:
                logprobs = None
                if self._request.logprobs is not None:
                    logprobs = self._open.get("_logprobs", [])
                item = _message_item(item_id, text, logprobs, "completed")
                events += [
                    self._event(
                        "response.output_text.done", item_id=item_id, output_index=index,
                        content_index=0, text=text, logprobs=logprobs or [],
                    ),
                    self._event(
                        "response.content_part.done", item_id=item_id, output_index=index,
                        content_index=0, part=item["content"][0],
                    ),
                ]  # fmt: skip
            events.append(self._event("response.output_item.done", output_index=index, item=item))
            self._items.append(item)
            self._open, self._open_text = None, ""
        return events

    def _call_delta(self, delta) -> list[dict]:
        events = []
        item = self._calls.get(delta.index)
        if item is None:
            # A call starts: the text (or thinking) before it ends, and so do the calls
            # before it (the model writes its calls one after another).
            events += self._close_text()
            for earlier in sorted(index for index in self._calls if index < delta.index):
                events += self._close_call(earlier)
            item = _call_item(_new_id("fc"), delta.id, delta.name, "", "in_progress")
            self._calls[delta.index] = item
            item["_output_index"] = len(self._items) + len(self._calls) - 1
            public = {k: v for k, v in item.items() if not k.startswith("_")}
            events.append(
                self._event(
                    "response.output_item.added", output_index=item["_output_index"], item=public
                )
            )
        if delta.arguments:
            item["arguments"] += delta.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=item["_output_index"],
                    delta=delta.arguments,
                )  # fmt: skip
            )
        return events

    def _close_call(self, call_index: int) -> list[dict]:
        item = self._calls.pop(call_index)
        output_index = item.pop("_output_index")
        item["status"] = "completed"
        self._items.append(item)
        return [
            self._event(
                "response.function_call_arguments.done", item_id=item["id"],
                output_index=output_index, arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=output_index, item=item),
        ]  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
