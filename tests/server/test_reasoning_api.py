"""A reasoning model's thinking apart from its answer (``--reasoning-parser``) over the
real server: the whole answer's ``reasoning_content`` and ``content``, a stream's deltas
adding up to them, ``include_reasoning: false``, and completions left raw; gpt-oss's
harmony format (``--reasoning-parser openai_gptoss --tool-call-parser openai``), its
thinking, answer and calls apart. The tiny random model writes garbage when free, so a
regex (structured output) makes it write the format (harmony's markers byte by byte: this
tokenizer does not hold them, so the text keeps them as o200k_harmony's would)."""

from __future__ import annotations

import openai
import pytest

from helpers.http_calls import post, sse_events, typed_events
from helpers.server_process import SERVED_MODEL_NAME
from helpers.tool_calls import ONE_TOOL, streamed_calls, whole_calls, without_ids
from pagedserve.frontend.tokenizer import Tokenizer

FORCED = r"Paris is big\.</think>It is Paris\."
BODY = {
    "model": SERVED_MODEL_NAME,
    "messages": [{"role": "user", "content": "Capital of France?"}],
    "max_tokens": 40,
    "temperature": 0,
    "structured_outputs": {"regex": FORCED},
}


@pytest.fixture
def thinking_server(start_server):
    server = start_server(
        "--http-port", "0", "--served-model-name", SERVED_MODEL_NAME,
        "--reasoning-parser", "deepseek_r1", "--kv-cache-bytes", str(4 << 20),
    )  # fmt: skip
    yield server
    server.assert_blocks_all_free()


def test_thinking_and_answer_come_apart_whole_and_streamed(thinking_server):
    status, answer = post(thinking_server, "/v1/chat/completions", BODY)
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Paris is big.", "It is Paris.")
    assert answer["choices"][0]["finish_reason"] == "stop"

    events = sse_events(thinking_server, "/v1/chat/completions", {**BODY, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris is big."
    assert "".join(d.get("content") or "" for d in deltas) == "It is Paris."
    # The thinking streams first; no delta mixes a marker into either part.
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])
    assert not any("<" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)

    status, hidden = post(
        thinking_server, "/v1/chat/completions", {**BODY, "include_reasoning": False}
    )
    assert "reasoning_content" not in hidden["choices"][0]["message"]
    assert hidden["choices"][0]["message"]["content"] == "It is Paris."

    # OpenAI's client keeps the field (an extra of its message model).
    client = openai.OpenAI(
        base_url=f"{thinking_server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    )
    with client:
        fields = {key: value for key, value in BODY.items() if key != "structured_outputs"}
        chat = client.chat.completions.create(
            **fields, extra_body={"structured_outputs": BODY["structured_outputs"]}
        )
    assert chat.choices[0].message.reasoning_content == "Paris is big."

    # Completions are text continuation: no splitting.
    completion = {"model": SERVED_MODEL_NAME, "prompt": "x", "max_tokens": 40, "temperature": 0}
    status, raw = post(
        thinking_server, "/v1/completions", {**completion, "structured_outputs": {"regex": FORCED}}
    )
    assert raw["choices"][0]["text"] == "Paris is big.</think>It is Paris."


def test_a_bad_include_reasoning_is_refused_by_name(thinking_server):
    status, answer = post(thinking_server, "/v1/chat/completions", {**BODY, "include_reasoning": 1})
    assert status == 400 and answer["error"]["param"] == "include_reasoning", answer


def test_responses_put_the_thinking_in_a_reasoning_item(thinking_server, server_model_dir):
    body = {
        "model": SERVED_MODEL_NAME,
        "input": "Capital of France?",
        "max_output_tokens": 40,
        "temperature": 0,
        "structured_outputs": {"regex": FORCED},
        "store": False,
    }
    status, answer = post(thinking_server, "/v1/responses", body)
    assert status == 200, answer
    reasoning, message = answer["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Paris is big."}]
    assert message["type"] == "message"
    assert message["content"][0]["text"] == "It is Paris."
    events = typed_events(thinking_server, body)
    kinds = [e["type"] for e in events]
    thinking = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thinking, text) == ("Paris is big.", "It is Paris.")
    # The reasoning item closes before the message opens.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "Paris is big."
    # The thinking's tokens, its closing marker included (this byte-level vocabulary
    # spells </think> in several tokens: counted by tokenizing the thinking again).
    usage = answer["usage"]
    thinking_tokens = len(Tokenizer(server_model_dir).encode("Paris is big.</think>", False))
    assert usage["output_tokens_details"]["reasoning_tokens"] == thinking_tokens
    assert 0 < thinking_tokens < usage["output_tokens"]
    assert final["usage"]["output_tokens_details"] == usage["output_tokens_details"]


# gpt-oss's outputs after the prompt's "<|start|>assistant": thinking, then the answer or a
# call (the recipient before <|channel|>); <|return|> and <|call|> would end them.
HARMONY_ANSWER = (
    r"<\|channel\|>analysis<\|message\|>Paris is big\.<\|end\|><\|start\|>assistant"
    r"<\|channel\|>final<\|message\|>It is Paris\."
)
HARMONY_CALL = (
    r"<\|channel\|>analysis<\|message\|>Ask\.<\|end\|><\|start\|>assistant to=functions\."
    r'get_weather<\|channel\|>commentary json<\|message\|>\{"city":"Paris"\}'
)
HARMONY_MAX_TOKENS = 160  # a byte-level vocabulary: about a token per character


def test_gptoss_harmony_reads_apart_whole_and_streamed(start_server):
    server = start_server(
        "--http-port", "0", "--served-model-name", SERVED_MODEL_NAME,
        "--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice",
        "--tool-call-parser", "openai", "--kv-cache-bytes", str(4 << 20),
    )  # fmt: skip
    body = {
        **BODY,
        "max_tokens": HARMONY_MAX_TOKENS,
        "structured_outputs": {"regex": HARMONY_ANSWER},
    }
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Paris is big.", "It is Paris.")
    events = sse_events(server, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Paris is big."
    assert "".join(d.get("content") or "" for d in deltas) == "It is Paris."
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "")
                   for d in deltas)  # fmt: skip

    # With tools, the call's message is the call; the thinking stays apart.
    body = {**body, "tools": ONE_TOOL, "structured_outputs": {"regex": HARMONY_CALL}}
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "Ask."
    want = [{"type": "function", "name": "get_weather", "arguments": '{"city":"Paris"}'}]
    assert without_ids(whole_calls(choice["message"])) == want
    events = sse_events(server, "/v1/chat/completions", {**body, "stream": True})
    content, calls, _deltas, finishes = streamed_calls(events)
    assert content == "" and finishes[-1] == "tool_calls"
    assert [(call["name"], call["arguments"]) for call in calls] == [
        ("get_weather", '{"city":"Paris"}')
    ]
    server.assert_blocks_all_free()
