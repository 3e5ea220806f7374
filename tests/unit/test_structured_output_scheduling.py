"""Structured output on the scheduler's side: the constraint's checks, the matcher each
constrained sequence owns, the allowed-token bitmask the plan carries for each sampling
step, forks, preemption, and how a completed grammar ends a sequence. Torch-free, like
the scheduler; the vocabulary is a real byte-level tokenizer built in code."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS, byte_level_piece, byte_level_tokenizer
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import StepResult
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.structured_output import (
    GrammarVocabulary,
    StructuredOutput,
    grammar_text,
)

VOCAB_SIZE = 300  # 3 specials, 256 bytes, a few words, then padding the tokenizer lacks
EOS = BYTE_LEVEL_SPECIALS.index("<|im_end|>")
WORDS = ["yes", "no", " maybe"]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer(WORDS)


@pytest.fixture(scope="module")
def structured(tokenizer) -> StructuredOutput:
    return StructuredOutput(GrammarVocabulary(tokenizer.to_str(), VOCAB_SIZE, [EOS]))


def allowed_ids(bitmask: bytes) -> list[int]:
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def token_id(tokenizer, text: str) -> int:
    return tokenizer.token_to_id(byte_level_piece(text))


def choice(*texts: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=list(texts))


# ------------------------------------------------------------------ the constraint's checks


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"regex": "a", "choice": ["a"]}, ValueError, "got regex, choice"),
        ({"json": "{not json"}, ValueError, "structured_outputs.json is not valid JSON"),
        ({"json": "[1, 2]"}, ValueError, "structured_outputs.json must be a JSON schema"),
        ({"json": 5}, TypeError, "structured_outputs.json must be a JSON schema"),
        ({"choice": []}, ValueError, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 1]}, TypeError, r"structured_outputs.choice\[1\] must be a string"),
        ({"regex": ""}, ValueError, "structured_outputs.regex must not be empty"),
        ({"grammar": b"x"}, TypeError, "structured_outputs.grammar must be a string"),
        ({"json_object": 1}, TypeError, "structured_outputs.json_object must be a bool"),
        (
            {"regex": "a", "disable_any_whitespace": None},
            TypeError,
            "structured_outputs.disable_any_whitespace must be a bool, got None",
        ),
    ],
)
def test_params_name_the_field_that_is_wrong(kwargs, error, match):
    with pytest.raises(error, match=match):
        StructuredOutputsParams(**kwargs)


def test_a_schema_given_as_a_dict_is_kept_as_its_text():
    params = StructuredOutputsParams(json={"type": "integer"})
    assert json.loads(params.json) == {"type": "integer"} and params.kind == "json"


def test_beam_search_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="structured_outputs is not supported with beam search"):
        SamplingParams(temperature=0.0, beam_width=2, structured_outputs=choice("a"))


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (StructuredOutputsParams(regex="a["), r"structured_outputs.regex does not compile: .*a\["),
        (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(params, match):
    with pytest.raises(ValueError, match=match):
        grammar_text(params)


def test_gbnf_grammars_are_accepted_as_well_as_lark():
    grammar_text(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    grammar_text(StructuredOutputsParams(grammar='start: "yes" | "no"'))


def test_an_engine_without_a_tokenizer_refuses_constraints():
    with pytest.raises(ValueError, match="structured_outputs.choice: this engine has no tokenizer"):
        StructuredOutput(None).new_matcher(choice("a"))


# ------------------------------------------------------------------ matchers


def test_the_mask_allows_exactly_the_grammar_s_next_tokens(structured, tokenizer):
    matcher = structured.new_matcher(choice("yes", "no"))
    mask = matcher.allowed_token_bitmask()
    assert len(mask) == 4 * ((VOCAB_SIZE + 31) // 32)
    # Whole words or their first byte; nothing past the tokenizer's own vocabulary.
    expected = {token_id(tokenizer, t) for t in ("yes", "no", "y", "n")}
    assert set(allowed_ids(mask)) == expected
    assert matcher.accept(token_id(tokenizer, "n"))
    assert allowed_ids(matcher.allowed_token_bitmask()) == [token_id(tokenizer, "o")]
    assert not matcher.is_finished
    assert matcher.accept(token_id(tokenizer, "o"))
    assert matcher.is_finished  # "no" is complete and nothing may follow it


def test_eos_is_allowed_only_where_the_output_is_complete(structured, tokenizer):
    matcher = structured.new_matcher(StructuredOutputsParams(regex="a+"))
    assert EOS not in allowed_ids(matcher.allowed_token_bitmask())
    matcher.accept(token_id(tokenizer, "a"))
    assert EOS in allowed_ids(matcher.allowed_token_bitmask())


def test_a_token_outside_the_grammar_is_refused(structured, tokenizer):
    matcher = structured.new_matcher(choice("yes"))
    assert not matcher.accept(token_id(tokenizer, "n"))
    assert matcher.error


def test_a_fork_moves_on_its_own(structured, tokenizer):
    parent = structured.new_matcher(choice("yes", "no"))
    child = parent.fork()
    assert parent.accept(token_id(tokenizer, "yes"))
    assert parent.is_finished and not child.is_finished
    assert child.accept(token_id(tokenizer, "no")) and child.is_finished


# ------------------------------------------------------------------ disable_any_whitespace


def whitespace_allowed_after_brace(structured: StructuredOutput, tokenizer, **kwargs) -> bool:
    """Whether a space may follow a JSON output's opening ``{``."""
    matcher = structured.new_matcher(StructuredOutputsParams(**kwargs))
    assert matcher.accept(token_id(tokenizer, "{"))
    return token_id(tokenizer, " ") in allowed_ids(matcher.allowed_token_bitmask())


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "constraint", [{"json_object": True}, {"json": SCHEMA}], ids=["json_object", "json"]
)
def test_disable_any_whitespace_makes_json_compact(structured, tokenizer, constraint):
    assert whitespace_allowed_after_brace(structured, tokenizer, **constraint)
    assert not whitespace_allowed_after_brace(
        structured, tokenizer, **constraint, disable_any_whitespace=True
    )


def test_a_schema_s_own_whitespace_setting_wins(structured, tokenizer):
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}
    assert whitespace_allowed_after_brace(
        structured, tokenizer, json=schema, disable_any_whitespace=True
    )


def test_the_engine_default_turns_it_on_for_every_request(tokenizer):
    vocabulary = GrammarVocabulary(tokenizer.to_str(), VOCAB_SIZE, [EOS])
    compact = StructuredOutput(vocabulary, disable_any_whitespace=True)
    assert not whitespace_allowed_after_brace(compact, tokenizer, json_object=True)
    assert not whitespace_allowed_after_brace(compact, tokenizer, json={"type": "object"})


def test_other_constraints_ignore_it(structured, tokenizer):
    matcher = structured.new_matcher(
        StructuredOutputsParams(regex="a b", disable_any_whitespace=True)
    )
    assert matcher.accept(token_id(tokenizer, "a"))
    assert allowed_ids(matcher.allowed_token_bitmask()) == [token_id(tokenizer, " ")]


# ------------------------------------------------------------------ the grammar tokenizer


def test_the_grammar_tokenizer_builds_before_any_constrained_request(tokenizer, monkeypatch):
    """Built at the first constrained request, it would pause every stream then."""
    import llguidance

    started = threading.Event()
    build = llguidance.LLTokenizer

    def recording_build(*args, **kwargs):
        started.set()
        return build(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", recording_build)
    structured = StructuredOutput(GrammarVocabulary(tokenizer.to_str(), VOCAB_SIZE, [EOS]))
    # No request has asked for a matcher: the build must have started on its own.
    assert started.wait(timeout=60)
    assert structured.wait_until_built()
    assert structured.new_matcher(choice("yes")).accept(token_id(tokenizer, "yes"))


def test_a_tokenizer_llguidance_cannot_read_fails_each_constrained_request():
    structured = StructuredOutput(GrammarVocabulary('{"model": 1}', VOCAB_SIZE, [EOS]))
    assert not structured.wait_until_built()  # the engine itself runs on
    with pytest.raises(ValueError, match="structured_outputs.choice: the model's tokenizer could"):
        structured.new_matcher(choice("a"))


# ------------------------------------------------------------------ in the scheduler


def make_scheduler(structured: StructuredOutput, num_blocks=16, **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    config.setdefault("watermark_fraction", 0.0)
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, 8), structured)


def make_request(request_id: str, num_prompt_tokens: int, constraint=None, **params) -> Request:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 16)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(10, 10 + num_prompt_tokens)),
        sampling_params=SamplingParams(structured_outputs=constraint, **params),
        eos_token_ids=frozenset({EOS}),
        arrival_time_s=0.0,
        max_model_len=256,
    )


def answer(scheduler: Scheduler, plan, tokens: dict[str, list[int]]):
    """The worker's result: for each sampling sequence, its next token from ``tokens``
    (a group's first sample: one per sample, from the list)."""
    request_ids, sampled = [], []
    for item in (*plan.new_requests, *plan.cached_requests):
        request = scheduler.requests[item.request_id]
        if item.num_computed_tokens + item.num_scheduled_tokens == request.num_tokens:
            forks = request.group is not None and request.num_output_tokens == 0
            rows = request.sampling_params.num_sequences if forks else 1
            request_ids.extend([item.request_id] * rows)
            sampled.extend(tokens[item.request_id].pop(0) for _ in range(rows))
    return scheduler.update_from_output(plan, StepResult(plan.step_id, request_ids, sampled))


def test_only_sampling_steps_carry_a_mask_and_unconstrained_requests_none(structured, tokenizer):
    scheduler = make_scheduler(structured, max_num_batched_tokens=8)
    scheduler.add_request(make_request("c", 12, choice("yes", "no")))
    scheduler.add_request(make_request("free", 2))
    plan = scheduler.schedule()  # c's first chunk of 8 tokens: it samples nothing yet
    assert plan.token_bitmasks == {}
    answer(scheduler, plan, {})
    plan = scheduler.schedule()
    assert set(plan.token_bitmasks) == {"c"}  # the last chunk samples; "free" is free
    assert token_id(tokenizer, "yes") in allowed_ids(plan.token_bitmasks["c"])
    deltas = answer(scheduler, plan, {"c": [token_id(tokenizer, "yes")], "free": [7]})
    ended = {d.request_id: d.finish_reason for d in deltas if d.finished}
    assert ended == {"c": "stop"}  # "yes" completes the choice: no EOS step needed
    assert (
        scheduler.block_manager.num_free_blocks + len(scheduler.block_manager.block_tables["free"])
        == 16
    )


def test_the_sampled_token_advances_the_grammar(structured, tokenizer):
    scheduler = make_scheduler(structured)
    scheduler.add_request(make_request("r", 4, StructuredOutputsParams(regex="ab+")))
    plan = scheduler.schedule()
    assert allowed_ids(plan.token_bitmasks["r"]) == [token_id(tokenizer, "a")]
    answer(scheduler, plan, {"r": [token_id(tokenizer, "a")]})
    plan = scheduler.schedule()
    assert allowed_ids(plan.token_bitmasks["r"]) == [token_id(tokenizer, "b")]
    answer(scheduler, plan, {"r": [token_id(tokenizer, "b")]})
    plan = scheduler.schedule()
    assert set(allowed_ids(plan.token_bitmasks["r"])) == {token_id(tokenizer, "b"), EOS}
    deltas = answer(scheduler, plan, {"r": [EOS]})
    assert deltas[0].finished and deltas[0].finish_reason == "stop"


def test_completion_ends_the_sequence_even_with_ignore_eos(structured, tokenizer):
    scheduler = make_scheduler(structured)
    scheduler.add_request(make_request("r", 4, choice("no"), ignore_eos=True, max_tokens=50))
    answer(scheduler, scheduler.schedule(), {"r": [token_id(tokenizer, "no")]})
    assert "r" not in scheduler.requests


def test_parallel_samples_each_follow_their_own_token(structured, tokenizer):
    scheduler = make_scheduler(structured)
    scheduler.add_request(make_request("g", 4, choice("yes", "no"), n=2, temperature=1.0, seed=3))
    plan = scheduler.schedule()
    yes_y, no_n = token_id(tokenizer, "y"), token_id(tokenizer, "n")
    answer(scheduler, plan, {"g": [yes_y, no_n]})
    plan = scheduler.schedule()
    masks = {item: allowed_ids(mask) for item, mask in plan.token_bitmasks.items()}
    assert masks == {"g": [token_id(tokenizer, "e")], "g#1": [token_id(tokenizer, "o")]}
    deltas = answer(
        scheduler, plan, {"g": [token_id(tokenizer, "e")], "g#1": [token_id(tokenizer, "o")]}
    )
    assert [(d.index, d.finish_reason) for d in deltas] == [(0, None), (1, "stop")]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_sequence_keeps_its_place_in_the_grammar(structured, tokenizer, mode):
    # Two blocks of 8 tokens: two 7-token prompts fit, then both grow into a second block.
    scheduler = make_scheduler(
        structured, num_blocks=3, preemption_mode=mode, max_num_batched_tokens=64
    )
    if mode == "swap":
        scheduler.block_manager = BlockManager(3, 8, num_host_blocks=4)
        scheduler = Scheduler(scheduler.config, scheduler.block_manager, structured)
    a, b = token_id(tokenizer, "a"), token_id(tokenizer, "b")
    for request_id in ("x", "y"):
        scheduler.add_request(make_request(request_id, 7, StructuredOutputsParams(regex="(ab){4}")))
    tokens = {"x": [a, b, a, b, a, b, a, b], "y": [a, b, a, b, a, b, a, b]}
    finished = {}
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        for request_id, mask in plan.token_bitmasks.items():
            # The mask always allows exactly the token the grammar is at.
            assert allowed_ids(mask) == [tokens[request_id][0]]
        for delta in answer(scheduler, plan, tokens):
            if delta.finished:
                finished[delta.request_id] = delta.finish_reason
    assert scheduler.num_preemptions > 0
    assert finished == {"x": "stop", "y": "stop"}


def test_matching_a_grammar_imports_no_torch(tokenizer):
    """The scheduler process stays torch-free with structured output in use."""
    script = f"""
import sys
from pagedserve.scheduler.sampling_params import StructuredOutputsParams
from pagedserve.scheduler.structured_output import GrammarVocabulary, StructuredOutput
structured = StructuredOutput(GrammarVocabulary({tokenizer.to_str()!r}, {VOCAB_SIZE}, [{EOS}]))
matcher = structured.new_matcher(StructuredOutputsParams(json={{"type": "object"}}))
matcher.allowed_token_bitmask()
assert "torch" not in sys.modules, "torch was imported"
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_a_request_whose_grammar_fails_to_build_is_refused_at_admission(structured):
    scheduler = make_scheduler(structured)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        scheduler.add_request(make_request("r", 4, StructuredOutputsParams(regex="(")))
    assert not scheduler.requests


def test_a_request_status_reflects_the_grammar(structured, tokenizer):
    request = make_request("r", 2, choice("no"), min_tokens=5, max_tokens=10)
    request.grammar = structured.new_matcher(request.sampling_params.structured_outputs)
    assert request.append_output_token(token_id(tokenizer, "n")) is RequestStatus.RUNNING
    # Complete before min_tokens: the grammar allows nothing more, so it ends.
    assert request.append_output_token(token_id(tokenizer, "o")) is RequestStatus.FINISHED_STOPPED


def test_a_refused_draft_leaves_the_matcher_where_it_was(structured, tokenizer):
    """Checking drafts never moves the matcher, a refused one included: llguidance puts a
    matcher that consumes a refused token in its error state, where only EOS is allowed
    (an early version checked drafts so and ended such outputs early)."""
    a, b = token_id(tokenizer, "a"), token_id(tokenizer, "b")
    matcher = structured.new_matcher(StructuredOutputsParams(regex="ab+"))
    assert matcher.usable_drafts([b]) == 0
    assert matcher.usable_drafts([a, a]) == 1
    assert matcher.usable_drafts([a, b, b, a]) == 3
    assert allowed_ids(matcher.allowed_token_bitmask()) == [a]
    assert matcher.accept(a) and matcher.accept(b)
    assert set(allowed_ids(matcher.allowed_token_bitmask())) == {b, EOS}
    # A draft after which the grammar is complete is not usable either.
    done = structured.new_matcher(choice("yes", "no"))
    assert done.usable_drafts([token_id(tokenizer, "yes")]) == 0
    assert not done.is_finished


def test_a_process_that_exits_at_once_waits_for_the_grammar_tokenizer(tmp_path):
    """An offline run can end while llguidance's tokenizer still builds on its thread. The
    interpreter must wait for it: a daemon thread ended inside llguidance's Rust frames at
    exit crashed the process (SIGSEGV) about one time in ten."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = [f" {a}{b}{c}" for a in syllables for b in syllables for c in syllables]
    tokenizer = byte_level_tokenizer(words[:60_000])  # a real model's size: a slow build
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text(tokenizer.to_str())
    vocab_size = tokenizer.get_vocab_size()
    script = f"""
import logging, sys
from pagedserve.scheduler.structured_output import GrammarVocabulary, StructuredOutput
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
text = open({str(tokenizer_file)!r}).read()
StructuredOutput(GrammarVocabulary(text, {vocab_size}, [2]))
"""  # and exit at once, the build under way
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"grammar tokenizer built ({vocab_size} tokens)" in result.stderr
