"""Tool calling and reasoning content over gRPC end to end: real server processes, real
gRPC clients (the raw stubs and ``pagedserve.frontend.client``) on 127.0.0.1, and the
HTTP API of the same server asked the same question for comparison.

Two servers share the module, started together, both with the tool template of
``helpers/tool_calls.py`` and JSON without whitespace:

- ``plain``: no parsers: named and required tool choices (no parser needed), the
  refusals, and chats whose text stays whole.
- ``parsing``: ``--tool-call-parser hermes`` and ``--reasoning-parser qwen3`` (which thinks
  only when the output opens ``<think>``): tool_choice "auto" and the thinking apart.

The tiny random model writes garbage when free, so its calls and thinking are forced
(constraints, as in the HTTP tests). Greedy gRPC answers must equal the HTTP API's and
the offline engine's; a stream must add up to the whole answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import pytest

from helpers.grpc_calls import both_rpcs
from helpers.http_calls import post, sse_events
from helpers.server_process import SERVED_MODEL_NAME, ServerProcess
from helpers.tool_calls import (
    CHECKING_CALL,
    CONVERSATION,
    CONVERSATION_RENDERED,
    MAX_TOKENS,
    MESSAGES,
    ONE_TOOL,
    REQUIRED_MAX_TOKENS,
    TOOL_TEMPLATE,
    TOOLS,
    WEATHER,
    streamed_calls,
    whole_calls,
    without_ids,
)
from pagedserve.frontend import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.frontend.client import AsyncClient, Client, stream_request
from pagedserve.frontend.grpc_convert import chat_to_proto
from pagedserve.v1 import generation_pb2 as pb

THINK_THEN_ANSWER = r"<think>Paris is big\.</think>It is Paris\."
THINK_THEN_CALL = r"<think>Ask\.</think>" + CHECKING_CALL
THINK_THEN_CALL_TOKENS = 120  # a byte-level tokenizer: about a token per character
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def servers(server_model_dir, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    """The module's two servers, started at once; each must drain cleanly (exit 0)."""
    common = (
        "--kv-cache-bytes", str(4 << 20), "--http-port", "0",
        "--served-model-name", SERVED_MODEL_NAME, "--structured-outputs-disable-any-whitespace",
        "--chat-template", TOOL_TEMPLATE,
    )  # fmt: skip
    started = {
        "plain": ServerProcess(server_model_dir, tmp_path_factory.mktemp("plain"), *common),
        "parsing": ServerProcess(
            server_model_dir,
            tmp_path_factory.mktemp("parsing"),
            *common,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        ),
    }
    try:
        yield {name: server.wait_serving() for name, server in started.items()}
        for server in started.values():
            assert server.terminate() == 0, server.log()
    finally:
        for server in started.values():
            server.close()


@pytest.fixture
def plain(servers) -> Iterator[ServerProcess]:
    """The server without parsers, checked after the test: nothing left running, every
    block free, the accounting consistent."""
    yield servers["plain"]
    servers["plain"].assert_blocks_all_free()


@pytest.fixture
def parsing(servers) -> Iterator[ServerProcess]:
    """The hermes + qwen3 server, checked after the test as ``plain`` is."""
    yield servers["parsing"]
    servers["parsing"].assert_blocks_all_free()


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(
        server_model_dir,
        num_blocks=128,
        chat_template=TOOL_TEMPLATE,
        structured_outputs_disable_any_whitespace=True,
    )


def chat_request(
    max_tokens: int,
    messages=MESSAGES,
    tools=TOOLS,
    tool_choice=None,
    regex: str | None = None,
    **chat_fields,
) -> pb.GenerateRequest:
    """A greedy gRPC chat request, built from OpenAI's shapes as the Python client does."""
    chat = chat_to_proto(messages, tools, tool_choice, **chat_fields)
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if regex is not None:
        sampling.structured_outputs.regex = regex
    return pb.GenerateRequest(chat=chat, sampling=sampling)


def http_body(max_tokens: int, tools=TOOLS, regex: str | None = None, **fields) -> dict:
    """The same request for the HTTP API."""
    body = {"messages": MESSAGES, "temperature": 0.0, "max_tokens": max_tokens, **fields}
    if tools is not None:
        body["tools"] = tools
    if regex is not None:
        body["structured_outputs"] = {"regex": regex}
    return body


def streamed(server: ServerProcess, request: pb.GenerateRequest) -> dict:
    """A GenerateStream read back (one output): its text, thinking and calls joined, every
    call piece, and the finish reasons of the messages."""
    text = reasoning = ""
    calls: list[dict] = []
    pieces: list[pb.ToolCall] = []
    finishes = []
    for message in server.stub.GenerateStream(stream_request(request), timeout=60):
        for completion in message.outputs:
            assert completion.index == 0
            text += completion.text
            reasoning += completion.reasoning_text
            finishes.append(completion.finish_reason)
            for piece in completion.tool_calls:
                pieces.append(piece)
                if piece.index == len(calls):
                    assert piece.id.startswith("call_") and piece.name, piece
                    calls.append({"id": piece.id, "name": piece.name, "arguments": ""})
                else:
                    assert not piece.id and not piece.name, piece
                calls[piece.index]["arguments"] += piece.arguments
    return {
        "text": text,
        "reasoning": reasoning,
        "calls": calls,
        "pieces": pieces,
        "finishes": [f for f in finishes if f],
    }


def calls_of(completion: pb.Completion) -> list[dict]:
    return [
        {"id": call.id, "name": call.name, "arguments": call.arguments}
        for call in completion.tool_calls
    ]


def http_calls(message: dict) -> list[dict]:
    return [
        {key: value for key, value in call.items() if key != "type"}
        for call in whole_calls(message)
    ]


def refused(server: ServerProcess, request: pb.GenerateRequest) -> str:
    """Both RPCs refuse ``request`` with INVALID_ARGUMENT; the message."""
    details = []
    for call in both_rpcs(server.stub):
        with pytest.raises(grpc.RpcError) as caught:
            call(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        details.append(caught.value.details())
    assert details[0] == details[1]
    return details[0]


# ---------------------------------------------------------------- named and required


def test_a_named_call_matches_the_offline_engine_and_the_http_api(plain, offline):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=WEATHER),
    )
    want = offline.chat(MESSAGES, params, tools=TOOLS)[0].outputs[0]
    assert want.finish_reason == "stop", want
    request = chat_request(MAX_TOKENS, tool_choice=NAMED)
    response = plain.stub.Generate(request, timeout=60)
    (completion,) = response.outputs
    # As OpenAI ends a forced call: STOP, and no content beside it.
    assert completion.finish_reason == pb.FINISH_REASON_STOP
    assert completion.text == "" and completion.reasoning_text == ""
    (call,) = calls_of(completion)
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["arguments"] == want.text
    assert list(completion.token_ids) == want.token_ids  # every token, calls or not

    status, http = post(plain, "/v1/chat/completions", http_body(MAX_TOKENS, tool_choice=NAMED))
    assert status == 200, http
    (choice,) = http["choices"]
    assert without_ids(http_calls(choice["message"])) == without_ids([call])
    assert choice["finish_reason"] == "stop"
    assert http["usage"]["completion_tokens"] == response.usage.completion_tokens

    # The stream sends the arguments as they come: the first piece names the call.
    got = streamed(plain, request)
    assert got["text"] == "" and without_ids(got["calls"]) == without_ids([call])
    first = got["pieces"][0]
    assert first.arguments.startswith("{") and len(first.arguments) < len(call["arguments"])
    assert len(got["pieces"]) >= 2 and {piece.index for piece in got["pieces"]} == {0}
    assert got["finishes"] == [pb.FINISH_REASON_STOP]
    # HTTP's stream adds up to the same call (how it is cut into pieces depends on timing:
    # a reader that falls behind gets several steps at once).
    events = sse_events(
        plain, "/v1/chat/completions", {**http_body(MAX_TOKENS, tool_choice=NAMED), "stream": True}
    )
    content, http_streamed, _, _ = streamed_calls(events)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in http_streamed] == [
        (c["name"], c["arguments"]) for c in got["calls"]
    ]


@pytest.mark.parametrize("parallel_tool_calls", [False, True])
def test_required_calls_match_the_http_api_whole_and_streamed(plain, parallel_tool_calls):
    request = chat_request(
        REQUIRED_MAX_TOKENS, tool_choice="required", parallel_tool_calls=parallel_tool_calls
    )
    (completion,) = plain.stub.Generate(request, timeout=60).outputs
    body = http_body(
        REQUIRED_MAX_TOKENS, tool_choice="required", parallel_tool_calls=parallel_tool_calls
    )
    status, http = post(plain, "/v1/chat/completions", body)
    assert status == 200, http
    (choice,) = http["choices"]
    calls = calls_of(completion)
    assert without_ids(calls) == without_ids(http_calls(choice["message"]))
    assert all(call["name"] in ("get_weather", "get_time") for call in calls)
    assert [call.index for call in completion.tool_calls] == list(range(len(calls)))
    assert completion.text == ""
    if parallel_tool_calls:
        # The model calls on and on: cut at max_tokens inside a third call.
        assert len(calls) == 2 and choice["finish_reason"] == "length"
        assert completion.finish_reason == pb.FINISH_REASON_LENGTH
    else:
        assert len(calls) == 1 and choice["finish_reason"] == "tool_calls"
        assert completion.finish_reason == pb.FINISH_REASON_TOOL_CALLS

    got = streamed(plain, request)
    assert got["text"] == "" and without_ids(got["calls"]) == without_ids(calls)
    assert len({call["id"] for call in got["calls"]}) == len(calls)
    # Each call goes out whole once its object is complete.
    assert [piece.index for piece in got["pieces"]] == list(range(len(calls)))
    assert got["finishes"] == [completion.finish_reason]


# ---------------------------------------------------------------- auto and reasoning


def test_auto_reads_a_hermes_call_as_the_http_api_does(parsing):
    request = chat_request(MAX_TOKENS * 2, regex=CHECKING_CALL)  # "auto": the default
    (completion,) = parsing.stub.Generate(request, timeout=60).outputs
    assert completion.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert completion.text == "Checking.\n" and completion.reasoning_text == ""
    (call,) = calls_of(completion)
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")

    body = http_body(MAX_TOKENS * 2, regex=CHECKING_CALL)
    status, http = post(parsing, "/v1/chat/completions", body)
    assert status == 200, http
    message = http["choices"][0]["message"]
    assert message["content"] == completion.text
    assert without_ids(http_calls(message)) == without_ids([call])

    got = streamed(parsing, request)
    assert got["text"] == "Checking.\n" and without_ids(got["calls"]) == without_ids([call])
    assert len(got["pieces"]) == 1  # hermes' call goes out once its block is closed
    assert got["finishes"] == [pb.FINISH_REASON_TOOL_CALLS]

    # Without a call the answer is text, and the output ends with STOP.
    plain_text = chat_request(MAX_TOKENS, regex=r"Just text\.")
    (completion,) = parsing.stub.Generate(plain_text, timeout=60).outputs
    assert (completion.text, len(completion.tool_calls)) == ("Just text.", 0)
    assert completion.finish_reason == pb.FINISH_REASON_STOP


def test_thinking_comes_apart_whole_and_streamed_as_over_http(parsing, plain):
    request = chat_request(40, tools=None, regex=THINK_THEN_ANSWER)
    (completion,) = parsing.stub.Generate(request, timeout=60).outputs
    assert (completion.reasoning_text, completion.text) == ("Paris is big.", "It is Paris.")
    assert completion.finish_reason == pb.FINISH_REASON_STOP
    status, http = post(
        parsing, "/v1/chat/completions", http_body(40, tools=None, regex=THINK_THEN_ANSWER)
    )
    message = http["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Paris is big.", "It is Paris.")

    got = streamed(parsing, request)
    assert (got["reasoning"], got["text"]) == ("Paris is big.", "It is Paris.")

    hidden = chat_request(40, tools=None, regex=THINK_THEN_ANSWER, include_reasoning=False)
    (completion,) = parsing.stub.Generate(hidden, timeout=60).outputs
    assert (completion.reasoning_text, completion.text) == ("", "It is Paris.")
    assert streamed(parsing, hidden)["reasoning"] == ""

    # A text prompt is continuation, not a chat: its text stays whole.
    text_prompt = pb.GenerateRequest(text="x", sampling=request.sampling)
    (completion,) = parsing.stub.Generate(text_prompt, timeout=60).outputs
    assert completion.text == "<think>Paris is big.</think>It is Paris."
    # So is a chat's on a server without a reasoning parser.
    (completion,) = plain.stub.Generate(request, timeout=60).outputs
    assert (completion.reasoning_text, completion.text) == ("", completion.text)
    assert completion.text == "<think>Paris is big.</think>It is Paris."


def test_tool_calls_are_read_from_the_answer_after_the_thinking(parsing):
    request = chat_request(THINK_THEN_CALL_TOKENS, regex=THINK_THEN_CALL)
    (completion,) = parsing.stub.Generate(request, timeout=60).outputs
    assert (completion.reasoning_text, completion.text) == ("Ask.", "Checking.\n")
    assert [call.name for call in completion.tool_calls] == ["get_weather"]
    assert completion.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    got = streamed(parsing, request)
    assert (got["reasoning"], got["text"]) == ("Ask.", "Checking.\n")
    assert without_ids(got["calls"]) == without_ids(calls_of(completion))

    status, http = post(
        parsing, "/v1/chat/completions", http_body(THINK_THEN_CALL_TOKENS, regex=THINK_THEN_CALL)
    )
    assert status == 200, http
    message = http["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Ask.", "Checking.\n")
    assert without_ids(http_calls(message)) == without_ids(calls_of(completion))


# ---------------------------------------------------------------- a conversation after a call


def test_a_tool_result_round_trip_renders_through_the_template(plain, offline):
    text = offline.render_chat(CONVERSATION_RENDERED, tools=ONE_TOOL)
    want_prompt = offline.tokenizer.encode(text, add_special_tokens=False)
    chat = chat_to_proto(CONVERSATION, ONE_TOOL, "none")
    tokens = plain.stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=30)
    assert list(tokens.token_ids) == want_prompt
    status, http = post(plain, "/tokenize", {"messages": CONVERSATION, "tools": ONE_TOOL})
    assert http["tokens"] == want_prompt

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = offline.chat(CONVERSATION_RENDERED, params, tools=ONE_TOOL)[0]
    request = pb.GenerateRequest(
        chat=chat, sampling=pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    response = plain.stub.Generate(request, timeout=60)
    assert list(response.prompt_token_ids) == want.prompt_token_ids
    assert response.outputs[0].text == want.outputs[0].text
    assert list(response.outputs[0].token_ids) == want.outputs[0].token_ids


# ---------------------------------------------------------------- the Python client


def test_the_python_client_reads_calls_and_thinking(plain, parsing):
    params = SamplingParams(temperature=0.0, max_tokens=REQUIRED_MAX_TOKENS)
    with Client(f"127.0.0.1:{plain.port}") as client:
        whole = client.chat(MESSAGES, params, tools=TOOLS, tool_choice=NAMED).outputs[0]
        (call,) = whole.tool_calls
        assert call.name == "get_weather" and call.id.startswith("call_")
        assert whole.finish_reason == "stop" and whole.text == ""
        outputs = list(client.chat_stream(MESSAGES, params, tools=TOOLS, tool_choice=NAMED))
        assert len(outputs) >= 2  # the stream yields one RequestOutput as it grows
        (streamed_call,) = outputs[-1].outputs[0].tool_calls
        assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
        one = client.chat(
            MESSAGES, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
        ).outputs[0]
        assert len(one.tool_calls) == 1 and one.finish_reason == "tool_calls"
        with pytest.raises(grpc.RpcError) as caught:
            client.chat(MESSAGES, params, tools=TOOLS)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat.tool_choice='auto'" in caught.value.details()

    thinking = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(regex=THINK_THEN_ANSWER),
    )

    async def run():
        async with AsyncClient(f"127.0.0.1:{parsing.port}") as client:
            whole = await client.chat(MESSAGES, thinking)
            outputs = [output async for output in client.chat_stream(MESSAGES, thinking)]
            return whole.outputs[0], outputs[-1].outputs[0]

    whole, last = asyncio.run(run())
    for output in (whole, last):
        assert (output.reasoning_text, output.text) == ("Paris is big.", "It is Paris.")
        assert output.finish_reason == "stop"


# ---------------------------------------------------------------- refusals


def test_bad_tool_requests_are_refused_naming_the_field(plain):
    bad_json = chat_request(MAX_TOKENS, tool_choice="required")
    bad_json.chat.tools[0].parameters = "{city: Paris"
    developer = [{"role": "developer", "content": "Be brief."}]
    beams = chat_request(MAX_TOKENS, tool_choice="required")
    beams.sampling.beam_width = 2
    unspecified_mode = chat_request(MAX_TOKENS)
    unspecified_mode.chat.tool_choice.mode = pb.TOOL_CHOICE_MODE_UNSPECIFIED
    cases = [
        # "auto" needs a parser, and it is the default with tools.
        (chat_request(MAX_TOKENS), "chat.tool_choice='auto' (the default when tools are given) "
         "needs a server started with --enable-auto-tool-choice"),
        (chat_request(MAX_TOKENS, tool_choice="auto"), "--tool-call-parser"),
        (chat_request(MAX_TOKENS, tool_choice={"function": {"name": "get_news"}}),
         "chat.tool_choice.function_name='get_news' is not one of the tools "
         "(get_weather, get_time)"),
        (unspecified_mode, "chat.tool_choice.mode is TOOL_CHOICE_MODE_UNSPECIFIED; set one of "
         "TOOL_CHOICE_MODE_NONE, TOOL_CHOICE_MODE_AUTO, TOOL_CHOICE_MODE_REQUIRED"),
        (bad_json, "chat.tools[0].parameters is not valid JSON"),
        (chat_request(MAX_TOKENS, tools=None, tool_choice="required"),
         "chat.tool_choice needs chat.tools to choose from"),
        (chat_request(MAX_TOKENS, tool_choice="required", regex="a"),
         "chat.tool_choice (required) constrains the output to the calls, and "
         "sampling.structured_outputs sets another constraint; give one"),
        (beams, "chat.tool_choice (required) constrains the output to the calls: "
         "structured_outputs is not supported with beam search"),
        (chat_request(MAX_TOKENS, tools=[TOOLS[0], TOOLS[0]], tool_choice="none"),
         "chat.tools[1].name: 'get_weather' names two tools"),
        (chat_request(MAX_TOKENS, messages=CONVERSATION[:2] + [{"role": "tool", "content": "1"}],
                      tool_choice="none"), "chat.messages[2].tool_call_id must name the call"),
        # The template's own refusal is bad input too, not a server error.
        (chat_request(MAX_TOKENS, messages=developer, tool_choice="none"),
         "chat.messages: the chat template refused them: no developer turns here"),
    ]  # fmt: skip
    for request, words in cases:
        details = refused(plain, request)
        assert words in details, (words, details)
    # Tokenize renders the tools too, and refuses what the template refuses.
    with pytest.raises(grpc.RpcError) as caught:
        plain.stub.Tokenize(pb.TokenizeRequest(chat=cases[-1][0].chat), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no developer turns here" in caught.value.details()
