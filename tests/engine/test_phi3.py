"""Microsoft's Phi-3 and Phi-4 (``Phi3ForCausalLM``): Llama with fused ``qkv_proj`` and
``gate_up_proj`` checkpoint tensors and a sliding window on every layer when the config sets
one. Greedy tokens identical to HF transformers (float32) across block sizes (the parity
matrix), with a window the longer prompts pass, chunked prefill with prefix hits, and two
tensor-parallel ranks (each takes its heads and rows out of the fused tensors); Phi-4-mini's
shape of RoPE (LongRoPE, three quarters of each head rotated): the short factors within its
original context, the long ones past it as HF's ``generate`` rotates (a prompt past it:
every position; a shorter one: the positions its decoding reaches past it), under chunked
prefill, prefix hits, preemption by recompute and two ranks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from helpers.family_configs import PHI3
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
from pagedserve.gpu_worker.model_config import ModelConfig

model_dir, hf_reference = family_fixtures(PHI3)


def test_the_window_is_on_every_layer(model_dir):
    assert ModelConfig.from_dir(model_dir).layer_sliding_windows == (32, 32)


def test_the_window_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    # Without it HF's own tokens differ: the parity test above tells an engine that
    # ignores the window from one that applies it.
    unwindowed = rewritten(model_dir, tmp_path / "unwindowed", sliding_window=None)
    assert hf_greedy(unwindowed, prompts()) != hf_reference
    llm = LLM(unwindowed, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy(unwindowed, prompts())


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


rng = random.Random(3)
LONGROPE_PHI4_MINI = dict(
    PHI3,
    sliding_window=None,
    max_position_embeddings=1024,
    original_max_position_embeddings=256,
    partial_rotary_factor=0.75,
    rope_scaling={
        "type": "longrope",
        "short_factor": [round(1.0 + rng.random(), 3) for _ in range(24)],
        "long_factor": [round(4.0 + 8 * rng.random(), 3) for _ in range(24)],
    },
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory) -> Path:
    saved = random_hf_model(LONGROPE_PHI4_MINI, tmp_path_factory.mktemp("phi4_mini_saved"))
    # transformers 5 saved rope_parameters: back to the config as the Hub's is written.
    return rewritten(
        saved,
        tmp_path_factory.mktemp("phi4_mini") / "model",
        rope_parameters=None,
        rope_theta=10000.0,
        rope_scaling=LONGROPE_PHI4_MINI["rope_scaling"],
    )


def test_longrope_and_partial_rotary_match_hf(longrope_dir):
    """Within the original context HF rotates with the short factors, three quarters of each
    head, cos and sin scaled by the attention factor: so does the engine (chunked prefill
    and prefix hits too); its window is the whole max_position_embeddings."""
    expected = hf_greedy(longrope_dir, prompts())
    llm = LLM(longrope_dir, block_size=16, num_blocks=256)
    assert llm.scheduler_config.max_model_len == 1024
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected
    chunked = LLM(
        longrope_dir,
        block_size=16,
        num_blocks=256,
        max_num_batched_tokens=24,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
    )
    chunked.generate(prompts(), GREEDY)
    assert token_ids(chunked.generate(prompts(), GREEDY)) == expected


def test_the_short_factors_and_the_partial_rotation_change_hf_s_tokens(longrope_dir, tmp_path):
    # The parity test above fails on an engine that leaves either out.
    expected = hf_greedy(longrope_dir, prompts())
    plain_factors = rewritten(
        longrope_dir,
        tmp_path / "plain_factors",
        rope_scaling={**LONGROPE_PHI4_MINI["rope_scaling"], "short_factor": [1.0] * 24},
    )
    assert hf_greedy(plain_factors, prompts()) != expected
    whole_heads = rewritten(
        longrope_dir,
        tmp_path / "whole_heads",
        partial_rotary_factor=1.0,
        rope_scaling={
            "type": "longrope",
            "short_factor": LONGROPE_PHI4_MINI["rope_scaling"]["short_factor"] + [1.0] * 8,
            "long_factor": LONGROPE_PHI4_MINI["rope_scaling"]["long_factor"] + [1.0] * 8,
        },
    )
    assert hf_greedy(whole_heads, prompts()) != expected


def long_prompts() -> list[list[int]]:
    """Past the original context (256): two prompts longer than it, one that decodes across
    it, one within it (beside them in the batch)."""
    rng = random.Random(7)
    return [[rng.randrange(512) for _ in range(n)] for n in (300, 600, 240, 40)]


@pytest.fixture(scope="module")
def long_reference(longrope_dir) -> list[list[int]]:
    return hf_greedy(longrope_dir, long_prompts())


def test_longrope_past_the_original_context_matches_hf(longrope_dir, long_reference):
    """The long factors where HF's generate uses them: every position of a prompt past the
    original context, and a shorter prompt's positions from the original context on."""
    llm = LLM(longrope_dir, block_size=16, num_blocks=256)
    assert token_ids(llm.generate(long_prompts(), GREEDY)) == long_reference


@pytest.mark.parametrize("preemption_mode", [None, "recompute"])
def test_longrope_rotation_follows_the_prompt_through_chunks_hits_and_recompute(
    longrope_dir, long_reference, preemption_mode
):
    """Chunks of 64 rotate as the whole prompt's pass does (the prompt's length decides,
    not the chunk's); the second run's prefix hits come only from prompts on the same side
    of the original context (the long prompts' blocks and the short ones' differ for the
    same tokens); a sequence recomputed after preemption rotates as it first did."""
    tight = dict(num_blocks=60, preemption_mode="recompute") if preemption_mode else {}
    llm = LLM(
        longrope_dir,
        block_size=16,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        **({"num_blocks": 256} | tight),
    )
    prompts = long_prompts()
    assert token_ids(llm.generate(prompts, GREEDY)) == long_reference
    # A short prompt that is the first 240 tokens of the 300-token one: the same tokens,
    # the other rotation, so no hit on the long prompt's blocks; the 240-token prompt hits
    # the blocks it computed before it grew past the original context.
    again = llm.generate([*prompts, prompts[0][:240]], GREEDY)
    assert token_ids(again)[:4] == long_reference
    if preemption_mode:
        assert llm.stats()["num_recompute_preemptions"] > 0  # (and hits evicted: no count)
    else:
        assert [o.num_cached_tokens for o in again] == [288, 592, 224, 32, 0]


def test_a_group_of_samples_grows_past_the_original_context_together(longrope_dir):
    """n=2 samples of the 240-token prompt cross the original context together: the group is
    computed again from its first token as one (seeded: the same samples either way)."""
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=48, ignore_eos=True)
    prompt = long_prompts()[2]
    outputs = [
        LLM(longrope_dir, block_size=16, num_blocks=256, **kwargs).generate([prompt], params)
        for kwargs in ({}, {"preemption_mode": "swap"})
    ]
    samples = [[list(c.token_ids) for c in output[0].outputs] for output in outputs]
    assert samples[0] == samples[1] and [len(s) for s in samples[0]] == [48, 48]
    assert samples[0][0] != samples[0][1]


def test_longrope_two_ranks_match_hf(longrope_dir, long_reference):
    parallel = LLM(longrope_dir, num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(parallel.generate(long_prompts(), GREEDY)) == long_reference
    finally:
        parallel.shutdown()


def test_the_long_factors_change_hf_s_tokens(longrope_dir, long_reference, tmp_path):
    # The checks above fail on an engine that keeps the short factors past the context.
    short_only = rewritten(
        longrope_dir,
        tmp_path / "short_only",
        rope_scaling={
            **LONGROPE_PHI4_MINI["rope_scaling"],
            "long_factor": LONGROPE_PHI4_MINI["rope_scaling"]["short_factor"],
        },
    )
    changed = hf_greedy(short_only, long_prompts())
    assert [a != b for a, b in zip(changed, long_reference)] == [True, True, True, False]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 24}),
            "rope long_factor must be a list of positive numbers",
        ),
        (
            dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                               "long_factor": [1.0] * 8}),
            "rope short_factor has 8 values; the rotated head size 48 needs 24",
        ),
        (dict(rope_scaling={"type": "ntk_by_parts", "factor": 2.0}),
         "rope_type 'ntk_by_parts' is not supported yet"),
    ],
)  # fmt: skip
def test_bad_rope_settings_are_refused_by_name(longrope_dir, tmp_path, changes, message):
    changed = rewritten(longrope_dir, tmp_path / "changed", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(changed, num_blocks=16)


def test_partial_rotary_is_refused_where_hf_has_none(tiny_model_dirs, tmp_path):
    llama = rewritten(tiny_model_dirs["llama"], tmp_path / "llama", partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for"):
        ModelConfig.from_dir(llama)


def test_lora_on_phi3_s_fused_projections_matches_hf_peft(model_dir, tmp_path):
    """PEFT targets Phi-3's own fused qkv_proj and gate_up_proj: each adapter's B spans the
    fused output; tokens equal HF + peft and differ from the base model's."""
    from helpers.lora_adapters import make_lora_adapter, peft_greedy

    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapter = make_lora_adapter(
        model_dir, tmp_path / "phi3_lora", seed=4, target_modules=targets, r=8, lora_alpha=16
    )
    short_prompts = prompts()[:4]
    llm = LLM(model_dir, num_blocks=256, lora_modules={"fused": str(adapter)})
    expected = peft_greedy(model_dir, adapter, short_prompts)
    outputs = llm.generate(
        short_prompts,
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        lora_request="fused",
    )
    assert token_ids(outputs) == expected
    assert expected != peft_greedy(model_dir, None, short_prompts)


def test_lora_targets_phi3_does_not_have_are_refused(model_dir, tiny_model_dirs, tmp_path):
    from helpers.lora_adapters import make_lora_adapter

    llama_adapter = make_lora_adapter(
        tiny_model_dirs["llama"],
        tmp_path / "llama_lora",
        seed=1,
        target_modules=["q_proj"],
        r=4,
        lora_alpha=8,
    )
    with pytest.raises(ValueError, match="targets 'q_proj', which Phi3ForCausalLM does not have"):
        LLM(model_dir, num_blocks=64, lora_modules={"llama": str(llama_adapter)})
