"""A reasoning model's structured output (``LLM(reasoning_parser=...)``): the grammar waits
for the end of the thinking, token for token as HF transformers' greedy output under the
same rule (float32).

The tiny random Llama thinks in garbage, so its markers are chosen from its own greedy
path: ``</think>`` is a token it writes free a few tokens in, and for Qwen3 ``<think>`` is
the token it writes first; a byte-level tokenizer then names those ids so. The reference
is independent of the engine: HF's model recomputes the whole sequence each step,
llguidance's ``hf.from_tokenizer`` builds the matcher from the HF tokenizer, and the test's
own state machine says when the grammar applies.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import AddedToken

from helpers.grammar_cases import PERSON_SCHEMA
from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS, byte_level_tokenizer, save_for_transformers
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.scheduler.sampling_params import StructuredOutputsParams

VOCAB_SIZE = 512
FIRST_PIECE_ID = len(BYTE_LEVEL_SPECIALS) + 256  # ids below are specials and bytes
MAX_TOKENS = 48
CONSTRAINTS = {
    "regex": StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{3,12}\."),
    "json": StructuredOutputsParams(json=PERSON_SCHEMA),
}
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def free_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        input_ids = torch.tensor([prompt])
        generated = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return generated[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dirs, tmp_path_factory) -> tuple[Path, list[int], int, int]:
    """(model dir, prompt, <think> id, </think> id): a prompt whose free greedy output opens
    with a token that can be named <think> and writes another, new one 3+ tokens in."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dirs["llama"], dtype=torch.float32
    ).eval()
    rng = random.Random(11)
    for _ in range(200):
        prompt = [rng.randrange(FIRST_PIECE_ID, VOCAB_SIZE) for _ in range(6)]
        path = free_greedy(model, prompt, 12)
        start = path[0]
        ends = [
            token
            for k, token in enumerate(path[3:], start=3)
            if token >= FIRST_PIECE_ID and token not in path[:k]
        ]
        if start >= FIRST_PIECE_ID and ends:
            break
    else:
        pytest.fail("no prompt of the tiny model writes usable markers")
    end = ends[0]
    names = {start: "<think>", end: "</think>"}
    pieces = [names.get(i, f"w{i}") for i in range(FIRST_PIECE_ID, max(names) + 1)]
    tokenizer = byte_level_tokenizer(pieces, vocab_size=VOCAB_SIZE)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<think>", "</think>")])
    assert tokenizer.token_to_id("<think>") == start and tokenizer.token_to_id("</think>") == end
    directory = tmp_path_factory.mktemp("tiny_thinking_llama")
    shutil.copytree(tiny_model_dirs["llama"], directory, dirs_exist_ok=True)
    save_for_transformers(tokenizer, directory, BYTE_LEVEL_SPECIALS)
    return directory, prompt, start, end


def hf_reference(
    model_dir: Path,
    prompt,
    constraint: str,
    start: int | None,
    end: int | tuple[int, ...] | None,
):
    """HF greedy where the grammar's mask applies once the thinking has ended (at the token
    ``end``, or once the output's last tokens are the run ``end``): the output thinks from its
    start (start None) or, with start, only if its first token is start (the first token's
    mask then also allows it); end None: no thinking at all."""
    end_run = (end,) if isinstance(end, int) else end
    import llguidance
    import llguidance.hf
    from llguidance import LLMatcher

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB_SIZE)
    grammar = (
        LLMatcher.grammar_from_regex(CONSTRAINTS["regex"].regex)
        if constraint == "regex"
        else LLMatcher.grammar_from_json_schema(PERSON_SCHEMA)
    )
    matcher = LLMatcher(ll_tokenizer, grammar)
    eos = hf_tokenizer.eos_token_id
    state = "grammar" if end is None else ("thinking" if start is None else "first")
    ids, output = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            if state != "thinking":
                bits = np.unpackbits(
                    np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
                )[:VOCAB_SIZE].copy()
                if state == "first":
                    bits[start] = 1
                logits[torch.from_numpy(bits == 0)] = float("-inf")
            token = int(logits.argmax())
            output.append(token)
            ids.append(token)
            if state == "first" and token == start:
                state = "thinking"
            elif state == "thinking":
                if tuple(output[-len(end_run) :]) == end_run:
                    state = "grammar"
            else:
                state = "grammar"
                assert matcher.consume_token(token), matcher.get_error()
                if matcher.is_stopped():
                    break
            if token == eos:
                break
    return output


@pytest.mark.parametrize("constraint", ["regex", "json"])
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_grammar_starts_after_the_thinking(thinking_model, parser, constraint):
    model_dir, prompt, start, end = thinking_model
    want = hf_reference(model_dir, prompt, constraint, start if parser == "qwen3" else None, end)
    assert end in want and want.index(end) >= 3  # it thought, then answered
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=CONSTRAINTS[constraint]
    )
    for extra in ({}, {"speculative_config": SPECULATIVE}):
        llm = LLM(model_dir, num_blocks=64, reasoning_parser=parser, **extra)
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert got == want, (parser, constraint, extra)
    # Without the parser the grammar holds from the first token: another output.
    plain = LLM(model_dir, num_blocks=64).generate([prompt], params)[0].outputs[0].token_ids
    assert plain == hf_reference(model_dir, prompt, constraint, None, None) != want


@pytest.fixture(scope="module")
def harmony_model(tiny_model_dirs, tmp_path_factory) -> tuple[Path, list[int], tuple[int, ...]]:
    """(model dir, prompt, the run of ids named <|channel|> final <|message|>): a prompt whose
    free greedy output writes three new tokens in a row 3+ tokens in, named as gpt-oss's
    header of its answer (the two markers special tokens, ``final`` a word)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dirs["llama"], dtype=torch.float32
    ).eval()
    rng = random.Random(12)
    for _ in range(200):
        prompt = [rng.randrange(FIRST_PIECE_ID, VOCAB_SIZE) for _ in range(6)]
        path = free_greedy(model, prompt, 14)
        runs = [
            tuple(path[k : k + 3])
            for k in range(3, len(path) - 2)
            if len(set(path[k : k + 3])) == 3
            and all(t >= FIRST_PIECE_ID and t not in path[:k] for t in path[k : k + 3])
        ]
        if runs:
            break
    else:
        pytest.fail("no prompt of the tiny model writes a usable run of three tokens")
    run = runs[0]
    names = dict(zip(run, ("<|channel|>", "final", "<|message|>")))
    pieces = [names.get(i, f"w{i}") for i in range(FIRST_PIECE_ID, max(names) + 1)]
    tokenizer = byte_level_tokenizer(pieces, vocab_size=VOCAB_SIZE)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<|channel|>", "<|message|>")]
    )
    tokenizer.add_tokens([AddedToken("final", special=False)])
    assert tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False).ids == list(
        run
    )
    directory = tmp_path_factory.mktemp("tiny_harmony_llama")
    shutil.copytree(tiny_model_dirs["llama"], directory, dirs_exist_ok=True)
    save_for_transformers(tokenizer, directory, BYTE_LEVEL_SPECIALS)
    return directory, prompt, run


@pytest.mark.parametrize("constraint", ["regex", "json"])
def test_gpt_oss_s_grammar_starts_after_its_final_header(harmony_model, constraint):
    """openai_gptoss: the output thinks from its start until it has written the run
    <|channel|>final<|message|>, then its grammar holds (also with drafts across the run)."""
    model_dir, prompt, run = harmony_model
    want = hf_reference(model_dir, prompt, constraint, None, run)
    first = next(k for k in range(len(want)) if tuple(want[k : k + 3]) == run)
    assert first >= 3 and len(want) > first + 3  # it thought, wrote the header, answered
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=CONSTRAINTS[constraint]
    )
    for extra in ({}, {"speculative_config": SPECULATIVE}):
        llm = LLM(model_dir, num_blocks=64, reasoning_parser="openai_gptoss", **extra)
        assert llm.grammar_vocabulary.think_end_token_ids == list(run)
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert got == want, (constraint, extra)
    # Without the parser the grammar holds from the first token: another output.
    plain = LLM(model_dir, num_blocks=64).generate([prompt], params)[0].outputs[0].token_ids
    assert plain != want


def test_markers_the_vocabulary_splits_leave_the_grammar_on_everything(tiny_model_dirs, caplog):
    """The byte-level vocabulary spells <think> in 7 tokens: no gate, and a warning says so."""
    directory = tiny_model_dirs["llama"].parent / "tiny_llama_no_markers"
    if not directory.exists():
        shutil.copytree(tiny_model_dirs["llama"], directory)
        save_for_transformers(
            byte_level_tokenizer([], vocab_size=VOCAB_SIZE), directory, BYTE_LEVEL_SPECIALS
        )
    with caplog.at_level("WARNING"):
        llm = LLM(directory, num_blocks=32, reasoning_parser="qwen3")
    assert "does not hold <think> and </think> as single tokens" in caplog.text
    assert llm.grammar_vocabulary.think_end_token_ids is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        LLM(directory, num_blocks=32, reasoning_parser="o1")
