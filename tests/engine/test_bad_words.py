"""``bad_words`` (vLLM's): words the output may not contain, tokenized by the frontend (as
they stand and after a space) and banned by the workers' sampler where the output so far
ends with all but a word's last token. Greedy tokens equal HF transformers' ``generate``
with the same sequences as ``bad_words_ids``; the ban holds across processes, under
speculative decoding and for each parallel sample; bad settings are refused by name.

The tiny random Llama gets a byte-level tokenizer (one token per byte, plus filler words
the model may emit), so a one-letter word is one token and " x" two.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.parity import hf_greedy
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.scheduler.sampling_params import MAX_BAD_WORDS

# Neither prompt ends with a space byte (id 3 + 0x20) or a letter, so HF's processor, which
# also matches a word's first tokens against the prompt's end, bans what the engine bans.
PROMPTS = [[5, 300, 301, 302], [400, 7, 7, 401, 402, 403, 404, 405, 406]]
NUM_TOKENS = 40


def greedy(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **fields)


@pytest.fixture(scope="module")
def llm(byte_level_llama_dir) -> LLM:
    return LLM(byte_level_llama_dir, num_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def plain(llm) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, greedy())]


def hf_greedy_without(model_dir: Path, bad_words_ids: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model_dir, PROMPTS, max_new_tokens=NUM_TOKENS, bad_words_ids=bad_words_ids)


def a_letter_it_says(llm: LLM, plain: list[list[int]]) -> tuple[str, int]:
    """A letter the unconstrained output picks as a token of its own, and that token."""
    for token_id in plain[0]:
        text = llm.tokenizer.decode([token_id])
        if len(text) == 1 and text.isalpha():
            return text, token_id
    raise AssertionError(f"no one-letter token in {plain[0]}")


def test_a_word_is_tokenized_both_ways_and_never_said(llm, plain, byte_level_llama_dir):
    letter, token_id = a_letter_it_says(llm, plain)
    params = llm.resolve_bad_words(greedy(bad_words=[letter]), "sampling_params")
    space = llm.tokenizer.encode(" ", add_special_tokens=False)
    assert params.bad_words_token_ids == [[token_id], [*space, token_id]]
    outputs = llm.generate(PROMPTS, greedy(bad_words=[letter]))
    tokens = [output.outputs[0].token_ids for output in outputs]
    assert all(token_id not in output for output in tokens)
    assert tokens[0] != plain[0]  # the word was there to ban
    assert tokens == hf_greedy_without(byte_level_llama_dir, params.bad_words_token_ids)
    assert all(letter not in output.outputs[0].text for output in outputs)


def test_a_sequence_is_banned_only_where_its_first_tokens_end_the_output(
    llm, plain, byte_level_llama_dir
):
    # Two tokens the output says in a row: the second stays allowed anywhere else.
    first, second = plain[0][5], plain[0][6]
    word = [first, second]
    tokens = [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(bad_words_token_ids=[word]))
    ]
    assert tokens[0][:6] == plain[0][:6] and tokens[0][6] != second
    for output in tokens:
        assert not any(output[i : i + 2] == word for i in range(len(output) - 1))
    assert tokens == hf_greedy_without(byte_level_llama_dir, [word])


def test_across_processes_with_speculation_and_parallel_samples(byte_level_llama_dir, llm, plain):
    letter, token_id = a_letter_it_says(llm, plain)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(bad_words=[letter]))]
    speculating = LLM(
        byte_level_llama_dir,
        num_blocks=64,
        block_size=16,
        multiprocess=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    try:
        outputs = speculating.generate(PROMPTS, greedy(bad_words=[letter]))
        assert [o.outputs[0].token_ids for o in outputs] == want
        samples = SamplingParams(
            max_tokens=NUM_TOKENS, temperature=1.0, seed=4, n=3, ignore_eos=True, bad_words=[letter]
        )
        for output in speculating.generate(PROMPTS, samples):
            assert len(output.outputs) == 3
            assert all(token_id not in sample.token_ids for sample in output.outputs)
    finally:
        speculating.shutdown()


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        (dict(bad_words="no"), TypeError, "bad_words must be a list of strings, got 'no'"),
        (dict(bad_words=["ok", " "]), ValueError, r"bad_words\[\] must be non-blank strings"),
        (
            dict(bad_words=["x"] * (MAX_BAD_WORDS + 1)),
            ValueError,
            f"bad_words must have <= {MAX_BAD_WORDS} words, got {MAX_BAD_WORDS + 1}",
        ),
        (dict(bad_words_token_ids=[[1], []]), ValueError, "bad_words_token_ids.. must be non-emp"),
        (dict(bad_words_token_ids=[[1, -2]]), ValueError, r"bad_words_token_ids\[\]\[\] must be"),
    ],
)
def test_bad_settings_are_refused_by_name(fields, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**fields)


def test_ids_outside_the_vocabulary_and_a_model_without_a_tokenizer_are_refused(
    llm, tiny_model_dirs
):
    with pytest.raises(ValueError, match=r"bad_words_token_ids: token id 512 is outside"):
        llm.generate(PROMPTS, greedy(bad_words_token_ids=[[5, 512]]))
    bare = LLM(tiny_model_dirs["llama"], num_blocks=16)
    with pytest.raises(ValueError, match="sampling_params.bad_words: text needs a tokenizer"):
        bare.generate(PROMPTS, greedy(bad_words=["x"]))
