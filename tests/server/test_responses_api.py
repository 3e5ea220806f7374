"""OpenAI's Responses API (``/v1/responses``) over the real server, with OpenAI's own client:
each response answers as the same conversation sent to ``/v1/chat/completions`` (greedy,
token for token); streams send typed events that add up to the whole response; stored
responses continue (``previous_response_id``), are read back and deleted; tools, a JSON
schema and logprobs take the Responses shapes; what is not served is refused by name."""

from __future__ import annotations

import http.client
import json
import os
import signal
from collections.abc import Iterator

import openai
import pytest

from helpers.http_calls import get, post, typed_events
from helpers.openai_shapes import assert_openai_shape
from helpers.processes import wait_until
from helpers.server_process import SERVED_MODEL_NAME, ServerProcess, serving
from helpers.tool_calls import TOOL_TEMPLATE, WEATHER

STORE_SIZE = 4
GREEDY = {"temperature": 0.0}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


@pytest.fixture(scope="module")
def responses_server(server_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    with serving(
        server_model_dir, tmp_path_factory.mktemp("responses_server"),
        "--chat-template", TOOL_TEMPLATE, "--structured-outputs-disable-any-whitespace",
        "--responses-store-size", str(STORE_SIZE),
    ) as server:  # fmt: skip
        yield server


@pytest.fixture
def server(responses_server) -> Iterator[ServerProcess]:
    yield responses_server
    responses_server.assert_blocks_all_free()


@pytest.fixture
def client(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


def chat(client, messages: list[dict], max_tokens: int, **fields):
    return client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, max_tokens=max_tokens, **GREEDY, **fields
    )


def without_ids(value):
    """A response without what differs between two runs (ids, times, prefix-cache hits and
    writes)."""
    varying = ("id", "item_id", "created_at", "call_id", "cached_tokens", "cache_write_tokens")
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in varying}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def test_a_response_answers_as_the_chat_completion_of_its_conversation(client):
    response = client.responses.create(
        model=SERVED_MODEL_NAME, input="Hello", instructions="Be brief", max_output_tokens=12,
        **GREEDY,
    )  # fmt: skip
    want = chat(client, [{"role": "system", "content": "Be brief"},
                         {"role": "user", "content": "Hello"}], 12)  # fmt: skip
    assert response.output_text == want.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    length = want.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if length else "completed")
    if length:
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == want.usage.prompt_tokens
    assert response.usage.output_tokens == want.usage.completion_tokens
    assert response.usage.total_tokens == want.usage.total_tokens
    assert response.instructions == "Be brief" and response.max_output_tokens == 12
    assert response.model == SERVED_MODEL_NAME


def test_a_stream_adds_up_to_the_whole_response(server, client):
    body = {"model": SERVED_MODEL_NAME, "input": [{"role": "user", "content": "Tell"}],
            "max_output_tokens": 10, "store": False, **GREEDY}  # fmt: skip
    status, whole = post(server, "/v1/responses", body)
    assert status == 200, whole
    events = typed_events(server, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        last_event_type(whole),
    ]  # fmt: skip
    assert events[0]["response"]["status"] == "in_progress"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert deltas == final["output"][0]["content"][0]["text"]
    assert without_ids(final) == without_ids(whole)
    assert events[2]["item"]["id"] == final["output"][0]["id"]  # the item's id throughout
    # OpenAI's stream helper assembles the same response, in its last event.
    with client.responses.stream(**body) as stream:
        *_, last = stream
    assert last.type == kinds[-1] and last.response.output_text == deltas


@pytest.mark.parametrize("max_output_tokens", [2, 40])
def test_bodies_and_events_are_exactly_openai_s(server, max_output_tokens):
    # Cut by max_output_tokens (incomplete, the stream ending in response.incomplete) and
    # longer: the body and every event validated strictly against the openai SDK's types.
    body = {"model": SERVED_MODEL_NAME, "input": "Hi", "max_output_tokens": max_output_tokens,
            "top_logprobs": 2, **GREEDY}  # fmt: skip
    status, whole = post(server, "/v1/responses", body)
    assert status == 200, whole
    assert_openai_shape("response", whole)
    assert whole["usage"]["input_tokens_details"].keys() == {"cached_tokens", "cache_write_tokens"}
    events = typed_events(server, body)
    for event in events:
        assert_openai_shape("response event", event)
    assert events[-1]["type"] == last_event_type(whole)
    if max_output_tokens == 2:
        assert whole["status"] == "incomplete"


def last_event_type(response: dict) -> str:
    """How OpenAI ends a response's stream: response.incomplete when it was cut short."""
    return "response.incomplete" if response["status"] == "incomplete" else "response.completed"


def test_stored_responses_continue_are_read_back_and_deleted(server, client):
    first = client.responses.create(
        model=SERVED_MODEL_NAME, input="Hi", max_output_tokens=6, **GREEDY
    )
    second = client.responses.create(
        model=SERVED_MODEL_NAME, input="More", previous_response_id=first.id,
        max_output_tokens=6, **GREEDY,
    )  # fmt: skip
    want = chat(client, [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "More"}], 6)  # fmt: skip
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == want.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    status, body = get(server, f"/v1/responses/{second.id}")
    assert status == 200
    assert_openai_shape("response", json.loads(body))
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model=SERVED_MODEL_NAME, input="x", previous_response_id=first.id)
    assert refused.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(
        model=SERVED_MODEL_NAME, input="x", max_output_tokens=2, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # The store keeps the most recent STORE_SIZE responses.
    made = [
        client.responses.create(model=SERVED_MODEL_NAME, input="x", max_output_tokens=1).id
        for _ in range(STORE_SIZE + 1)
    ]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0])
    assert client.responses.retrieve(made[-1]).id == made[-1]


def test_function_calls_and_their_outputs(client):
    question = {"role": "user", "content": "Weather in Paris?"}
    response = client.responses.create(
        model=SERVED_MODEL_NAME, input=[question], tools=[TOOL], tool_choice="required",
        **GREEDY,
    )  # fmt: skip
    want = chat(client, [question], 64, tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}}], tool_choice="required")  # fmt: skip
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id
    assert call.arguments == want.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # The call and its result go back as input items; the model answers after them.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    after = client.responses.create(
        model=SERVED_MODEL_NAME, input=[question, call.model_dump(), result], tools=[TOOL],
        tool_choice="none", max_output_tokens=4, **GREEDY,
    )  # fmt: skip
    messages = [
        question,
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    want = chat(client, messages, 4, tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}}], tool_choice="none")  # fmt: skip
    assert after.usage.input_tokens == want.usage.prompt_tokens
    assert after.output_text == want.choices[0].message.content
    named = client.responses.create(
        model=SERVED_MODEL_NAME, input=[question], tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    assert named.output[0].type == "function_call"


def test_a_stream_of_calls_adds_up(server):
    """tool_choice "required" lets the random model write several calls: each item opens,
    takes its arguments and closes before the next opens; the last event lists them."""
    body = {"model": SERVED_MODEL_NAME, "input": "Weather?", "tools": [TOOL],
            "tool_choice": "required", "store": False}  # fmt: skip
    events = typed_events(server, body)
    final = events[-1]["response"]
    assert len(final["output"]) >= 1
    opened = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["id"] for e in opened] == [item["id"] for item in final["output"]]
    for position, item in enumerate(final["output"]):
        assert item["type"] == "function_call" and item["status"] == "completed"
        mine = [e for e in events if e.get("item_id") == item["id"] or
                e.get("item", {}).get("id") == item["id"]]  # fmt: skip
        assert [e["type"] for e in mine][0] == "response.output_item.added"
        assert [e["type"] for e in mine][-2:] == [
            "response.function_call_arguments.done", "response.output_item.done"
        ]  # fmt: skip
        assert all(e["output_index"] == position for e in mine)
        deltas = [e["delta"] for e in mine if e["type"].endswith("arguments.delta")]
        assert "".join(deltas) == item["arguments"] == mine[-2]["arguments"]
        if position + 1 < len(final["output"]):  # closed before the next call opens
            next_added = events.index(opened[position + 1])
            assert events.index(mine[-1]) < next_added
    one = typed_events(server, {**body, "parallel_tool_calls": False})[-1]["response"]
    assert len(one["output"]) == 1 and one["parallel_tool_calls"] is False


def test_text_format_and_logprobs(client):
    structured = client.responses.create(
        model=SERVED_MODEL_NAME, input="A city?",
        text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER}},
    )  # fmt: skip
    assert json.loads(structured.output_text)["city"] in ("Paris", "Rome")
    assert structured.text.format.type == "json_schema"
    scored = client.responses.create(
        model=SERVED_MODEL_NAME, input="Hello", max_output_tokens=5, top_logprobs=2, **GREEDY
    )
    logprobs = scored.output[0].content[0].logprobs
    assert len(logprobs) == scored.usage.output_tokens == 5
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs)


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens",
         "max_output_tokens must be >= 1, got 0"),
        ({"input": ""}, 400, "input", "input is empty"),
        ({"input": []}, 400, "input", "input must be a string or a non-empty list"),
        ({}, 400, "input", "input must be a string or a non-empty list of items, got None"),
        ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role",
         "input[0].role must be one of user, assistant, system, developer"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         400, "input[0].content[0]", "only text parts are supported"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type",
         "'item_reference' is not served here"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400,
         "input[0].call_id", "input[0].call_id must be a non-empty string"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type",
         "'web_search' is not served here"),
        ({"input": "x", "background": True, "store": False}, 400, "background",
         "background=true needs store=true"),
        ({"input": "x", "truncation": "auto"}, 400, "truncation", "only 'disabled'"),
        ({"input": "x", "metadata": {"k": 1}}, 400, "metadata",
         "metadata['k'] must be a string, got 1"),
        ({"input": "x", "reasoning": {"effort": "max"}}, 400, "reasoning.effort",
         "reasoning.effort must be one of low, medium, high; got 'max'"),
        ({"input": "x", "reasoning": "high"}, 400, "reasoning", "reasoning must be an object"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format",
         "text.format must be an object of type text, json_object or json_schema"),
        ({"input": "x", "previous_response_id": "resp_none"}, 404, "previous_response_id",
         "no response 'resp_none' is stored here"),
        ({"input": "x", "model": "other"}, 404, "model", "model 'other' is not served here"),
        (["x"], 400, "", "the request body must be a JSON object, got list"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_naming_the_field(server, body, status, param, message):
    got_status, answer = post(server, "/v1/responses", body)
    assert got_status == status, answer
    assert answer["error"]["param"] == param
    assert message in answer["error"]["message"], answer


def test_get_and_delete_of_an_unknown_response_are_404(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        for method in ("GET", "DELETE"):
            connection.request(method, "/v1/responses/resp_unknown")
            response = connection.getresponse()
            answer = json.loads(response.read())
            assert response.status == 404 and answer["error"]["param"] == "response_id"
    finally:
        connection.close()


def test_a_client_that_disconnects_mid_stream_ends_its_response(server):
    """The request ends in the engine (the fixture then finds every block free), and an
    unfinished response is not stored."""
    cancelled_before = server.stats().requests_cancelled
    sampled_before = server.stats().engine["num_sampled_tokens"]
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    body = {"model": SERVED_MODEL_NAME, "input": "Tell a long story", "max_output_tokens": 400,
            "stream": True}  # fmt: skip
    connection.request("POST", "/v1/responses", json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline() == b"event: response.created\n"
    created = json.loads(response.readline().removeprefix(b"data: "))
    connection.close()  # gone mid-stream
    assert wait_until(lambda: server.stats().requests_cancelled == cancelled_before + 1, 10)
    assert server.stats().engine["num_sampled_tokens"] - sampled_before < 400
    status, _answer = get(server, f"/v1/responses/{created['response']['id']}")
    assert status == 404


def test_a_background_response_answers_queued_and_is_read_back_when_done(client):
    """``background``: the call answers at once, ``queued`` and empty; the response runs on
    and ``GET`` reads it back as the same request answered in the foreground."""
    fields = {"model": SERVED_MODEL_NAME, "input": "Hello", "max_output_tokens": 12, **GREEDY}
    queued = client.responses.create(**fields, background=True)
    assert queued.status == "queued" and queued.background and queued.output == []
    assert wait_until(
        lambda: client.responses.retrieve(queued.id).status in ("completed", "incomplete"), 30
    )
    done = client.responses.retrieve(queued.id)
    foreground = client.responses.create(**fields)
    assert done.output_text == foreground.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert done.background and not foreground.background
    # It continues a conversation as any stored response does.
    after = client.responses.create(
        model=SERVED_MODEL_NAME, input="More", previous_response_id=done.id, max_output_tokens=2
    )
    assert after.previous_response_id == done.id
    # Cancelling an ended one returns it as it ended.
    assert client.responses.cancel(done.id).status == done.status


def start_long_background_response(server, client):
    """A background response of 400 tokens, its first body checked strictly, read back
    through the SDK."""
    status, created = post(server, "/v1/responses", {
        "model": SERVED_MODEL_NAME, "input": "Tell a long story", "max_output_tokens": 400,
        "background": True,
    })  # fmt: skip
    assert status == 200 and created["status"] in ("queued", "in_progress"), created
    assert_openai_shape("response", created)
    return client.responses.retrieve(created["id"])


def test_a_background_response_is_cancelled(server, client):
    """``POST /v1/responses/{id}/cancel`` ends it in the engine (the fixture then finds every
    block free) and stores it ``cancelled``; a second cancel returns the same; a response
    still running cannot be continued; only background responses can be cancelled."""
    sampled_before = server.stats().engine["num_sampled_tokens"]
    running = start_long_background_response(server, client)
    status, refused = post(
        server,
        "/v1/responses",
        {"input": "x", "previous_response_id": running.id},
    )
    assert status == 400 and refused["error"]["param"] == "previous_response_id"
    assert (
        "is still queued" in refused["error"]["message"]
        or "still in_progress" in (refused["error"]["message"])
    )
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert server.stats().engine["num_sampled_tokens"] - sampled_before < 400
    assert client.responses.retrieve(running.id).status == "cancelled"
    status, again = post(server, f"/v1/responses/{running.id}/cancel", {})
    assert status == 200 and again["status"] == "cancelled"
    assert_openai_shape("response", again)
    foreground = client.responses.create(model=SERVED_MODEL_NAME, input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as not_background:
        client.responses.cancel(foreground.id)
    assert not_background.value.body["param"] == "response_id"
    assert "only background responses can be cancelled" in not_background.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def read_events(response) -> list[dict]:
    """The typed events of an SSE answer read to its end, each checked against its
    ``event:`` line."""
    events = []
    for raw in response.read().decode().split("\n\n"):
        if raw.strip():
            event_line, data_line = raw.split("\n")
            event = json.loads(data_line.removeprefix("data: "))
            assert event_line == f"event: {event['type']}"
            events.append(event)
    return events


def delta_runs(events: list[dict]) -> list[str]:
    """The events' types, each run of text deltas as one, with the deltas' text after it."""
    types = [e["type"] for e in events]
    delta = "response.output_text.delta"
    runs = [t for i, t in enumerate(types) if t != delta or i == 0 or types[i - 1] != delta]
    return [*runs, "".join(e["delta"] for e in events if e["type"] == delta)]


def get_events(server, path: str) -> list[dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200, response.read()
        return read_events(response)
    finally:
        connection.close()


def test_a_streamed_background_response_is_read_again_from_any_event(server):
    """``background`` with ``stream``: the call streams as any stream does, and the events
    are kept: ``GET ...?stream=true&starting_after=N`` reads them again from event N + 1,
    all of them without it."""
    body = {"model": SERVED_MODEL_NAME, "input": "Tell", "max_output_tokens": 10,
            "background": True, **GREEDY}  # fmt: skip
    events = typed_events(server, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == last_event_type(events[-1]["response"])
    response_id = events[0]["response"]["id"]
    assert get_events(server, f"/v1/responses/{response_id}?stream=true") == events
    again = get_events(server, f"/v1/responses/{response_id}?stream=true&starting_after=3")
    assert again == events[4:]
    status, stored = get(server, f"/v1/responses/{response_id}")
    assert status == 200 and json.loads(stored) == events[-1]["response"]
    foreground = typed_events(server, {**body, "background": False})
    # The same events, but for how many text deltas the tokens came in (a stream merges the
    # steps a reader that fell behind has not taken yet).
    assert delta_runs(foreground) == delta_runs(events)
    assert (
        foreground[-1]["response"]["output"][0]["content"]
        == (events[-1]["response"]["output"][0]["content"])
    )
    assert events[-1]["response"]["background"] and not foreground[-1]["response"]["background"]
    for query, param in [
        ("?stream=true&starting_after=x", "starting_after"),
        (f"?stream=true&starting_after={len(events)}", "starting_after"),
        ("?stream=maybe", "stream"),
    ]:
        status, answer = get(server, f"/v1/responses/{response_id}{query}")
        assert status == 400 and json.loads(answer)["error"]["param"] == param, answer
    status, plain = post(server, "/v1/responses", {"input": "x", "max_output_tokens": 1})
    status, answer = get(server, f"/v1/responses/{plain['id']}?stream=true")
    assert status == 400 and json.loads(answer)["error"]["param"] == "stream"


def test_a_lost_background_stream_runs_on_and_resumes(server):
    """The client of a streamed background response goes after a few events: the response
    runs on, and ``starting_after`` the last event it read gives the rest, the two parts one
    whole stream."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    body = {"model": SERVED_MODEL_NAME, "input": "Tell a story", "max_output_tokens": 60,
            "background": True, "stream": True, **GREEDY}  # fmt: skip
    connection.request("POST", "/v1/responses", json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200
    first = []
    while len(first) < 3:
        event_line = response.readline()
        data = json.loads(response.readline().removeprefix(b"data: "))
        assert event_line == f"event: {data['type']}\n".encode()
        assert response.readline() == b"\n"
        first.append(data)
    connection.close()  # gone: the response runs on
    response_id = first[0]["response"]["id"]
    rest = get_events(server, f"/v1/responses/{response_id}?stream=true&starting_after=2")
    whole = first + rest
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert whole[-1]["type"] == last_event_type(whole[-1]["response"])
    deltas = "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta")
    status, stored = get(server, f"/v1/responses/{response_id}")
    final = json.loads(stored)
    assert final["status"] in ("completed", "incomplete")
    assert deltas == final["output"][0]["content"][0]["text"]


def test_deleting_a_running_background_response_ends_it(server, client):
    running = start_long_background_response(server, client)
    client.responses.delete(running.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    server.assert_blocks_all_free()


def test_a_draining_server_waits_for_its_background_responses(start_server):
    """SIGTERM with a background response queued behind a stream (one sequence at a time):
    the drain waits for both as calls in flight, the background response runs whole after
    the stream, and the server exits 0."""
    server = start_server("--http-port", "0", "--max-num-seqs", "1")
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    # 500 tokens: the stream must outlive four more round trips and the signal.
    stream_body = {"prompt": [5, 300, 301, 302], "max_tokens": 500, "temperature": 0,
                   "ignore_eos": True, "stream": True}  # fmt: skip
    connection.request("POST", "/v1/completions", json.dumps(stream_body))
    stream = connection.getresponse()
    assert stream.readline().startswith(b"data: ")
    status, queued = post(
        server, "/v1/responses", {"input": "Tell a story", "max_output_tokens": 40,
                                  "background": True, "temperature": 0.0},
    )  # fmt: skip
    assert status == 200 and queued["status"] == "queued", queued
    os.kill(server.pid, signal.SIGTERM)
    assert wait_until(lambda: get(server, "/health")[0] == 503, 10)
    status, refused = post(server, "/v1/responses", {"input": "x", "background": True})
    assert status == 503 and "shutting down" in refused["error"]["message"]
    assert stream.read().decode().rstrip().endswith("data: [DONE]")
    connection.close()
    assert server.process.wait(30) == 0  # by itself: no second signal
    log = server.log()
    assert "draining: 2 calls in flight" in log, log
    assert "shut down before the request finished" not in log, log
    finished = [line for line in log.splitlines() if " output tokens, " in line]
    assert len(finished) == 2, log


def test_input_items_are_listed_and_paged(server, client):
    """``GET /v1/responses/{id}/input_items`` (OpenAI's SDK ``responses.input_items.list``):
    the request's own input items with ids, newest first by default, paged by id."""
    question = {"role": "user", "content": "Weather in Paris?"}
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "id": "fc_mine",
    }
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    response = client.responses.create(
        model=SERVED_MODEL_NAME, input=[question, call, result], tools=[TOOL],
        tool_choice="none", max_output_tokens=2, **GREEDY,
    )  # fmt: skip
    items = client.responses.input_items.list(response.id)
    status, body = get(server, f"/v1/responses/{response.id}/input_items")
    assert status == 200
    assert_openai_shape("response item list", json.loads(body))
    assert [item.type for item in items.data] == [
        "function_call_output", "function_call", "message"
    ]  # fmt: skip
    message = items.data[2]
    assert message.role == "user" and message.id.startswith("msg_")
    assert message.content[0].type == "input_text"
    assert message.content[0].text == "Weather in Paris?"
    assert items.data[1].id == "fc_mine" and items.data[1].arguments == call["arguments"]
    assert items.first_id == items.data[0].id and items.has_more is False
    ascending = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.type for item in ascending.data] == ["message", "function_call"]
    assert ascending.has_more is True and ascending.last_id == "fc_mine"
    rest = client.responses.input_items.list(response.id, order="asc", after="fc_mine")
    assert [item.type for item in rest.data] == ["function_call_output"]
    text = client.responses.create(model=SERVED_MODEL_NAME, input="Hi", max_output_tokens=1)
    (only,) = client.responses.input_items.list(text.id).data
    assert only.role == "user" and only.content[0].text == "Hi"
    for query, param in [("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"),
                         ("after=nope", "after")]:  # fmt: skip
        status, body = get(server, f"/v1/responses/{response.id}/input_items?{query}")
        answer = json.loads(body)
        assert status == 400 and answer["error"]["param"] == param, answer
    status, body = get(server, "/v1/responses/resp_unknown/input_items")
    assert status == 404 and json.loads(body)["error"]["param"] == "response_id"
