"""Sequences that share KV blocks: parallel samples, best_of and beam search.

Beam search is checked against HF transformers' own beam search on the same weights
(float32); the block integrity check (tests/conftest.py) runs after every test.
"""

from __future__ import annotations

import collections
import json
import random
import shutil

import pytest
import torch
import transformers

from helpers.parity import prompts_for
from pagedserve.frontend import LLM, SamplingParams


def hf_beam_search(model, prompt: list[int], params: SamplingParams, eos: int) -> list[list[int]]:
    """HF's beams for one prompt, each cut after its first EOS or stop token (what follows
    is padding)."""
    return hf_beam_search_steps(model, prompt, params, eos)[0]


def hf_beam_search_steps(
    model, prompt: list[int], params: SamplingParams, eos: int
) -> tuple[list[list[int]], int]:
    """hf_beam_search, and how many steps HF's search ran. The settings HF has logits
    processors for go to them: repetition_penalty, min_tokens, logit_bias (as a sequence
    bias of one token each) and bad_words_token_ids."""
    ends = [eos, *params.stop_token_ids]
    processors = {}
    if params.repetition_penalty != 1.0:
        processors["repetition_penalty"] = params.repetition_penalty
    if params.min_tokens:
        processors["min_new_tokens"] = params.min_tokens
    if params.logit_bias:
        processors["sequence_bias"] = {(t,): bias for t, bias in params.logit_bias.items()}
    if params.bad_words_token_ids:
        processors["bad_words_ids"] = params.bad_words_token_ids
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            num_beams=params.beam_width,
            num_return_sequences=params.n,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=ends,
            **processors,
        )
    beams = []
    for row in generated[:, len(prompt) :].tolist():
        end = next((i for i, token in enumerate(row) if token in ends), None)
        beams.append(row if end is None else row[: end + 1])
    return beams, generated.shape[1] - len(prompt)


@pytest.fixture(scope="module")
def beam_model_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny Llama with an EOS token its beams actually produce, so hypotheses end
    by EOS as well as by length: the EOS is a token HF's best beam emits early on."""
    path = tmp_path_factory.mktemp("beam") / "llama"
    shutil.copytree(tiny_model_dirs["llama"], path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = prompts_for(0)[1]
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            num_beams=4,
            max_new_tokens=8,
            eos_token_id=None,
        )
    eos = generated[0, len(prompt) + 4].item()
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": eos, "bos_token_id": 1})
    )
    return path, eos


@pytest.fixture(scope="module")
def beam_hf_model(beam_model_dir):
    path, _ = beam_model_dir
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


BEAM_CASES = {
    "w4-default": SamplingParams(beam_width=4, n=4, temperature=0.0, max_tokens=12),
    "w2-early": SamplingParams(
        beam_width=2, n=2, temperature=0.0, max_tokens=12, early_stopping=True
    ),
    "w4-never-lp2": SamplingParams(
        beam_width=4,
        n=3,
        temperature=0.0,
        max_tokens=10,
        early_stopping="never",
        length_penalty=2.0,
    ),
    "w3-lp0.5": SamplingParams(
        beam_width=3, n=1, temperature=0.0, max_tokens=14, length_penalty=0.5
    ),
}


@pytest.mark.parametrize("case", list(BEAM_CASES))
def test_beam_search_matches_hf(beam_model_dir, beam_hf_model, case):
    path, eos = beam_model_dir
    params = BEAM_CASES[case]
    prompts = prompts_for(0)
    llm = LLM(path, block_size=8, num_blocks=256)
    outputs = llm.generate(prompts, params)
    finish_reasons = set()
    for prompt, output in zip(prompts, outputs):
        assert [c.token_ids for c in output.outputs] == hf_beam_search(
            beam_hf_model, prompt, params, eos
        )
        finish_reasons.update(c.finish_reason for c in output.outputs)
    if case == "w4-default":
        # Both ways a hypothesis ends are exercised.
        assert finish_reasons == {"stop", "length"}


def test_beams_rank_by_processed_log_probs_as_hf(beam_model_dir, beam_hf_model):
    """A repetition penalty, min_tokens, a logit bias and a bad word each change the beams,
    and each as HF's processors change its beams."""
    path, eos = beam_model_dir
    prompts = prompts_for(0)
    llm = LLM(path, block_size=8, num_blocks=256)
    base = dict(beam_width=3, n=2, temperature=0.0, max_tokens=12)
    plain = [
        [c.token_ids for c in o.outputs] for o in llm.generate(prompts, SamplingParams(**base))
    ]
    # A token the best beams say that is not EOS (a one-token bad word: HF, which also
    # matches a word's first tokens against the prompt, bans it as the engine does).
    said = next(t for beams in plain for t in beams[0] if t != eos)
    cases = {
        "penalty-and-min-tokens": SamplingParams(**base, repetition_penalty=1.8, min_tokens=7),
        "logit-bias": SamplingParams(**base, logit_bias={said: -3.0, 300: 2.5}),
        "bad-word": SamplingParams(**base, bad_words_token_ids=[[said]]),
    }
    for name, params in cases.items():
        outputs = llm.generate(prompts, params)
        beams = [[c.token_ids for c in output.outputs] for output in outputs]
        assert beams != plain, name
        for prompt, got in zip(prompts, beams):
            assert got == hf_beam_search(beam_hf_model, prompt, params, eos), (name, prompt)
        if name == "penalty-and-min-tokens":
            assert all(eos not in beam[:7] for output in beams for beam in output)
        if name == "bad-word":
            assert all(said not in beam for output in beams for beam in output)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_survives_preemption(beam_model_dir, beam_hf_model, mode):
    path, eos = beam_model_dir
    params = BEAM_CASES["w4-default"]
    prompts = prompts_for(0)
    # 4 beams x 5 blocks each at most; 4 requests at once need far more than 24 blocks.
    llm = LLM(path, block_size=8, num_blocks=24, preemption_mode=mode)
    outputs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, output in zip(prompts, outputs):
        assert [c.token_ids for c in output.outputs] == hf_beam_search(
            beam_hf_model, prompt, params, eos
        )


def _token_ids(outputs) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


def test_parallel_samples_share_the_prompt_and_reproduce(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=256)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    prompts = prompts_for(2)
    first = _token_ids(llm.generate(prompts, params))
    assert first == _token_ids(llm.generate(prompts, params))
    for samples in first:
        assert len(samples) == 4 and all(len(sample) == 12 for sample in samples)
        assert len({tuple(sample) for sample in samples}) == 4  # distinct draws
    # The same request alone, or beside other requests, draws the same samples.
    alone = _token_ids(llm.generate(prompts[2], params))
    assert alone[0] == first[2]
    mixed = llm.generate(
        [prompts[2], prompts[0]], [params, SamplingParams(temperature=0.7, max_tokens=5)]
    )
    assert _token_ids(mixed)[0] == first[2]
    # Sample 0 is what n=1 with the same seed draws.
    single = llm.generate(
        prompts[2], SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    )
    assert single[0].outputs[0].token_ids == first[2][0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_samples_survive_preemption(tiny_model_dirs, mode):
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    prompts = prompts_for(3)
    roomy = LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=256)
    expected = _token_ids(roomy.generate(prompts, params))
    tight = LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=28, preemption_mode=mode)
    assert _token_ids(tight.generate(prompts, params)) == expected
    stats = tight.stats()
    assert stats[f"num_{mode}_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_groups_swap_by_default(tiny_model_dirs):
    """The paper's default: a single sequence is recomputed, a group is swapped."""
    llm = LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=28)
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    llm.generate(prompts_for(3), params)
    assert llm.stats()["num_swap_preemptions"] > 0


def test_best_of_returns_the_most_likely_samples(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=256)
    prompt = prompts_for(4)[2]
    all_samples = llm.generate(
        prompt, SamplingParams(n=5, temperature=1.0, seed=9, max_tokens=8, logprobs=0)
    )[0].outputs
    best = llm.generate(
        prompt, SamplingParams(n=2, best_of=5, temperature=1.0, seed=9, max_tokens=8, logprobs=0)
    )[0].outputs
    ranked = sorted(all_samples, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]
    for completion in best:
        assert completion.cumulative_logprob == pytest.approx(
            sum(entry[token] for entry, token in zip(completion.logprobs, completion.token_ids))
        )


def test_mixed_sharing_under_forced_preemption(beam_model_dir, tiny_model_dirs):
    """Beams, parallel samples, plain requests and prefix hits in one run with a cache
    too small for them: same tokens as with room, and every block back at the end."""
    path, _ = beam_model_dir
    prompts = prompts_for(6, lengths=[20, 20, 9, 33, 12, 25])
    prompts[1][:16] = prompts[0][:16]  # a shared prefix of two full blocks
    params = [
        SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=10),
        SamplingParams(n=3, temperature=0.9, seed=1, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(n=2, best_of=3, temperature=1.0, seed=2, max_tokens=9),
        SamplingParams(beam_width=2, temperature=0.0, max_tokens=12, early_stopping=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=11),
    ]
    expected = _token_ids(LLM(path, block_size=8, num_blocks=512).generate(prompts, params))
    for mode in (None, "recompute", "swap"):
        llm = LLM(path, block_size=8, num_blocks=20, preemption_mode=mode)
        assert _token_ids(llm.generate(prompts, params)) == expected, mode
        assert llm.stats()["num_preemptions"] > 0
        llm.check_integrity()


def test_bad_sharing_parameters_are_rejected(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"best_of \(2\) must be >= n \(3\)"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match=r"n \(5\) must be <= beam_width \(4\)"):
        SamplingParams(beam_width=4, n=5, temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be 0"):
        SamplingParams(beam_width=4)
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'"):
        SamplingParams(beam_width=2, temperature=0.0, early_stopping="sometimes")
    llm = LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=16, max_num_seqs=4)
    with pytest.raises(ValueError, match="runs 8 sequences .* max_num_seqs is 4"):
        llm.generate([1, 2, 3], SamplingParams(n=8, max_tokens=4))
    with pytest.raises(ValueError, match=r"x 4 sequences = 20 blocks .* 16 blocks"):
        llm.generate([1, 2, 3], SamplingParams(n=4, max_tokens=37))


def test_copy_on_write_leaves_the_siblings_cache_unchanged(tiny_model_dirs):
    """Two samples share the prompt's last, partly filled block; the first to write
    into it gets a copy, and the other's cached K/V stay as they were."""
    llm = LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=64)
    core, kv_cache = llm.engine, llm.engine.executor.kv_cache
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    core.add_request("r", prompts_for(7, lengths=[12])[0], params, llm.eos_token_ids)
    core.step()  # the prompt's prefill: 12 tokens, block 1 holds tokens 8..11
    tables = core.block_manager.block_tables
    assert tables["r"] == tables["r#1"]
    shared = tables["r"][1]
    before = kv_cache[shared].clone()
    first_tokens = [seq.token_ids[12] for seq in core.scheduler.requests.values()]
    assert first_tokens[0] != first_tokens[1]

    plan = core.scheduler.schedule()
    assert len(plan.copy_blocks) == 1
    source, copy = plan.copy_blocks[0]
    assert source == shared
    result = core.executor.execute(plan)
    core.scheduler.update_from_output(plan, result)
    writer = next(rid for rid, table in tables.items() if table[1] == copy)
    sibling = next(rid for rid, table in tables.items() if table[1] == shared)
    assert {writer, sibling} == {"r", "r#1"}
    # Slots 0..3 (tokens 8..11): the sibling's unchanged, the copy identical.
    assert torch.equal(kv_cache[shared][..., :4, :], before[..., :4, :])
    assert torch.equal(kv_cache[copy][..., :4, :], before[..., :4, :])
    # Slot 4 (token 12): each wrote its own token's K/V into its own block.
    assert not torch.equal(kv_cache[copy][..., 4, :], kv_cache[shared][..., 4, :])
    while core.has_unfinished_requests():
        core.step()


@pytest.mark.slow
def test_embedded_model_beam_search_matches_hf(embedded_model_dir):
    llm = LLM(kv_cache_bytes=256 << 20)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]
    prompts = [llm.tokenizer.encode(text) for text in texts]
    params = SamplingParams(beam_width=4, n=4, temperature=0.0, max_tokens=16)
    outputs = llm.generate(prompts, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        embedded_model_dir, dtype=torch.float32
    )
    (eos,) = llm.eos_token_ids
    for prompt, output in zip(prompts, outputs):
        assert [c.token_ids for c in output.outputs] == hf_beam_search(model, prompt, params, eos)


def test_reservation_policies_give_the_same_tokens_and_waste_more(tiny_model_dirs):
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(5, 60))] for _ in range(16)]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(5, 70))
        for _ in prompts
    ]
    utilization = {}
    expected = None
    for policy in ("paged", "max", "pow2", "oracle"):
        llm = LLM(
            tiny_model_dirs["llama"],
            block_size=8,
            num_blocks=100,
            max_model_len=256,
            allocation_policy=policy,
        )
        tokens = _token_ids(llm.generate(prompts, params))
        expected = expected or tokens
        assert tokens == expected, policy
        stats = llm.stats()
        utilization[policy] = stats["kv_utilization"]
        fractions = [value for key, value in stats.items() if key.endswith("_fraction")]
        assert sum(fractions) + stats["kv_utilization"] == pytest.approx(1.0)
    assert utilization["paged"] > 0.9
    assert utilization["paged"] > utilization["oracle"] > utilization["pow2"] > utilization["max"]


def test_reservation_policies_reject_what_they_cannot_do(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=64, allocation_policy="oracle")
    with pytest.raises(ValueError, match="shares no blocks.*need allocation_policy 'paged'"):
        llm.generate([1, 2, 3], SamplingParams(n=2, max_tokens=4))
    with pytest.raises(ValueError, match="allocation_policy must be one of paged, max"):
        LLM(tiny_model_dirs["llama"], allocation_policy="buddy")
    with pytest.raises(ValueError, match=r"reserves max_model_len \(512 tokens = 64 blocks\)"):
        LLM(tiny_model_dirs["llama"], block_size=8, num_blocks=32, allocation_policy="max")


def test_sharing_in_multiprocess_mode_matches_in_process(beam_model_dir):
    path, _ = beam_model_dir
    prompts = prompts_for(8, lengths=[6, 19])
    params = [
        SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=9, logprobs=1),
        SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=9),
    ]
    expected = LLM(path, block_size=8, num_blocks=64).generate(prompts, params)
    llm = LLM(path, block_size=8, num_blocks=64, multiprocess=True)
    try:
        outputs = llm.generate(prompts, params)
        assert _token_ids(outputs) == _token_ids(expected)
        # The same tokens; the log-probabilities to float32 rounding only: requests reach the
        # engine process over ZeroMQ and may start in different steps, and a float32 GEMM's
        # last bits depend on how many rows share it (which kernel, which reduction order).
        # Summed over nine tokens that reached 1.3e-5 relative on an Intel Xeon (session 20,
        # 1 run in 3); a different token anywhere would move it by far more.
        for got, want in zip(outputs, expected):
            assert [c.cumulative_logprob for c in got.outputs] == pytest.approx(
                [c.cumulative_logprob for c in want.outputs], rel=1e-4
            )
        stats = llm.stats()
        assert stats["kv_sharing_savings"] > 0
        llm.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beam_search_that_fills_its_finished_hypotheses_matches_hf(
    beam_model_dir, beam_hf_model, early_stopping
):
    """A stop token the model emits often: beam_width hypotheses finish while beams still
    run, so the search ends on HF's rule for early_stopping (no running beam can beat the
    worst finished one, or at once, or never)."""
    path, eos = beam_model_dir
    prompts = prompts_for(0)
    # The stop token: the one HF's best beam for one prompt repeats most, searching
    # without stops (9 times in 30 here, and the other prompts' beams reach it too).
    with torch.no_grad():
        best = beam_hf_model.generate(
            torch.tensor([prompts[2]]),
            do_sample=False,
            num_beams=3,
            max_new_tokens=30,
            eos_token_id=None,
        )[0, len(prompts[2]) :].tolist()
    frequent = collections.Counter(token for token in best if token != eos).most_common(1)[0][0]
    params = SamplingParams(
        beam_width=3,
        n=3,
        temperature=0.0,
        max_tokens=30,
        stop_token_ids=[frequent],
        early_stopping=early_stopping,
    )
    llm = LLM(path, block_size=8, num_blocks=256)
    outputs = llm.generate(prompts, params)
    hf_steps = []
    for prompt, output in zip(prompts, outputs):
        expected, steps = hf_beam_search_steps(beam_hf_model, prompt, params, eos)
        assert [c.token_ids for c in output.outputs] == expected
        hf_steps.append(steps)
    # The search ended at the same step as HF's: one row sampled at the prompt's end, then
    # one per beam per step.
    assert llm.stats()["num_sampled_tokens"] == sum(1 + 3 * (steps - 1) for steps in hf_steps)
