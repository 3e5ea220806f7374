"""A streamed completions or chat answer's chunks: per choice, what it has been sent, so
each chunk carries only what is new (``--stream-interval`` tokens at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.openai_answers import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echo_text,
    finish_reason,
    prompt_logprobs,
    usage,
)

if TYPE_CHECKING:
    from pagedserve.frontend.chat_request import ChatAnswerStream
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.openai_protocol import ApiRequest
    from pagedserve.frontend.outputs import RequestOutput
    from pagedserve.frontend.tool_calls import ToolCallDelta


def _openai_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` delta: the first of a call names it and carries its id."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {
        "index": delta.index,
        "id": delta.id,
        "type": "function",
        "function": {"name": delta.name, "arguments": delta.arguments},
    }


@dataclass
class _ChoiceCursor:
    """How much of one choice a stream has sent."""

    text_chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    started: bool = False
    finished: bool = False
    chat: ChatAnswerStream | None = None  # a chat request: its reader


class StreamWriter:
    """The chunks of a streamed answer for one prompt of a request: each carries only
    what is new since the last, and the first of a chat choice names the role."""

    def __init__(
        self,
        request: ApiRequest,
        response_id: str,
        prompt_index: int,
        llm: LLM,
        texts: TokenTexts,
        interval_tokens: int,
    ) -> None:
        self._request = request
        self._id = response_id
        self._prompt_index = prompt_index
        self._llm = llm
        self._texts = texts
        self._interval_tokens = interval_tokens
        self._cursors: dict[int, _ChoiceCursor] = {}

    def chunks(self, output: RequestOutput) -> list[dict]:
        """The chunks for what changed (none when too little did for the interval)."""
        if not self._due(output):
            return []
        request = self._request
        chunks = []
        num_outputs = len(output.outputs)
        for completion in output.outputs:
            cursor = self._cursors.get(completion.index)
            if cursor is None:
                cursor = self._cursors[completion.index] = _ChoiceCursor()
                if request.chat_reading is not None:
                    cursor.chat = request.chat_reading.stream()
            new_text = completion.text[cursor.text_chars :]
            new_tokens = completion.token_ids[cursor.tokens :]
            new_entries = (
                [] if completion.logprobs is None else completion.logprobs[cursor.logprobs :]
            )
            reason = finish_reason(completion)
            newly_finished = reason is not None and not cursor.finished
            new_logprobs = request.logprobs is not None and bool(new_entries)
            call_deltas: list[dict] = []
            new_reasoning = ""
            if cursor.chat is not None:
                read = cursor.chat.feed(completion.text, reason is not None)
                new_text, new_reasoning = read.content, read.reasoning
                call_deltas = [_openai_call_delta(delta) for delta in read.tool_calls]
                reason = cursor.chat.finish_reason(reason)
            if not cursor.started and not (new_tokens or newly_finished):
                # The prompt still being prefilled (a chunked prefill reports its prompt
                # logprobs piece by piece): a choice starts with its first token, when the
                # prompt's are all there.
                continue
            news = new_text or new_reasoning or call_deltas or new_logprobs or newly_finished
            if cursor.started and not news:
                continue  # tokens whose text the detokenizer (or a parser) holds back
            index = self._prompt_index * num_outputs + completion.index
            choice: dict[str, Any] = {"index": index}
            if request.kind == "chat":
                delta: dict[str, Any] = {}
                if not cursor.started:
                    delta["role"] = "assistant"
                    new_text = request.chat_echo + new_text
                if new_reasoning:
                    delta["reasoning_content"] = new_reasoning
                if new_text or not (call_deltas or new_reasoning):
                    delta["content"] = new_text
                if call_deltas:
                    delta["tool_calls"] = call_deltas
                choice["delta"] = delta
                choice["logprobs"] = None
                if request.logprobs is not None and new_entries:
                    choice["logprobs"] = chat_logprobs(
                        new_tokens[: len(new_entries)], new_entries, request.logprobs, self._texts
                    )
            else:
                prefix = ""
                token_ids, entries = new_tokens[: len(new_entries)], list(new_entries)
                offset = cursor.text_chars
                if not cursor.started and request.echo:
                    prompt = request.prompts[self._prompt_index]
                    prefix = echo_text(request, prompt, output, self._llm)
                    if request.logprobs is not None:
                        token_ids = list(output.prompt_token_ids) + token_ids
                        entries = list(output.prompt_logprobs or []) + entries
                choice["text"] = prefix + new_text
                choice["logprobs"] = None
                if request.logprobs is not None and (entries or not cursor.started):
                    choice["logprobs"] = completion_logprobs(
                        token_ids, entries, request.logprobs, offset, self._texts
                    )
            choice["finish_reason"] = reason if newly_finished else None
            choice["stop_reason"] = completion.stop_reason if newly_finished else None
            if request.prompt_logprobs and not cursor.started:
                choice["prompt_logprobs"] = prompt_logprobs(output, self._texts)
            first_of_stream = not any(c.started for c in self._cursors.values())
            if request.return_token_ids:
                if request.kind == "completion" and not cursor.started:
                    choice["prompt_token_ids"] = list(output.prompt_token_ids)
                # Every token since the last chunk, those whose text is held back included.
                choice["token_ids"] = list(new_tokens)
            cursor.started = True
            cursor.finished = cursor.finished or newly_finished
            cursor.text_chars = len(completion.text)
            cursor.tokens = len(completion.token_ids)
            cursor.logprobs += len(new_entries)
            chunk = self.chunk([choice])
            if request.return_token_ids and request.kind == "chat" and first_of_stream:
                chunk["prompt_token_ids"] = list(output.prompt_token_ids)
            if request.continuous_usage:
                chunk["usage"] = usage([output])
            chunks.append(chunk)
        return chunks

    def chunk(self, choices: list[dict]) -> dict:
        request = self._request
        message = {
            "id": self._id,
            "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
            "created": request.created_s,
            "model": request.model,
            "choices": choices,
        }
        if request.include_usage:
            message["usage"] = None
        return message

    def _due(self, output: RequestOutput) -> bool:
        """As ``--stream-interval`` says: the first chunk at once, then once enough new
        tokens are there, and whenever a choice ends."""
        if output.finished or self._interval_tokens <= 1 or not self._cursors:
            return True
        new_tokens = 0
        for completion in output.outputs:
            cursor = self._cursors.get(completion.index)
            if cursor is None or not cursor.started:
                return True  # its first token goes at once (time to first token)
            if finish_reason(completion) is not None and not cursor.finished:
                return True
            new_tokens += len(completion.token_ids) - cursor.tokens
        return new_tokens >= self._interval_tokens
