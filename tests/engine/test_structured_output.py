"""Structured output end to end: the engine's constrained greedy output equals HF
transformers' greedy output under the same grammar, token for token (float32).

The reference is independent of the engine's code: HF's model recomputes the whole
sequence each step, llguidance's own ``hf.from_tokenizer`` builds the matcher from the
HF tokenizer, the disallowed logits are set to -inf and the argmax taken, until the
grammar completes or EOS is chosen. The tiny random Llama, which writes garbage when
free, gets a byte-level tokenizer, so every JSON text, number or word is reachable.
GBNF grammars are checked against a regex of their language instead, greedy and sampled.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.grammar_cases import CHOICES, CONSTRAINTS, GRAMMAR, PERSON_SCHEMA, PROMPTS, REGEX
from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS, byte_level_tokenizer, save_for_transformers
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.scheduler.sampling_params import StructuredOutputsParams

VOCAB_SIZE = 512
MAX_TOKENS = 64
# The person schema without its own whitespace setting: compact only by the request's flag.
LOOSE_PERSON_SCHEMA = {key: value for key, value in PERSON_SCHEMA.items() if key != "x-guidance"}
COMPACT_CONSTRAINTS = {
    "json-compact": StructuredOutputsParams(json=LOOSE_PERSON_SCHEMA, disable_any_whitespace=True),
    "json_object-compact": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
}


def is_valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return (
            set(value) == {"name", "age", "pet"}
            and isinstance(value["age"], int)
            and value["pet"] in ("cat", "dog", "none")
        )
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\((?:[xyz]|\(.*\))(?:,(?:[xyz]|\(.*\)))*\)", text) is not None


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama_with_tokenizer")
    shutil.copytree(tiny_model_dirs["llama"], path, dirs_exist_ok=True)
    return save_for_transformers(
        byte_level_tokenizer([], vocab_size=VOCAB_SIZE), path, BYTE_LEVEL_SPECIALS
    )


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def reference(model_dir):
    """HF greedy under llguidance's mask: ``(prompt, kind) -> (token ids, finished)``."""
    import llguidance
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB_SIZE)
    eos = hf_tokenizer.eos_token_id
    compact = {"whitespace_flexible": False}
    grammars = {
        "json": LLMatcher.grammar_from_json_schema(PERSON_SCHEMA),
        "json-compact": LLMatcher.grammar_from_json_schema(LOOSE_PERSON_SCHEMA, defaults=compact),
        "json_object-compact": LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=compact
        ),
        "regex": LLMatcher.grammar_from_regex(REGEX),
        "choice": llguidance.grammar_from("choice", CHOICES),
        "grammar": LLMatcher.grammar_from_lark(GRAMMAR),
    }
    cache: dict[tuple, tuple[list[int], bool]] = {}

    def run(prompt: list[int], kind: str) -> tuple[list[int], bool]:
        key = (tuple(prompt), kind)
        if key in cache:
            return cache[key]
        matcher = LLMatcher(ll_tokenizer, grammars[kind])
        ids, output = list(prompt), []
        finished = False
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                bits = np.unpackbits(
                    np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
                )[:VOCAB_SIZE]
                logits[torch.from_numpy(bits == 0)] = float("-inf")
                token = int(logits.argmax())
                output.append(token)
                ids.append(token)
                assert matcher.consume_token(token), matcher.get_error()
                if token == eos or matcher.is_stopped():
                    finished = True
                    break
        cache[key] = (output, finished)
        return cache[key]

    return run


def greedy(constraint: StructuredOutputsParams | None, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0.0, structured_outputs=constraint, **kwargs)


def assert_matches_reference(outputs, prompts, kinds, reference, llm):
    for output, prompt, kind in zip(outputs, prompts, kinds):
        expected, finished = reference(prompt, kind)
        completion = output.outputs[0]
        assert completion.token_ids == expected, (kind, prompt)
        assert finished and completion.finish_reason == "stop", (kind, completion.text)
        assert is_valid(kind, completion.text), (kind, completion.text)


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_constrained_greedy_matches_hf_under_the_same_grammar(llm, reference, kind):
    outputs = llm.generate(PROMPTS, greedy(CONSTRAINTS[kind]))
    assert_matches_reference(outputs, PROMPTS, [kind] * len(PROMPTS), reference, llm)


def test_constrained_and_free_requests_share_a_batch(llm, reference):
    kinds = list(CONSTRAINTS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    params = [greedy(CONSTRAINTS[kind]) for kind in kinds]
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([*prompts, PROMPTS[0]], [*params, free])
    assert_matches_reference(outputs[:-1], prompts, kinds, reference, llm)
    alone = llm.generate(PROMPTS[0], free)[0].outputs[0].token_ids
    assert outputs[-1].outputs[0].token_ids == alone


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        # Ten blocks of 8 tokens: one request at its longest (73 tokens) fits, six do not.
        dict(num_blocks=10, block_size=8, preemption_mode="recompute"),
        dict(num_blocks=10, block_size=8, preemption_mode="swap"),
        dict(num_blocks=128, block_size=16, max_num_batched_tokens=4),  # 4 tokens a step
    ],
    ids=["recompute", "swap", "chunked-prefill"],
)
def test_preemption_and_chunked_prefill_keep_the_grammar(model_dir, reference, engine_kwargs):
    llm = LLM(model_dir, **engine_kwargs)
    kinds = ["json", "grammar", "json", "regex", "json", "grammar"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    outputs = llm.generate(prompts, [greedy(CONSTRAINTS[kind]) for kind in kinds])
    assert_matches_reference(outputs, prompts, kinds, reference, llm)
    if "preemption_mode" in engine_kwargs:
        assert llm.stats()["num_preemptions"] > 0
    llm.check_integrity()


def test_seeded_samples_are_valid_and_independent_of_the_batch(llm):
    constraint = CONSTRAINTS["json"]
    params = SamplingParams(
        temperature=1.0, seed=7, n=3, max_tokens=MAX_TOKENS, structured_outputs=constraint
    )
    alone = llm.generate(PROMPTS[1], params)[0]
    crowd = llm.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2]],
        [greedy(CONSTRAINTS["regex"]), params, SamplingParams(temperature=0.9, max_tokens=30)],
    )[1]
    assert [c.token_ids for c in crowd.outputs] == [c.token_ids for c in alone.outputs]
    for completion in alone.outputs:
        assert completion.finish_reason == "stop" and is_valid("json", completion.text)


# GBNF (llama.cpp's grammar syntax) reaches llguidance through its own front end, not the
# Lark one above; each grammar with a Python regex of the same language to check against.
# The digits are bounded because this model, greedy, repeats one digit until max_tokens.
GBNF_CASES = {
    "alternation": ('root ::= "yes" | "no"', r"yes|no"),
    "repetition": ('root ::= [0-9]{1,3} ("," [0-9]{1,3}){0,3}', r"[0-9]{1,3}(?:,[0-9]{1,3}){0,3}"),
    "rules": (
        'root ::= pet (" and " pet)*\npet ::= "cat" | "dog" | "none"',
        r"(?:cat|dog|none)(?: and (?:cat|dog|none))*",
    ),
}
SEEDS = range(6)


def gbnf_params(constraint: StructuredOutputsParams | None) -> list[SamplingParams]:
    """Greedy, then sampled at temperature 1 under each of ``SEEDS``."""
    sampled = [
        SamplingParams(
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=constraint
        )
        for seed in SEEDS
    ]
    return [greedy(constraint), *sampled]


@pytest.mark.parametrize("case", GBNF_CASES)
def test_gbnf_grammars_constrain_greedy_and_sampled_output(llm, case):
    grammar, pattern = GBNF_CASES[case]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(1 + len(SEEDS))]
    constrained = llm.generate(prompts, gbnf_params(StructuredOutputsParams(grammar=grammar)))
    texts = [output.outputs[0].text for output in constrained]
    for output in constrained:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (case, completion.text)
        assert re.fullmatch(pattern, completion.text), (case, completion.text)
    assert len(set(texts)) > 1, texts  # the seeds did sample different strings of it
    # The same requests unconstrained: none of them lands in the grammar by chance, so
    # the matches above are the constraint's doing.
    for output in llm.generate(prompts, gbnf_params(None)):
        assert not re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text


def test_min_tokens_and_ignore_eos_yield_to_a_completed_grammar(llm):
    params = greedy(CONSTRAINTS["choice"], min_tokens=40, ignore_eos=True)
    completion = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert completion.text in CHOICES and completion.finish_reason == "stop"


def test_max_tokens_cuts_a_constrained_output_short(llm, reference):
    expected, _ = reference(PROMPTS[0], "json")
    completion = llm.generate(PROMPTS[0], greedy(CONSTRAINTS["json"], max_tokens=5))[0].outputs[0]
    assert completion.token_ids == expected[:5] and completion.finish_reason == "length"


def test_json_object_gives_an_object(llm):
    params = greedy(StructuredOutputsParams(json_object=True), max_tokens=200)
    for output in llm.generate(PROMPTS, params):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # a random model may ramble inside a string; it is still an object's prefix
            assert completion.text.lstrip().startswith("{")


def whitespace_outside_strings(text: str) -> str:
    """The whitespace of a JSON text (or of a prefix of one) outside its strings."""
    found, in_string, escaped = [], False, False
    for char in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped = char == "\\"
            in_string = char != '"'
        elif char == '"':
            in_string = True
        elif char.isspace():
            found.append(char)
    return "".join(found)


@pytest.mark.parametrize("kind", COMPACT_CONSTRAINTS)
def test_disable_any_whitespace_gives_compact_json(llm, reference, kind):
    outputs = llm.generate(PROMPTS, greedy(COMPACT_CONSTRAINTS[kind]))
    for output, prompt in zip(outputs, PROMPTS):
        completion = output.outputs[0]
        assert completion.token_ids == reference(prompt, kind)[0], prompt
        assert whitespace_outside_strings(completion.text) == "", completion.text
        if kind == "json-compact":  # json_object may ramble inside a string until max_tokens
            assert completion.finish_reason == "stop" and is_valid("json", completion.text)


def test_without_it_this_model_loops_on_whitespace(llm):
    """What the option is for (and what makes the test above able to fail)."""
    loose = greedy(StructuredOutputsParams(json=LOOSE_PERSON_SCHEMA))
    completion = llm.generate(PROMPTS[1], loose)[0].outputs[0]
    assert completion.finish_reason == "length"
    assert len(whitespace_outside_strings(completion.text)) > MAX_TOKENS // 2


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "multi-process"])
def test_the_engine_wide_default_makes_every_json_request_compact(
    model_dir, reference, multiprocess
):
    llm = LLM(
        model_dir,
        num_blocks=128,
        block_size=16,
        multiprocess=multiprocess,
        structured_outputs_disable_any_whitespace=True,
    )
    try:
        constraints = {
            "json-compact": StructuredOutputsParams(json=LOOSE_PERSON_SCHEMA),
            "json_object-compact": StructuredOutputsParams(json_object=True),
            "regex": CONSTRAINTS["regex"],  # no JSON: as without the default
        }
        outputs = llm.generate(
            [PROMPTS[0]] * len(constraints), [greedy(c) for c in constraints.values()]
        )
        for output, kind in zip(outputs, constraints):
            assert output.outputs[0].token_ids == reference(PROMPTS[0], kind)[0], kind
    finally:
        llm.shutdown()


def test_across_processes_the_output_is_the_same(model_dir, reference):
    llm = LLM(model_dir, num_blocks=128, block_size=16, multiprocess=True)
    try:
        kinds = list(CONSTRAINTS)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
        outputs = llm.generate(prompts, [greedy(CONSTRAINTS[kind]) for kind in kinds])
        assert_matches_reference(outputs, prompts, kinds, reference, llm)
        with pytest.raises(ValueError, match=r"sampling_params.structured_outputs.regex"):
            llm.generate(PROMPTS[0], greedy(StructuredOutputsParams(regex="(")))
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_a_model_without_a_tokenizer_refuses_constraints(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=16, block_size=16)
    with pytest.raises(ValueError, match="structured_outputs: grammars are matched over"):
        llm.generate(PROMPTS[0], greedy(CONSTRAINTS["choice"]))


def test_command_line_flags(model_dir, llm, tmp_path, capsys):
    from pagedserve.frontend.cli import main

    prompt = "Once upon"
    arguments = ["generate", "--model", str(model_dir), "--kv-cache-bytes", str(1 << 20)]
    arguments += ["--max-tokens", str(MAX_TOKENS)]
    expected = llm.generate(prompt, greedy(CONSTRAINTS["regex"]))[0].outputs[0].text
    assert main([*arguments, "--regex", REGEX, prompt]) == 0
    assert capsys.readouterr().out == expected + "\n"
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON_SCHEMA))
    expected = llm.generate(prompt, greedy(CONSTRAINTS["json"]))[0].outputs[0].text
    assert main([*arguments, "--json-schema", f"@{schema_file}", prompt]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main([*arguments, "--regex", "a", "--choice", "b", prompt]) == 2
    assert "at most one of the structured output flags, got --regex and --choice" in (
        capsys.readouterr().err
    )
    assert main([*arguments, "--grammar", f"@{tmp_path / 'missing.lark'}", prompt]) == 2
    assert "cannot read" in capsys.readouterr().err
    schema_file.write_text(json.dumps(LOOSE_PERSON_SCHEMA))
    expected = llm.generate(prompt, greedy(COMPACT_CONSTRAINTS["json-compact"]))
    loose = llm.generate(prompt, greedy(StructuredOutputsParams(json=LOOSE_PERSON_SCHEMA)))
    assert loose[0].outputs[0].text != expected[0].outputs[0].text  # the flag matters here
    flag = "--structured-outputs-disable-any-whitespace"
    assert main([*arguments, flag, "--json-schema", f"@{schema_file}", prompt]) == 0
    assert capsys.readouterr().out == expected[0].outputs[0].text + "\n"


def test_serve_passes_the_whitespace_flag_to_the_engine():
    from pagedserve.frontend.cli import build_parser
    from pagedserve.frontend.engine_args import engine_options_from_cli

    for flags, expected in (([], False), (["--structured-outputs-disable-any-whitespace"], True)):
        args = build_parser().parse_args(["serve", *flags])
        options = engine_options_from_cli(args, "serve")
        assert options["structured_outputs_disable_any_whitespace"] is expected
