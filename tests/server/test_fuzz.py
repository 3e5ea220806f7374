"""Property-based fuzz of every HTTP route and every gRPC method against a real server.

hypothesis draws request bodies and messages field by field: plausible values (so that many
requests run) mixed with hostile ones (huge, negative, NaN, infinite, deep, long, of the
wrong type, unknown fields, bytes that are no JSON or no protobuf). Every answer must be a
success or a refusal that names what was wrong: no 5xx, no UNKNOWN / INTERNAL / UNAVAILABLE,
a stream that runs to its end without an error event; and at the end the server serves on
with its block accounting intact and every block free (the ``server`` fixture).

``PAGEDSERVE_FUZZ_EXAMPLES`` (default 400 per test, a few seconds) sets how many requests each
test draws, ``PAGEDSERVE_FUZZ_RANDOM=1`` draws new ones (default: the same every run);
docs/testing.md records the long runs.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import urllib.parse

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.scheduler.fault_injection import ENVIRONMENT_VARIABLE
from pagedserve.v1 import generation_pb2 as pb

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "400"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # a run is its own: nothing kept between runs
    # The same cases every run (CI must not flake on a new draw), unless
    # PAGEDSERVE_FUZZ_RANDOM=1 asks for new ones.
    derandomize=os.environ.get("PAGEDSERVE_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# ---------------------------------------------------------------- values

INTS = [0, 1, -1, 2, 7, 20, 21, 100, 511, 512, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63,
        2**64, -(2**63) - 1, 10**30]  # fmt: skip
FLOATS = [0.0, -0.0, 0.5, 1.5, 2.5, 100.5, 1e-300, 1e308, -1e308, math.nan, math.inf,
          -math.inf]  # fmt: skip
# Texts a protobuf string can hold (valid Unicode); JSON may carry a lone surrogate too.
TEXTS = st.one_of(
    st.sampled_from(["", " ", "x", "hello", "\x00", "é" * 10, "token_id:5", "{", "null"]),
    st.integers(4000, 6000).map(lambda length: "a" * length),
)
JSON_TEXTS_ONLY = st.sampled_from(["\ud800", "\udfff x"])


class Deep:
    """A value nested ``depth`` lists deep, written into the body's JSON text as it is
    (too deep for ``json.dumps``)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(INTS),
    st.integers(-(2**70), 2**70),
    st.sampled_from(FLOATS),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXTS,
    JSON_TEXTS_ONLY,
    st.text(max_size=20),
)
HOSTILE = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=4),
    st.dictionaries(st.text(max_size=6), SCALARS, max_size=4),
    st.sampled_from([10, 63, 64, 65, 100, 1500, 100_000]).map(Deep),
)


def json_text(value: object) -> bytes:
    """``value`` as JSON (NaN and infinities as Python writes them), ``Deep`` values
    written in place; lone surrogates escaped, as a client would send them."""
    deep: list[Deep] = []

    def default(item: object) -> str:
        if isinstance(item, Deep):
            deep.append(item)
            return f"__deep_{len(deep) - 1}__"
        raise TypeError(type(item).__name__)

    text = json.dumps(value, default=default)
    for index, item in enumerate(deep):
        text = text.replace(f'"__deep_{index}__"', "[" * item.depth + "]" * item.depth)
    return text.encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------- HTTP bodies

MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
         "content": st.one_of(st.text(max_size=30), TEXTS)},
        optional={"name": st.text(max_size=5), "tool_call_id": st.text(max_size=5)},
    ),
    min_size=1,
    max_size=3,
)  # fmt: skip
TOOLS = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"),
         "function": st.fixed_dictionaries(
             {"name": st.sampled_from(["f", "get_weather", "bad name", ""])},
             optional={"parameters": st.one_of(
                 st.just({"type": "object", "properties": {"x": {"type": "integer"}}}),
                 HOSTILE)})},
    ),
    max_size=2,
)  # fmt: skip
PROMPTS = st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(0, 600), min_size=1, max_size=8),
    st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
)
# Plausible values of the sampling fields, so that many requests run.
SAMPLING = {
    "max_tokens": st.integers(1, 6),
    "min_tokens": st.integers(0, 3),
    "temperature": st.sampled_from([0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "top_k": st.sampled_from([-1, 0, 5]),
    "min_p": st.sampled_from([0.0, 0.1]),
    "seed": st.integers(0, 1000),
    "n": st.integers(1, 3),
    "best_of": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1), max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3),
    "logprobs": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100), max_size=2),
    "allowed_token_ids": st.lists(st.integers(0, 511), min_size=1, max_size=4),
    "bad_words": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([1.0, 1.2]),
    "truncate_prompt_tokens": st.sampled_from([-1, 1, 8]),
    "use_beam_search": st.booleans(),
    "length_penalty": st.floats(-2, 2),
    "early_stopping": st.sampled_from([True, False, "never"]),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(0, 2),
    "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "text"},
         {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]
    ),
    "structured_outputs": st.sampled_from([{"regex": "[ab]+"}, {"choice": ["a", "b"]},
                                           {"grammar": "start: 'a'+"}, {"regex": "("}]),
    "priority": st.just(0),
    "user": st.text(max_size=10),
    "request_id": st.text(max_size=10),
    "cache_salt": st.text(max_size=10),
}  # fmt: skip
CHAT = {
    "messages": MESSAGES,
    "tools": TOOLS,
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function",
                                    "function": {"name": "f"}}]),
    "max_completion_tokens": st.integers(1, 6),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 3),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]),
                                            st.booleans(), max_size=1),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "documents": st.lists(st.dictionaries(st.sampled_from(["title", "text"]), st.text(max_size=5))),
    "chat_template": st.text(max_size=20),
    "reasoning_effort": st.sampled_from(["low", "high", "max"]),
    "parallel_tool_calls": st.booleans(),
    "include_reasoning": st.booleans(),
}  # fmt: skip
RESPONSES = {
    "input": st.one_of(st.text(max_size=20), MESSAGES),
    "instructions": st.text(max_size=20),
    "max_output_tokens": st.integers(1, 6),
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=600), max_size=17),
    "store": st.booleans(),
    "background": st.booleans(),
    "previous_response_id": st.text(max_size=10),
    "text": st.just({"format": {"type": "json_object"}}),
    "truncation": st.sampled_from(["disabled", "auto"]),
    "reasoning": st.just({"effort": "low"}),
    "top_logprobs": st.integers(0, 3),
    "stream": st.booleans(),
    "seed": st.integers(0, 1000),
    "temperature": st.sampled_from([0.0, 1.0]),
}
POOLING = {
    "input": PROMPTS,
    "messages": MESSAGES,
    "encoding_format": st.sampled_from(["float", "base64", "x"]),
    "dimensions": st.integers(1, 200),
    "normalize": st.booleans(),
    "truncate_prompt_tokens": st.sampled_from([-1, 1, 8]),
    "text_1": PROMPTS,
    "text_2": PROMPTS,
    "query": st.text(max_size=10),
    "documents": st.lists(st.text(max_size=10), max_size=3),
    "top_n": st.integers(0, 3),
    "task": st.sampled_from(["embed", "classify", "token_embed", "x"]),
    "use_activation": st.booleans(),
}
TOKENIZE = {
    "prompt": st.text(max_size=40),
    "messages": MESSAGES,
    "add_special_tokens": st.booleans(),
    "tokens": st.lists(st.integers(0, 600), max_size=5),
}

# route -> (its fields, the fields every plausible body has)
ROUTES = {
    "/v1/completions": ({**SAMPLING, "prompt": PROMPTS}, ("prompt", "max_tokens")),
    "/v1/chat/completions": ({**SAMPLING, **CHAT}, ("messages", "max_tokens")),
    "/v1/responses": (RESPONSES, ("input", "max_output_tokens")),
    "/v1/embeddings": (POOLING, ("input",)),
    "/score": (POOLING, ("text_1", "text_2")),
    "/rerank": (POOLING, ("query", "documents")),
    "/classify": (POOLING, ("input",)),
    "/pooling": (POOLING, ("input",)),
    "/tokenize": (TOKENIZE, ("prompt",)),
    "/detokenize": (TOKENIZE, ("tokens",)),
    "/invocations": ({**SAMPLING, **POOLING, "prompt": PROMPTS}, ("prompt", "max_tokens")),
}


@st.composite
def http_calls(draw) -> tuple[str, str, bytes]:
    """(method, path, body): a route's body, its fields plausible or hostile, some
    unknown ones; now and then no JSON object at all, or another route's method."""
    kind = draw(st.sampled_from(["body"] * 8 + ["not_an_object", "bytes", "get", "delete"]))
    if kind == "get":
        name = urllib.parse.quote(draw(st.text(max_size=12)), safe="")
        path = draw(
            st.sampled_from(
                ["/v1/models", f"/v1/models/{name}", f"/v1/responses/{name}",
                 f"/v1/responses/{name}/input_items?limit=3&order=x", "/health", "/metrics",
                 "/version", "/load", f"/v1/responses/{name}?stream=true&starting_after=-9"]
            )
        )  # fmt: skip
        return "GET", path, b""
    if kind == "delete":
        name = urllib.parse.quote(draw(st.text(max_size=12)), safe="")
        return draw(
            st.sampled_from(
                [("DELETE", f"/v1/responses/{name}", b""),
                 ("POST", f"/v1/responses/{name}/cancel", b""),
                 ("POST", "/reset_prefix_cache", b"")]
            )
        )  # fmt: skip
    route = draw(st.sampled_from(sorted(ROUTES)))
    if kind == "not_an_object":
        return "POST", route, json_text(draw(HOSTILE))
    if kind == "bytes":
        return "POST", route, draw(st.binary(max_size=64))
    fields, required = ROUTES[route]
    body = {}
    for name in required:
        body[name] = draw(fields[name])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(st.one_of(fields[name], fields[name], HOSTILE))
    body.update(draw(st.dictionaries(st.text(min_size=1, max_size=8), HOSTILE, max_size=2)))
    return "POST", route, json_text(body)


def call_http(server, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"} if body else {}
        connection.request(method, path, body=body or None, headers=headers)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        connection.close()


def check_event_stream(path: str, data: bytes) -> None:
    """A streamed answer: every event parses, none is an error, and it has its end
    ([DONE] for completions; a Responses stream's completed or incomplete event)."""
    events = []
    for raw in data.decode().split("\n\n"):
        if not raw.strip():
            continue
        lines = raw.split("\n")
        payload = next(line for line in lines if line.startswith("data: "))[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events, "an empty stream"
    for item in events:
        assert not (isinstance(item, dict) and "error" in item and item.get("error")), item
    if path.startswith("/v1/responses"):
        kinds = [event["type"] for event in events]
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        assert "response.failed" not in kinds and "error" not in kinds, kinds
    else:
        assert events[-1] == "[DONE]", events[-3:]


def check_http_answer(method: str, path: str, body: bytes, answer) -> None:
    status, content_type, data = answer
    assert status < 500, (method, path, body[:300], status, data[:500])
    if status == 200 and content_type.startswith("text/event-stream"):
        check_event_stream(path, data)
    elif status >= 400:
        error = json.loads(data)["error"]
        assert error["code"] == status and error["message"], error
        if status == 400:
            # The refusal names the field: as its param, or in its message.
            assert error["param"] is not None or any(
                name in error["message"] for name in _field_names(body)
            ), (body[:300], error)


def _field_names(body: bytes) -> list[str]:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return ["the request body"]
    if not isinstance(value, dict):
        return ["the request body"]
    return [*value, "the request body"]


@FUZZ_SETTINGS
@given(call=http_calls())
def test_http_routes_answer_or_refuse_by_name(server, call):
    method, path, body = call
    answer = call_http(server, method, path, body)
    event(f"HTTP {answer[0]}")  # the share of each status: --hypothesis-show-statistics
    check_http_answer(method, path, body, answer)


# ---------------------------------------------------------------- gRPC messages

UINT32 = st.sampled_from([0, 1, 2, 7, 20, 21, 511, 512, 2**31 - 1, 2**31, 2**32 - 1])
INT32 = st.sampled_from([-(2**31), -2, -1, 0, 1, 8, 513, 2**31 - 1])
DOUBLES = st.one_of(st.sampled_from(FLOATS), st.floats(-3, 3))
SMALL_UINT = st.one_of(st.integers(1, 6), UINT32)
JSON_TEXTS = st.one_of(
    st.just('{"type": "object"}'),
    st.sampled_from(["", "{", "[]", "null", "1e999"]),
    st.sampled_from([10, 64, 65, 2000, 100_000]).map(lambda d: "[" * d + "]" * d),
    st.text(max_size=20),
)


def _enum_values(enum) -> st.SearchStrategy:
    """An enum's values, its _UNSPECIFIED among them, or any int32 (a newer client's)."""
    return st.one_of(st.sampled_from(list(enum.values())), INT32)


def _sampling_messages() -> st.SearchStrategy:
    fields = {
        "max_tokens": SMALL_UINT, "min_tokens": SMALL_UINT, "temperature": DOUBLES,
        "top_k": INT32, "top_p": DOUBLES, "min_p": DOUBLES, "repetition_penalty": DOUBLES,
        "presence_penalty": DOUBLES, "frequency_penalty": DOUBLES,
        "seed": st.sampled_from([0, 7, 2**63 - 1, 2**63, 2**64 - 1]), "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(UINT32, max_size=3), "stop": st.lists(st.text(max_size=4),
        max_size=2), "include_stop_str_in_output": st.booleans(), "logprobs": UINT32,
        "prompt_logprobs": UINT32, "n": SMALL_UINT, "best_of": SMALL_UINT,
        "beam_width": SMALL_UINT, "length_penalty": DOUBLES,
        "early_stopping": _enum_values(pb.EarlyStopping),
        "skip_special_tokens": st.booleans(), "detokenize": st.booleans(),
        "logit_bias": st.dictionaries(UINT32, DOUBLES, max_size=2),
        "allowed_token_ids": st.lists(UINT32, max_size=3),
        "bad_words": st.lists(st.text(max_size=4), max_size=2),
        "truncate_prompt_tokens": INT32,
        "structured_outputs": st.one_of(
            JSON_TEXTS.map(lambda text: pb.StructuredOutputs(json_schema=text)),
            st.text(max_size=8).map(lambda text: pb.StructuredOutputs(regex=text)),
            st.text(max_size=8).map(lambda text: pb.StructuredOutputs(grammar=text)),
            st.lists(st.text(max_size=3), max_size=3).map(
                lambda choices: pb.StructuredOutputs(choice=pb.ChoiceList(choices=choices))
            ),
            st.just(pb.StructuredOutputs(json_object=True)),
        ),
    }  # fmt: skip
    return (
        st.dictionaries(st.sampled_from(sorted(fields)), st.none(), max_size=6)
        .flatmap(lambda chosen: st.fixed_dictionaries({name: fields[name] for name in chosen}))
        .map(lambda kwargs: pb.SamplingParams(**kwargs))
    )


CHAT_MESSAGES = st.lists(
    st.builds(
        pb.ChatMessage,
        role=_enum_values(pb.ChatRole),
        content=st.one_of(st.text(max_size=20), TEXTS),
        tool_calls=st.lists(
            st.builds(pb.ToolCall, id=st.text(max_size=4), name=st.sampled_from(["f", ""]),
                      arguments=JSON_TEXTS), max_size=1),
        tool_call_id=st.text(max_size=4),
        reasoning_content=st.text(max_size=4),
    ),
    max_size=3,
)  # fmt: skip
CHATS = st.builds(
    pb.Chat,
    messages=CHAT_MESSAGES,
    tools=st.lists(
        st.builds(pb.Tool, name=st.sampled_from(["f", "g", "bad name", ""]),
                  parameters=JSON_TEXTS), max_size=2),
    tool_choice=st.one_of(
        st.builds(pb.ToolChoice, mode=_enum_values(pb.ToolChoiceMode)),
        st.builds(pb.ToolChoice, function_name=st.sampled_from(["f", "h"]))),
    chat_template_kwargs=JSON_TEXTS,
    chat_template=st.sampled_from(["", "{{ messages }}"]),
    reasoning_effort=_enum_values(pb.ReasoningEffort),
)  # fmt: skip
TOKEN_IDS = st.builds(pb.TokenIds, ids=st.lists(UINT32 | st.integers(0, 511), max_size=6))
PROMPT_FIELDS = st.one_of(
    st.fixed_dictionaries({"text": st.one_of(st.text(max_size=30), TEXTS)}),
    st.fixed_dictionaries({"token_ids": TOKEN_IDS}),
    st.fixed_dictionaries({"chat": CHATS}),
    st.just({}),
)
IDS = st.one_of(st.text(max_size=6), st.just("r" * 300))
COMMON = {"request_id": IDS, "lora_adapter": st.sampled_from(["", "nope"]), "priority": INT32}


def _with(strategy: st.SearchStrategy, **fields: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(strategy, st.fixed_dictionaries({}, optional=fields)).map(
        lambda pair: {**pair[0], **pair[1]}
    )


GRPC_CALLS = st.one_of(
    _with(PROMPT_FIELDS, sampling=_sampling_messages(), cache_namespace=IDS, **COMMON).map(
        lambda kwargs: ("Generate", pb.GenerateRequest(**kwargs))
    ),
    _with(PROMPT_FIELDS, sampling=_sampling_messages(), **COMMON).map(
        lambda kwargs: ("GenerateStream", pb.GenerateStreamRequest(**kwargs))
    ),
    _with(PROMPT_FIELDS, dimensions=UINT32, normalize=st.booleans(), **COMMON).map(
        lambda kwargs: ("Embed", pb.EmbedRequest(**kwargs))
    ),
    st.builds(pb.ScoreRequest, text_1=st.lists(st.text(max_size=6), max_size=2),
              text_2=st.lists(st.text(max_size=6), max_size=2), truncate_prompt_tokens=INT32,
              priority=INT32).map(lambda message: ("Score", message)),
    st.builds(pb.ClassifyRequest, input=st.lists(st.text(max_size=6), max_size=2),
              truncate_prompt_tokens=INT32).map(lambda message: ("Classify", message)),
    st.one_of(
        st.builds(pb.TokenizeRequest, text=st.text(max_size=20)),
        st.builds(pb.TokenizeRequest, chat=CHATS),
        st.just(pb.TokenizeRequest()),
    ).map(lambda message: ("Tokenize", message)),
    st.just(("GetModelInfo", pb.GetModelInfoRequest())),
    st.just(("GetStats", pb.GetStatsRequest())),
    st.tuples(
        st.sampled_from(["Generate", "GenerateStream", "Embed", "Score", "Tokenize"]),
        st.binary(min_size=1, max_size=32),
    ),
)  # fmt: skip

# Refusals; anything else (UNKNOWN, INTERNAL, UNAVAILABLE, a deadline) is a server fault.
GRPC_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def call_grpc(server, method: str, message) -> None:
    path = f"/pagedserve.v1.GenerationService/{method}"
    serialize = (
        (lambda data: data) if isinstance(message, bytes) else (lambda m: m.SerializeToString())
    )
    if method == "GenerateStream":
        call = server.channel.unary_stream(path, request_serializer=serialize)
        for _response in call(message, timeout=120):
            pass
    else:
        server.channel.unary_unary(path, request_serializer=serialize)(message, timeout=120)


@FUZZ_SETTINGS
@given(call=GRPC_CALLS)
def test_grpc_methods_answer_or_refuse(server, call):
    method, message = call
    try:
        call_grpc(server, method, message)
        event("gRPC OK")
    except grpc.RpcError as error:
        event(f"gRPC {error.code().name}")
        assert error.code() in GRPC_REFUSALS, (method, str(message)[:300], error)
        assert error.details(), (method, error)


# ---------------------------------------------------------------- the fuzz's own checks


def test_the_stream_check_fails_on_an_error_event(start_server):
    """The checks above would see a stream that fails midway: a fault forced into output
    processing (a stream already answering 200) must trip ``check_event_stream``."""
    server = start_server("--http-port", "0", env={ENVIRONMENT_VARIABLE: "output_processing:77"})
    body = json_text({"prompt": [5, 6], "max_tokens": 4, "stream": True, "seed": 77})
    answer = call_http(server, "POST", "/v1/completions", body)
    assert answer[0] == 200
    with pytest.raises(AssertionError):
        check_http_answer("POST", "/v1/completions", body, answer)
    healthy = json_text({"prompt": [5, 6], "max_tokens": 4, "stream": True, "seed": 78})
    check_http_answer(
        "POST", "/v1/completions", healthy, call_http(server, "POST", "/v1/completions", healthy)
    )
    server.assert_blocks_all_free()
