"""Cohere's Command R / Aya (``CohereForCausalLM``), Command R+'s per-head query and key
norms, and Command R7B / Command A (``Cohere2ForCausalLM``): a mean-centred LayerNorm,
attention and MLP side by side on it, RoPE on interleaved pairs (run as halves on rows the
loader reorders), logits times ``logit_scale``; Cohere2's sliding layers rotate and its full
layers have no position embedding. Greedy tokens identical to HF transformers (float32)
across block sizes (the parity matrix), chunked prefill with prefix hits and two
tensor-parallel ranks; the logprobs carry the logit scale; bfloat16's first tokens agree
with HF's bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from helpers.family_configs import COHERE_CONFIGS
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf
from helpers.tiny_family import GREEDY, check_chunked_prefix_hits_and_two_ranks, prompts, token_ids
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.model_config import ModelConfig


@pytest.fixture(scope="module")
def model_dirs(family_models) -> dict[str, Path]:
    return {name: family_models.model_dir(config) for name, config in COHERE_CONFIGS.items()}


@pytest.fixture(scope="module")
def hf_references(family_models) -> dict[str, list[list[int]]]:
    return {name: family_models.reference(config) for name, config in COHERE_CONFIGS.items()}


@pytest.mark.parametrize("block_size", [8, 16])
def test_command_r_plus_s_query_and_key_norms_match_hf(model_dirs, hf_references, block_size):
    # Command R and Command R7B at each block size: the parity matrix.
    llm = LLM(model_dirs["cohere_qk_norm"], block_size=block_size, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references["cohere_qk_norm"]


def test_command_r7b_slides_three_layers_in_four(model_dirs):
    assert ModelConfig.from_dir(model_dirs["cohere2"]).layer_sliding_windows == (16, 16, 16, 0)


@pytest.mark.parametrize("name", ["cohere_qk_norm", "cohere2"])
def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dirs, hf_references, name):
    check_chunked_prefix_hits_and_two_ranks(model_dirs[name], hf_references[name])


def test_logprobs_carry_the_logit_scale(model_dirs):
    model_dir = model_dirs["cohere"]
    prompt = prompts()[2]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    completion = LLM(model_dir, num_blocks=64).generate([prompt], params)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(completion.token_ids))
    scaled = torch.log_softmax(logits[rows], dim=-1)
    assert (scaled - torch.log_softmax(logits[rows] / 0.5, dim=-1)).abs().max() > 0.1
    for entry, row in zip(completion.logprobs, scaled):
        top = row.topk(5)
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-4)


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dirs):
    check_bfloat16_first_tokens_agree_with_hf(model_dirs["cohere"])
