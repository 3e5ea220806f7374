"""``--generation-config`` / ``--override-generation-config`` on a real server: the
defaults reach both APIs for the fields a call leaves unset, max_new_tokens cuts what a
call asks for, the start-up log says what they are, and a bad override stops the server
before it serves (exit 2), naming it."""

from __future__ import annotations

import grpc
import pytest

from helpers.grpc_calls import token_request
from helpers.http_calls import post
from helpers.parity import hf_greedy
from pagedserve.v1 import generation_pb2 as pb

PROMPT = [5, 9, 31, 2, 77, 300]


def test_the_override_is_every_calls_default(start_server, server_model_dir):
    # Sampling at temperature 1.5 from the single most likely token: greedy's tokens, which
    # only the defaults' top_k can give (a call sets max_tokens, ignore_eos and no more).
    # max_new_tokens 10: a call asking for 12 gets 10, as vLLM's server cuts it.
    server = start_server(
        "--http-port", "0",
        "--served-model-name", "m",
        "--generation-config", "vllm",
        "--override-generation-config",
        '{"temperature": 1.5, "top_k": 1, "max_new_tokens": 10}',
    )  # fmt: skip
    assert (
        "sampling defaults: temperature=1.5, top_k=1, max_tokens<=10 (max_new_tokens) "
        "(from vllm + override)"
    ) in server.log()
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.HasField("max_output_tokens") and info.max_output_tokens == 10
    greedy = hf_greedy(server_model_dir, [PROMPT])[0][:10]
    sampling = pb.SamplingParams(max_tokens=12, ignore_eos=True)
    output = server.stub.Generate(token_request(PROMPT, sampling)).outputs[0]
    assert list(output.token_ids) == greedy
    assert output.finish_reason == pb.FINISH_REASON_LENGTH
    unset = server.stub.Generate(token_request(PROMPT, pb.SamplingParams(ignore_eos=True)))
    assert list(unset.outputs[0].token_ids) == greedy  # unset: the limit, not 16
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    status, answer = post(server, "/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == output.text
    assert (answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]) == (
        "length",
        10,
    )
    del body["max_tokens"]  # unset: 16 for a completion, cut to 10
    status, answer = post(server, "/v1/completions", body)
    assert (status, answer["usage"]["completion_tokens"]) == (200, 10), answer
    # A call that needs more than the limit is refused, naming min_tokens.
    status, answer = post(server, "/v1/completions", {**body, "min_tokens": 11})
    assert (status, answer["error"]["param"]) == (400, "min_tokens"), answer
    assert "min_tokens=11 is more than the 10 output tokens" in answer["error"]["message"]
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(token_request(PROMPT, pb.SamplingParams(min_tokens=11)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling.min_tokens=11 is more than the 10 ")
    # A call's own top_k wins: sampled at 1.5 over every token, it leaves the greedy path.
    status, wide = post(server, "/v1/completions", {**body, "top_k": -1, "seed": 3})
    assert status == 200, wide
    assert wide["choices"][0]["text"] != output.text
    wide_sampling = pb.SamplingParams(max_tokens=12, ignore_eos=True, top_k=0, seed=3)
    completion = server.stub.Generate(token_request(PROMPT, wide_sampling))
    assert list(completion.outputs[0].token_ids) != greedy
    server.assert_blocks_all_free()


def test_a_bad_override_exits_2_before_serving(start_server):
    server = start_server("--override-generation-config", '{"top_p": 3}', wait=False)
    assert server.process.wait(120) == 2
    assert "override_generation_config: top_p must be" in server.log()
    assert not server.port_file.exists()
