"""The HTTP API's request reading and chunking (frontend/openai_protocol.py), in this
process on the tiny model's real engine: what the end-to-end tests cannot pin down
exactly (defaults, limits, the names in errors, when a stream chunk is due)."""

from __future__ import annotations

import json
import logging

import pytest

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.openai_answers import TokenTexts, whole_response
from pagedserve.frontend.openai_protocol import parse_request
from pagedserve.frontend.openai_streams import StreamWriter
from pagedserve.frontend.outputs import CompletionOutput, RequestOutput

GREEDY_DEFAULT = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def llm(server_model_dir) -> LLM:
    return LLM(server_model_dir, num_blocks=40)  # 640 tokens: more than the 512 window


def parse(llm, body, kind="completion", default=GREEDY_DEFAULT):
    return parse_request(kind, body, llm, default, "m", None)


def refusal(llm, body, kind="completion") -> CallError:
    with pytest.raises(CallError) as caught:
        parse(llm, body, kind)
    return caught.value


def test_defaults_follow_openai_and_the_model(llm):
    request = parse(llm, {"prompt": [5, 6, 7]})
    assert request.params[0].max_tokens == 16  # OpenAI's completions default
    assert request.params[0].temperature == 0.0  # the model's default, as gRPC's
    sampled = parse(llm, {"prompt": [5]}, default=SamplingParams(temperature=0.7))
    assert sampled.params[0].temperature == 0.7
    assert parse(llm, {"prompt": [5], "temperature": 1.2}).params[0].temperature == 1.2
    # The model's other sampling defaults (generation_config.py) fill what is left unset.
    model = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    filled = parse(llm, {"prompt": [5], "top_k": 3}, default=model).params[0]
    assert (filled.temperature, filled.top_k, filled.top_p, filled.min_p) == (0.7, 3, 0.8, 0.0)
    assert filled.repetition_penalty == 1.05
    beams = parse(llm, {"prompt": [5], "use_beam_search": True, "n": 2}, default=model)
    assert (beams.params[0].temperature, beams.params[0].beam_width) == (0.0, 2)
    # Chat: the rest of the window by default.
    chat = parse(llm, {"messages": [{"role": "user", "content": "hi"}]}, "chat")
    assert chat.params[0].max_tokens == 512 - len(chat.prompts[0].token_ids)
    explicit = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    assert parse(llm, explicit, "chat").params[0].max_tokens == 3
    # An unset max_tokens rises to min_tokens, within the room the prompt leaves.
    raised = parse(llm, {"prompt": [5], "min_tokens": 40}).params[0]
    assert (raised.min_tokens, raised.max_tokens) == (40, 40)
    error = refusal(llm, {"prompt": [5] * 500, "min_tokens": 40})
    assert error.param == "min_tokens" and "leaves at most 12" in error.message


def test_the_default_limit_fits_the_cache_for_every_sequence(llm):
    # n = 2 sequences may each need their own blocks: 40 // 2 = 20 blocks = 320 tokens.
    chat = parse(llm, {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "chat")
    assert chat.params[0].max_tokens == 320 - len(chat.prompts[0].token_ids)
    llm.engine.check_request_fits(
        len(chat.prompts[0].token_ids), chat.params[0].max_tokens, chat.params[0].num_sequences
    )


def test_batched_prompts_get_one_params_each(llm):
    request = parse(llm, {"prompt": ["hello", [5, 6]], "max_tokens": 4})
    assert [p.text for p in request.prompts] == ["hello", None]
    assert request.prompts[1].token_ids == [5, 6]
    assert [p.max_tokens for p in request.params] == [4, 4]
    error = refusal(llm, {"prompt": ["ok", [5, 99999]]})
    assert error.param == "prompt[1]" and "outside the vocabulary" in error.message
    with pytest.raises(CallError) as caught:
        parse_request("completion", {"prompt": ["a"] * 5}, llm, GREEDY_DEFAULT, "m", None, 4)
    assert caught.value.param == "prompt"
    assert "a batch of 5 prompts; this server takes at most 4" in caught.value.message


def test_beam_search_as_vllm_spells_it(llm):
    request = parse(llm, {"prompt": [5], "use_beam_search": True, "best_of": 3, "n": 2})
    params = request.params[0]
    assert (params.beam_width, params.n, params.temperature) == (3, 2, 0.0)
    error = refusal(llm, {"prompt": [5], "use_beam_search": True, "temperature": 0.5})
    assert error.param == "temperature" and "beam search is greedy" in error.message
    error = refusal(llm, {"prompt": [5], "length_penalty": 0.5})
    assert error.param == "length_penalty" and "use_beam_search" in error.message


def test_errors_use_the_requests_own_field_names(llm):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    error = refusal(llm, {**chat, "max_completion_tokens": 0}, "chat")
    assert error.param == "max_completion_tokens"
    assert error.message.startswith("max_completion_tokens must be >= 1")
    error = refusal(llm, {**chat, "logprobs": True, "top_logprobs": 25}, "chat")
    assert error.param == "top_logprobs" and "in [0, 20], got 25" in error.message
    error = refusal(llm, {"prompt": [5], "min_tokens": 9, "max_tokens": 3})
    assert error.param == "min_tokens"
    error = refusal(llm, {"prompt": [5], "echo": "yes"})
    assert error.param == "echo" and "must be a boolean" in error.message
    error = refusal(llm, {"prompt": [5], "model": "other"})
    assert error.code == "NOT_FOUND"


def test_unknown_fields_are_ignored_and_logged(llm, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedserve.server"):
        request = parse(llm, {"prompt": [5], "frobnicate": 1, "user": "u1"})
    assert request.params[0].max_tokens == 16
    assert "frobnicate" in caplog.text and "user" not in caplog.text


def grown(output: RequestOutput, token_ids: list[int], text: str, finish=None) -> RequestOutput:
    output.outputs[0].token_ids = list(token_ids)
    output.outputs[0].text = text
    output.outputs[0].finish_reason = finish
    output.finished = finish is not None
    return output


def test_stream_chunks_carry_what_is_new_and_respect_the_interval(llm):
    request = parse(llm, {"prompt": [5, 6], "max_tokens": 6, "stream": True}, "completion")
    writer = StreamWriter(request, "cmpl-x", 0, llm, TokenTexts(llm), interval_tokens=3)
    output = RequestOutput(
        "r", None, [5, 6], outputs=[CompletionOutput(0, "", [], None)], finished=False
    )
    first = writer.chunks(grown(output, [10], "a"))  # the first token goes at once
    assert [c["choices"][0]["text"] for c in first] == ["a"]
    assert writer.chunks(grown(output, [10, 11], "ab")) == []  # 1 new token < 3
    assert writer.chunks(grown(output, [10, 11, 12], "abc")) == []  # 2 new
    due = writer.chunks(grown(output, [10, 11, 12, 13], "abcd"))  # 3 new
    assert [c["choices"][0]["text"] for c in due] == ["bcd"]
    end = writer.chunks(grown(output, [10, 11, 12, 13, 14], "abcde", finish="length"))
    assert end[0]["choices"][0]["text"] == "e"
    assert end[0]["choices"][0]["finish_reason"] == "length"
    assert all(c["id"] == "cmpl-x" and c["object"] == "text_completion" for c in first + end)


def test_a_streamed_choice_starts_with_its_first_token_and_the_whole_prompts_logprobs(llm):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True, "prompt_logprobs": 1}
    request = parse(llm, body)
    writer = StreamWriter(request, "cmpl-y", 0, llm, TokenTexts(llm), interval_tokens=8)
    output = RequestOutput(
        "r", None, [5, 6, 7], outputs=[CompletionOutput(0, "", [], None)], finished=False
    )
    # A chunked prefill reports the prompt's logprobs piece by piece, before any token.
    output.prompt_logprobs = [None, {6: -1.5, 9: -0.5}]
    assert writer.chunks(output) == []
    output.prompt_logprobs.append({7: -2.0})
    first = writer.chunks(grown(output, [10], "a"))  # at once, despite the interval of 8
    assert len(first) == 1 and first[0]["choices"][0]["text"] == "a"
    reported = first[0]["choices"][0]["prompt_logprobs"]
    assert reported[0] is None and len(reported) == 3
    assert reported[1]["6"]["logprob"] == -1.5 and reported[2]["7"]["logprob"] == -2.0
    later = writer.chunks(grown(output, [10, 11, 12, 13], "abcd", finish="length"))
    assert "prompt_logprobs" not in later[0]["choices"][0]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_choice_becomes_a_constraint_or_a_reader(llm):
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL]}
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = parse(llm, {**chat, "tool_choice": named}, "chat")
    constraint = request.params[0].structured_outputs
    assert constraint is not None
    assert json.loads(constraint.json) == WEATHER_TOOL["function"]["parameters"]
    required = parse(llm, {**chat, "tool_choice": "required"}, "chat")
    assert json.loads(required.params[0].structured_outputs.json)["type"] == "array"
    # "auto" reads the model's format; without a parser on the server it is refused.
    auto = parse_request("chat", chat, llm, GREEDY_DEFAULT, "m", None, 8, "hermes")
    assert auto.chat_reading.tool_calling.mode == "auto"
    assert auto.params[0].structured_outputs is None
    assert refusal(llm, chat, "chat").param == "tool_choice"
    none = parse(llm, {**chat, "tool_choice": "none"}, "chat")
    assert none.chat_reading.tool_calling is None and none.params[0].structured_outputs is None
    # The template got the tools (this one ignores them: the same prompt either way).
    assert (
        none.prompts[0].token_ids
        == parse(llm, {"messages": chat["messages"]}, "chat").prompts[0].token_ids
    )
    two = {**chat, "tool_choice": "required", "response_format": {"type": "json_object"}}
    error = refusal(llm, two, "chat")
    assert error.param == "response_format" and "give one" in error.message
    error = refusal(llm, {**chat, "tools": None, "tool_choice": "required"}, "chat")
    assert error.param == "tool_choice" and "needs tools" in error.message
    error = refusal(llm, {**chat, "functions": [WEATHER_TOOL["function"]]}, "chat")
    assert error.param == "functions" and "tools" in error.message


def test_streamed_tool_calls_add_up_to_the_whole_answer(llm):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER_TOOL],
        "stream": True,
    }
    request = parse_request("chat", body, llm, GREEDY_DEFAULT, "m", None, 8, "hermes")
    writer = StreamWriter(request, "chatcmpl-t", 0, llm, TokenTexts(llm), interval_tokens=1)
    output = RequestOutput("r", None, [5], outputs=[CompletionOutput(0, "", [], None)])
    text = 'On it.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    deltas = []
    for end in range(1, len(text) + 1):
        finish = "stop" if end == len(text) else None
        for chunk in writer.chunks(grown(output, list(range(end)), text[:end], finish)):
            deltas.append(chunk["choices"][0])
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "On it."
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]
    # Held-back text (a tag, the call being written) sends no empty chunks.
    assert all(d["delta"] or d["finish_reason"] for d in deltas)
    whole = whole_response(request, [grown(output, [1], text, "stop")], llm)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "On it."
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_thinking_streams_apart_and_tool_calls_are_read_from_the_answer(llm, include_reasoning):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER_TOOL],
        "stream": True,
        "include_reasoning": include_reasoning,
    }
    request = parse_request("chat", body, llm, GREEDY_DEFAULT, "m", None, 8, "hermes", "qwen3")
    writer = StreamWriter(request, "chatcmpl-r", 0, llm, TokenTexts(llm), interval_tokens=1)
    output = RequestOutput("r", None, [5], outputs=[CompletionOutput(0, "", [], None)])
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    text = "<think>Weather: ask the tool.</think>On it." + call
    deltas = []
    for end in range(1, len(text) + 1):
        finish = "stop" if end == len(text) else None
        for chunk in writer.chunks(grown(output, list(range(end)), text[:end], finish)):
            deltas.append(chunk["choices"][0]["delta"])
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == ("Weather: ask the tool." if include_reasoning else "")
    assert "".join(d.get("content") or "" for d in deltas) == "On it."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    whole = whole_response(request, [grown(output, [1], text, "stop")], llm)
    message = whole["choices"][0]["message"]
    assert message["content"] == "On it." and len(message["tool_calls"]) == 1
    assert message.get("reasoning_content") == (
        "Weather: ask the tool." if include_reasoning else None
    )
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    # Thinking only (cut short): no answer.
    no_tools = {key: value for key, value in body.items() if key != "tools"}
    thinking = parse_request(
        "chat", no_tools, llm, GREEDY_DEFAULT, "m", None, 8, None, "deepseek_r1"
    )
    body_only = whole_response(thinking, [grown(output, [1], "Hmm", "length")], llm)
    assert body_only["choices"][0]["message"]["content"] is None


def test_the_logprobs_limit_is_the_engines_max_logprobs(server_model_dir):
    wide = LLM(server_model_dir, num_blocks=40, max_logprobs=30)
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    assert parse(wide, {**chat, "top_logprobs": 30}, "chat").logprobs == 30
    assert parse(wide, {"prompt": [5], "logprobs": 30}).logprobs == 30
    error = refusal(wide, {**chat, "top_logprobs": 31}, "chat")
    assert error.param == "top_logprobs" and "in [0, 30], got 31" in error.message
