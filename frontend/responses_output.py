"""A Responses call's answer, from its chat answer: the response object and its output
items (the thinking as a ``reasoning`` item, the text as a ``message``, the calls as
``function_call`` items), whole, queued or in progress, failed or cancelled, or streamed as
OpenAI's typed events.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.openai_answers import TokenTexts, chat_logprobs, finish_reason
from pagedserve.frontend.openai_responses import new_id

if TYPE_CHECKING:
    from pagedserve.frontend.chat_request import ChatAnswerStream
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.openai_protocol import ApiRequest
    from pagedserve.frontend.openai_responses import ResponsesCall
    from pagedserve.frontend.outputs import RequestOutput

# A failed background response's error code (OpenAI's) by how its call ended.
_ERROR_CODES = {"INVALID_ARGUMENT": "invalid_prompt", "RESOURCE_EXHAUSTED": "rate_limit_exceeded"}


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
    cached = output.num_cached_tokens
    # Written to the prefix cache: the prompt's full blocks this call computed (the
    # others came from the cache); none without prefix caching.
    whole_blocks = input_tokens // llm.block_size * llm.block_size
    cache_write = max(0, whole_blocks - cached) if llm.enable_prefix_caching else 0
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": cache_write},
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


def _event_logprobs(logprobs: list | None) -> list:
    """The text events' logprobs: OpenAI's text delta and done events carry each token's
    ``token``, ``logprob`` and ``top_logprobs`` without the ``bytes`` the output part has."""
    return [
        {
            "token": entry["token"],
            "logprob": entry["logprob"],
            "top_logprobs": [
                {"token": top["token"], "logprob": top["logprob"]}
                for top in entry.get("top_logprobs", [])
            ],
        }
        for entry in logprobs or []
    ]


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
        items.append(_reasoning_item(new_id("rs"), answer.reasoning))
    if answer.content or not answer.tool_calls:
        texts = TokenTexts(llm, api_request.tokens_as_ids)
        logprobs = _logprobs(api_request, completion.token_ids, completion.logprobs, texts)
        items.append(_message_item(new_id("msg"), answer.content, logprobs, "completed"))
    items += [
        _call_item(new_id("fc"), c.id, c.name, c.arguments, "completed") for c in answer.tool_calls
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
            # OpenAI's last event: response.incomplete when the output ran out of tokens
            # (its SDK's stream helper then hands over no final response, as with OpenAI).
            last = (
                "response.incomplete"
                if response["status"] == "incomplete"
                else "response.completed"
            )
            events.append(self._event(last, response=copy.deepcopy(response)))
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
                    logprobs=_event_logprobs(logprobs),
                )  # fmt: skip
            )
        return events

    def _open_item(self, kind: str) -> list[dict]:
        index = len(self._items)
        if kind == "reasoning":
            self._open = {"id": new_id("rs"), "type": "reasoning"}
            added = {**self._open, "summary": [], "content": [], "status": "in_progress"}
            return [self._event("response.output_item.added", output_index=index, item=added)]
        self._open = {"id": new_id("msg"), "type": "message"}
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
                        content_index=0, text=text, logprobs=_event_logprobs(logprobs),
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
            item = _call_item(new_id("fc"), delta.id, delta.name, "", "in_progress")
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
