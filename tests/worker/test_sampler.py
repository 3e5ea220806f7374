"""Each sampling parameter against a reference computation on fixed logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.sampler_batches import VOCAB, fixed_logits, make_batch
from pagedserve.gpu_worker.sampler import Sampler, apply_penalties, request_uniforms


def reference_draw(probs: np.ndarray, uniform: float) -> int:
    """Inverse CDF in the given order: the first bucket whose running sum exceeds u."""
    cdf = np.cumsum(probs.astype(np.float64))
    return int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax():
    logits = fixed_logits(5)
    out = Sampler()(logits.clone(), make_batch(5))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draw_matches_reference(temperature):
    rows = 6
    logits = fixed_logits(rows, 1)
    batch = make_batch(rows, temperatures=np.full(rows, temperature))
    got = Sampler()(logits.clone(), batch).token_ids.tolist()
    uniforms = request_uniforms(batch.seeds, batch.output_positions)
    expected = [
        reference_draw(softmax(logits[r].numpy() / temperature), uniforms[r]) for r in range(rows)
    ]
    assert got == expected


def test_top_k_keeps_only_the_k_most_likely():
    rows = 200
    logits = fixed_logits(1, 2).repeat(rows, 1)
    batch = make_batch(
        rows,
        temperatures=np.full(rows, 1.0),
        top_k=np.full(rows, 3),
        seeds=np.arange(rows, dtype=np.uint64),
    )
    got = set(Sampler()(logits.clone(), batch).token_ids.tolist())
    top3 = set(logits[0].topk(3).indices.tolist())
    assert got == top3  # 200 draws hit all three and nothing else


def test_top_k_and_top_p_match_the_sorted_reference():
    rows = 8
    logits = fixed_logits(rows, 3)
    top_k = np.array([0, 5, 10, 0, 3, 64, 1, 7])
    top_p = np.array([0.5, 1.0, 0.9, 0.3, 0.8, 0.95, 1.0, 0.6], dtype=np.float32)
    temperature = 0.8
    batch = make_batch(rows, temperatures=np.full(rows, temperature), top_k=top_k, top_p=top_p)
    got = Sampler()(logits.clone(), batch).token_ids.tolist()
    uniforms = request_uniforms(batch.seeds, batch.output_positions)
    for r in range(rows):
        scaled = logits[r].numpy().astype(np.float64) / temperature
        order = np.argsort(-scaled, kind="stable")
        values = scaled[order]
        if top_k[r] > 0:
            values[top_k[r] :] = -np.inf
        probs = softmax(values)
        mass_before = np.cumsum(probs) - probs
        probs[mass_before >= top_p[r]] = 0.0
        assert got[r] == order[reference_draw(probs, uniforms[r])], r


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :4] = torch.tensor([5.0, 4.5, 1.0, 0.0])  # probs ~0.62, 0.38, 0.01, 0.004
    rows = 300
    batch = make_batch(
        rows,
        temperatures=np.ones(rows),
        min_p=np.full(rows, 0.1),
        seeds=np.arange(rows, dtype=np.uint64),
    )
    got = Sampler()(logits.repeat(rows, 1), batch).token_ids.tolist()
    assert set(got) == {0, 1}


def test_repetition_presence_and_frequency_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.25, 0.0]])
    batch = make_batch(
        1,
        penalty_rows=[0],
        repetition_penalties=[2.0],
        presence_penalties=[0.5],
        frequency_penalties=[0.25],
        penalty_prompt_tokens=[np.array([0, 1])],
        penalty_output_tokens=[np.array([3, 3, 2])],
    )
    penalized = logits.clone()
    apply_penalties(penalized, batch)
    # repetition: positive / 2, negative * 2 on prompt+output tokens {0,1,2,3}; then
    # output counts {3: 2, 2: 1} pay frequency * count + presence.
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.25 - 0.5, 3.0 / 2 - 0.5 - 0.5, 1.25, 0.0]
    assert penalized[0].tolist() == pytest.approx(expected)
    # Greedy picks from the penalized logits: token 3 lost its lead.
    assert Sampler()(logits.clone(), batch).token_ids.tolist() == [4]


def test_min_tokens_bans_stop_and_eos_tokens():
    logits = torch.tensor([[0.0, 9.0, 5.0, 1.0]])
    batch = make_batch(1, banned_rows=[0], banned_token_ids=[np.array([1])])
    assert Sampler()(logits.clone(), batch).token_ids.tolist() == [2]


def test_logprobs_are_the_raw_log_softmax_with_top_k():
    rows = 3
    logits = fixed_logits(rows, 4)
    batch = make_batch(
        rows,
        temperatures=np.array([0.0, 1.5, 0.0]),
        num_logprobs=np.array([2, 5, -1]),
        penalty_rows=[0],
        repetition_penalties=[1.3],
        presence_penalties=[0.0],
        frequency_penalties=[0.0],
        penalty_prompt_tokens=[np.array([1, 2, 3])],
        penalty_output_tokens=[np.array([], dtype=np.int64)],
    )
    out = Sampler()(logits.clone(), batch)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for r in range(2):
        chosen = out.token_ids[r]
        assert out.logprob_token_ids[r, 0] == chosen
        assert out.logprobs[r, 0].item() == pytest.approx(reference[r, chosen].item(), abs=1e-4)
        k = int(batch.num_logprobs[r])
        expected_ids = reference[r].topk(k).indices.tolist()
        assert out.logprob_token_ids[r, 1 : k + 1].tolist() == expected_ids
        assert torch.allclose(
            out.logprobs[r, 1 : k + 1].double(), reference[r].topk(k).values, atol=1e-4
        )


def test_uniforms_depend_only_on_seed_and_position():
    seeds = np.array([1, 2, 1], dtype=np.uint64)
    positions = np.array([0, 0, 1])
    u = request_uniforms(seeds, positions)
    assert len(set(u.tolist())) == 3 and ((u >= 0) & (u < 1)).all()
    assert request_uniforms(seeds[:1], positions[:1])[0] == u[0]
    draws = request_uniforms(np.full(20000, 7, np.uint64), np.arange(20000))
    assert abs(draws.mean() - 0.5) < 0.01  # roughly uniform


def bitmask_rows(allowed: list[list[int]], vocab: int = VOCAB) -> np.ndarray:
    """Rows of allowed-token bits as the scheduler sends them (little-endian int32 words)."""
    words = (vocab + 31) // 32
    bits = np.zeros((len(allowed), words * 32), dtype=np.uint8)
    for row, ids in enumerate(allowed):
        bits[row, ids] = 1
    return np.packbits(bits, axis=1, bitorder="little")


def test_grammar_masks_restrict_greedy_and_random_rows_to_allowed_tokens():
    logits = fixed_logits(4, seed=3)
    allowed = [[5, 9, 40], [63], [0, 1, 2, 3]]
    batch = make_batch(
        4,
        temperatures=[0.0, 1.0, 0.7, 0.0],
        top_k=[0, 0, 2, 0],
        grammar_rows=[0, 1, 2],
        allowed_token_bits=bitmask_rows(allowed),
    )
    out = Sampler()(logits.clone(), batch).token_ids.tolist()
    assert out[0] == max(allowed[0], key=lambda t: logits[0, t].item())
    assert out[1] == 63
    # A random row draws from its allowed tokens only, by the reference inverse CDF over
    # the top-2 of them (top-k applies after the mask).
    top2 = sorted(allowed[2], key=lambda t: -logits[2, t].item())[:2]
    probs = softmax(logits[2, top2].numpy() / 0.7)
    uniform = request_uniforms(batch.seeds[2:3], batch.output_positions[2:3])[0]
    assert out[2] == top2[reference_draw(probs, uniform)]
    assert out[3] == logits[3].argmax().item()  # unconstrained


def test_logprobs_stay_those_of_the_unconstrained_distribution():
    logits = fixed_logits(1, seed=4)
    batch = make_batch(
        1, num_logprobs=[3], grammar_rows=[0], allowed_token_bits=bitmask_rows([[7, 8]])
    )
    out = Sampler()(logits.clone(), batch)
    raw = torch.log_softmax(logits, dim=-1)
    chosen = out.token_ids.item()
    assert chosen in (7, 8)
    assert out.logprobs[0, 0].item() == pytest.approx(raw[0, chosen].item(), abs=1e-6)
    assert out.logprob_token_ids[0, 1:].tolist() == raw[0].topk(3).indices.tolist()


def test_min_tokens_never_empties_a_row_its_grammar_has_completed():
    logits = fixed_logits(2, seed=5)
    # Row 0's grammar allows only EOS (2) or stop token 4; row 1's allows more.
    batch = make_batch(
        2,
        grammar_rows=[0, 1],
        allowed_token_bits=bitmask_rows([[2, 4], [2, 4, 30]]),
        banned_rows=[0, 1],
        banned_token_ids=[np.array([2, 4]), np.array([2, 4])],
    )
    out = Sampler()(logits.clone(), batch).token_ids.tolist()
    assert out[0] == max((2, 4), key=lambda t: logits[0, t].item())  # the grammar wins
    assert out[1] == 30  # the ban holds where something else is allowed


def test_logit_bias_shifts_the_greedy_pick_and_the_sampled_distribution():
    logits = fixed_logits(2, seed=6)
    weakest = int(logits[0].argmin())
    bias = {weakest: 100.0, int(logits[0].argmax()): -5.0}
    batch = make_batch(
        2,
        temperatures=[0.0, 0.8],
        bias_rows=[0, 1],
        bias_token_ids=[np.fromiter(bias, np.int64), np.array([3, 9])],
        bias_values=[np.fromiter(bias.values(), np.float32), np.array([1.5, -2.0], np.float32)],
    )
    out = Sampler()(logits.clone(), batch).token_ids.tolist()
    assert out[0] == weakest
    biased = logits[1].clone()
    biased[3] += 1.5
    biased[9] -= 2.0
    uniform = request_uniforms(batch.seeds[1:2], batch.output_positions[1:2])[0]
    assert out[1] == reference_draw(softmax(biased.numpy() / 0.8), uniform)


def test_logit_bias_goes_before_the_penalties_as_in_vllm_and_hf():
    # Token 1 leads (2.0 against 1.5), was seen (repetition penalty 4) and gets a bias of
    # +2: biased first, (2.0 + 2.0) / 4 = 1.0 and token 0 wins; penalized first, it would
    # be 2.0 / 4 + 2.0 = 2.5 and token 1 would.
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 0], logits[0, 1] = 1.5, 2.0
    batch = make_batch(
        1,
        num_logprobs=[-1],
        penalty_rows=[0],
        repetition_penalties=[4.0],
        presence_penalties=[0.0],
        frequency_penalties=[0.0],
        penalty_prompt_tokens=[np.array([1])],
        penalty_output_tokens=[np.array([], np.int64)],
        bias_rows=[0],
        bias_token_ids=[np.array([1])],
        bias_values=[np.array([2.0], np.float32)],
    )
    assert Sampler()(logits, batch).token_ids.tolist() == [0]


def test_allowed_token_ids_restrict_each_row_to_its_own_list():
    logits = fixed_logits(3, seed=7)
    batch = make_batch(
        3,
        temperatures=[0.0, 1.0, 0.0],
        allowed_rows=[0, 1],
        allowed_token_ids=[np.array([4, 50, 60]), np.array([10, 11])],
    )
    out = Sampler()(logits.clone(), batch).token_ids.tolist()
    assert out[0] == max((4, 50, 60), key=lambda t: logits[0, t].item())
    assert out[1] in (10, 11)
    assert out[2] == logits[2].argmax().item()


def test_min_tokens_never_empties_a_row_whose_allowed_tokens_are_all_stop_tokens():
    logits = fixed_logits(1, seed=8)
    batch = make_batch(
        1,
        allowed_rows=[0],
        allowed_token_ids=[np.array([2])],
        banned_rows=[0],
        banned_token_ids=[np.array([2])],
    )
    assert Sampler()(logits.clone(), batch).token_ids.tolist() == [2]
