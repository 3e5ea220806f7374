"""Llama 4's language model (``Llama4ForCausalLM``): chunked attention with RoPE over
interleaved pairs and L2 query / key norms on most layers, global attention without RoPE and
with a position-dependent query temperature on every other one here
(``no_rope_layer_interval`` 2), top-1 experts that scale their input by the sigmoid of their
logit beside a shared expert on two layers, dense MLPs of ``intermediate_size_mlp`` on the
others. Chunks of 32 tokens: the prompts (up to 150 tokens) and their 48 new tokens cross
many chunk starts, in prefill and in decode. Greedy tokens identical to HF transformers
(float32) across block sizes (the parity matrix), chunked prefill with prefix hits, two
tensor-parallel ranks and preemption by swap; the chunks, the temperature and the q/k norms
each change HF's own tokens, so the checks can fail; bfloat16's first tokens agree with HF's
bfloat16."""

from __future__ import annotations

import pytest

from helpers.family_configs import LLAMA4
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.speculative_decoding import SPECULATIVE, assert_speculated, repetitive_prompts
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    check_preemption_by_swap_keeps_the_tokens,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import ModelConfig, check_tensor_parallel_size

model_dir, hf_reference = family_fixtures(LLAMA4)


def test_the_layers_kinds_are_read(model_dir):
    config = ModelConfig.from_dir(model_dir)
    assert config.layer_attention_chunks == (32, 0, 32, 0)
    assert config.attention_chunk_size == 32
    experts = config.layer_experts
    assert experts[2] is None and experts[3] is None
    spec = experts[0]
    assert (spec.num_experts, spec.top_k, spec.intermediate_size) == (4, 1, 96)
    assert spec.sigmoid_scales_input and spec.shared_intermediate_size == 96
    assert not spec.shared_expert_gated
    assert config.spec.nope_temperature(config, rotates=False) == (0.5, 16)
    assert config.spec.nope_temperature(config, rotates=True) is None


def test_llama4_matches_hf_with_a_block_as_long_as_the_attention_chunk(model_dir, hf_reference):
    # Block sizes 8 and 16: the parity matrix.
    llm = LLM(model_dir, block_size=32, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference):
    check_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference)


@pytest.mark.slow
def test_the_chunks_the_temperature_and_the_norms_each_change_hf_s_tokens(
    model_dir, hf_reference, tmp_path
):
    """Without chunks (``attention_chunk_size`` null: every layer global), without the
    temperature, without the q/k norms: HF's tokens move each time, and ours follow them."""
    unchunked = rewritten(model_dir, tmp_path / "unchunked", layer_types=None)
    config_file = unchunked / "config.json"
    config_file.write_text(
        config_file.read_text().replace(
            '"attention_chunk_size": 32', '"attention_chunk_size": null'
        )
    )
    assert ModelConfig.from_dir(unchunked).attention_chunk_size == 0
    variants = [
        unchunked,
        rewritten(model_dir, tmp_path / "no_temperature", attn_temperature_tuning=False),
        rewritten(model_dir, tmp_path / "no_qk_norm", use_qk_norm=False),
    ]
    for variant in variants:
        expected = hf_greedy(variant, prompts())
        assert expected != hf_reference, variant.name
        llm = LLM(variant, num_blocks=256)
        assert token_ids(llm.generate(prompts(), GREEDY)) == expected, variant.name


def test_a_block_size_that_does_not_divide_the_chunks_is_refused(model_dir, tmp_path):
    odd = rewritten(model_dir, tmp_path / "odd", attention_chunk_size=24, layer_types=None)
    with pytest.raises(ValueError, match="block_size=16 must divide .*attention_chunk_size=24"):
        LLM(odd, block_size=16, num_blocks=64)


def test_bad_layer_fields_are_refused(model_dir, tmp_path):
    cases = [
        ({"layer_types": ["chunked_attention", "sliding_attention"] * 2}, "sliding_attention"),
        ({"attention_chunk_size": 0, "layer_types": None}, "attention_chunk_size must be"),
        ({"moe_layers": [0, 4]}, "moe_layers must list layer indices from 0 to 3"),
        ({"floor_scale": 0}, "floor_scale must be an integer >= 1"),
    ]
    for index, (changes, message) in enumerate(cases):
        bad = rewritten(model_dir, tmp_path / f"bad{index}", **changes)
        with pytest.raises(ValueError, match=message):
            LLM(bad, num_blocks=64)


def test_tensor_parallel_checks_the_dense_layers_own_width(model_dir, tmp_path):
    odd = rewritten(model_dir, tmp_path / "odd", intermediate_size_mlp=385)
    with pytest.raises(ValueError, match="intermediate_size_mlp=385"):
        check_tensor_parallel_size(ModelConfig.from_dir(odd), 2)
    check_tensor_parallel_size(ModelConfig.from_dir(model_dir), 2)


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)


def test_speculative_decoding_matches_hf(model_dir):
    """Prompt-lookup drafts verified several tokens a sequence a step: the chunked view cuts
    those rows at chunk starts too."""
    prompts = repetitive_prompts(1)
    llm = LLM(model_dir, block_size=8, num_blocks=256, speculative_config=SPECULATIVE)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == hf_greedy(model_dir, prompts)
    assert_speculated(llm)
