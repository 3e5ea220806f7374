"""Tool (function) calling in ``/v1/chat/completions`` end to end, as vLLM serves it: real
server processes, OpenAI's own client and plain HTTP on 127.0.0.1.

Two servers share the module, started together (each takes a while to load):

- ``plain``: no tool-call parser, the tool template given inline (``--chat-template TEXT``):
  named and required tool choices, which need no parser, and the refusals.
- ``auto``: ``--enable-auto-tool-choice --tool-call-parser hermes`` and the template from a
  file: tool_choice "auto".

The tiny random Llama writes garbage when free, so its calls are forced: a named or
required choice constrains the output to the calls' JSON (both servers allow no whitespace
in JSON, or the model's favourite token, a space, would run to max_tokens), and "auto"
tests add a regex that writes hermes' ``<tool_call>`` blocks. Greedy answers must equal
the offline engine's, token for token; a stream must add up to the whole answer."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest

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
from pagedserve.frontend.tool_calls import ToolCalling, parse_tools

NAMED = {"type": "function", "function": {"name": "get_weather"}}

# Two calls: with one tool shown, to fit the context.
TWO_CALLS = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Rome"\}\}</tool_call>\n'
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
)
NO_CALL = r"Just text(, no call)?\."


@pytest.fixture(scope="module")
def servers(server_model_dir, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    """The module's two servers, started at once; each must drain cleanly (exit 0)."""
    template_file = tmp_path_factory.mktemp("template") / "tool_template.jinja"
    template_file.write_text(TOOL_TEMPLATE)
    common = (
        "--kv-cache-bytes",
        str(4 << 20),
        "--http-port",
        "0",
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--structured-outputs-disable-any-whitespace",
    )
    started = {
        "plain": ServerProcess(
            server_model_dir,
            tmp_path_factory.mktemp("plain_server"),
            *common,
            "--chat-template",
            TOOL_TEMPLATE,
        ),
        "auto": ServerProcess(
            server_model_dir,
            tmp_path_factory.mktemp("auto_server"),
            *common,
            "--chat-template",
            str(template_file),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
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
def plain_server(servers) -> Iterator[ServerProcess]:
    """The server without a tool-call parser, checked after the test: nothing left
    running, every block free."""
    yield servers["plain"]
    servers["plain"].assert_blocks_all_free()


@pytest.fixture
def auto_server(servers) -> Iterator[ServerProcess]:
    """The hermes server, checked after the test as ``plain_server`` is."""
    yield servers["auto"]
    servers["auto"].assert_blocks_all_free()


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(
        server_model_dir,
        num_blocks=128,
        chat_template=TOOL_TEMPLATE,
        structured_outputs_disable_any_whitespace=True,
    )


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    )


def offline_answer(offline: LLM, structured: StructuredOutputsParams, max_tokens: int):
    """The offline engine's greedy answer to MESSAGES with TOOLS under ``structured``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)
    return offline.chat(MESSAGES, params, tools=TOOLS)[0].outputs[0]


def chat_body(**fields) -> dict:
    return {"messages": MESSAGES, "tools": TOOLS, "temperature": 0.0, **fields}


# ---------------------------------------------------------------- a named function


def test_a_named_function_is_called_with_the_offline_engines_arguments(plain_server, offline):
    want = offline_answer(offline, StructuredOutputsParams(json=WEATHER), MAX_TOKENS)
    assert want.finish_reason == "stop", want  # the schema completes within MAX_TOKENS
    with openai_client(plain_server) as client:
        answer = client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=NAMED,
            max_completion_tokens=MAX_TOKENS,
            temperature=0.0,
        )
    (choice,) = answer.choices
    # A named call ends as OpenAI's does: "stop", with no content beside the call.
    assert choice.finish_reason == "stop"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and len(call.id) > len("call_")
    assert call.function.arguments == want.text
    assert answer.usage.completion_tokens == len(want.token_ids)
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_a_named_function_streams_its_arguments_as_they_come(plain_server):
    body = chat_body(tool_choice=NAMED, max_tokens=MAX_TOKENS)
    _, whole = post(plain_server, "/v1/chat/completions", body)
    (choice,) = whole["choices"]
    assert choice["message"]["content"] is None

    events = sse_events(plain_server, "/v1/chat/completions", {**body, "stream": True})
    content, calls, deltas, finishes = streamed_calls(events)
    assert content == ""
    assert without_ids(calls) == without_ids(whole_calls(choice["message"]))
    # The arguments come as they are made: the first chunk names the call with the text
    # so far ("{", or more when the stream merged steps for a reader that fell behind),
    # the rest follows; only the first delta names the call.
    first = deltas[0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    arguments = whole_calls(choice["message"])[0]["arguments"]
    assert first["function"]["arguments"].startswith("{")
    assert len(first["function"]["arguments"]) < len(arguments)
    assert arguments.startswith(first["function"]["arguments"])
    assert len(deltas) >= 2, deltas
    assert all(set(delta) == {"index", "function"} for delta in deltas[1:]), deltas
    assert {delta["index"] for delta in deltas} == {0}
    assert finishes[-1] == "stop" and finishes.count("stop") == 1


# ---------------------------------------------------------------- tool_choice "required"


def required_schema(parallel_tool_calls: bool) -> dict:
    """The schema the server constrains a required choice's output to."""
    calling = ToolCalling(parse_tools(TOOLS), "required", parallel_tool_calls, None)
    _, schema = calling.constraint()
    return schema


@pytest.mark.parametrize("parallel_tool_calls", [False, True])
def test_a_required_choice_calls_tools_as_the_offline_engine_does(
    plain_server, offline, parallel_tool_calls
):
    want = offline_answer(
        offline,
        StructuredOutputsParams(json=required_schema(parallel_tool_calls)),
        REQUIRED_MAX_TOKENS,
    )
    body = chat_body(
        tool_choice="required",
        parallel_tool_calls=parallel_tool_calls,
        max_tokens=REQUIRED_MAX_TOKENS,
    )
    status, whole = post(plain_server, "/v1/chat/completions", body)
    assert status == 200, whole
    (choice,) = whole["choices"]
    message = choice["message"]
    assert message["content"] is None
    assert whole["usage"]["completion_tokens"] == len(want.token_ids)
    calls = whole_calls(message)
    assert all(call["name"] in ("get_weather", "get_time") for call in calls), calls
    got = [(call["name"], json.loads(call["arguments"])) for call in calls]
    if parallel_tool_calls:
        # This model calls on and on: the answer ends at max_tokens inside a third call,
        # and the two complete ones are the calls.
        assert want.finish_reason == choice["finish_reason"] == "length"
        complete = json.loads(want.text[: want.text.rindex("},{") + 1] + "]")
        assert len(complete) == 2
    else:
        assert want.finish_reason == "stop"
        assert choice["finish_reason"] == "tool_calls"
        complete = json.loads(want.text)
        assert len(complete) == 1  # maxItems 1
    assert got == [(item["name"], item["parameters"]) for item in complete]

    events = sse_events(plain_server, "/v1/chat/completions", {**body, "stream": True})
    content, streamed, deltas, finishes = streamed_calls(events)
    assert content == ""
    assert without_ids(streamed) == without_ids(calls)
    assert all(call["id"].startswith("call_") for call in streamed)
    assert len({call["id"] for call in streamed}) == len(streamed)
    # Each call goes out whole once its object is complete.
    assert [delta["index"] for delta in deltas] == list(range(len(calls)))
    assert finishes[-1] == choice["finish_reason"] and finishes.count(None) == len(finishes) - 1


# ---------------------------------------------------------------- tool_choice "auto"


def test_auto_reads_a_hermes_call_and_the_content_before_it(auto_server, offline):
    body = chat_body(structured_outputs={"regex": CHECKING_CALL}, max_tokens=MAX_TOKENS * 2)
    want = offline_answer(offline, StructuredOutputsParams(regex=CHECKING_CALL), MAX_TOKENS * 2)
    assert want.finish_reason == "stop", want
    with openai_client(auto_server) as client:
        answer = client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,  # tool_choice "auto" is the default with tools
            max_completion_tokens=MAX_TOKENS * 2,
            temperature=0.0,
            extra_body={"structured_outputs": {"regex": CHECKING_CALL}},
        )
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert want.text == (
        f'Checking.\n<tool_call>{{"name": "get_weather", "arguments": '
        f'{{"city": "{arguments["city"]}"}}}}</tool_call>'
    )

    events = sse_events(auto_server, "/v1/chat/completions", {**body, "stream": True})
    content, calls, deltas, finishes = streamed_calls(events)
    assert content == "Checking.\n"
    # A tag that may be starting is held back, never sent as content.
    assert not any(
        "<" in (chunk["choices"][0]["delta"].get("content") or "") for chunk in events[:-1]
    )
    assert calls == [
        {"id": calls[0]["id"], "type": "function", "name": "get_weather",
         "arguments": call.function.arguments}
    ]  # fmt: skip
    assert len(deltas) == 1  # hermes' call goes out once its block is closed
    assert finishes[-1] == "tool_calls"


def test_auto_without_a_call_answers_content(auto_server):
    body = chat_body(structured_outputs={"regex": NO_CALL}, max_tokens=MAX_TOKENS)
    _, whole = post(auto_server, "/v1/chat/completions", body)
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] in ("Just text.", "Just text, no call.")
    assert "tool_calls" not in choice["message"]

    events = sse_events(auto_server, "/v1/chat/completions", {**body, "stream": True})
    content, calls, _, finishes = streamed_calls(events)
    assert (content, calls, finishes[-1]) == (choice["message"]["content"], [], "stop")


def test_auto_keeps_only_the_first_call_without_parallel_tool_calls(auto_server):
    body = chat_body(tools=ONE_TOOL, structured_outputs={"regex": TWO_CALLS}, max_tokens=160)
    both = [
        {"type": "function", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    ]
    for parallel_tool_calls, want in ((True, both), (False, both[:1])):
        body["parallel_tool_calls"] = parallel_tool_calls
        _, whole = post(auto_server, "/v1/chat/completions", body)
        (choice,) = whole["choices"]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        assert without_ids(whole_calls(choice["message"])) == want

        events = sse_events(auto_server, "/v1/chat/completions", {**body, "stream": True})
        content, calls, _, finishes = streamed_calls(events)
        assert (content, without_ids(calls), finishes[-1]) == ("", want, "tool_calls")


# ---------------------------------------------------------------- tool_choice "none"


def test_tool_choice_none_answers_text_with_the_tools_in_the_prompt(plain_server, offline):
    fields = {"tool_choice": "none", "max_tokens": 12, "ignore_eos": True}
    _, whole = post(plain_server, "/v1/chat/completions", chat_body(**fields))
    (choice,) = whole["choices"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = offline.chat(MESSAGES, params, tools=TOOLS)[0].outputs[0]
    without_tools = offline.chat(MESSAGES, params)[0].outputs[0]
    assert want.text != without_tools.text  # the tools make a difference to the answer
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["finish_reason"] == "length"


# ---------------------------------------------------------------- a conversation after a call


def test_a_tool_call_and_its_result_are_rendered_by_the_template(servers, offline):
    text = offline.render_chat(CONVERSATION_RENDERED, tools=ONE_TOOL)
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        "<|im_end|>\n<|im_start|>tool\n<tool_response>18 C</tool_response>"
    ) in text
    assert '"name":"get_weather","description":"Weather now.","parameters":' in text
    want = offline.tokenizer.encode(text, add_special_tokens=False)
    # One server has the template inline, the other from a file.
    for server in servers.values():
        status, answer = post(server, "/tokenize", {"messages": CONVERSATION, "tools": ONE_TOOL})
        assert status == 200, answer
        assert answer["tokens"] == want


def test_a_conversation_after_a_call_generates_as_the_offline_engine(plain_server, offline):
    body = {
        "messages": CONVERSATION,
        "tools": ONE_TOOL,
        "tool_choice": "none",
        "temperature": 0.0,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    _, whole = post(plain_server, "/v1/chat/completions", body)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = offline.chat(CONVERSATION_RENDERED, params, tools=ONE_TOOL)[0]
    assert whole["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert whole["choices"][0]["message"]["content"] == want.outputs[0].text
    assert whole["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- refusals


def test_bad_tool_requests_are_refused_naming_the_field(plain_server):
    bad_name = [{"type": "function", "function": {"name": "get weather"}}]
    twice = [TOOLS[0], TOOLS[0]]
    bad_parameters = [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]
    no_call_id = [*CONVERSATION[:2], {"role": "tool", "content": "18 C"}]
    bad_arguments = json.loads(json.dumps(CONVERSATION))
    bad_arguments[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    cases = [
        # "auto" needs a parser, and it is the default when tools are given.
        ({"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}},
         "tool_choice.function.name",
         "tool_choice.function.name='get_news' is not one of the tools (get_weather, get_time)"),
        ({"tool_choice": "always"}, "tool_choice", "got 'always'"),
        ({"tools": bad_name, "tool_choice": "required"}, "tools[0].function.name",
         "must be 1 to 64 letters"),
        ({"tools": twice, "tool_choice": "required"}, "tools[1].function.name",
         "'get_weather' names two tools"),
        ({"tools": bad_parameters, "tool_choice": "required"}, "tools[0].function.parameters",
         "must be a JSON schema (an object)"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0].type",
         "must be 'function'"),
        ({"tools": [], "tool_choice": "none"}, "tools", "tools must be a non-empty list"),
        ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format",
         "constrains the output to the calls, and response_format sets another"),
        ({"tool_choice": "required", "structured_outputs": {"regex": "a"}},
         "structured_outputs.regex", "tool_choice=required constrains the output"),
        ({"tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls",
         "must be a boolean"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools to choose from"),
        ({"tools": None, "functions": [{"name": "f"}]}, "functions", "deprecated"),
        ({"tool_choice": "none", "function_call": "auto"}, "function_call", "deprecated"),
        ({"tool_choice": "none", "messages": no_call_id}, "messages[2].tool_call_id",
         "must name the call this message answers"),
        ({"tool_choice": "none", "messages": bad_arguments},
         "messages[1].tool_calls[0].function.arguments", "is not valid JSON"),
        ({"tool_choice": "none", "messages": [{"role": "developer", "content": "Be brief."}]},
         "messages", "the chat template refused them: no developer turns here"),
    ]  # fmt: skip
    for fields, param, words in cases:
        body = {key: value for key, value in chat_body(**fields).items() if value is not None}
        status, answer = post(plain_server, "/v1/chat/completions", body)
        assert status == 400, (fields, answer)
        error = answer["error"]
        assert error["param"] == param, (fields, error)
        assert words in error["message"], (fields, error)

    # OpenAI's client sees the same: a BadRequestError naming the field.
    with openai_client(plain_server) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=SERVED_MODEL_NAME, messages=MESSAGES, tools=TOOLS)
    assert caught.value.body["param"] == "tool_choice"


def test_the_command_line_refuses_bad_tool_flags(server_model_dir, tmp_path):
    """Refused before the model loads; the three commands run side by side."""
    missing = str(tmp_path / "no_such_template.jinja")
    together = "--enable-auto-tool-choice and --tool-call-parser go together"
    cases = [
        (["--enable-auto-tool-choice"], together),
        (["--tool-call-parser", "hermes"], together),
        (["--chat-template", missing], f"--chat-template: {missing!r} is neither a file nor"),
    ]
    command = [sys.executable, "-m", "pagedserve.frontend.cli", "serve"]
    running = [
        subprocess.Popen(
            [*command, "--model", str(server_model_dir), "--port", "0", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flags, _ in cases
    ]
    for process, (flags, words) in zip(running, cases, strict=True):
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 2 and words in stderr, (flags, stderr)
