"""A completions or chat answer that did not stream, whole, and the parts streamed answers
share: the answer's id, finish reason and usage, and logprobs in OpenAI's two formats (the
legacy completions one and chat's) and vLLM's prompt logprobs.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.frontend.chat_request import ChatAnswer, ChatReading
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.openai_prompts import Prompt
    from pagedserve.frontend.openai_protocol import ApiRequest
    from pagedserve.frontend.outputs import CompletionOutput, RequestOutput, ToolCall


def response_id(request: ApiRequest) -> str:
    """The answer's id: the client's request id (``X-Request-Id`` or ``request_id``) after
    OpenAI's prefix, as vLLM names it, so a client can match answers to requests; a
    random one when the client named none."""
    prefix = "cmpl-" if request.kind == "completion" else "chatcmpl-"
    return prefix + (request.client_request_id or uuid.uuid4().hex)


def finish_reason(completion: CompletionOutput) -> str | None:
    """OpenAI's: "stop" (EOS, a stop token or string) or "length"; an output the
    engine aborted has none (its call ended with an error instead)."""
    return completion.finish_reason if completion.finish_reason in ("stop", "length") else None


def usage(outputs: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }


class TokenTexts:
    """Each token as logprobs name it (``__call__``: its own text, ``tokenizer.decode([id])``,
    or ``"token_id:<id>"`` when asked or without a tokenizer) and its text (``text``: what it
    adds to the output, for offsets); cached."""

    def __init__(self, llm: LLM, as_token_ids: bool = False) -> None:
        self._tokenizer = llm.tokenizer
        self._as_token_ids = as_token_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self._as_token_ids:
            return f"token_id:{token_id}"
        return self.text(token_id)

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, float] | None],
    k: int,
    text_offset_start: int,
    texts: TokenTexts,
) -> dict:
    """The legacy completions format: tokens, their logprobs, the top ``k`` per token,
    and each token's character offset."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset_start
    for token_id, entry in zip(token_ids, entries, strict=True):
        tokens.append(texts(token_id))
        offsets.append(offset)
        offset += len(texts.text(token_id))
        if entry is None:  # the prompt's first token: nothing predicts it
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.get(token_id))
        top_logprobs.append({texts(t): lp for t, lp in _top(entry, k)})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], k: int, texts: TokenTexts
) -> dict:
    """The chat format: per token its text, logprob, UTF-8 bytes and the top ``k``."""

    def item(token_id: int, logprob: float) -> dict:
        return {
            "token": texts(token_id),
            "logprob": logprob,
            "bytes": list(texts.text(token_id).encode()),
        }

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        chosen = item(token_id, entry[token_id])
        chosen["top_logprobs"] = [item(t, lp) for t, lp in _top(entry, k)]
        content.append(chosen)
    return {"content": content}


def prompt_logprobs(output: RequestOutput, texts: TokenTexts) -> list[dict | None]:
    """vLLM's format: per prompt token (None for the first, which nothing predicts), each
    token id's logprob and text."""
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": logprob, "decoded_token": texts(token_id)}
            for token_id, logprob in entry.items()
        }
        for entry in output.prompt_logprobs or []
    ]


def whole_response(request: ApiRequest, outputs: list[RequestOutput], llm: LLM) -> dict:
    """The answer of a call that did not stream: every choice in full."""
    texts = TokenTexts(llm, request.tokens_as_ids)
    choices = []
    for prompt_index, (prompt, output) in enumerate(zip(request.prompts, outputs, strict=True)):
        num_outputs = len(output.outputs)
        for completion in output.outputs:
            index = prompt_index * num_outputs + completion.index
            if request.chat_reading is not None:
                answer = request.chat_reading.whole(completion.text, finish_reason(completion))
                message = _chat_message(request.chat_reading, answer)
                if request.chat_echo:
                    message["content"] = request.chat_echo + (message["content"] or "")
                choice = {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": answer.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
                if request.logprobs is not None and completion.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(
                        completion.token_ids, completion.logprobs, request.logprobs, texts
                    )
            else:
                prefix = echo_text(request, prompt, output, llm)
                choice = {
                    "index": index,
                    "text": prefix + completion.text,
                    "logprobs": None,
                    "finish_reason": finish_reason(completion),
                    "stop_reason": completion.stop_reason,
                }
                if request.logprobs is not None and completion.logprobs is not None:
                    token_ids, entries = list(completion.token_ids), list(completion.logprobs)
                    if request.echo:
                        token_ids = list(output.prompt_token_ids) + token_ids
                        entries = list(output.prompt_logprobs or []) + entries
                    choice["logprobs"] = completion_logprobs(
                        token_ids, entries, request.logprobs, 0, texts
                    )
            if request.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs(output, texts)
            if request.return_token_ids:
                if request.kind == "completion":
                    choice["prompt_token_ids"] = list(output.prompt_token_ids)
                choice["token_ids"] = list(completion.token_ids)
            choices.append(choice)
    response = {
        "id": response_id(request),
        "object": "chat.completion" if request.kind == "chat" else "text_completion",
        "created": request.created_s,
        "model": request.model,
        "choices": choices,
        "usage": usage(outputs),
    }
    if request.return_token_ids and request.kind == "chat":
        response["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
    return response


def _chat_message(reading: ChatReading, answer: ChatAnswer) -> dict[str, Any]:
    """A whole answer's assistant message: content (null beside calls or thinking when
    empty, as vLLM writes it), the calls, the thinking."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["content"] = answer.content or None
        message["tool_calls"] = [_openai_call(call) for call in answer.tool_calls]
    if reading.reasoning is not None:
        message["content"] = message["content"] or None
        if reading.include_reasoning:
            message["reasoning_content"] = answer.reasoning or None
    return message


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def echo_text(request: ApiRequest, prompt: Prompt, output: RequestOutput, llm: LLM) -> str:
    if not request.echo:
        return ""
    if prompt.text is not None:
        return prompt.text
    if llm.tokenizer is None:
        return ""
    return llm.tokenizer.decode(list(output.prompt_token_ids), skip_special_tokens=False)
