"""Sampling through the whole engine: seeds survive batching and preemption, logprobs
match HF's log_softmax, every parameter reaches the sampler."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from pagedserve.frontend import LLM, SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79] * 7, list(range(40, 100)), [7] * 25]


def sampled_params(seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=40, temperature=0.8, top_k=50, top_p=0.9, seed=seed, ignore_eos=True
    )


def test_seeded_samples_survive_preemption_in_both_modes(tiny_model_dirs):
    roomy = LLM(tiny_model_dirs["llama"], num_blocks=256)
    params = [sampled_params(100 + i) for i in range(len(PROMPTS))]
    expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params)]
    for mode in ("recompute", "swap"):
        tight = LLM(
            tiny_model_dirs["llama"],
            num_blocks=9,
            max_num_batched_tokens=32,
            preemption_mode=mode,
        )
        got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, params)]
        assert got == expected, mode
        assert tight.stats()[f"num_{mode}_preemptions"] > 0


def test_logprobs_match_hf_log_softmax(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    llm = LLM(path, num_blocks=128, max_num_batched_tokens=16)  # chunked prompt scoring
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    output = llm.generate([PROMPTS[2]], params)[0]
    completion = output.outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sequence = torch.tensor([PROMPTS[2] + completion.token_ids])
    with torch.no_grad():
        reference = torch.log_softmax(model(sequence).logits[0].float(), dim=-1)
    prompt_len = len(PROMPTS[2])

    assert len(completion.logprobs) == 12
    for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[prompt_len - 1 + step]
        assert entry[token_id] == pytest.approx(row[token_id].item(), abs=1e-4)
        top = row.topk(5)
        assert set(entry) >= set(top.indices.tolist())
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(
        sum(entry[t] for t, entry in zip(completion.token_ids, completion.logprobs)), abs=1e-4
    )

    assert len(output.prompt_logprobs) == prompt_len
    assert output.prompt_logprobs[0] is None
    for position in range(1, prompt_len):
        entry = output.prompt_logprobs[position]
        token_id = PROMPTS[2][position]
        expected = reference[position - 1, token_id].item()
        assert entry[token_id] == pytest.approx(expected, abs=1e-4)
        assert len(entry) >= 3


def test_prompt_logprobs_are_reported_once_across_recompute(tiny_model_dirs):
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=9,
        max_num_batched_tokens=32,
        preemption_mode="recompute",
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    assert llm.stats()["num_recompute_preemptions"] > 0
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output.prompt_logprobs) == len(prompt)


def test_prompt_logprobs_of_a_cached_prefix_are_all_reported(tiny_model_dirs):
    """A prompt whose prefix is in the cache still gets a logprob for every position, the
    same as on a fresh engine: it does not read the cache (and others still can)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    prompt = PROMPTS[2] + [5, 6, 7]
    fresh = LLM(tiny_model_dirs["llama"], num_blocks=64).generate([prompt], params)[0]
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64)
    llm.generate([PROMPTS[2]], SamplingParams(max_tokens=4, temperature=0.0))  # caches it
    cached = llm.generate([prompt], params)[0]
    assert len(cached.prompt_logprobs) == len(prompt)
    assert cached.prompt_logprobs == fresh.prompt_logprobs
    assert cached.num_cached_tokens == 0
    # Without prompt logprobs the same prompt reads the cache.
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert plain.num_cached_tokens >= 48


def test_min_tokens_and_stop_token_ids(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64)
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0))[0]
    tokens = greedy.outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    stopped = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at])
    )[0].outputs[0]
    assert stopped.token_ids == tokens[: first + 1] and stopped.finish_reason == "stop"
    held = llm.generate(
        PROMPTS[0],
        SamplingParams(
            max_tokens=20, temperature=0.0, stop_token_ids=[stop_at], min_tokens=first + 2
        ),
    )[0].outputs[0]
    # The stop token is masked until min_tokens are out, so the path changes there.
    assert held.token_ids[:first] == tokens[:first]
    assert stop_at not in held.token_ids[: first + 2]
    assert len(held.token_ids) >= first + 3


def test_repetition_penalty_changes_a_repetitive_greedy_path(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64)
    plain = llm.generate(PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.0))[0]
    penalized = llm.generate(
        PROMPTS[3],
        SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=5.0),
    )[0]
    plain_tokens = plain.outputs[0].token_ids
    penalized_tokens = penalized.outputs[0].token_ids
    assert penalized_tokens != plain_tokens
    # A strong repetition penalty steers away from the prompt's token 7.
    assert 7 not in penalized_tokens


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("top_p", 0.0, "top_p must be > 0.0 and <= 1.0, got 0.0"),
        ("top_k", -2, "top_k must be >= -1, got -2"),
        ("min_p", 1.5, "min_p must be >= 0.0 and <= 1.0, got 1.5"),
        ("logprobs", -1, "logprobs must be >= 0, got -1"),
        ("prompt_logprobs", -1, "prompt_logprobs must be >= 0, got -1"),
        ("presence_penalty", 3.0, "presence_penalty must be >= -2.0 and <= 2.0, got 3.0"),
        ("repetition_penalty", 0.0, "repetition_penalty must be >= 0.01 and <= 100.0, got 0.0"),
        ("min_tokens", 50, r"min_tokens \(50\) must be <= max_tokens \(16\)"),
    ],
)
def test_bad_sampling_values_name_field_value_and_limit(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_max_logprobs_bounds_what_a_request_may_ask(tiny_model_dirs):
    """vLLM's max_logprobs: 20 unless the engine is told otherwise; -1 is the vocabulary."""
    path = tiny_model_dirs["llama"]
    default = LLM(path, num_blocks=64)
    with pytest.raises(
        ValueError,
        match=r"sampling_params.logprobs must be <= 20 \(the engine's max_logprobs\), got 21",
    ):
        default.generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=21))
    wide = LLM(path, num_blocks=64, max_logprobs=40)
    (output,) = wide.generate(
        PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, logprobs=40, prompt_logprobs=40)
    )
    # The 40 most likely tokens, and the chosen one when it is not among them.
    assert all(len(entry) in (40, 41) for entry in output.outputs[0].logprobs)
    assert all(len(entry) in (40, 41) for entry in output.prompt_logprobs[1:])
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= 40 .*, got 41"):
        wide.generate(PROMPTS[0], SamplingParams(max_tokens=2, prompt_logprobs=41))
    everything = LLM(path, num_blocks=64, max_logprobs=-1)
    assert everything.max_logprobs == 512  # the tiny model's vocabulary
    (output,) = everything.generate(PROMPTS[0], SamplingParams(max_tokens=1, logprobs=512))
    (entry,) = output.outputs[0].logprobs
    assert len(entry) == 512
    assert math.fsum(math.exp(value) for value in entry.values()) == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, or -1"):
        LLM(path, num_blocks=64, max_logprobs=-2)


def hf_greedy_with(path, prompt: list[int], num_tokens: int, adjust) -> list[int]:
    """HF's greedy path with ``adjust(logits)`` applied to each step's float32 logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            adjust(logits)
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_logit_bias_and_allowed_token_ids_match_hf_with_the_same_adjustment(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    llm = LLM(path, num_blocks=64)
    plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))[0]
    favourite = plain.outputs[0].token_ids[0]
    bias = {favourite: -100.0, 300: 4.0, 301: 3.5}
    allowed = [5, 17, 300, 301, 302, 450]

    def biased(logits):
        for token_id, value in bias.items():
            logits[token_id] += value

    def restricted(logits):
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[allowed] = True
        logits.masked_fill_(~keep, float("-inf"))

    base = dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    with_bias, with_allowed = llm.generate(
        [PROMPTS[0], PROMPTS[0]],
        [
            SamplingParams(**base, logit_bias=bias),
            SamplingParams(**base, allowed_token_ids=allowed),
        ],
    )
    assert with_bias.outputs[0].token_ids == hf_greedy_with(path, PROMPTS[0], 12, biased)
    assert favourite not in with_bias.outputs[0].token_ids
    assert with_allowed.outputs[0].token_ids == hf_greedy_with(path, PROMPTS[0], 12, restricted)
    assert set(with_allowed.outputs[0].token_ids) <= set(allowed)
    # Logprobs stay those of the unadjusted distribution.
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([PROMPTS[0]])).logits[0, -1].float(), dim=-1)
    for completion in (with_bias.outputs[0], with_allowed.outputs[0]):
        first_token = completion.token_ids[0]
        assert completion.logprobs[0][first_token] == pytest.approx(
            raw[first_token].item(), abs=1e-4
        )


def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=16)
    with pytest.raises(
        ValueError, match=r"sampling_params.logit_bias: token id 512 is outside the vocabulary"
    ):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={512: 1.0}))
    with pytest.raises(ValueError, match=r"sampling_params.allowed_token_ids: token id 9999"):
        llm.generate(PROMPTS[0], SamplingParams(allowed_token_ids=[1, 9999]))
