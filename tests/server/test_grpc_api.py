"""The gRPC API end to end: a real server process, real gRPC clients on 127.0.0.1.

Outputs are compared with the offline engine in this process on the same weights (and,
for greedy tokens, with HF transformers); streams must add up to the whole result."""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
import transformers
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.grpc_calls import NUM_TOKENS, both_rpcs, collect_stream, greedy, token_request
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.client import stream_request
from pagedserve.v1 import generation_pb2 as pb

PROMPTS = [[5, 300, 301, 302], [400, 7, 7, 401, 402, 403, 404, 405, 406], [9, 10, 11]]


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(server_model_dir, num_blocks=128)


def test_greedy_tokens_equal_hf_and_the_offline_engine(server, server_model_dir, offline):
    stub = server.stub
    futures = [stub.Generate.future(token_request(p, greedy()), timeout=60) for p in PROMPTS]
    responses = [future.result() for future in futures]
    expected = offline.generate(
        PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(server_model_dir)
    for prompt, response, want in zip(PROMPTS, responses, expected):
        (completion,) = response.outputs
        assert list(completion.token_ids) == want.outputs[0].token_ids
        assert completion.text == want.outputs[0].text
        assert completion.finish_reason == pb.FINISH_REASON_LENGTH
        assert list(response.prompt_token_ids) == prompt
        assert response.finished
        assert response.usage.prompt_tokens == len(prompt)
        assert response.usage.completion_tokens == NUM_TOKENS
        with torch.no_grad():
            input_ids = torch.tensor([prompt])
            hf = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=NUM_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert list(completion.token_ids) == hf[0, len(prompt) :].tolist()


def test_stream_adds_up_to_the_whole_result(server):
    sampling = greedy(logprobs=3, prompt_logprobs=2)
    whole = server.stub.Generate(token_request(PROMPTS[1], sampling, request_id="mine"))
    messages, outputs = collect_stream(
        server.stub.GenerateStream(
            stream_request(token_request(PROMPTS[1], sampling, request_id="mine"))
        )
    )
    assert all(m.request_id == "mine" for m in messages) and whole.request_id == "mine"
    assert list(messages[0].prompt_token_ids) == PROMPTS[1]
    assert all(not m.prompt_token_ids for m in messages[1:])
    assert [m.finished for m in messages] == [False] * (len(messages) - 1) + [True]
    assert len(messages) >= 2  # it streamed, not one message at the end
    (completion,) = whole.outputs
    assert outputs[0]["text"] == completion.text
    assert outputs[0]["token_ids"] == list(completion.token_ids)
    assert outputs[0]["finish_reason"] == completion.finish_reason == pb.FINISH_REASON_LENGTH
    whole_logprobs = [dict(zip(e.token_ids, e.logprobs)) for e in completion.logprobs]
    assert outputs[0]["logprobs"] == whole_logprobs
    assert len(whole_logprobs) == NUM_TOKENS
    assert all(len(entry) in (3, 4) for entry in whole_logprobs)  # chosen + top 3
    streamed_prompt_logprobs = [e for m in messages for e in m.prompt_logprobs]
    assert len(streamed_prompt_logprobs) == len(whole.prompt_logprobs) == len(PROMPTS[1]) - 1
    assert messages[-1].usage.completion_tokens == NUM_TOKENS


def test_text_prompt_stop_string_and_seeded_samples_as_offline(server, offline):
    # A stop string that the greedy text contains: output cut before it, as offline.
    text = "hello world"
    plain = offline.generate(text, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
    stop = plain[0].outputs[0].text[5:8]
    assert len(stop) == 3
    sampling = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, stop=[stop])
    want = offline.generate(
        text, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, stop=[stop])
    )[0]
    whole = server.stub.Generate(pb.GenerateRequest(text=text, sampling=sampling))
    _messages, streamed = collect_stream(
        server.stub.GenerateStream(pb.GenerateStreamRequest(text=text, sampling=sampling))
    )
    assert whole.outputs[0].text == streamed[0]["text"] == want.outputs[0].text
    assert list(whole.outputs[0].token_ids) == want.outputs[0].token_ids
    assert whole.outputs[0].stop_string == streamed[0]["stop"] and streamed[0]["stop"]
    assert whole.outputs[0].stop_string == stop
    # n = 3 seeded samples: the same draws as offline, streamed or whole.
    sampling = pb.SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3, ignore_eos=True)
    want = offline.generate(
        PROMPTS[0],
        SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3, ignore_eos=True),
    )[0]
    whole = server.stub.Generate(token_request(PROMPTS[0], sampling))
    _messages, streamed = collect_stream(
        server.stub.GenerateStream(stream_request(token_request(PROMPTS[0], sampling)))
    )
    for index in range(3):
        assert list(whole.outputs[index].token_ids) == want.outputs[index].token_ids
        assert streamed[index]["token_ids"] == want.outputs[index].token_ids


def test_detokenize_false_gives_the_same_tokens_without_text(server, offline):
    """vLLM's detokenize=False, offline and over gRPC: the ids only; not with stop strings
    (matched in the text), nor for a gRPC chat (its answer is read from the text)."""
    text = "hello world"
    want = offline.generate(text, SamplingParams(max_tokens=8, temperature=0.0))[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    got = offline.generate(text, params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and want.outputs[0].text
    assert got.outputs[0].text == ""
    sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    whole = server.stub.Generate(pb.GenerateRequest(text=text, sampling=sampling))
    assert list(whole.outputs[0].token_ids) == want.outputs[0].token_ids
    assert whole.outputs[0].text == ""
    _messages, streamed = collect_stream(
        server.stub.GenerateStream(pb.GenerateStreamRequest(text=text, sampling=sampling))
    )
    assert streamed[0]["token_ids"] == want.outputs[0].token_ids and streamed[0]["text"] == ""
    with pytest.raises(ValueError, match="stop strings .* need detokenize=True"):
        SamplingParams(stop=["a"], detokenize=False)
    bad = [
        pb.GenerateRequest(text=text, sampling=pb.SamplingParams(stop=["a"], detokenize=False)),
        pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="hi")]),
            sampling=sampling,
        ),
    ]
    for request, words in zip(bad, ["need detokenize=True", "detokenize=false is for token"]):
        with pytest.raises(grpc.RpcError) as caught:
            server.stub.Generate(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in caught.value.details()


def test_chat_and_tokenize_use_the_chat_template(server, offline):
    messages = [pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="hi there")]
    tokens = server.stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=messages)))
    text = offline.render_chat([{"role": "user", "content": "hi there"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert list(tokens.token_ids) == offline.tokenizer.encode(text, add_special_tokens=False)
    response = server.stub.Generate(
        pb.GenerateRequest(chat=pb.Chat(messages=messages), sampling=greedy(8))
    )
    assert list(response.prompt_token_ids) == list(tokens.token_ids)
    want = offline.chat(
        [{"role": "user", "content": "hi there"}],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    )[0]
    assert list(response.outputs[0].token_ids) == want.outputs[0].token_ids
    text_tokens = server.stub.Tokenize(pb.TokenizeRequest(text="hello"))
    assert list(text_tokens.token_ids) == offline.tokenizer.encode("hello")


def test_beam_search_and_best_of_rank_like_the_offline_engine(server, offline):
    sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, beam_width=3, n=2, ignore_eos=True)
    want = offline.generate(
        PROMPTS[2],
        SamplingParams(max_tokens=8, temperature=0.0, beam_width=3, n=2, ignore_eos=True),
    )[0]
    whole = server.stub.Generate(token_request(PROMPTS[2], sampling))
    _messages, streamed = collect_stream(
        server.stub.GenerateStream(stream_request(token_request(PROMPTS[2], sampling)))
    )
    for index in range(2):
        assert list(whole.outputs[index].token_ids) == want.outputs[index].token_ids
        assert streamed[index]["token_ids"] == want.outputs[index].token_ids
        assert whole.outputs[index].cumulative_logprob == pytest.approx(
            want.outputs[index].cumulative_logprob
        )


def test_many_concurrent_calls_each_end_once(server, offline):
    """64 calls at once, streamed and whole, with a shared prefix: each gets its tokens
    and exactly one final message."""
    prompts = [
        [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, i] for i in range(32)
    ]
    want = offline.generate(
        prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    hits_before = server.stats().engine["prefix_cache_hits"]

    def streamed(prompt):
        return collect_stream(
            server.stub.GenerateStream(stream_request(token_request(prompt, greedy(10))))
        )

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        stream_results = list(pool.map(streamed, prompts))
    whole_futures = [server.stub.Generate.future(token_request(p, greedy(10))) for p in prompts]
    for (messages, outputs), future, expected in zip(stream_results, whole_futures, want):
        assert sum(m.finished for m in messages) == 1 and messages[-1].finished
        assert outputs[0]["token_ids"] == expected.outputs[0].token_ids
        assert list(future.result().outputs[0].token_ids) == expected.outputs[0].token_ids
    # The shared 16-token prefix was served from the prefix cache for most calls.
    assert server.stats().engine["prefix_cache_hits"] - hits_before >= 16 * 32


def test_cancel_storm_leaves_no_request_or_block_behind(server, offline):
    """48 streams at once; two thirds are cancelled at random points (before any message,
    mid-stream, after the last), the rest read to the end and get their exact tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))] for _ in range(48)]
    plans = [rng.choice(["cancel_early", "cancel_mid", "read_all"]) for _ in prompts]
    want = offline.generate(
        prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    )

    def run(prompt, plan):
        stream = server.stub.GenerateStream(
            stream_request(token_request(prompt, greedy(30))), timeout=120
        )
        if plan == "cancel_early":
            stream.cancel()
            return None
        if plan == "cancel_mid":
            # A stream merges the steps its reader fell behind on, so under this load it
            # may end in fewer messages than asked for here.
            for _ in range(rng.randrange(1, 4)):
                if next(stream, None) is None:
                    break
            stream.cancel()
            return None
        return collect_stream(stream)

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        results = list(pool.map(run, prompts, plans))
    for result, expected in zip(results, want):
        if result is not None:
            messages, outputs = result
            assert sum(m.finished for m in messages) == 1
            assert outputs[0]["token_ids"] == expected.outputs[0].token_ids
    # The fixture then checks that nothing runs and every block is free.


def test_bad_input_names_the_field_value_and_limit(server):
    stub = server.stub
    cases = [
        (pb.GenerateRequest(sampling=greedy()), "prompt: set one of text, token_ids, chat"),
        (pb.GenerateRequest(text=""), "text: prompt is empty"),
        (token_request([], greedy()), "token_ids.ids: prompt is empty"),
        (token_request([1, 2, 999], greedy()), "token_ids.ids[2]: token id 999"),
        (token_request([1], greedy(top_p=1.5)), "sampling.top_p"),
        (token_request([1], pb.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
        (
            token_request([1], greedy(logprobs=21)),
            "sampling.logprobs must be <= 20 (the engine's max_logprobs), got 21",
        ),
        (
            token_request([1], greedy(early_stopping=7)),
            "sampling.early_stopping is 7, which is no EarlyStopping value this server knows",
        ),
        (token_request([1], greedy(seed=1 << 63)), "sampling.seed must be <="),
        (
            token_request([1] * 600, greedy()),
            "token_ids: 600 prompt tokens leave no room to generate in the model's context "
            "window of 512",
        ),
        (token_request([1], greedy(n=100)), "max_num_seqs is 64"),
        (pb.GenerateRequest(chat=pb.Chat()), "chat.messages is empty"),
        (
            token_request([1], greedy(logit_bias={600: 1.0})),
            "sampling.logit_bias: token id 600 is outside the vocabulary [0, 512)",
        ),
        (token_request([1], greedy(logit_bias={5: float("inf")})), "sampling.logit_bias[5]"),
        (token_request([1], greedy(allowed_token_ids=[3, 512])), "sampling.allowed_token_ids"),
        (token_request([1], greedy(bad_words=["a", " "])), "sampling.bad_words[] must be non-"),
    ]
    for request, expected in cases:
        for call in both_rpcs(stub):
            with pytest.raises(grpc.RpcError) as caught:
                call(request, timeout=30)
                pytest.fail(f"accepted: {request}")
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert expected in caught.value.details(), (expected, caught.value.details())
    with pytest.raises(grpc.RpcError) as caught:
        stub.Tokenize(pb.TokenizeRequest())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The server serves on, and counted the failures.
    assert server.stub.Generate(token_request([1, 2], greedy(4))).finished
    assert server.stats().requests_failed >= 2 * len(cases)


def test_model_info_health_and_reflection(server, server_model_dir):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model == str(server_model_dir)
    assert info.architecture == "LlamaForCausalLM"
    assert (info.vocab_size, info.max_model_len, info.block_size) == (512, 512, 16)
    assert info.num_blocks > 0 and info.max_num_seqs == 64 and info.dtype == pb.DTYPE_FLOAT32
    assert (info.quantization, info.kv_cache_dtype) == (
        pb.QUANTIZATION_NONE,
        pb.KV_CACHE_DTYPE_AUTO,
    )
    assert not info.HasField("max_output_tokens")  # no max_new_tokens in its config
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "pagedserve.v1.GenerationService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    (reply,) = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in reply.list_services_response.service}
    assert {"pagedserve.v1.GenerationService", "grpc.health.v1.Health"} <= names
    # grpc.reflection.v1, as grpcurl asks: the same messages under v1's package name (the
    # same bytes, so v1alpha's classes encode them), listing and describing the services.
    v1 = server.channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    listed, described = v1(
        iter(
            [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="grpc.reflection.v1.ServerReflection"
                ),
            ]
        )
    )
    v1_names = {s.name for s in listed.list_services_response.service}
    assert {
        "pagedserve.v1.GenerationService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= v1_names
    (file_bytes,) = described.file_descriptor_response.file_descriptor_proto
    assert b"grpc.reflection.v1" in file_bytes and b"v1alpha" not in file_bytes


def scrape(server) -> dict[str, float]:
    """The server's /metrics, as {sample name with labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_prometheus_metrics_count_calls_tokens_and_the_engine(server):
    before = scrape(server)
    response = server.stub.Generate(token_request(PROMPTS[0], greedy(6)))
    assert response.usage.HasField("queue_time") and response.usage.queue_time.ToNanoseconds() >= 0
    with pytest.raises(grpc.RpcError):
        server.stub.Generate(token_request([1], greedy(top_p=2.0)))
    after = scrape(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('pagedserve_requests_total{api="grpc",code="OK"}') == 1
    assert grew('pagedserve_requests_total{api="grpc",code="INVALID_ARGUMENT"}') == 1
    assert grew("pagedserve_generation_tokens_total") == 6
    assert grew("pagedserve_prompt_tokens_total") == len(PROMPTS[0])
    assert grew("pagedserve_time_to_first_token_seconds_count") == 1
    assert grew("pagedserve_time_per_output_token_seconds_count") == 1
    assert grew("pagedserve_request_queue_time_seconds_count") == 1
    assert after["pagedserve_requests_running"] == 0
    assert after["pagedserve_engine_up"] == 1
    assert after["pagedserve_engine_num_free_blocks"] == after["pagedserve_engine_num_total_blocks"]
    # The scheduler's counts are counters (rate() reads them), its levels gauges.
    assert grew("pagedserve_engine_num_sampled_tokens_total") == 6
    assert "pagedserve_engine_num_preemptions_total" in after
    assert "pagedserve_engine_prefix_cache_hits_total" in after
    assert after["pagedserve_engine_kv_cache_usage"] == 0.0  # nothing in flight


def test_json_logs_carry_each_calls_fields(start_server):
    """--log-format json: the server's lines are JSON objects, the request log's with its
    ids, token counts and times as fields; an unknown format is refused at start."""
    server = start_server("--log-format", "json")
    server.stub.Generate(token_request(PROMPTS[1], greedy(5)), metadata=(("x-request-id", "c1"),))
    assert server.terminate() == 0
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    assert {"time", "level", "logger", "pid", "message"} <= set(lines[0])
    (call,) = [line for line in lines if "prompt_tokens" in line]
    assert call["logger"] == "pagedserve.server" and call["level"] == "INFO"
    assert call["prompt_tokens"] == len(PROMPTS[1]) and call["output_tokens"] == 5
    assert call["finish_reasons"] == "length" and call["duration_s"] > 0
    assert call["queue_time_s"] is not None and call["first_token_s"] is not None
    # No line of ours in the text format.
    assert not re.search(r"^\S+ \S+ pagedserve[.\w]* (INFO|WARNING)", server.log(), re.MULTILINE)
    refused = start_server("--log-format", "yaml", wait=False)
    assert refused.process.wait(timeout=60) == 2
    assert "invalid choice: 'yaml'" in refused.log()


def test_a_server_with_int8_weights_and_a_float8_cache_says_so_and_runs_them(
    start_server, server_model_dir
):
    server = start_server("--quantization", "int8", "--kv-cache-dtype", "fp8", "--no-request-log")
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.quantization, info.kv_cache_dtype) == (
        pb.QUANTIZATION_INT8,
        pb.KV_CACHE_DTYPE_FP8_E4M3,
    )
    got = server.stub.Generate(token_request(PROMPTS[0], greedy(12)))
    quantized = LLM(server_model_dir, num_blocks=128, quantization="int8", kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = quantized.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    assert list(got.outputs[0].token_ids) == want
    assert server.terminate() == 0


def test_the_server_process_runs_no_model(server):
    """The frontend process tokenizes and streams; only the workers load the compiled
    ops and the weights. (It does import torch: transformers' tokenizers import it.)"""
    maps = Path(f"/proc/{server.pid}/maps").read_text()
    assert "_C_cpu" not in maps and "model.safetensors" not in maps
    worker_maps = [Path(f"/proc/{pid}/maps").read_text() for pid in server.engine_pids()]
    assert any("_C_cpu" in text for text in worker_maps)  # the check can see it


def test_cli_serve_help_lists_the_operator_flags():
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for flag in (
        "--host", "--port", "--http-port", "--served-model-name", "--api-key",
        "--max-concurrent-requests", "--drain-timeout-s",
    ):  # fmt: skip
        assert flag in result.stdout
    # A flag out of range is refused before anything starts, naming it (exit 2).
    bad = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "serve", "--http-port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "http_port must be in [0, 65535], got 70000" in bad.stderr


def test_stream_interval_sends_fewer_larger_messages_with_the_same_result(start_server, offline):
    server = start_server("--stream-interval", "8", "--no-request-log")
    request = token_request(PROMPTS[0], greedy(30))
    messages, outputs = collect_stream(server.stub.GenerateStream(stream_request(request)))
    want = offline.generate(
        PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    )[0]
    assert outputs[0]["token_ids"] == want.outputs[0].token_ids
    counts = [sum(len(c.token_ids) for c in m.outputs) for m in messages]
    assert counts[0] >= 1 and sum(counts) == 30
    assert all(count >= 8 for count in counts[1:-1]), counts  # the first and last at once
    assert len(messages) <= 1 + 30 // 8 + 1
    assert messages[-1].finished and sum(m.finished for m in messages) == 1
    assert server.terminate() == 0
    log = server.log()
    assert "serving" in log and "output tokens" not in log  # no line per call
