"""The OpenAI-compatible HTTP API end to end: a real server process (both APIs on one
engine), OpenAI's own Python client and plain HTTP on 127.0.0.1.

Outputs are compared with the offline engine in this process on the same weights; streams
must add up to the whole answer; bad input must name the field."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.grpc_calls import both_rpcs
from helpers.http_calls import get, post, sse_events
from helpers.openai_shapes import assert_openai_shape
from helpers.processes import wait_until
from helpers.server_process import SERVED_MODEL_NAME
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.client import Client
from pagedserve.frontend.grpc_convert import chat_to_proto
from pagedserve.v1 import generation_pb2 as pb

PROMPT_IDS = [5, 300, 301, 302]
NUM_TOKENS = 20
# Fields of vLLM's that OpenAI's client passes through as they are.
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(server_model_dir, num_blocks=128)


@pytest.fixture
def client(server) -> openai.OpenAI:
    with openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


def greedy_params(max_tokens: int = NUM_TOKENS, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


# ---------------------------------------------------------------- completions


def test_completions_equal_the_offline_engine_whole_and_streamed(server, client, offline):
    want = offline.generate(PROMPT_IDS, greedy_params())[0]
    whole = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, **GREEDY
    )
    assert whole.object == "text_completion" and whole.model == SERVED_MODEL_NAME
    assert whole.choices[0].text == want.outputs[0].text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(PROMPT_IDS)
    assert whole.usage.completion_tokens == NUM_TOKENS
    assert whole.usage.total_tokens == len(PROMPT_IDS) + NUM_TOKENS

    chunks = list(
        client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=PROMPT_IDS,
            max_tokens=NUM_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes.count("length") == 1 and finishes[-1] == "length"
    # Streamed as it was made: the first token goes out alone, before the rest exists (a
    # reader that falls behind gets the steps it missed merged, so no more is certain).
    assert len([c for c in chunks if c.choices]) >= 2 and chunks[0].choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NUM_TOKENS
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_logit_bias_allowed_token_ids_and_bad_words_equal_the_offline_engine(
    server, client, offline
):
    plain = offline.generate(PROMPT_IDS, greedy_params())[0].outputs[0].token_ids
    # OpenAI's range is [-100, 100]; a bias past it is clamped, as vLLM does.
    bias = {plain[0]: -100.0, 300: 6.5}
    allowed = [5, 17, 300, 301, 302, 450]
    # A letter the output says as a token of its own (vLLM's bad_words field).
    letter = next(t for t in map(offline.tokenizer.decode, ([i] for i in plain)) if t.isalpha())
    for fields, wire in (
        (dict(logit_bias=bias), dict(logit_bias={str(plain[0]): -1000, "300": 6.5})),
        (dict(allowed_token_ids=allowed), dict(extra_body={"allowed_token_ids": allowed})),
        (dict(bad_words=[letter]), dict(extra_body={"bad_words": [letter]})),
    ):
        want = offline.generate(PROMPT_IDS, greedy_params(**fields))[0].outputs[0]
        extra = {**GREEDY["extra_body"], **wire.pop("extra_body", {})}
        answer = client.completions.create(
            model=SERVED_MODEL_NAME,
            prompt=PROMPT_IDS,
            max_tokens=NUM_TOKENS,
            temperature=0.0,
            extra_body=extra,
            **wire,
        )
        assert answer.choices[0].text == want.text, fields
        assert want.token_ids != plain
    assert (
        plain[0]
        not in offline.generate(PROMPT_IDS, greedy_params(logit_bias=bias))[0].outputs[0].token_ids
    )


def test_truncate_prompt_tokens_keeps_the_prompts_end_in_both_apis(server, offline):
    # 600 tokens: past the 512-token window, so only a truncated prompt can run.
    long = [5 + (i * 7) % 500 for i in range(600)]
    want = offline.generate(long, greedy_params(truncate_prompt_tokens=20))[0]
    assert want.prompt_token_ids == long[-20:]
    assert (
        want.outputs[0].token_ids
        == offline.generate(long[-20:], greedy_params())[0].outputs[0].token_ids
    )
    body = {"model": SERVED_MODEL_NAME, "prompt": long, "max_tokens": NUM_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "truncate_prompt_tokens": 20}  # fmt: skip
    status, answer = post(server, "/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == want.outputs[0].text
    assert answer["usage"]["prompt_tokens"] == 20
    sampling = pb.SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=20
    )
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=long), sampling=sampling)
    output = server.stub.Generate(request)
    assert list(output.outputs[0].token_ids) == want.outputs[0].token_ids
    assert list(output.prompt_token_ids) == long[-20:] and output.usage.prompt_tokens == 20
    # More than the window holds is refused by name, in both APIs.
    status, answer = post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 513})
    assert (status, answer["error"]["param"]) == (400, "truncate_prompt_tokens"), answer
    assert (
        "must be -1 or in [1, 512] (the model's context window), got 513"
        in (answer["error"]["message"])
    )
    request.sampling.truncate_prompt_tokens = 513
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling.truncate_prompt_tokens must be -1 or in")


def test_text_prompts_in_a_batch_stop_strings_and_seeded_samples(server, client, offline):
    prompts = ["hello world", "the cat"]
    want = offline.generate(prompts, greedy_params())
    answer = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=prompts, max_tokens=NUM_TOKENS, **GREEDY
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == [w.outputs[0].text for w in want]
    # A stop string from the greedy text: cut before it, reported as the stop reason.
    stop = want[0].outputs[0].text[5:8]
    cut = offline.generate(
        prompts[0], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, stop=[stop])
    )
    answer = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=prompts[0], max_tokens=NUM_TOKENS, stop=stop,
        temperature=0.0,
    )  # fmt: skip
    assert answer.choices[0].text == cut[0].outputs[0].text
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].model_extra["stop_reason"] == stop
    # n = 3 seeded samples draw what the offline engine draws.
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, n=3, ignore_eos=True)
    want = offline.generate(PROMPT_IDS, params)[0]
    answer = client.completions.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT_IDS, max_tokens=10, temperature=0.8, seed=7,
        n=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in answer.choices] == [o.text for o in want.outputs]


def test_completion_logprobs_and_echo(server, offline):
    want = offline.generate(PROMPT_IDS, greedy_params(6, logprobs=2, prompt_logprobs=2))[0]
    body = {
        "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "logprobs": 2, "echo": True,
    }  # fmt: skip
    status, answer = post(server, "/v1/completions", body)
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    num_prompt = len(PROMPT_IDS)
    assert len(logprobs["tokens"]) == num_prompt + 6
    assert logprobs["token_logprobs"][0] is None  # nothing predicts the first token
    for position, entry in enumerate(want.prompt_logprobs[1:], start=1):
        chosen = PROMPT_IDS[position]
        assert logprobs["token_logprobs"][position] == pytest.approx(entry[chosen], abs=1e-5)
    for position, entry in enumerate(want.outputs[0].logprobs):
        chosen = want.outputs[0].token_ids[position]
        got = logprobs["token_logprobs"][num_prompt + position]
        assert got == pytest.approx(entry[chosen], abs=1e-5)
        top = logprobs["top_logprobs"][num_prompt + position]
        assert len(top) == 2 and max(top.values()) == pytest.approx(max(entry.values()), abs=1e-5)
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    echoed = answer["choices"][0]["text"]
    assert echoed.endswith(want.outputs[0].text)
    assert echoed[: -len(want.outputs[0].text) or None] == offline.tokenizer.decode(
        PROMPT_IDS, skip_special_tokens=False
    )
    # vLLM's prompt_logprobs, without echo: per choice, keyed by token id.
    status, answer = post(server, "/v1/completions", {**body, "echo": False, "prompt_logprobs": 2})
    reported = answer["choices"][0]["prompt_logprobs"]
    assert reported[0] is None and len(reported) == len(PROMPT_IDS)
    for entry, want_entry in zip(reported[1:], want.prompt_logprobs[1:]):
        assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(want_entry)
    # Streamed: the same logprobs, a token at a time.
    events = sse_events(server, "/v1/completions", {**body, "echo": False, "stream": True})
    assert events[-1] == "[DONE]"
    streamed = [
        lp for e in events[:-1] for c in e["choices"] if c["logprobs"]
        for lp in c["logprobs"]["token_logprobs"]
    ]  # fmt: skip
    assert streamed == pytest.approx(logprobs["token_logprobs"][num_prompt:], abs=1e-6)
    # vLLM's return_tokens_as_token_ids: tokens named by id; offsets still the text's.
    by_id = {**body, "return_tokens_as_token_ids": True}
    status, answer = post(server, "/v1/completions", by_id)
    named = answer["choices"][0]["logprobs"]
    assert named["tokens"] == [f"token_id:{t}" for t in PROMPT_IDS + want.outputs[0].token_ids]
    assert named["text_offset"] == offsets
    assert all(k.startswith("token_id:") for top in named["top_logprobs"][1:] for k in top)
    events = sse_events(server, "/v1/completions", {**by_id, "echo": False, "stream": True})
    tokens = [t for e in events[:-1] for c in e["choices"] if c["logprobs"]
              for t in c["logprobs"]["tokens"]]  # fmt: skip
    assert tokens == [f"token_id:{t}" for t in want.outputs[0].token_ids]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    status, answer = post(server, "/v1/chat/completions", chat)
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(item["token"].startswith("token_id:") for item in content)
    status, answer = post(server, "/v1/completions", {**by_id, "return_tokens_as_token_ids": 1})
    assert (status, answer["error"]["param"]) == (400, "return_tokens_as_token_ids"), answer


# ---------------------------------------------------------------- chat


def test_chat_completions_use_the_chat_template_as_offline(server, client, offline):
    messages = [{"role": "user", "content": "hi there"}]
    want = offline.chat(messages, greedy_params(8))[0]
    answer = client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, max_completion_tokens=8, **GREEDY
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == want.outputs[0].text
    assert answer.usage.prompt_tokens == len(want.prompt_token_ids)
    # Text parts are joined as one content string.
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        }
    ]
    again = client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=parts, max_tokens=8, **GREEDY
    )
    assert again.choices[0].message.content == want.outputs[0].text

    chunks = list(
        client.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=messages, max_tokens=8, stream=True,
            logprobs=True, top_logprobs=3, **GREEDY,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(streamed) == 8
    for item, entry, token_id in zip(
        streamed, want_logprobs(offline, messages), want.outputs[0].token_ids
    ):
        assert item.logprob == pytest.approx(entry[token_id], abs=1e-5)
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(max(entry.values()), abs=1e-5)
        assert bytes(item.bytes).decode(errors="replace") == item.token


def assert_chat_answer_is(server, body: dict, want) -> None:
    """An HTTP chat call answers as the offline engine did (``want``): the same text from
    the same number of prompt tokens."""
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == want.outputs[0].text
    assert answer["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def assert_refused_by_name(server, body: dict, request, field: str, words: str) -> None:
    """The same bad chat setting, as an HTTP body and as a gRPC request: each API refuses it
    naming the field (HTTP's param; gRPC's "chat.<field>") and saying ``words``."""
    status, answer = post(server, "/v1/chat/completions", body)
    assert (status, answer["error"]["param"]) == (400, field), answer
    assert words in answer["error"]["message"]
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"chat.{field}"), caught.value.details()
    assert words in caught.value.details()


def test_a_final_message_is_continued_as_offline_and_as_hf_renders_it(
    server, offline, server_model_dir
):
    from transformers import AutoTokenizer

    started = [
        {"role": "user", "content": "name a fruit"},
        {"role": "assistant", "content": "I would say the"},
    ]
    reference = AutoTokenizer.from_pretrained(server_model_dir).apply_chat_template(
        started, tokenize=False, continue_final_message=True
    )
    assert reference.endswith("I would say the")  # no end of turn: the model goes on
    flags = dict(add_generation_prompt=False, continue_final_message=True)
    want = offline.chat(started, greedy_params(8), **flags)[0]
    assert want.prompt == reference
    assert want.prompt_token_ids == offline.tokenizer.encode(reference, add_special_tokens=False)
    body = {"model": SERVED_MODEL_NAME, "messages": started, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, **flags}  # fmt: skip
    assert_chat_answer_is(server, body, want)
    chat = pb.Chat(add_generation_prompt=False, continue_final_message=True)
    for message in started:
        role = pb.ChatRole.Value(f"CHAT_ROLE_{message['role'].upper()}")
        chat.messages.add(role=role, content=message["content"])
    sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    output = server.stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling))
    assert list(output.prompt_token_ids) == want.prompt_token_ids
    assert list(output.outputs[0].token_ids) == want.outputs[0].token_ids
    # Without the assistant's header: the conversation as it stands, no turn opened.
    closed = offline.chat(started[:1], greedy_params(8), add_generation_prompt=False)[0]
    assert closed.prompt.endswith("<|im_end|>\n")
    # Both at once is refused by name, in each API.
    chat.add_generation_prompt = True
    assert_refused_by_name(
        server, {**body, "add_generation_prompt": True}, pb.GenerateRequest(chat=chat),
        "continue_final_message", "cannot both be true",
    )  # fmt: skip
    with pytest.raises(ValueError, match="^continue_final_message and add_generation_prompt"):
        offline.chat(started, greedy_params(8), continue_final_message=True)


def test_documents_reach_the_template_and_a_request_template_needs_trust(
    server, offline, server_model_dir
):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "what is it?"}]
    documents = [{"title": "a", "text": "plums are fruit"}]
    reference = AutoTokenizer.from_pretrained(server_model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, documents=documents
    )
    assert reference.startswith("<|im_start|>document\nplums are fruit")
    want = offline.chat(messages, greedy_params(8), documents=documents)[0]
    assert want.prompt == reference
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, "documents": documents}  # fmt: skip
    assert_chat_answer_is(server, body, want)
    chat = pb.Chat()
    chat.messages.add(role=pb.CHAT_ROLE_USER, content="what is it?")
    chat.documents.add(fields=documents[0])
    sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    output = server.stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling))
    assert list(output.outputs[0].token_ids) == want.outputs[0].token_ids
    assert list(output.prompt_token_ids) == want.prompt_token_ids
    status, answer = post(server, "/v1/chat/completions", {**body, "documents": [{"text": 1}]})
    assert (status, answer["error"]["param"]) == (400, "documents"), answer
    assert "documents[0] must be an object of strings" in answer["error"]["message"]
    with pytest.raises(ValueError, match=r"^documents must be a list"):
        offline.chat(messages, greedy_params(8), documents="plums")
    # A template of the request's own: this server does not trust its clients with one.
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    chat.chat_template = own
    assert_refused_by_name(
        server, {**body, "chat_template": own}, pb.GenerateRequest(chat=chat),
        "chat_template", "--trust-request-chat-template",
    )  # fmt: skip


def test_a_trusting_server_renders_a_request_template(start_server, offline):
    server = start_server(
        "--http-port", "0", "--served-model-name", SERVED_MODEL_NAME,
        "--kv-cache-bytes", str(4 << 20), "--trust-request-chat-template",
    )  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    own = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}>"
    want = offline.chat(messages, greedy_params(8), chat_template=own)[0]
    assert want.prompt == "[user: hi]>"
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, "chat_template": own}  # fmt: skip
    assert_chat_answer_is(server, body, want)
    chat = pb.Chat(chat_template=own)
    chat.messages.add(role=pb.CHAT_ROLE_USER, content="hi")
    tokens = server.stub.Tokenize(pb.TokenizeRequest(chat=chat))
    assert list(tokens.token_ids) == want.prompt_token_ids
    # OpenAI's reasoning_effort reaches the template as its variable (gpt-oss's reads it);
    # the request's own chat_template_kwargs win; a value not OpenAI's is refused by name.
    effort = "Reasoning: {{ reasoning_effort | default('unset') }}>"
    overridden = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "medium"}}
    for extra, shown in [({"reasoning_effort": "high"}, "high"), (overridden, "medium")]:
        kwargs = {"reasoning_effort": shown}
        want = offline.chat(
            messages, greedy_params(8), chat_template=effort, chat_template_kwargs=kwargs
        )[0]
        assert want.prompt == f"Reasoning: {shown}>"
        assert_chat_answer_is(server, {**body, "chat_template": effort, **extra}, want)
    # An assistant message's reported thinking goes back to the template as reasoning_content
    # (Qwen3's, DeepSeek's templates) and thinking (gpt-oss's); elsewhere it is refused.
    shows = (
        "{% for m in messages %}[{{ m.reasoning_content | default('-') }}/"
        "{{ m.thinking | default('-') }}]{% endfor %}>"
    )
    history = [*messages, {"role": "assistant", "content": "4", "reasoning_content": "2+2"}]
    rendered = [*messages, {**history[-1], "thinking": "2+2"}, *messages]
    want = offline.chat(rendered, greedy_params(8), chat_template=shows)[0]
    assert want.prompt == "[-/-][2+2/2+2][-/-]>"
    request = {**body, "messages": [*history, *messages], "chat_template": shows}
    assert_chat_answer_is(server, request, want)
    reasoning = {**history[-1], "reasoning": "2+2"}
    del reasoning["reasoning_content"]
    assert_chat_answer_is(server, {**request, "messages": [*messages, reasoning, *messages]}, want)
    bad_messages = [
        ({"role": "user", "content": "x", "reasoning_content": "y"}, "only an assistant's"),
        ({"role": "assistant", "content": "x", "reasoning_content": 3}, "must be a string"),
    ]
    for bad, words in bad_messages:
        status, answer = post(server, "/v1/chat/completions", {**request, "messages": [bad]})
        assert (status, answer["error"]["param"]) == (400, "messages[0].reasoning_content"), answer
        assert words in answer["error"]["message"]
    status, answer = post(
        server, "/v1/chat/completions", {**body, "chat_template": effort, "reasoning_effort": "max"}
    )
    assert (status, answer["error"]["param"]) == (400, "reasoning_effort"), answer
    assert "must be one of low, medium, high; got 'max'" in answer["error"]["message"]
    # gRPC: Chat.reasoning_effort and ChatMessage.reasoning_content, alike.
    grpc_chat = chat_to_proto([*history, *messages], chat_template=shows, reasoning_effort="low")
    tokens = server.stub.Tokenize(pb.TokenizeRequest(chat=grpc_chat))
    assert list(tokens.token_ids) == want.prompt_token_ids
    low = offline.chat(messages, greedy_params(8), chat_template=effort,
                       chat_template_kwargs={"reasoning_effort": "low"})[0]  # fmt: skip
    grpc_chat = chat_to_proto(messages, chat_template=effort, reasoning_effort="low")
    assert list(server.stub.Tokenize(pb.TokenizeRequest(chat=grpc_chat)).token_ids) == (
        low.prompt_token_ids
    )
    unknown_effort = chat_to_proto(messages, chat_template=effort)
    unknown_effort.reasoning_effort = 9  # a newer client's value
    for bad_chat, words in [
        (unknown_effort,
         "chat.reasoning_effort is 9, which is no ReasoningEffort value this server knows"),
        (chat_to_proto([{"role": "user", "content": "x", "reasoning_content": "y"}]),
         "chat.messages[0].reasoning_content: only an assistant's message has thinking"),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as caught:
            server.stub.Generate(pb.GenerateRequest(chat=bad_chat))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in caught.value.details()
    # Text that is not a template is refused by name, the server serving on.
    status, answer = post(server, "/v1/chat/completions", {**body, "chat_template": "{% for %}"})
    assert (status, answer["error"]["param"]) == (400, "chat_template"), answer
    assert answer["error"]["message"].startswith("chat_template: not a Jinja template")
    # A template that fails on the messages (it is code) is the request's error, in both
    # APIs: not the server's.
    for failing, error in [("{{ 1 / 0 }}", "ZeroDivisionError"),
                           ("{{ messages[0].content + 1 }}", "TypeError"),
                           ("{{ messages[0]['x']['y'] }}", "refused them")]:  # fmt: skip
        status, answer = post(server, "/v1/chat/completions", {**body, "chat_template": failing})
        assert (status, answer["error"]["param"]) == (400, "messages"), answer
        assert error in answer["error"]["message"], answer
        chat.chat_template = failing
        with pytest.raises(grpc.RpcError) as caught:
            server.stub.Generate(pb.GenerateRequest(chat=chat))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error in caught.value.details()
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    server.assert_blocks_all_free()


def test_chat_echo_starts_the_answer_with_the_message_it_goes_on_with(server, offline):
    """vLLM's chat echo: with the last message continued, the answer reads whole."""
    started = [
        {"role": "user", "content": "name a fruit"},
        {"role": "assistant", "content": "I would say the"},
    ]
    flags = dict(add_generation_prompt=False, continue_final_message=True)
    want = offline.chat(started, greedy_params(8), **flags)[0].outputs[0].text
    body = {"model": SERVED_MODEL_NAME, "messages": started, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, "echo": True, **flags}  # fmt: skip
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == "I would say the" + want
    events = sse_events(server, "/v1/chat/completions", {**body, "stream": True})
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == "I would say the" + want
    # The last message is not the answering role's: nothing to echo.
    asked = started[:1]
    want = offline.chat(asked, greedy_params(8))[0].outputs[0].text
    body = {**body, "messages": asked, "add_generation_prompt": True,
            "continue_final_message": False}  # fmt: skip
    status, answer = post(server, "/v1/chat/completions", body)
    assert (status, answer["choices"][0]["message"]["content"]) == (200, want), answer
    status, answer = post(server, "/v1/chat/completions", {**body, "echo": "yes"})
    assert (status, answer["error"]["param"]) == (400, "echo"), answer


def test_chat_template_kwargs_reach_the_template_in_each_api(server, offline, server_model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "name a fruit"}]
    kwargs = {"enable_thinking": False}
    reference = AutoTokenizer.from_pretrained(server_model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert reference.endswith("assistant\n<think>\n\n</think>\n\n")  # the variable was read
    want = offline.chat(messages, greedy_params(8), chat_template_kwargs=kwargs)[0]
    assert want.prompt == reference
    plain = offline.chat(messages, greedy_params(8))[0]
    assert len(want.prompt_token_ids) > len(plain.prompt_token_ids)
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, "chat_template_kwargs": kwargs}  # fmt: skip
    assert_chat_answer_is(server, body, want)
    status, answer = post(
        server, "/tokenize", {"messages": messages, "chat_template_kwargs": kwargs}
    )
    assert (status, answer["tokens"]) == (200, want.prompt_token_ids), answer
    chat = pb.Chat(chat_template_kwargs=json.dumps(kwargs))
    chat.messages.add(role=pb.CHAT_ROLE_USER, content="name a fruit")
    sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    output = server.stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling))
    assert list(output.prompt_token_ids) == want.prompt_token_ids
    assert list(output.outputs[0].token_ids) == want.outputs[0].token_ids
    # A name the rendering sets itself, or not an object: refused by name in each API.
    for bad, words in [({"add_generation_prompt": False}, "add_generation_prompt: set by"),
                       ([1], "must be an object")]:  # fmt: skip
        chat.chat_template_kwargs = json.dumps(bad)
        assert_refused_by_name(
            server, {**body, "chat_template_kwargs": bad}, pb.GenerateRequest(chat=chat),
            "chat_template_kwargs", words,
        )  # fmt: skip
        with pytest.raises(ValueError, match=f"^chat_template_kwargs.*{words}"):
            offline.chat(messages, greedy_params(8), chat_template_kwargs=bad)
    chat.chat_template_kwargs = "{not json"
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling))
    assert caught.value.details().startswith("chat.chat_template_kwargs is not valid JSON")


def test_return_token_ids_beside_the_text_whole_and_streamed(server, offline):
    """vLLM's return_token_ids: completions give each choice its prompt's ids and its own;
    chat gives the prompt's once (the response's, or the stream's first chunk) and each
    choice its own. A stream's token_ids add up to the whole, held-back text or not."""
    prompts = ["hello there", "a b c"]
    wants = offline.generate(prompts, greedy_params(10))
    body = {"model": SERVED_MODEL_NAME, "prompt": prompts, "max_tokens": 10,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    status, plain = post(server, "/v1/completions", body)
    assert status == 200 and "token_ids" not in plain["choices"][0], plain
    assert "prompt_token_ids" not in plain["choices"][0]
    status, answer = post(server, "/v1/completions", {**body, "return_token_ids": True})
    assert status == 200, answer
    for choice, want in zip(answer["choices"], wants):
        assert choice["prompt_token_ids"] == want.prompt_token_ids
        assert choice["token_ids"] == want.outputs[0].token_ids
        assert choice["text"] == want.outputs[0].text
    events = sse_events(
        server, "/v1/completions", {**body, "return_token_ids": True, "stream": True}
    )
    for index, want in enumerate(wants):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == want.prompt_token_ids
        assert all("prompt_token_ids" not in choice for choice in mine[1:])
        assert [t for choice in mine for t in choice["token_ids"]] == want.outputs[0].token_ids
    messages = [{"role": "user", "content": "name a fruit"}]
    want = offline.chat(messages, greedy_params(10))[0]
    body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 10,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["prompt_token_ids"] == want.prompt_token_ids
    assert answer["choices"][0]["token_ids"] == want.outputs[0].token_ids
    events = sse_events(server, "/v1/chat/completions", {**body, "stream": True})
    chunks = [event for event in events if event != "[DONE]"]
    assert chunks[0]["prompt_token_ids"] == want.prompt_token_ids
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    streamed = [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]]
    assert streamed == want.outputs[0].token_ids
    status, answer = post(server, "/v1/chat/completions", {**body, "return_token_ids": 1})
    assert (status, answer["error"]["param"]) == (400, "return_token_ids"), answer


def want_logprobs(offline, messages) -> list[dict[int, float]]:
    return offline.chat(messages, greedy_params(8, logprobs=3))[0].outputs[0].logprobs


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(server, client, offline):
    """As vLLM: a chat call that names no limit runs to EOS or the end of the window; with
    ignore_eos it fills the window exactly."""
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    messages = [{"role": "user", "content": "count"}]
    answer = client.chat.completions.create(model=SERVED_MODEL_NAME, messages=messages, **GREEDY)
    window = min(info.max_model_len, info.num_blocks * info.block_size)
    assert answer.usage.total_tokens == window
    assert answer.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- the rest of the API


def test_answers_carry_the_clients_request_id(server, client):
    headers = {"X-Request-Id": "trace-42"}
    raw = client.completions.with_raw_response.create(
        model=SERVED_MODEL_NAME, prompt=PROMPT_IDS, max_tokens=2, extra_headers=headers
    )
    assert raw.headers["X-Request-Id"] == "trace-42"
    assert raw.parse().id == "cmpl-trace-42"
    chunks = list(
        client.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
            max_tokens=2, stream=True, extra_body={"request_id": "chat-7"},
        )
    )  # fmt: skip
    assert {c.id for c in chunks} == {"chatcmpl-chat-7"}
    anonymous = client.completions.create(model=SERVED_MODEL_NAME, prompt=[5], max_tokens=1)
    assert anonymous.id.startswith("cmpl-") and len(anonymous.id) > 20


def test_models_tokenize_detokenize_health_and_version(server, offline):
    status, body = get(server, "/v1/models")
    models = json.loads(body)
    assert status == 200 and [m["id"] for m in models["data"]] == [SERVED_MODEL_NAME]
    assert models["data"][0]["max_model_len"] > 0
    assert models["data"][0]["vocab_size"] == 512
    status, body = get(server, f"/v1/models/{SERVED_MODEL_NAME}")
    assert status == 200 and json.loads(body)["id"] == SERVED_MODEL_NAME
    status, answer = post(server, "/tokenize", {"prompt": "hello"})
    assert status == 200 and answer["tokens"] == offline.tokenizer.encode("hello")
    assert answer["count"] == len(answer["tokens"])
    status, answer = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    text = offline.render_chat([{"role": "user", "content": "hi"}])
    assert answer["tokens"] == offline.tokenizer.encode(text, add_special_tokens=False)
    status, answer = post(
        server,
        "/detokenize",
        {"tokens": offline.tokenizer.encode("hello", add_special_tokens=False)},
    )
    assert status == 200 and answer["prompt"] == "hello"
    assert get(server, "/health")[0] == 200
    status, body = get(server, "/version")
    assert status == 200 and json.loads(body)["version"]


def test_load_and_reset_prefix_cache(server):
    """vLLM's GET /load (the requests in flight) and POST /reset_prefix_cache: the same
    prompt hits the cache again only until the reset."""
    status, body = get(server, "/load")
    assert status == 200 and json.loads(body) == {"server_load": 0}
    prompt = list(range(5, 5 + 64))  # four full blocks of 16
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}

    def cached_tokens() -> int:
        status, answer = post(server, "/v1/completions", body)
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached_tokens()
    assert cached_tokens() > 0
    status, answer = post(server, "/reset_prefix_cache", b"")
    assert status == 200 and answer is None
    assert cached_tokens() == 0
    assert cached_tokens() > 0


def test_sagemaker_routes_ping_and_invocations(server, offline):
    """vLLM's /ping (a probe) and /invocations (the body's shape picks the API)."""
    assert get(server, "/ping")[0] == 200
    assert post(server, "/ping", {})[0] == 200
    messages = [{"role": "user", "content": "hi"}]
    want = offline.chat(messages, greedy_params(6))[0]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    status, answer = post(server, "/invocations", body)
    assert status == 200 and answer["object"] == "chat.completion", answer
    assert answer["choices"][0]["message"]["content"] == want.outputs[0].text
    want = offline.generate(PROMPT_IDS, greedy_params(6))[0]
    body = {"prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    status, answer = post(server, "/invocations", body)
    assert status == 200 and answer["object"] == "text_completion", answer
    assert answer["choices"][0]["text"] == want.outputs[0].text
    events = sse_events(server, "/invocations", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.outputs[0].text
    status, answer = post(server, "/invocations", {"input": "hello"})
    assert status == 200 and answer["object"] == "list", answer
    assert answer["data"][0]["embedding"] == pytest.approx(
        offline.embed("hello")[0].outputs.embedding, abs=1e-5
    )
    status, answer = post(server, "/invocations", {"text": "hello"})
    assert status == 400 and "messages" in answer["error"]["message"], answer


def test_bad_input_gets_openai_errors_naming_the_field(server):
    cases = [
        ({"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
        ({"prompt": "hi", "top_p": 2}, 400, "top_p", "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be >= 1"),
        ({"prompt": "hi", "n": "two"}, 400, "n", "n must be"),
        ({"prompt": "hi", "logprobs": 21}, 400, "logprobs",
         "logprobs must be <= 20 (the engine's max_logprobs), got 21"),
        ({"prompt": "hi", "stop": 3}, 400, "stop", "stop must be a string or a list"),
        ({"prompt": ""}, 400, "prompt", "prompt is empty"),
        ({"prompt": []}, 400, "prompt", "not empty"),
        ({"prompt": [1, 99999]}, 400, "prompt", "outside the vocabulary [0, 512)"),
        ({}, 400, "prompt", "prompt is required"),
        ({"prompt": "hi", "model": "gpt-9"}, 404, "model", "this server serves 'tiny-llama'"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "'x' is not a token id"),
        ({"prompt": "hi", "logit_bias": {"5": "up"}}, 400, "logit_bias", "must be a number"),
        ({"prompt": "hi", "logit_bias": {"600": 1}}, 400, None,
         "logit_bias: token id 600 is outside the vocabulary [0, 512)"),
        ({"prompt": "hi", "allowed_token_ids": [1, 600]}, 400, None,
         "allowed_token_ids: token id 600 is outside the vocabulary"),
        ({"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids", "non-empty list"),
        ({"prompt": "hi", "bad_words": "no"}, 400, "bad_words", "must be a list of strings"),
        ({"prompt": "hi", "bad_words": [" "]}, 400, "bad_words", "must be non-blank strings"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
         "stream is not true"),
        ({"prompt": [5] * 5000}, 400, "prompt", "context window"),
        ({"prompt": [5, 6], "max_tokens": 100000}, 400, "max_tokens",
         "context window is 512 tokens and prompt takes 2, which leaves at most 510"),
    ]  # fmt: skip
    for body, status, param, words in cases:
        got_status, answer = post(server, "/v1/completions", body)
        assert got_status == status, (body, answer)
        error = answer["error"]
        assert words in error["message"], (body, error)
        assert error["code"] == status
        if param is not None:
            assert error["param"] == param, (body, error)
    user = [{"role": "user", "content": "x"}]
    image = [{"role": "user", "content": [{"type": "image_url"}]}]
    chat_cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": image}, "messages[0].content[0]"),
        ({"messages": user, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": user, "response_format": {"type": "json_mode"}}, "response_format.type"),
        ({"messages": user, "top_logprobs": 2}, "top_logprobs"),
    ]  # fmt: skip
    for body, param in chat_cases:
        got_status, answer = post(server, "/v1/chat/completions", body)
        assert got_status == 400 and answer["error"]["param"] == param, (body, answer)
    got_status, answer = post(server, "/v1/completions", b"{not json")
    assert got_status == 400 and "not valid JSON" in answer["error"]["message"]
    got_status, answer = post(server, "/v1/completions", [1, 2])
    assert got_status == 400 and "JSON object" in answer["error"]["message"]
    got_status, body = get(server, "/v1/nothing")
    assert got_status == 404 and json.loads(body)["error"]["code"] == 404
    got_status, body = get(server, "/v1/completions")  # GET on a POST route
    assert got_status == 405 and "error" in json.loads(body)


def test_both_apis_share_one_engine_and_the_metrics(server, client, offline):
    want = offline.generate(PROMPT_IDS, greedy_params(8))[0]
    sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def over_grpc():
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT_IDS), sampling=sampling)
        return list(server.stub.Generate(request, timeout=60).outputs[0].token_ids)

    def over_http():
        answer = client.completions.create(
            model=SERVED_MODEL_NAME, prompt=PROMPT_IDS, max_tokens=8, **GREEDY
        )
        return answer.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        grpc_calls = [pool.submit(over_grpc) for _ in range(6)]
        http_calls = [pool.submit(over_http) for _ in range(6)]
        assert all(f.result() == want.outputs[0].token_ids for f in grpc_calls)
        assert all(f.result() == want.outputs[0].text for f in http_calls)
    status, body = get(server, "/metrics")
    text = body.decode()
    assert status == 200
    assert 'pagedserve_requests_total{api="http",code="OK"}' in text
    assert 'pagedserve_requests_total{api="grpc",code="OK"}' in text
    assert "pagedserve_engine_num_total_blocks" in text  # the scheduler's, at scrape time
    # Per output and per call (the module's server has served other tests' calls too).
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['pagedserve_request_success_total{finish_reason="length"}'] >= 12
    assert samples['pagedserve_request_generation_tokens_bucket{le="10.0"}'] >= 12
    assert samples["pagedserve_request_prompt_tokens_count"] >= 12
    assert server.stats().requests_running == 0
    # A call is counted before its end reaches the client: no waiting for the stats.
    finished_before = server.stats().requests_finished
    body = {"prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "stream": True}
    assert sse_events(server, "/v1/completions", body)[-1] == "[DONE]"
    stats = server.stats()
    assert stats.requests_finished == finished_before + 1 and stats.requests_running == 0


@pytest.mark.parametrize(
    "fields",
    [{}, {"logprobs": True, "top_logprobs": 2, "n": 2, "stop": ["."], "seed": 3}],
    ids=["plain", "logprobs-n-stop-seed"],
)
def test_chat_and_completion_bodies_and_chunks_are_exactly_openai_s(server, fields):
    # Every body and stream chunk validated strictly against the openai SDK's own types,
    # no field they do not declare (tests/helpers/openai_shapes.py).
    messages = [{"role": "user", "content": "Hi"}]
    chat = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 5, **fields}
    status, body = post(server, "/v1/chat/completions", chat)
    assert status == 200, body
    assert_openai_shape("chat.completion", body)
    stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(server, "/v1/chat/completions", stream)
    assert events[-1] == "[DONE]" and events[-2]["usage"] is not None
    for chunk in events[:-1]:
        assert_openai_shape("chat.completion.chunk", chunk)
    status, models = get(server, "/v1/models")
    models = json.loads(models)
    assert status == 200 and models.keys() == {"object", "data"} and models["object"] == "list"
    for model in models["data"]:
        assert_openai_shape("model", model)
        status, card = get(server, f"/v1/models/{model['id']}")
        assert status == 200
        assert_openai_shape("model", json.loads(card))
    completion_fields = {
        name: value for name, value in fields.items() if name not in ("logprobs", "top_logprobs")
    }
    if "logprobs" in fields:
        completion_fields["logprobs"] = fields["top_logprobs"]
    completion = {"model": SERVED_MODEL_NAME, "prompt": "Hi", "max_tokens": 5,
                  **completion_fields}  # fmt: skip
    status, body = post(server, "/v1/completions", completion)
    assert status == 200, body
    assert_openai_shape("text_completion", body)
    events = sse_events(server, "/v1/completions", {**completion, "stream": True})
    for chunk in events[:-1]:
        assert_openai_shape("text_completion.chunk", chunk)


def test_both_ports_negotiate_the_metrics_format_alike(server):
    # The HTTP port's /metrics answers each Accept as the metrics port (prometheus_client's
    # own server) does: OpenMetrics when asked for, Prometheus text otherwise.
    def scrape(port: int, accept: str | None) -> tuple[str, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
        if accept is not None:
            request.add_header("Accept", accept)
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.headers["Content-Type"], response.read().decode()

    for accept, media_type in (
        (None, "text/plain; version=0.0.4"),
        ("text/plain", "text/plain; version=0.0.4"),
        ("application/openmetrics-text; version=1.0.0", "application/openmetrics-text"),
    ):
        http_type, http_text = scrape(server.http_port, accept)
        metrics_type, metrics_text = scrape(server.metrics_port, accept)
        assert http_type == metrics_type and http_type.startswith(media_type), (accept, http_type)
        openmetrics = media_type.startswith("application/openmetrics-text")
        assert http_text.rstrip().endswith("# EOF") == openmetrics
        assert "pagedserve_requests" in http_text and "pagedserve_requests" in metrics_text


def test_a_client_that_disconnects_mid_stream_ends_its_request(server):
    sampled_before = server.stats().engine["num_sampled_tokens"]
    cancelled_before = server.stats().requests_cancelled
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    body = {"prompt": PROMPT_IDS, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    connection.request("POST", "/v1/completions", json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    connection.close()  # gone mid-stream
    assert wait_until(lambda: server.stats().requests_cancelled == cancelled_before + 1, 10)
    sampled = server.stats().engine["num_sampled_tokens"] - sampled_before
    assert sampled < 500  # the engine stopped it, it did not run to max_tokens


# ---------------------------------------------------------------- a server of its own


def test_overload_and_drain_over_http(start_server):
    server = start_server("--http-port", "0", "--max-concurrent-requests", "2")
    # 500 tokens: the streams must outlive five more round trips (the tiny model streams
    # over 1000 tokens a second on a quiet machine).
    long_body = {"prompt": PROMPT_IDS, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
                 "stream": True}  # fmt: skip
    connections = []
    for _ in range(2):
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        connection.request("POST", "/v1/completions", json.dumps(long_body))
        response = connection.getresponse()
        assert response.readline().startswith(b"data: ")
        connections.append((connection, response))
    status, answer = post(server, "/v1/completions", {"prompt": "hi"})
    assert status == 429 and "max_concurrent_requests is 2" in answer["error"]["message"]
    # SIGTERM: /health turns 503 and new calls are refused, the streams in flight end whole.
    started_s = time.monotonic()
    os.kill(server.pid, signal.SIGTERM)
    assert wait_until(lambda: get(server, "/health")[0] == 503, 10)
    status, answer = post(server, "/v1/completions", {"prompt": "hi"})
    assert status == 503 and "shutting down" in answer["error"]["message"]
    for connection, response in connections:
        rest = response.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        events = [json.loads(e[6:]) for e in rest.split("\n\n") if e.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        connection.close()
    assert server.terminate() == 0
    assert time.monotonic() - started_s < 30


def test_a_busy_http_port_exits_1(start_server):
    first = start_server("--http-port", "0")
    second = start_server("--http-port", str(first.http_port), wait=False)
    assert second.process.wait(60) == 1
    assert f"cannot listen on 127.0.0.1:{first.http_port} (HTTP)" in second.log()
    assert first.terminate() == 0


def test_a_worker_killed_mid_stream_ends_http_calls_with_an_error_event(start_server):
    server = start_server("--http-port", "0")
    # Batches of 8 long prompts per call: on the tiny model one 400-token request can end
    # (~1 ms a step) before the second call is in flight.
    prompts = [[5 + index, 300, 301, 302] for index in range(8)]
    long_body = {"prompt": prompts, "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    (worker_pid,) = server.worker_pids()  # read before the calls: /proc is slow to scan
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({**long_body, "stream": True}))
    response = connection.getresponse()
    assert response.readline().startswith(b"data: ")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(post, server, "/v1/completions", long_body)
        assert wait_until(lambda: server.stats().requests_running == 2, 10)
        os.kill(worker_pid, signal.SIGKILL)
        # The stream's last events: the error, then [DONE].
        events = [e for e in response.read().decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == 503 and f"worker rank 0 (pid {worker_pid}) died" in error["message"]
        # The call that waited for a whole answer gets a 503 naming the same.
        status, answer = whole.result(30)
        assert status == 503 and "died" in answer["error"]["message"]
    connection.close()
    assert server.process.wait(30) == 1


def test_an_api_key_guards_generation_in_both_apis(start_server):
    key = "s3cret-key"
    server = start_server("--http-port", "0", env={"PAGEDSERVE_API_KEY": key})
    body = json.dumps({"prompt": PROMPT_IDS, "max_tokens": 3}).encode()

    def complete(headers: dict[str, str]) -> int:
        request = urllib.request.Request(
            f"{server.http_url}/v1/completions", data=body, headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as error:
            assert error.headers["WWW-Authenticate"] == "Bearer"
            assert json.loads(error.read())["error"]["type"] == "authentication_error"
            return error.code

    assert complete({}) == 401
    assert complete({"Authorization": "Bearer wrong"}) == 401
    assert complete({"Authorization": f"Basic {key}"}) == 401
    assert complete({"Authorization": f"Bearer {key}"}) == 200
    embed = urllib.request.Request(
        f"{server.http_url}/v1/embeddings", data=json.dumps({"input": "a"}).encode()
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(embed, timeout=30)
    assert refused.value.code == 401
    embed.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(embed, timeout=30) as response:
        assert response.status == 200
    assert get(server, "/health")[0] == 200  # probes and scrapers hold no key
    assert get(server, "/metrics")[0] == 200
    assert get(server, "/load")[0] == 200
    assert post(server, "/reset_prefix_cache", b"")[0] == 401  # an operator's action
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0) as client:
        assert client.models.list().data[0].id
    # gRPC: the same key as metadata; health stays open.
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT_IDS), sampling=pb.SamplingParams(max_tokens=3)
    )
    for call in both_rpcs(server.stub):
        with pytest.raises(grpc.RpcError) as caught:
            call(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in caught.value.details()
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    with Client(f"127.0.0.1:{server.port}", api_key=key) as client:
        assert (
            len(client.generate(PROMPT_IDS, SamplingParams(max_tokens=3)).outputs[0].token_ids) == 3
        )
        assert list(client.stream(PROMPT_IDS, SamplingParams(max_tokens=3)))[-1].finished
    assert server.terminate() == 0


def http_call(server, method: str, path: str, headers: dict, body: bytes | None = None):
    """One raw call: (status, headers, body bytes), an error status included."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request(method, path, body, headers)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def test_allowed_origins_let_a_browser_page_call_the_api(start_server):
    """CORS: a preflight from an allowed origin is answered before the API key is asked
    for; every answer to it, a stream's too, names the origin; other origins get none."""
    key = "s3cret-key"
    page = "http://app.example:8080"
    server = start_server(
        "--http-port", "0", "--allowed-origins", f"{page},https://other.example",
        env={"PAGEDSERVE_API_KEY": key},
    )  # fmt: skip
    asks = {"Origin": page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    status, headers, _ = http_call(server, "OPTIONS", "/v1/chat/completions", asks)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == page
    assert headers["Access-Control-Allow-Methods"] == "OPTIONS, POST"
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert int(headers["Access-Control-Max-Age"]) > 0
    status, headers, body = http_call(
        server, "OPTIONS", "/v1/chat/completions", {**asks, "Origin": "http://evil.example"}
    )
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert "'http://evil.example' may not call" in json.loads(body)["error"]["message"]
    call = {"Origin": page, "Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    completion = json.dumps({"prompt": PROMPT_IDS, "max_tokens": 3}).encode()
    status, headers, _ = http_call(server, "POST", "/v1/completions", call, completion)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == page
    assert "Origin" in headers["Vary"]
    stream = json.dumps({"prompt": PROMPT_IDS, "max_tokens": 3, "stream": True}).encode()
    status, headers, body = http_call(server, "POST", "/v1/completions", call, stream)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == page
    assert body.endswith(b"data: [DONE]\n\n")
    # An error still reaches the page (it can read why), and the key is still asked for.
    status, headers, _ = http_call(server, "POST", "/v1/completions", {"Origin": page}, stream)
    assert status == 401 and headers["Access-Control-Allow-Origin"] == page
    status, headers, _ = http_call(
        server, "POST", "/v1/completions", {**call, "Origin": "http://evil.example"}, completion
    )
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    assert server.terminate() == 0


def test_without_allowed_origins_no_page_of_another_origin_may_call(server):
    asks = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    status, headers, _ = http_call(server, "OPTIONS", "/v1/completions", asks)
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    completion = json.dumps({"prompt": PROMPT_IDS, "max_tokens": 2}).encode()
    status, headers, _ = http_call(server, "POST", "/v1/completions", asks, completion)
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_cross_origin_settings_are_checked_at_start(start_server):
    for flags, words in [
        (
            ["--http-port", "0", "--allowed-origins", "app.example"],
            "'app.example' is not an origin",
        ),
        (["--allowed-origins", "*"], "allowed_origins is for the HTTP API"),
        (["--http-port", "0", "--allow-credentials"], "allow_credentials needs allowed_origins"),
    ]:
        server = start_server(*flags, wait=False)
        assert server.process.wait(timeout=60) == 2
        assert words in server.log()


def test_while_the_model_loads_http_answers_503_then_serves(start_server):
    with socket.socket() as probe:  # a free port, named up front: no port file yet
        probe.bind(("127.0.0.1", 0))
        http_port = probe.getsockname()[1]
    server = start_server("--http-port", str(http_port), wait=False)
    server.http_port = http_port
    statuses, refusals = [], []
    deadline_s = time.monotonic() + 120
    while time.monotonic() < deadline_s:
        try:
            status = get(server, "/health")[0]
        except OSError:
            time.sleep(0.02)  # not listening yet
            continue
        statuses.append(status)
        if status == 200:
            break
        refusals.append(post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}))
    assert statuses[0] == 503 and statuses[-1] == 200, statuses
    assert refusals and all(status in (503, 200) for status, _ in refusals)
    assert any(
        status == 503 and answer["error"]["message"] == "the engine is still starting"
        for status, answer in refusals
    ), refusals
    server.wait_serving()
    assert server.terminate() == 0


def test_the_drain_timeout_ends_an_http_stream_with_an_error_event(start_server):
    # No time to drain: the stream (500 tokens, of which it has read one) is ended at once.
    server = start_server("--http-port", "0", "--drain-timeout-s", "0")
    body = {"prompt": PROMPT_IDS, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body))
    response = connection.getresponse()
    assert response.readline().startswith(b"data: ")
    os.kill(server.pid, signal.SIGTERM)
    events = [e for e in response.read().decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "drain timeout 0 s" in error["message"]
    connection.close()
    assert server.terminate() == 0


def test_several_served_model_names_are_aliases(start_server):
    """vLLM's --served-model-name with more than one name: a request may give any, the
    answer names the first; /v1/models lists each."""
    server = start_server(
        "--http-port", "0", "--served-model-name", "main", "alias-a", "alias-b",
        "--kv-cache-bytes", str(4 << 20),
    )  # fmt: skip
    status, body = get(server, "/v1/models")
    assert status == 200
    assert [card["id"] for card in json.loads(body)["data"]] == ["main", "alias-a", "alias-b"]
    for name in ("main", "alias-a", "alias-b"):
        status, answer = post(
            server, "/v1/completions", {"model": name, "prompt": [5], "max_tokens": 1}
        )
        assert status == 200 and answer["model"] == "main", answer
    status, answer = post(server, "/v1/completions", {"model": "other", "prompt": [5]})
    assert status == 404
    assert "serves 'main', 'alias-a', 'alias-b'" in answer["error"]["message"]
    server.assert_blocks_all_free()


def test_force_include_usage_ends_every_stream_with_its_usage(start_server):
    """vLLM's --enable-force-include-usage: a stream that did not ask for the usage chunk
    still ends with it (the last before [DONE]), as one that asked does."""
    server = start_server(
        "--http-port", "0", "--enable-force-include-usage", "--kv-cache-bytes", str(4 << 20)
    )
    for path, body in [
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3, "ignore_eos": True}),
    ]:  # fmt: skip
        events = sse_events(server, path, {**body, "stream": True})
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        assert events[-2]["choices"] == [] and usage["completion_tokens"] == 3
        assert all(event["usage"] is None for event in events[:-2])
    server.assert_blocks_all_free()
