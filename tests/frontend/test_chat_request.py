"""A chat's output read as both APIs read it (frontend/chat_request.py), and the gRPC API's
chat messages (frontend/grpc_convert.py), without a model: thinking, answer and calls
apart, a stream fed a character at a time adding up to the whole answer; a ``Chat`` from
OpenAI's shapes and back to what the template gets, and its errors under the proto's
field names."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.frontend.chat_request import ChatReading
from pagedserve.frontend.grpc_convert import (
    chat_from_proto,
    chat_reading_from_proto,
    chat_to_proto,
)
from pagedserve.frontend.reasoning import ReasoningParser
from pagedserve.frontend.tool_calls import ToolCalling, chat_message_tool_fields, parse_tools
from pagedserve.v1 import generation_pb2 as pb

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
THINKING = "<think>Ask the tool.</think>"
# gpt-oss's harmony format: thinking, a preamble for the user, a call (its <|call|>, an
# end-of-sequence token, not in the text).
HARMONY = (
    "<|channel|>analysis<|message|>Ask the tool.<|end|><|start|>assistant"
    "<|channel|>commentary<|message|>On it.<|end|><|start|>assistant to=functions.get_weather"
    '<|channel|>commentary json<|message|>{"city": "Oslo"}'
)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Oslo."
)


def reading(parser: str | None, reasoning: str | None, include_reasoning: bool = True):
    calling = None
    if parser is not None:
        calling = ToolCalling(parse_tools([WEATHER]), "auto", True, parser)
    return ChatReading(
        calling, None if reasoning is None else ReasoningParser(reasoning), include_reasoning
    )


CASES = [
    # (reading, text, content, reasoning, calls, finish reason)
    (reading("hermes", "qwen3"), THINKING + "On it." + CALL, "On it.", "Ask the tool.", 1,
     "tool_calls"),
    (reading("hermes", "qwen3", False), THINKING + "On it." + CALL, "On it.", "", 1,
     "tool_calls"),
    (reading("hermes", None), "On it." + CALL, "On it.", "", 1, "tool_calls"),
    (reading(None, "deepseek_r1"), "Hmm.</think>Oslo.", "Oslo.", "Hmm.", 0, "stop"),
    (reading(None, None), "<think>a</think>b" + CALL, "<think>a</think>b" + CALL, "", 0,
     "stop"),
    # Harmony's reader reads the whole output: the same calls with or without the
    # reasoning parser, and never the thinking as content.
    (reading("openai", "openai_gptoss"), HARMONY, "On it.", "Ask the tool.", 1, "tool_calls"),
    (reading("openai", None), HARMONY, "On it.", "", 1, "tool_calls"),
    (reading(None, "openai_gptoss"), HARMONY_ANSWER, "Oslo.", "Hmm.", 0, "stop"),
    (reading(None, "openai_gptoss"), HARMONY, "On it.", "Ask the tool.", 0, "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("chat", "text", "content", "reasoning", "num_calls", "finish"), CASES)
def test_a_stream_adds_up_to_the_whole_answer(chat, text, content, reasoning, num_calls, finish):
    answer = chat.whole(text, "stop")
    assert (answer.content, answer.reasoning, answer.finish_reason) == (content, reasoning, finish)
    assert len(answer.tool_calls) == num_calls
    if num_calls:
        call = answer.tool_calls[0]
        assert call.id.startswith("call_") and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Oslo"}
    stream = chat.stream()
    got_content = got_reasoning = ""
    calls: list[list[str]] = []
    for end in range(1, len(text) + 1):
        delta = stream.feed(text[:end], final=end == len(text))
        got_content += delta.content
        got_reasoning += delta.reasoning
        for call_delta in delta.tool_calls:
            if call_delta.index == len(calls):
                calls.append([call_delta.name, ""])
            calls[call_delta.index][1] += call_delta.arguments
        # No marker leaks into either part while it may still be arriving.
        assert "<" not in delta.reasoning
    assert (got_content, got_reasoning) == (content, reasoning)
    assert calls == [[call.name, call.arguments] for call in answer.tool_calls]
    assert stream.finish_reason("stop") == finish
    assert stream.finish_reason("length") == "length"


class _Tokenizer:
    special_token_texts = frozenset({"<|start|>", "<|channel|>", "<|message|>", "<|end|>"})


class _Model:
    tokenizer = _Tokenizer()


def test_harmonys_readers_ask_for_its_special_tokens():
    """o200k_harmony's markers are special tokens: either gpt-oss parser keeps them in
    the text."""
    assert reading("openai", None).keeps_special_tokens(_Model())
    assert reading(None, "openai_gptoss").keeps_special_tokens(_Model())
    assert not reading("hermes", "qwen3").keeps_special_tokens(_Model())


CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]  # fmt: skip


def test_a_chat_reaches_the_template_as_the_http_apis_does():
    chat = chat_to_proto(CONVERSATION, [WEATHER], "required", parallel_tool_calls=False)
    conversation, tools = chat_from_proto(pb.Chat.FromString(chat.SerializeToString()))
    want = []
    for position, message in enumerate(CONVERSATION):
        entry = {"role": message["role"], "content": message["content"] or ""}
        entry.update(chat_message_tool_fields(message, f"messages[{position}]"))
        want.append(entry)
    assert conversation == want
    assert [tool.definition for tool in tools] == [WEATHER]
    read = chat_reading_from_proto(chat, tools, None, None)
    assert read.tool_calling.mode == "required" and not read.tool_calling.parallel_tool_calls
    assert read.reasoning is None and read.include_reasoning
    # Arguments given as an object travel as JSON text.
    as_object = json.loads(json.dumps(CONVERSATION))
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    assert chat_to_proto(as_object).messages[1].tool_calls[0].arguments == '{"city": "Oslo"}'
    named = chat_to_proto(CONVERSATION, [WEATHER], {"function": {"name": "get_weather"}})
    assert named.tool_choice.function_name == "get_weather"
    assert chat_reading_from_proto(named, tools, None, None).tool_calling.mode == "named"
    # "none" reads nothing, as no tools; a server's reasoning parser reads the thinking.
    none = chat_reading_from_proto(
        chat_to_proto(CONVERSATION, [WEATHER], "none"), tools, None, None
    )
    assert none.tool_calling is None
    thinking = chat_reading_from_proto(
        chat_to_proto(CONVERSATION[:1], include_reasoning=False), None, "hermes", "qwen3"
    )
    assert thinking.reasoning.name == "qwen3" and not thinking.include_reasoning


def refusal(chat: pb.Chat, tool_call_parser: str | None = None) -> str:
    with pytest.raises(ValueError) as caught:
        _, tools = chat_from_proto(chat)
        chat_reading_from_proto(chat, tools, tool_call_parser, None)
    return str(caught.value)


def test_bad_chats_are_refused_under_the_proto_field_names():
    user = CONVERSATION[:1]
    bad_json = pb.Chat(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="hi")])
    bad_json.tools.add(name="f", parameters="{city: Oslo")
    not_object = pb.Chat(messages=bad_json.messages)
    not_object.tools.add(name="f", parameters="[1]")
    bad_arguments = json.loads(json.dumps(CONVERSATION))
    bad_arguments[1]["tool_calls"][0]["function"]["arguments"] = "{city"
    no_call_id = [*CONVERSATION[:2], {"role": "tool", "content": "-3 C"}]
    cases = [
        (chat_to_proto(user, [WEATHER]), "chat.tool_choice='auto' (the default when tools are "
         "given) needs a server started with --enable-auto-tool-choice"),
        (pb.Chat(messages=bad_json.messages, tool_choice=pb.ToolChoice(mode=7)),
         "chat.tool_choice.mode is 7, which is no ToolChoiceMode value this server knows"),
        (pb.Chat(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_UNSPECIFIED)]),
         "chat.messages[0].role is CHAT_ROLE_UNSPECIFIED; set one of CHAT_ROLE_SYSTEM, "
         "CHAT_ROLE_DEVELOPER, CHAT_ROLE_USER, CHAT_ROLE_ASSISTANT, CHAT_ROLE_TOOL"),
        (chat_to_proto(user, [WEATHER], {"function": {"name": "get_news"}}),
         "chat.tool_choice.function_name='get_news' is not one of the tools (get_weather)"),
        (chat_to_proto(user, None, "required"), "chat.tool_choice needs chat.tools to choose"),
        (chat_to_proto(user, [{"type": "function", "function": {"name": "get weather"}}],
                       "required"), "chat.tools[0].name must be 1 to 64 letters"),
        (chat_to_proto(user, [WEATHER, WEATHER], "required"),
         "chat.tools[1].name: 'get_weather' names two tools"),
        (bad_json, "chat.tools[0].parameters is not valid JSON"),
        (not_object, "chat.tools[0].parameters must be a JSON schema (an object), got [1]"),
        (chat_to_proto(bad_arguments), "chat.messages[1].tool_calls[0].arguments is not valid "
         "JSON"),
        (chat_to_proto(no_call_id), "chat.messages[2].tool_call_id must name the call"),
        (chat_to_proto([{**CONVERSATION[1], "role": "user"}]),
         "chat.messages[0].tool_calls: only an assistant's message makes tool calls"),
        (pb.Chat(messages=bad_json.messages, tool_choice=pb.ToolChoice()),
         "chat.tool_choice is set but holds neither mode nor function_name"),
    ]  # fmt: skip
    for chat, words in cases:
        assert words in refusal(chat), (chat, refusal(chat))
    # The client's side names OpenAI's words, before anything is sent.
    client_cases = [
        (lambda: chat_to_proto(user, [WEATHER], "always"),
         "tool_choice must be one of none, auto, required; got 'always'"),
        (lambda: chat_to_proto([{"role": "wizard", "content": "hi"}]),
         "messages[0].role must be one of system, developer, user, assistant, tool; got "
         "'wizard'"),
        (lambda: chat_to_proto(user, reasoning_effort="max"),
         "reasoning_effort must be one of low, medium, high; got 'max'"),
    ]  # fmt: skip
    for build, words in client_cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            build()
    # With a parser on the server, "auto" is taken.
    _, tools = chat_from_proto(cases[0][0])
    assert chat_reading_from_proto(cases[0][0], tools, "hermes", None).tool_calling.mode == "auto"
