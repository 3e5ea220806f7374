"""IBM's Granite (``GraniteForCausalLM``): Llama with µP's four scalars. Greedy tokens
identical to HF transformers (float32) across block sizes (the parity matrix), chunked
prefill, prefix caching and two tensor-parallel ranks; the logprobs carry
``logits_scaling``; a config that leaves the scalars out takes GraniteConfig's defaults (an
attention scale of 1.0, not 1/sqrt(head size)), as HF does; and each scalar changes HF's own
tokens here, so the parity checks can tell an engine that ignores one from one that applies
it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from helpers.family_configs import GRANITE, GRANITE_MOE, GRANITE_MOE_SHARED, GRANITE_SCALARS
from helpers.parity import hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from helpers.tiny_models import random_hf_model
from pagedserve.frontend import LLM, SamplingParams

model_dir, hf_reference = family_fixtures(GRANITE)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_logprobs_carry_the_logits_scaling(model_dir):
    prompt = prompts()[2]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    completion = LLM(model_dir, num_blocks=64).generate([prompt], params)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(completion.token_ids))
    scaled = torch.log_softmax(logits[rows], dim=-1)
    unscaled = torch.log_softmax(logits[rows] * GRANITE_SCALARS["logits_scaling"], dim=-1)
    assert (scaled - unscaled).abs().max() > 0.1  # the check below tells them apart
    for entry, row in zip(completion.logprobs, scaled):
        top = row.topk(5)
        assert set(entry) >= set(top.indices.tolist())
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-4)


def test_a_config_without_the_scalars_takes_graniteconfig_s_defaults(model_dir, tmp_path):
    bare = rewritten(model_dir, tmp_path / "bare", **dict.fromkeys(GRANITE_SCALARS))
    llm = LLM(bare, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy(bare, prompts())


@pytest.mark.parametrize("name", list(GRANITE_SCALARS))
def test_each_scalar_changes_hf_s_tokens(model_dir, hf_reference, tmp_path, name):
    # Without it (its default of 1.0) HF's own tokens differ: the parity tests above fail
    # on an engine that leaves it out.
    plain = rewritten(model_dir, tmp_path / name, **{name: 1.0})
    if name == "logits_scaling":
        # Dividing every logit by one number keeps greedy's argmax: the logprobs test
        # above is the check for it.
        assert hf_greedy(plain, prompts()) == hf_reference
    else:
        assert hf_greedy(plain, prompts()) != hf_reference


def test_lora_matches_hf_peft(model_dir, tmp_path):
    from helpers.lora_adapters import ALL_MODULES, make_lora_adapter, peft_greedy

    adapter = make_lora_adapter(
        model_dir, tmp_path / "lora", seed=5, target_modules=ALL_MODULES, r=8, lora_alpha=16
    )
    short_prompts = prompts()[:4]
    llm = LLM(model_dir, num_blocks=256, lora_modules={"all": str(adapter)})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = peft_greedy(model_dir, adapter, short_prompts)
    assert token_ids(llm.generate(short_prompts, params, lora_request="all")) == expected
    assert expected != peft_greedy(model_dir, None, short_prompts)


# The stacked expert tensors as the Hub's checkpoints name them <-> transformers 5's names.
_MOE_NAMES = {
    "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
    "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
}


@pytest.fixture(scope="module")
def moe_dir(family_models) -> Path:
    return family_models.model_dir(GRANITE_MOE)


@pytest.fixture(scope="module")
def moe_reference(family_models) -> list[list[int]]:
    return family_models.reference(GRANITE_MOE)


def test_granite_moe_weights_the_top_two_by_their_softmax_and_matches_hf_chunked(
    moe_dir, moe_reference
):
    # One pass at each block size: the parity matrix.
    chunked = LLM(moe_dir, block_size=16, num_blocks=256, max_num_batched_tokens=24)
    assert chunked.model_config.layer_experts[0].softmax_over_top_k
    assert token_ids(chunked.generate(prompts(), GREEDY)) == moe_reference


def test_granite_moe_on_two_ranks_matches_hf(moe_dir, moe_reference):
    llm = LLM(moe_dir, num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY)) == moe_reference
    finally:
        llm.shutdown()


def test_granite_moe_reads_either_checkpoint_naming(moe_dir, moe_reference, tmp_path):
    """The Hub's checkpoints (input_linear, output_linear, router.layer) and what
    transformers 5 saves load alike."""
    from safetensors.torch import load_file, save_file

    renamed_dir = tmp_path / "renamed"
    shutil.copytree(moe_dir, renamed_dir)
    weights = load_file(moe_dir / "model.safetensors")
    renamed = {}
    for name, tensor in weights.items():
        for ours, theirs in list(_MOE_NAMES.items()) + [(b, a) for a, b in _MOE_NAMES.items()]:
            if name.endswith(ours):
                name = name.removesuffix(ours) + theirs
                break
        renamed[name] = tensor
    assert set(renamed) != set(weights)
    save_file(renamed, renamed_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(renamed_dir, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == moe_reference


def test_granite_moe_shared_matches_hf_on_one_and_two_ranks(family_models, tmp_path):
    model_dir = family_models.model_dir(GRANITE_MOE_SHARED)
    expected = family_models.reference(GRANITE_MOE_SHARED)
    unshared = random_hf_model(
        {**GRANITE_MOE_SHARED, "shared_intermediate_size": 0}, tmp_path / "unshared"
    )
    assert hf_greedy(unshared, prompts()) != expected  # the shared MLP shows in the tokens
    llm = LLM(model_dir, num_blocks=256)
    assert llm.model_config.layer_experts[0].shared_intermediate_size == 128
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected
    parallel = LLM(model_dir, num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(parallel.generate(prompts(), GREEDY)) == expected
    finally:
        parallel.shutdown()
    llm = LLM(unshared, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy(unshared, prompts())
