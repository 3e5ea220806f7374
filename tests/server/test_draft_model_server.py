"""``pagedserve serve --speculative-config '{"model": ...}'``: a real server with a draft
model (or the model's own MTP layer) answers both APIs with the target's greedy tokens, and
its metrics (ours and vLLM's ``spec_decode`` names) count the drafts it checked."""

from __future__ import annotations

import json
import shutil

from helpers.grpc_calls import token_request
from helpers.http_calls import metric_samples, post
from helpers.multi_token_prediction import CONFIGS as MTP_CONFIGS
from helpers.multi_token_prediction import predictable_copy, with_mtp_layer
from helpers.parity import hf_greedy
from helpers.server_process import SERVED_MODEL_NAME, serving
from helpers.tiny_models import random_hf_model
from pagedserve.v1 import generation_pb2 as pb

PROMPTS = [[5, 9, 31, 2, 77, 300], [40, 41, 42]]


def test_a_server_with_a_draft_model(start_server, server_model_dir):
    # The draft model is a copy of the target: every guess is the target's own token.
    speculative = {"model": str(server_model_dir), "num_speculative_tokens": 3}
    server = start_server(
        "--http-port", "0", "--served-model-name", SERVED_MODEL_NAME, "--vllm-metric-names",
        "--kv-cache-bytes", str(4 << 20), "--speculative-config", json.dumps(speculative),
    )  # fmt: skip
    want = hf_greedy(server_model_dir, PROMPTS)
    sampling = pb.SamplingParams(max_tokens=len(want[0]), temperature=0.0, ignore_eos=True)
    output = server.stub.Generate(token_request(PROMPTS[0], sampling)).outputs[0]
    assert list(output.token_ids) == want[0]
    body = {"prompt": PROMPTS[1], "max_tokens": len(want[1]), "ignore_eos": True}
    status, answer = post(server, "/v1/completions", {**body, "temperature": 0.0})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == len(want[1])
    got = metric_samples(server)
    model = (("model_name", SERVED_MODEL_NAME),)
    counts = {}
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        ours = got[(f"pagedserve_engine_num_{name}_total", ())]
        assert got[(f"vllm:spec_decode_num_{name}_total", model)] == ours
        counts[name] = ours
    assert 0 < counts["drafts"] < counts["draft_tokens"] == counts["accepted_tokens"], counts
    # By position in their step's drafts: every draft of a step at a position counts there.
    per_position = [
        got[("pagedserve_engine_num_accepted_tokens_per_pos_total", (("position", str(p)),))]
        for p in range(3)
    ]
    assert per_position[0] == counts["drafts"], per_position
    assert per_position[0] >= per_position[1] >= per_position[2] > 0, per_position
    assert sum(per_position) == counts["accepted_tokens"]
    vllm_name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert (
        got[(vllm_name, (("model_name", SERVED_MODEL_NAME), ("position", "2")))]
        == (per_position[2])
    )
    server.assert_blocks_all_free()


def test_a_server_drafting_with_the_model_s_mtp_layer(server_model_dir, tmp_path):
    """``--speculative-config '{"method": "mtp", ...}'`` on a DeepSeek-V3-shaped model whose
    multi-token-prediction layer guesses right (``predictable_copy``), with the byte-level
    tokenizer: the target's greedy tokens over both APIs, its guesses accepted."""
    base = random_hf_model(MTP_CONFIGS["deepseek_v3"], tmp_path / "base")
    model = predictable_copy(with_mtp_layer(base, tmp_path / "mtp"), tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(server_model_dir / name, model / name)
    speculative = {"method": "mtp", "num_speculative_tokens": 2}
    want = hf_greedy(model, PROMPTS)
    (tmp_path / "work").mkdir()
    with serving(
        model, tmp_path / "work", "--vllm-metric-names", "--speculative-config",
        json.dumps(speculative),
    ) as server:  # fmt: skip
        sampling = pb.SamplingParams(max_tokens=len(want[0]), temperature=0.0, ignore_eos=True)
        output = server.stub.Generate(token_request(PROMPTS[0], sampling)).outputs[0]
        assert list(output.token_ids) == want[0]
        body = {"prompt": PROMPTS[1], "max_tokens": len(want[1]), "ignore_eos": True}
        status, answer = post(server, "/v1/completions", {**body, "temperature": 0.0})
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == len(want[1])
        got = metric_samples(server)
        drafted = got[("pagedserve_engine_num_draft_tokens_total", ())]
        accepted = got[("pagedserve_engine_num_accepted_tokens_total", ())]
        assert drafted > 20 and drafted - accepted <= 2, (drafted, accepted)
        server.assert_blocks_all_free()
