"""Speculative decoding with a draft model through the engine: the output is what decoding
a token at a time gives (HF's greedy tokens; the same seeded samples and logprobs), under
preemption by swap and by recompute, chunked prefill, prefix-cache hits, beside sequences
that do not speculate, under grammars and across processes and ranks; and the draft model's
cache follows the target's: a draft model that is a copy of the target has every guess
accepted, after all of those, which a single stale or misplaced K/V would break."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.grammar_cases import CONSTRAINTS
from helpers.grammar_cases import PROMPTS as STRUCTURED_PROMPTS
from helpers.parity import NEW_TOKENS, hf_greedy
from helpers.speculative_decoding import (
    FEW,
    assert_same_tokens_and_logprobs,
    check_stops_inside_accepted_drafts,
    outputs,
    repetitive_prompts,
)
from pagedserve.frontend import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def draft_config(model: Path, num_speculative_tokens: int = 3) -> dict:
    return {"model": str(model), "num_speculative_tokens": num_speculative_tokens}


def random_prompts(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def rewritten_copy(source: Path, destination: Path, edit, config_edit=None) -> Path:
    """``source``'s checkpoint with ``edit(tensors)`` applied (and ``config_edit(config)``)."""
    shutil.copytree(source, destination)
    weights = destination / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, weights)
    if config_edit is not None:
        config_path = destination / "config.json"
        config = json.loads(config_path.read_text())
        config_edit(config)
        config_path.write_text(json.dumps(config))
    return destination


def assert_every_guess_accepted(llm: LLM, before: dict | None = None) -> None:
    stats = llm.stats()
    drafted = stats["num_draft_tokens"] - (before or {}).get("num_draft_tokens", 0)
    accepted = stats["num_accepted_tokens"] - (before or {}).get("num_accepted_tokens", 0)
    assert drafted > 0 and accepted == drafted, stats


def assert_some_guesses_accepted(llm: LLM) -> None:
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats


@pytest.fixture(scope="module")
def near_llama(tiny_model_dirs, tmp_path_factory) -> Path:
    """The tiny Llama with its last MLP scaled down: a draft model that agrees with the
    target on some tokens and not on others."""

    def scale(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"] *= 0.3

    return rewritten_copy(
        tiny_model_dirs["llama"], tmp_path_factory.mktemp("near") / "llama", scale
    )


@pytest.fixture(scope="module")
def plain_llama(tiny_model_dirs) -> LLM:
    return LLM(tiny_model_dirs["llama"], num_blocks=256)


@pytest.fixture(scope="module")
def self_drafted_llama(tiny_model_dirs) -> LLM:
    llama = tiny_model_dirs["llama"]
    return LLM(llama, num_blocks=256, speculative_config=draft_config(llama))


@pytest.fixture(scope="module")
def near_drafted_llama(tiny_model_dirs, near_llama) -> LLM:
    return LLM(
        tiny_model_dirs["llama"], num_blocks=256, speculative_config=draft_config(near_llama, 4)
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_equal_hf_and_a_copy_of_the_target_guesses_every_one(tiny_model_dirs, family):
    model = tiny_model_dirs[family]
    prompts = random_prompts(1)
    llm = LLM(model, num_blocks=256, speculative_config=draft_config(model))
    assert [tokens for tokens, _ in outputs(llm, prompts, GREEDY)] == hf_greedy(model, prompts)
    assert_every_guess_accepted(llm)
    # Each step emitted its accepted guesses and one more token: far fewer steps than tokens.
    stats = llm.stats()
    assert stats["num_accepted_tokens"] > stats["num_sampled_tokens"] // 2, stats


def test_a_draft_model_of_another_shape_changes_no_token(tiny_model_dirs, plain_llama):
    """Qwen3 (four query heads over two KV heads, q/k norms, a wider model) guessing for
    the Llama: its guesses are wrong, and the output is the target's all the same."""
    prompts = random_prompts(2)
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=256,
        speculative_config=draft_config(tiny_model_dirs["qwen3"], 2),
    )
    assert outputs(llm, prompts, GREEDY) == outputs(plain_llama, prompts, GREEDY)
    assert llm.stats()["num_draft_tokens"] > 0


SAMPLED = [
    SamplingParams(max_tokens=30, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, top_k=5, seed=5, ignore_eos=True),
    SamplingParams(
        max_tokens=30,
        temperature=0.7,
        seed=3,
        repetition_penalty=1.3,
        logit_bias={7: 2.0},
        min_tokens=10,
        ignore_eos=True,
    ),
    SamplingParams(max_tokens=30, temperature=0.9, seed=8, allowed_token_ids=FEW),
]


@pytest.mark.parametrize("params", SAMPLED, ids=range(len(SAMPLED)))
def test_seeded_samples_equal_plain_decoding(plain_llama, near_drafted_llama, params):
    """A guess is accepted with the target's probability for it, and a rejection samples
    the rest of the target's distribution: the same seeded draws as a token at a time."""
    prompts = random_prompts(3)
    assert outputs(near_drafted_llama, prompts, params) == outputs(plain_llama, prompts, params)


def test_greedy_tokens_and_logprobs_equal_plain_decoding(plain_llama, near_drafted_llama):
    prompts = random_prompts(4)
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=3, ignore_eos=True)
    assert_same_tokens_and_logprobs(
        near_drafted_llama.generate(prompts, params), plain_llama.generate(prompts, params)
    )
    assert_some_guesses_accepted(near_drafted_llama)


def test_stops_and_max_tokens_inside_the_accepted_guesses(plain_llama, self_drafted_llama):
    check_stops_inside_accepted_drafts(plain_llama, self_drafted_llama, random_prompts(5))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_and_chunked_prefill_keep_the_tokens_and_the_draft_cache(
    tiny_model_dirs, preemption_mode
):
    """Swaps move the draft's blocks with the target's, recomputation rebuilds both, and
    the guesses' reserved blocks never cost a preemption of their own."""
    model = tiny_model_dirs["qwen3"]
    prompts = repetitive_prompts(5, count=10)
    small = dict(
        num_blocks=32, block_size=8, max_num_batched_tokens=48, preemption_mode=preemption_mode
    )
    llm = LLM(model, **small, speculative_config=draft_config(model))
    plain = LLM(model, num_blocks=256)
    assert outputs(llm, prompts, GREEDY) == outputs(plain, prompts, GREEDY)
    assert llm.stats()["num_preemptions"] > 0
    assert_every_guess_accepted(llm)


def test_a_prefix_cache_hit_carries_the_draft_cache(tiny_model_dirs, plain_llama):
    """The second request's prompt is served from blocks the first one filled: the draft's
    K/V in them are right, so a copy of the target still guesses every token."""
    model = tiny_model_dirs["llama"]
    llm = LLM(model, num_blocks=256, block_size=8, speculative_config=draft_config(model))
    prompt = random_prompts(6, count=1)[0] * 3
    first = outputs(llm, [prompt], GREEDY)
    before = llm.stats()
    longer = prompt + first[0][0][:5]
    (output,) = llm.generate([longer], GREEDY)
    assert output.num_cached_tokens >= len(prompt) // 8 * 8
    assert list(output.outputs[0].token_ids) == outputs(plain_llama, [longer], GREEDY)[0][0]
    assert_every_guess_accepted(llm, before)


def test_sequences_that_do_not_speculate_run_beside_those_that_do(plain_llama, self_drafted_llama):
    """n > 1 and beams share blocks by copy-on-write: copies move the draft's K/V too."""
    prompts = random_prompts(7, count=3)
    mixed = [
        GREEDY,
        SamplingParams(max_tokens=20, temperature=0.9, n=2, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=12, beam_width=3, temperature=0.0, ignore_eos=True),
    ]
    before = self_drafted_llama.stats()
    for _ in range(2):  # the second run also hits the prefix cache
        got = [o.outputs for o in self_drafted_llama.generate(prompts, mixed)]
        want = [o.outputs for o in plain_llama.generate(prompts, mixed)]
        assert [[c.token_ids for c in cs] for cs in got] == [
            [c.token_ids for c in cs] for cs in want
        ]
    assert_every_guess_accepted(self_drafted_llama, before)


def test_blocks_are_reserved_for_the_guesses(tiny_model_dirs):
    """The draft writes its guesses' K/V past the scheduled tokens, in blocks the scheduler
    reserves when they are free: with them every step after the prefill guesses four
    tokens and, a copy of the target guessing, emits five, 40 tokens in eight steps
    (without them a guess stops at the end of the sequence's last block)."""
    model = tiny_model_dirs["llama"]
    llm = LLM(model, num_blocks=64, block_size=8, speculative_config=draft_config(model, 4))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True))
    stats = llm.stats()
    assert stats["num_draft_tokens"] == stats["num_accepted_tokens"] == 8 * 4, stats


def test_copy_on_write_copies_the_draft_cache(tiny_model_dirs, plain_llama):
    """Two samples share the prompt's last, partly filled block until each writes into it:
    the one that writes first gets a copy, of the draft's K/V too. A later request whose
    prompt is a sample's tokens hits those blocks in the prefix cache, and a copy of the
    target still guesses every token after them."""
    model = tiny_model_dirs["llama"]
    llm = LLM(model, num_blocks=256, block_size=8, speculative_config=draft_config(model))
    prompt = random_prompts(11, count=1)[0][:21]  # 2 blocks and 5 tokens
    sampled = SamplingParams(max_tokens=19, temperature=1.0, n=2, seed=6, ignore_eos=True)
    samples = [list(c.token_ids) for c in llm.generate([prompt], sampled)[0].outputs]
    assert samples[0] != samples[1]
    before = llm.stats()
    longer = [prompt + sample for sample in samples]
    got = llm.generate(longer, GREEDY)
    assert all(output.num_cached_tokens == 32 for output in got)
    assert [list(o.outputs[0].token_ids) for o in got] == [
        tokens for tokens, _ in outputs(plain_llama, longer, GREEDY)
    ]
    assert_every_guess_accepted(llm, before)


def test_an_embedding_requests_blocks_carry_the_draft_cache(tiny_model_dirs, plain_llama):
    """A pooling request's prompt runs through the draft model too: a generation request
    whose prompt starts with it hits its blocks, and a copy of the target still guesses
    every token after them."""
    model = tiny_model_dirs["llama"]
    llm = LLM(model, num_blocks=256, block_size=8, speculative_config=draft_config(model))
    prompt = random_prompts(13, count=1)[0] + random_prompts(14, count=1)[0]
    llm.embed([prompt])
    before = llm.stats()
    longer = prompt + [9, 10, 11]
    (output,) = llm.generate([longer], GREEDY)
    assert output.num_cached_tokens == len(prompt) // 8 * 8 > 0
    assert list(output.outputs[0].token_ids) == outputs(plain_llama, [longer], GREEDY)[0][0]
    assert_every_guess_accepted(llm, before)


def test_disable_by_batch_size_stops_the_guesses_of_a_large_batch(
    tiny_model_dirs, plain_llama, monkeypatch
):
    """Four running: no drafts checked, and the workers make no guesses (the passes would
    be wasted); two running: every guess again."""
    model = tiny_model_dirs["llama"]
    speculative = {**draft_config(model), "disable_by_batch_size": 3}
    llm = LLM(model, num_blocks=256, speculative_config=speculative)
    scheduler = llm.engine.scheduler
    guessed_when_off = []
    update = scheduler.update_from_output

    def recording_update(plan, result):
        if not plan.draft_guesses:
            guessed_when_off.append(result.draft_token_ids)
        return update(plan, result)

    monkeypatch.setattr(scheduler, "update_from_output", recording_update)
    prompts = random_prompts(15, count=4)
    assert outputs(llm, prompts, GREEDY) == outputs(plain_llama, prompts, GREEDY)
    assert llm.stats()["num_draft_tokens"] == 0  # four running from the second step on
    assert guessed_when_off and not any(guessed_when_off)
    assert outputs(llm, prompts[:2], GREEDY) == outputs(plain_llama, prompts[:2], GREEDY)
    assert_every_guess_accepted(llm)


def test_a_draft_model_with_a_shorter_window_guesses_within_it(tiny_model_dirs, plain_llama):
    """Past the draft model's context window it neither follows nor guesses; the target
    goes on a token at a time."""
    llama = tiny_model_dirs["llama"]
    short = rewritten_copy(
        llama,
        llama.parent / "short_window_llama",
        lambda tensors: None,
        lambda config: config.update(max_position_embeddings=48),
    )
    llm = LLM(llama, num_blocks=256, speculative_config=draft_config(short))
    prompts = random_prompts(8)
    assert outputs(llm, prompts, GREEDY) == outputs(plain_llama, prompts, GREEDY)
    assert_every_guess_accepted(llm)
    # Every prompt is under 40 tokens and every output 64: most positions lie past 48.
    stats = llm.stats()
    assert stats["num_accepted_tokens"] < stats["num_sampled_tokens"] // 2, stats


def test_guesses_stay_in_the_target_vocabulary(tiny_model_dirs, plain_llama, tmp_path):
    """A draft model whose vocabulary is padded past the target's, its extra rows made to
    win every argmax: it guesses among the target's tokens all the same."""
    llama = tiny_model_dirs["llama"]

    def pad(tensors):
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = tensors[name]
            extra = torch.full((64, rows.shape[1]), 50.0, dtype=rows.dtype)
            tensors[name] = torch.cat((rows, extra))

    padded = rewritten_copy(
        llama, tmp_path / "padded", pad, lambda config: config.update(vocab_size=576)
    )
    llm = LLM(llama, num_blocks=256, speculative_config=draft_config(padded))
    prompts = random_prompts(9, count=3)
    assert outputs(llm, prompts, GREEDY) == outputs(plain_llama, prompts, GREEDY)
    # The extra rows' embeddings never enter (no prompt uses them): every guess the
    # target's own, and all accepted.
    assert_every_guess_accepted(llm)


def test_structured_output_takes_forced_tokens_then_guesses(byte_level_llama_dir):
    """Under a grammar the tokens it forces come first, then the draft model's guesses, cut
    where the grammar refuses one (a guess is the draft's unconstrained choice)."""
    model = byte_level_llama_dir
    plain = LLM(model, num_blocks=128)
    llm = LLM(model, num_blocks=128, speculative_config=draft_config(model))
    for kind, constraint in CONSTRAINTS.items():
        for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=3)):
            params = SamplingParams(max_tokens=48, structured_outputs=constraint, **sampling)
            got = outputs(llm, STRUCTURED_PROMPTS, params)
            assert got == outputs(plain, STRUCTURED_PROMPTS, params), (kind, sampling)
    assert_some_guesses_accepted(llm)


@pytest.mark.slow
def test_across_processes_and_tensor_parallel_ranks(tiny_model_dirs, plain_llama, near_llama):
    """Every rank runs its share of the draft model too; rank 0's guesses go back."""
    prompts = random_prompts(10)
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=2, ignore_eos=True)
    want = outputs(plain_llama, prompts, params) + outputs(plain_llama, prompts, GREEDY)
    llama = tiny_model_dirs["llama"]
    for size, draft in ((1, llama), (2, llama), (2, near_llama)):
        llm = LLM(
            llama,
            num_blocks=128,
            multiprocess=True,
            tensor_parallel_size=size,
            speculative_config=draft_config(draft),
        )
        try:
            assert outputs(llm, prompts, params) + outputs(llm, prompts, GREEDY) == want
            if draft == llama:
                # Sampled outputs reject some guesses; the greedy ones none.
                before = llm.stats()
                assert outputs(llm, prompts, GREEDY) == want[len(prompts) :]
                assert_every_guess_accepted(llm, before)
            else:
                assert_some_guesses_accepted(llm)
        finally:
            llm.shutdown()


def test_the_cache_holds_blocks_of_both_models(tiny_model_dirs):
    """A block costs the target's bytes plus the draft's, so a byte budget holds fewer."""
    llama, qwen3 = tiny_model_dirs["llama"], tiny_model_dirs["qwen3"]
    budget = 1 << 20
    plain = LLM(llama, kv_cache_bytes=budget)
    drafted = LLM(llama, kv_cache_bytes=budget, speculative_config=draft_config(qwen3))
    # Llama: 2 layers x K and V x 1 head x 16 tokens x 64 values x 4 bytes; Qwen3: 2 heads.
    assert plain.bytes_per_block == 2 * 2 * 1 * 16 * 64 * 4
    assert drafted.bytes_per_block == plain.bytes_per_block * 3
    assert drafted.num_blocks == budget // drafted.bytes_per_block


def test_a_draft_model_that_cannot_serve_is_refused_naming_why(tiny_model_dirs, tmp_path):
    llama, mistral = tiny_model_dirs["llama"], tiny_model_dirs["mistral"]

    def config_copy(source: Path, name: str, **fields) -> Path:
        return rewritten_copy(
            source, tmp_path / name, lambda tensors: None, lambda config: config.update(fields)
        )

    classifier = config_copy(
        llama,
        "classifier",
        architectures=["LlamaForSequenceClassification"],
        id2label={"0": "no", "1": "yes"},
        label2id={"no": 0, "yes": 1},
    )
    windowed = config_copy(mistral, "windowed", sliding_window=16)
    # Refused from its config, before any weight loads.
    three_heads = config_copy(llama, "three_heads", num_attention_heads=3)
    cases = [
        (llama, classifier, {}, "speculative decoding needs causal LMs, but the draft model"),
        (
            windowed,
            llama,
            {},
            "every layer of MistralForCausalLM attends 16 tokens back, so the engine frees the "
            "blocks behind that window, but the draft model attends to every token",
        ),
        (
            llama,
            three_heads,
            {"tensor_parallel_size": 2},
            "speculative_config.model (LlamaForCausalLM): tensor_parallel_size=2 does not "
            "divide the model's num_attention_heads=3",
        ),
    ]
    for target, draft, options, words in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            LLM(target, num_blocks=64, speculative_config=draft_config(draft), **options)
    # vLLM's key for the draft's ranks: here always the target's.
    with pytest.raises(ValueError, match="splits the draft model over the target's ranks"):
        LLM(
            llama,
            num_blocks=64,
            speculative_config={**draft_config(llama), "draft_tensor_parallel_size": 2},
        )
    # A windowed draft model within the target's window serves.
    llm = LLM(windowed, num_blocks=64, speculative_config=draft_config(windowed))
    prompts = random_prompts(12, count=2)
    assert outputs(llm, prompts, GREEDY) == outputs(LLM(windowed, num_blocks=64), prompts, GREEDY)
    assert_every_guess_accepted(llm)
