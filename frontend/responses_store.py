"""The Responses API's memory, in this process: the stored responses (for
``previous_response_id``, ``GET``, ``DELETE``, ``input_items`` and cancel) within a count
and a byte limit, the background responses still running, and a streamed background
response's events (``EventLog``), which a client that lost the stream reads again from any
``sequence_number`` on (``GET /v1/responses/{id}?stream=true&starting_after=N``).
"""

from __future__ import annotations

import asyncio
import copy
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.openai_fields import invalid_field

if TYPE_CHECKING:
    from pagedserve.frontend.openai_responses import ResponsesCall

DEFAULT_RESPONSES_STORE_SIZE = 1024
# What the stored responses (their inputs, outputs and kept events) may take of the server's
# memory, in all; the oldest that have ended go first.
DEFAULT_RESPONSES_STORE_BYTES = 512 << 20


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
