"""Speculative decoding by prompt lookup through the engine: the output is what decoding
a token at a time gives (HF's greedy tokens; the same seeded samples under penalties,
bias and min_tokens; the same logprobs), whatever stops it, under preemption and chunked
prefill, beside sequences that do not speculate, under grammars, and across processes; and
drafts were really proposed and accepted (else the comparisons would prove nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.grammar_cases import CONSTRAINTS
from helpers.grammar_cases import PROMPTS as STRUCTURED_PROMPTS
from helpers.parity import GREEDY, NEW_TOKENS, hf_greedy
from helpers.speculative_decoding import (
    FEW,
    SPECULATIVE,
    assert_same_tokens_and_logprobs,
    assert_speculated,
    check_stops_inside_accepted_drafts,
    outputs,
    repetitive_prompts,
)
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.scheduler.sampling_params import StructuredOutputsParams


@pytest.mark.parametrize("family", ["llama", "qwen3", "opt"])
def test_greedy_tokens_equal_hf(tiny_model_dirs, family):
    prompts = repetitive_prompts(1)
    llm = LLM(tiny_model_dirs[family], num_blocks=256, speculative_config=SPECULATIVE)
    got = [tokens for tokens, _ in outputs(llm, prompts, GREEDY)]
    assert got == hf_greedy(tiny_model_dirs[family], prompts)
    assert_speculated(llm)
    # Fewer steps than tokens: accepted drafts came without a forward pass of their own.
    stats = llm.stats()
    assert stats["num_sampled_tokens"] == NEW_TOKENS * len(prompts)


@pytest.fixture(scope="module")
def plain_llama(tiny_model_dirs) -> LLM:
    return LLM(tiny_model_dirs["llama"], num_blocks=256)


@pytest.fixture(scope="module")
def speculative_llama(tiny_model_dirs) -> LLM:
    return LLM(tiny_model_dirs["llama"], num_blocks=256, speculative_config=SPECULATIVE)


SAMPLED = [
    SamplingParams(max_tokens=40, temperature=0.8, seed=11, allowed_token_ids=FEW),
    SamplingParams(
        max_tokens=40, temperature=1.0, top_p=0.9, top_k=3, seed=5, allowed_token_ids=FEW
    ),
    SamplingParams(
        max_tokens=40,
        temperature=0.7,
        seed=3,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        allowed_token_ids=FEW,
    ),
    SamplingParams(max_tokens=40, temperature=0.0, presence_penalty=0.3, min_tokens=30),
    SamplingParams(max_tokens=40, temperature=0.0, logit_bias={7: 4.0, 9: -100.0}),
    # EOS (2) allowed too: banned until 12 tokens are out, at draft positions as well.
    SamplingParams(
        max_tokens=40,
        temperature=0.9,
        seed=9,
        min_p=0.05,
        min_tokens=12,
        allowed_token_ids=[2, *FEW],
    ),
]


@pytest.mark.parametrize("params", SAMPLED, ids=range(len(SAMPLED)))
def test_seeded_samples_and_logits_processors_equal_plain_decoding(
    plain_llama, speculative_llama, params
):
    """Each position samples from the sequence as it would be had the drafts before it
    been accepted: the same penalties, bans and seeded draws as one token at a time."""
    prompts = repetitive_prompts(2)
    before = speculative_llama.stats()["num_accepted_tokens"]
    assert outputs(speculative_llama, prompts, params) == outputs(plain_llama, prompts, params)
    assert speculative_llama.stats()["num_accepted_tokens"] > before


def test_logprobs_equal_plain_decoding(plain_llama, speculative_llama):
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = repetitive_prompts(3)
    before = speculative_llama.stats()["num_accepted_tokens"]
    assert_same_tokens_and_logprobs(
        speculative_llama.generate(prompts, params), plain_llama.generate(prompts, params)
    )
    assert speculative_llama.stats()["num_accepted_tokens"] > before


def test_a_stop_inside_the_accepted_drafts_ends_the_output_there(plain_llama, speculative_llama):
    check_stops_inside_accepted_drafts(plain_llama, speculative_llama, repetitive_prompts(4))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_and_chunked_prefill_keep_the_tokens(tiny_model_dirs, preemption_mode):
    prompts = repetitive_prompts(5, count=10)
    params = GREEDY
    small = dict(
        num_blocks=32,
        block_size=8,
        max_num_batched_tokens=48,
        preemption_mode=preemption_mode,
    )
    speculative = LLM(tiny_model_dirs["qwen3"], **small, speculative_config=SPECULATIVE)
    plain = LLM(tiny_model_dirs["qwen3"], num_blocks=256)
    assert outputs(speculative, prompts, params) == outputs(plain, prompts, params)
    assert speculative.stats()["num_preemptions"] > 0
    assert_speculated(speculative)


def test_sequences_that_do_not_speculate_run_beside_those_that_do(plain_llama, speculative_llama):
    prompts = repetitive_prompts(6, count=3)
    mixed = [
        GREEDY,
        SamplingParams(max_tokens=20, temperature=0.9, n=2, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=12, beam_width=3, temperature=0.0, ignore_eos=True),
    ]
    for _ in range(2):  # the second run also hits the prefix cache
        got = [o.outputs for o in speculative_llama.generate(prompts, mixed)]
        want = [o.outputs for o in plain_llama.generate(prompts, mixed)]
        assert [[c.token_ids for c in cs] for cs in got] == [
            [c.token_ids for c in cs] for cs in want
        ]


def test_disable_by_batch_size_leaves_a_large_batch_unspeculated(tiny_model_dirs, plain_llama):
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=256,
        speculative_config={**SPECULATIVE, "disable_by_batch_size": 4},
    )
    prompts = repetitive_prompts(8)
    assert outputs(llm, prompts, GREEDY) == outputs(plain_llama, prompts, GREEDY)
    assert llm.stats()["num_draft_tokens"] == 0  # six running from the second step on
    assert outputs(llm, prompts[:3], GREEDY) == outputs(plain_llama, prompts[:3], GREEDY)
    assert llm.stats()["num_draft_tokens"] > 0


@pytest.mark.slow
def test_across_processes_and_tensor_parallel_ranks(tiny_model_dirs, plain_llama):
    prompts = repetitive_prompts(7)
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=2, allowed_token_ids=FEW)
    want = outputs(plain_llama, prompts, params) + outputs(plain_llama, prompts, GREEDY)
    for size in (1, 2):
        llm = LLM(
            tiny_model_dirs["llama"],
            num_blocks=128,
            multiprocess=True,
            tensor_parallel_size=size,
            speculative_config=SPECULATIVE,
        )
        try:
            assert outputs(llm, prompts, params) + outputs(llm, prompts, GREEDY) == want
            assert_speculated(llm)
        finally:
            llm.shutdown()


@pytest.fixture(scope="module")
def byte_model_dir(byte_level_llama_dir) -> Path:
    """The tiny Llama with a byte-level tokenizer: grammars force many tokens."""
    return byte_level_llama_dir


def test_structured_output_speculates_on_forced_and_looked_up_tokens(byte_model_dir):
    """Under a grammar the drafts are the tokens it forces (then prompt lookup), each
    position sampled under its own mask: the output is plain decoding's, and a JSON schema's
    keys and punctuation come as accepted drafts."""
    speculative = LLM(byte_model_dir, num_blocks=128, speculative_config=SPECULATIVE)
    plain = LLM(byte_model_dir, num_blocks=128)
    constraints = {
        **CONSTRAINTS,
        "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    }
    for kind, constraint in constraints.items():
        for sampling in (
            dict(temperature=0.0),
            dict(temperature=0.8, seed=3),
            dict(temperature=0.0, repetition_penalty=1.2, min_tokens=4),
        ):
            params = SamplingParams(max_tokens=64, structured_outputs=constraint, **sampling)
            before = speculative.stats()["num_accepted_tokens"]
            got = outputs(speculative, STRUCTURED_PROMPTS, params)
            assert got == outputs(plain, STRUCTURED_PROMPTS, params), (kind, sampling)
            if kind in ("json", "choice"):  # forced keys, punctuation, choice tails
                assert speculative.stats()["num_accepted_tokens"] > before, (kind, sampling)
    stats = speculative.stats()
    assert stats["num_accepted_tokens"] / stats["num_draft_tokens"] > 0.5, stats


def test_stop_strings_inside_accepted_drafts_cut_the_text_there(byte_model_dir):
    speculative = LLM(byte_model_dir, num_blocks=128, speculative_config=SPECULATIVE)
    plain = LLM(byte_model_dir, num_blocks=128)
    prompts = [[100, 101, 102] * 6, [300, 301, 302], list(b"the cat and the dog and the cat ")]
    long = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    free = plain.generate(prompts, long)
    # A two-character string each output writes late: it may end inside a step's drafts.
    stops = sorted({o.outputs[0].text[-6:-4] for o in free})
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, stop=stops)
    got = speculative.generate(prompts, params)
    want = plain.generate(prompts, params)
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in got] == [
        (o.outputs[0].text, o.outputs[0].token_ids) for o in want
    ]
    assert all(o.outputs[0].stop_reason in stops for o in got)
    assert speculative.stats()["num_accepted_tokens"] > 0


def test_a_looked_up_draft_the_grammar_refuses_changes_nothing(byte_model_dir):
    """Whatever two letters the output ends with, the prompt says "x" comes next, which the
    grammar refuses: the draft is dropped and decoding goes on as plain decoding does (an
    early version left the grammar broken by checking such a draft: the output then ended
    with EOS, or with the one token the engine stops at as outside its grammar)."""
    speculative = LLM(byte_model_dir, num_blocks=128, speculative_config=SPECULATIVE)
    plain = LLM(byte_model_dir, num_blocks=128)
    prompt = [3 + byte for byte in b"abxbaxaaxbbx"]
    params = SamplingParams(
        max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]+")
    )
    got = speculative.generate([prompt], params)[0].outputs[0]
    want = plain.generate([prompt], params)[0].outputs[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert len(want.token_ids) > 2
    assert speculative.stats()["num_draft_tokens"] > 0
