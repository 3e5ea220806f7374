"""Structured output through both server APIs, end to end: OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and ``guided_*`` fields over HTTP (OpenAI's own client), and
``SamplingParams.structured_outputs`` over gRPC (our ``Client``).

The tiny random Llama writes garbage when free, so an answer that parses as the schema
(or matches the regex, or is one of the choices) is the constraint at work; and a greedy
constrained answer must equal the offline engine's and the other API's, token for token.
Bad constraints must be refused naming the field the client used."""

from __future__ import annotations

import json
import re

import grpc
import openai
import pytest

from helpers.grammar_cases import CHOICES, GRAMMAR, PERSON_SCHEMA, REGEX
from helpers.http_calls import post, sse_events
from helpers.server_process import SERVED_MODEL_NAME
from pagedserve.frontend import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.client import Client
from pagedserve.frontend.grpc_convert import sampling_params_from_proto, sampling_params_to_proto
from pagedserve.frontend.openai_protocol import parse_request
from pagedserve.v1 import generation_pb2 as pb

PROMPT_IDS = [5, 300, 301, 302]
# Enough for every constraint below to complete: each test checks it did ("stop").
MAX_TOKENS = 64
# A prompt whose greedy answer under json_object is an object with a key (most prompts'
# is "{}", and some ramble whitespace past any max_tokens: any JSON object allows it).
JSON_OBJECT_PROMPT_IDS = [151, 97, 99, 423]
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# The person schema without its own whitespace setting: on PROMPT_IDS the model then
# loops on whitespace until max_tokens, unless the request sets disable_any_whitespace.
LOOSE_PERSON_SCHEMA = {key: value for key, value in PERSON_SCHEMA.items() if key != "x-guidance"}
COMPACT_PERSON = StructuredOutputsParams(json=LOOSE_PERSON_SCHEMA, disable_any_whitespace=True)


def is_person(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"name", "age", "pet"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 6
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 120
        and value["pet"] in ("cat", "dog", "none")
    )


def is_nested_tuple(text: str) -> bool:
    # The grammar's language: ( item , ... ) with items x, y, z or a nested tuple.
    while re.search(r"\([xyz](,[xyz])*\)", text):
        text = re.sub(r"\([xyz](,[xyz])*\)", "x", text)
    return text == "x"


# kind -> (the HTTP request's fields, the engine's constraint, what a valid answer is)
CONSTRAINTS = {
    "guided_json": (
        {"guided_json": PERSON_SCHEMA},
        StructuredOutputsParams(json=PERSON_SCHEMA),
        is_person,
    ),
    "response_format": (
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON_SCHEMA, "strict": True}}},
        StructuredOutputsParams(json=PERSON_SCHEMA),
        is_person,
    ),
    "guided_regex": (
        {"guided_regex": REGEX},
        StructuredOutputsParams(regex=REGEX),
        lambda text: re.fullmatch(REGEX, text) is not None,
    ),
    "structured_outputs.choice": (
        {"structured_outputs": {"choice": CHOICES}},
        StructuredOutputsParams(choice=CHOICES),
        lambda text: text in CHOICES,
    ),
    "guided_choice": (
        {"guided_choice": CHOICES},
        StructuredOutputsParams(choice=CHOICES),
        lambda text: text in CHOICES,
    ),
    "structured_outputs.grammar": (
        {"structured_outputs": {"grammar": GRAMMAR}},
        StructuredOutputsParams(grammar=GRAMMAR),
        is_nested_tuple,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(server_model_dir, num_blocks=128)


@pytest.fixture
def client(server) -> openai.OpenAI:
    with openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


@pytest.fixture
def grpc_client(server) -> Client:
    with Client(f"127.0.0.1:{server.port}") as client:
        yield client


def constrained(structured: StructuredOutputsParams) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=structured)


# ---------------------------------------------------------------- answers


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_a_constrained_completion_is_valid_and_equals_grpc_and_offline(
    kind, server, client, grpc_client, offline
):
    fields, structured, is_valid = CONSTRAINTS[kind]
    answer = client.completions.create(
        model=SERVED_MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body=fields,
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "stop", choice
    assert is_valid(choice.text), choice.text
    want = offline.generate(PROMPT_IDS, constrained(structured))[0].outputs[0]
    assert choice.text == want.text
    assert answer.usage.completion_tokens == len(want.token_ids)
    over_grpc = grpc_client.generate(PROMPT_IDS, constrained(structured)).outputs[0]
    assert (over_grpc.token_ids, over_grpc.text) == (want.token_ids, want.text)
    assert over_grpc.finish_reason == "stop"


def test_chat_with_a_json_schema_answers_the_schema_whole_and_streamed(server, client, offline):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "description": "A person.", "schema": PERSON_SCHEMA},
    }
    answer = client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=MAX_TOKENS,
        temperature=0.0,
        response_format=response_format,
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "stop", choice
    person = json.loads(choice.message.content)
    assert set(person) == {"name", "age", "pet"}, person
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert person["pet"] in ("cat", "dog", "none")
    want = offline.chat(CHAT, constrained(StructuredOutputsParams(json=PERSON_SCHEMA)))[0]
    assert choice.message.content == want.outputs[0].text

    chunks = list(
        client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=CHAT,
            max_completion_tokens=MAX_TOKENS,
            temperature=0.0,
            response_format=response_format,
            stream=True,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 2  # the answer came in pieces
    assert json.loads(streamed) == person
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_streamed_completion_with_a_json_schema_parses(server):
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
        "structured_outputs": {"json": PERSON_SCHEMA},
    }
    events = sse_events(server, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2  # in pieces (fewer when a reader that fell behind merged steps)
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert is_person(text), text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    _, whole = post(server, "/v1/completions", {**body, "stream": False})
    assert whole["choices"][0]["text"] == text


def test_json_object_answers_a_json_object(server, client, offline):
    for fields in (
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json_object": True}},
    ):
        answer = client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=JSON_OBJECT_PROMPT_IDS,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body=fields,
        )
        (choice,) = answer.choices
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.text)
        assert isinstance(value, dict) and value, choice.text
        want = offline.generate(
            JSON_OBJECT_PROMPT_IDS, constrained(StructuredOutputsParams(json_object=True))
        )[0]
        assert choice.text == want.outputs[0].text


def compact_person_answer(offline: LLM):
    """The offline engine's answer to COMPACT_PERSON, checked to differ from the answer
    without the flag (so an API that dropped the flag could not pass)."""
    want = offline.generate(PROMPT_IDS, constrained(COMPACT_PERSON))[0].outputs[0]
    assert want.finish_reason == "stop" and is_person(want.text), want.text
    loose = StructuredOutputsParams(json=LOOSE_PERSON_SCHEMA)
    assert offline.generate(PROMPT_IDS, constrained(loose))[0].outputs[0].text != want.text
    return want


def test_disable_any_whitespace_reaches_the_engine_over_grpc(server, grpc_client, offline):
    want = compact_person_answer(offline)
    answer = grpc_client.generate(PROMPT_IDS, constrained(COMPACT_PERSON)).outputs[0]
    assert (answer.token_ids, answer.finish_reason) == (want.token_ids, "stop")


def test_disable_any_whitespace_reaches_the_engine_over_http(server, client, offline):
    want = compact_person_answer(offline)
    answer = client.completions.create(
        model=SERVED_MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={
            "structured_outputs": {"json": LOOSE_PERSON_SCHEMA, "disable_any_whitespace": True}
        },
    )
    (choice,) = answer.choices
    assert (choice.text, choice.finish_reason) == (want.text, "stop")


def test_several_samples_each_keep_the_constraint(server, client):
    answer = client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=7,
        n=4,
        extra_body={"guided_regex": REGEX},
    )
    assert len(answer.choices) == 4
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice
        assert re.fullmatch(REGEX, choice.message.content), choice.message.content


def test_response_format_text_leaves_the_output_free(server, client):
    plain = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT_IDS, max_tokens=12, temperature=0.0
    )
    text = client.completions.create(
        model=SERVED_MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0.0,
        extra_body={"response_format": {"type": "text"}},
    )
    assert text.choices[0].text == plain.choices[0].text
    assert text.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- refusals


def test_bad_constraints_are_refused_naming_the_field_used(server, client):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    cases = [
        ({"guided_regex": "[a-"}, "guided_regex", "guided_regex does not compile"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex",
         "structured_outputs.regex does not compile"),
        ({"guided_grammar": "start: ???"}, "guided_grammar", "guided_grammar does not compile"),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list"),
        ({"guided_choice": ["a", 3]}, "guided_choice", "guided_choice[1] must be a string"),
        ({"response_format": schema}, "response_format.json_schema.schema",
         "response_format.json_schema.schema does not compile"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "must be a JSON schema (an object), got None"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name", "must be a non-empty string"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
         "must be an object with name and schema"),
        ({"response_format": {"type": "grammar"}}, "response_format.type",
         "must be 'text', 'json_object' or 'json_schema', got 'grammar'"),
        ({"response_format": "json"}, "response_format", "response_format must be an object"),
        ({"structured_outputs": {}}, "structured_outputs", "must set one of"),
        ({"structured_outputs": {"json_object": False, "regex": None}}, "structured_outputs",
         "must set one of"),
        ({"structured_outputs": {"whitespace_pattern": " ?"}},
         "structured_outputs.whitespace_pattern", "is not supported by this server"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object",
         "structured_outputs.json_object must be a bool"),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}},
         "structured_outputs.disable_any_whitespace", "must be a boolean, got 'yes'"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs",
         "must set one of"),
        # One constraint per request, however it came.
        ({"response_format": schema, "guided_regex": "a+"}, "guided_regex",
         "one structured output constraint per request, got "
         "response_format.json_schema.schema and guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
         "got structured_outputs.regex and structured_outputs.choice"),
        ({"guided_json": {}, "guided_choice": ["b"]}, "guided_choice",
         "got guided_json and guided_choice"),
        # Beam search picks beams from unconstrained candidates.
        ({"guided_choice": ["a"], "use_beam_search": True, "n": 2}, "guided_choice",
         "guided_choice is not supported with beam search"),
    ]  # fmt: skip
    for fields, param, words in cases:
        for path, body in (
            ("/v1/completions", {"prompt": PROMPT_IDS, **fields}),
            ("/v1/chat/completions", {"messages": CHAT, **fields}),
        ):
            status, answer = post(server, path, body)
            assert status == 400, (path, fields, answer)
            error = answer["error"]
            assert words in error["message"], (path, fields, error)
            assert error["param"] == param, (path, fields, error)
            assert error["code"] == 400, error

    # OpenAI's client sees the same: a BadRequestError with the field as its param.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=SERVED_MODEL_NAME,
            messages=CHAT,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a"},
        )
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "guided_regex"
    assert "response_format and guided_regex" in caught.value.body["message"]


def test_grpc_refuses_a_bad_constraint_naming_the_field(server, grpc_client):
    cases = [
        (pb.StructuredOutputs(grammar="start: ???"), "sampling.structured_outputs.grammar does"),
        (pb.StructuredOutputs(regex="[a-"), "sampling.structured_outputs.regex does not compile"),
        (pb.StructuredOutputs(json_schema='{"type": "nope"}'),
         "sampling.structured_outputs.json_schema does not compile"),
        (pb.StructuredOutputs(json_schema="{"),
         "sampling.structured_outputs.json_schema is not valid JSON"),
        (pb.StructuredOutputs(choice=pb.ChoiceList()),
         "sampling.structured_outputs.choice must be a non-empty list"),
        (pb.StructuredOutputs(json_object=False),
         "sampling.structured_outputs.json_object must be true"),
        (pb.StructuredOutputs(), "sampling.structured_outputs is set but names no constraint"),
    ]  # fmt: skip
    for structured, words in cases:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT_IDS),
            sampling=pb.SamplingParams(max_tokens=8, structured_outputs=structured),
        )
        with pytest.raises(grpc.RpcError) as caught:
            server.stub.Generate(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert words in caught.value.details(), caught.value.details()
    # Our client sends the engine's own constraint; the server names the proto's field.
    with pytest.raises(grpc.RpcError) as caught:
        grpc_client.generate(PROMPT_IDS, constrained(StructuredOutputsParams(grammar="?")))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling.structured_outputs.grammar: "), (
        caught.value.details()
    )
    beams = pb.SamplingParams(
        temperature=0.0, beam_width=2, structured_outputs=pb.StructuredOutputs(regex="a")
    )
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(pb.GenerateRequest(text="hi", sampling=beams), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured_outputs is not supported with beam search" in (
        caught.value.details()
    )


# ---------------------------------------------------------------- in this process


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutputsParams(json=PERSON_SCHEMA),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(grammar=GRAMMAR),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=REGEX, disable_any_whitespace=True),
        COMPACT_PERSON,
    ],
    ids=lambda structured: structured.kind + "-compact" * structured.disable_any_whitespace,
)
def test_structured_outputs_survive_the_wire(structured):
    params = SamplingParams(temperature=0.5, seed=1, structured_outputs=structured)
    assert sampling_params_from_proto(sampling_params_to_proto(params), GREEDY) == params
    assert sampling_params_to_proto(params).structured_outputs.WhichOneof("constraint") == {
        "json": "json_schema"
    }.get(structured.kind, structured.kind)


def test_a_model_without_a_tokenizer_refuses_constraints_by_field(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=8)
    assert llm.tokenizer is None
    with pytest.raises(CallError) as caught:
        parse_request("completion", {"prompt": [5], "guided_regex": "a"}, llm, GREEDY, "m", None)
    assert caught.value.param == "guided_regex"
    assert "has none" in caught.value.message
