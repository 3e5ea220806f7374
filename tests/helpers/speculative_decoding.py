"""What the speculative decoding tests share: the prompt-lookup config, prompts that repeat
(so lookups hit), outputs to compare, and the checks that drafts were proposed and accepted."""

from __future__ import annotations

import random

import pytest

from helpers.parity import GREEDY, NEW_TOKENS
from pagedserve.frontend import LLM, SamplingParams

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Random samples repeat themselves (so drafts get accepted, and rejected) when few tokens
# are allowed.
FEW = list(range(10, 14))


def repetitive_prompts(seed: int, count: int = 6) -> list[list[int]]:
    """Random prompts, some repeating a random phrase: lookups hit both in the prompt
    and in the tiny models' greedy output, which soon cycles."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 12))]
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))]
        prompts.append(prompt + phrase * (index % 3) + phrase[: index % 4])
    return prompts


def outputs(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    """Each output's tokens and finish reason."""
    return [
        (list(c.token_ids), c.finish_reason)
        for output in llm.generate(prompts, params)
        for c in output.outputs
    ]


def assert_same_tokens_and_logprobs(got, want) -> None:
    """Two runs' outputs (``generate``'s lists): the same tokens, the same top logprobs."""
    for got_output, want_output in zip(got, want, strict=True):
        assert got_output.outputs[0].token_ids == want_output.outputs[0].token_ids
        pairs = zip(got_output.outputs[0].logprobs, want_output.outputs[0].logprobs, strict=True)
        for got_entry, want_entry in pairs:
            assert got_entry.keys() == want_entry.keys()
            for token_id, logprob in want_entry.items():
                assert got_entry[token_id] == pytest.approx(logprob, abs=1e-4)


def assert_speculated(llm: LLM) -> None:
    """Drafts were proposed, and some but not all were accepted."""
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0, stats
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats


def check_stops_inside_accepted_drafts(plain: LLM, speculative: LLM, prompts) -> None:
    """A stop token, or max_tokens, inside a step's accepted drafts ends the output there."""
    free = outputs(plain, prompts, GREEDY)
    # Stop on a token each output generates late: it may arrive as an accepted draft.
    stops = sorted({tokens[-5] for tokens, _ in free})
    stopped = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=stops)
    got = outputs(speculative, prompts, stopped)
    assert got == outputs(plain, prompts, stopped)
    assert all(reason == "stop" and len(tokens) < NEW_TOKENS for tokens, reason in got)
    for max_tokens in (13, 2, 1):  # drafts never run past max_tokens
        short = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        got = outputs(speculative, prompts, short)
        assert got == [(tokens[:max_tokens], "length") for tokens, _ in free]
