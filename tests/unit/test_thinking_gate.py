"""A reasoning model's grammar waits for the end of its thinking (``ThinkingGate``): no mask
while the output thinks, the grammar from the token after ``</think>``; Qwen3's output
thinks only if it opens with ``<think>``. Scheduler-side and torch-free, on a real
byte-level vocabulary that holds the two markers as single tokens."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import AddedToken

from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS, byte_level_piece, byte_level_tokenizer
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import StepResult
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.structured_output import GrammarVocabulary, StructuredOutput

VOCAB_SIZE = 300
EOS = BYTE_LEVEL_SPECIALS.index("<|im_end|>")
REGEX = StructuredOutputsParams(regex="ab+")


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = byte_level_tokenizer(["<think>", "</think>"])
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<think>", "</think>")])
    return tokenizer


def tid(tokenizer, text: str) -> int:
    token_id = tokenizer.token_to_id(text)
    return token_id if token_id is not None else tokenizer.token_to_id(byte_level_piece(text))


def structured_output(tokenizer, qwen3: bool) -> StructuredOutput:
    start = tid(tokenizer, "<think>") if qwen3 else None
    vocabulary = GrammarVocabulary(
        tokenizer.to_str(), VOCAB_SIZE, [EOS], start, [tid(tokenizer, "</think>")]
    )
    return StructuredOutput(vocabulary)


def allowed(bitmask: bytes) -> set[int]:
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def make_scheduler(structured: StructuredOutput) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_model_len=256, watermark_fraction=0.0, num_speculative_tokens=0),
        BlockManager(32, 8),
        structured,
    )


def make_request(request_id: str, **params) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=[10, 11, 12],
        sampling_params=SamplingParams(
            structured_outputs=REGEX, **{"temperature": 0.0, "max_tokens": 16, **params}
        ),
        eos_token_ids=frozenset({EOS}),
        arrival_time_s=0.0,
        max_model_len=256,
    )


def step(scheduler: Scheduler, tokens: dict[str, int]):
    """One step: the plan's masks, then the given token for each sampling sequence."""
    plan = scheduler.schedule()
    request_ids = [r.request_id for r in (*plan.new_requests, *plan.cached_requests)]
    result = StepResult(plan.step_id, request_ids, [tokens[r] for r in request_ids])
    return plan.token_bitmasks, scheduler.update_from_output(plan, result)


def test_deepseek_r1_thinks_unmasked_then_follows_the_grammar(tokenizer):
    scheduler = make_scheduler(structured_output(tokenizer, qwen3=False))
    scheduler.add_request(make_request("r"))
    x, end, a, b = (tid(tokenizer, t) for t in ("x", "</think>", "a", "b"))
    # Thinking: no mask, any token (b, which the grammar could not start with, too).
    for token in (x, b, x):
        masks, _ = step(scheduler, {"r": token})
        assert masks == {}
    masks, _ = step(scheduler, {"r": end})
    assert masks == {}
    masks, _ = step(scheduler, {"r": a})
    assert allowed(masks["r"]) == {a}
    masks, _ = step(scheduler, {"r": b})
    assert allowed(masks["r"]) == {b}
    masks, deltas = step(scheduler, {"r": EOS})
    assert allowed(masks["r"]) == {b, EOS}
    assert deltas[0].finished and deltas[0].finish_reason == "stop"
    assert deltas[0].new_token_ids == [EOS]


def test_qwen3_thinks_only_when_its_output_opens_with_think(tokenizer):
    structured = structured_output(tokenizer, qwen3=True)
    start, end, a, b, x = (tid(tokenizer, t) for t in ("<think>", "</think>", "a", "b", "x"))
    thinking = make_scheduler(structured)
    thinking.add_request(make_request("r"))
    masks, _ = step(thinking, {"r": start})
    assert allowed(masks["r"]) == {a, start}  # the grammar's first token, or a thinking
    for token in (x, start, end):
        masks, _ = step(thinking, {"r": token})
        assert masks == {}
    masks, _ = step(thinking, {"r": a})
    assert allowed(masks["r"]) == {a}

    answering = make_scheduler(structured)  # thinking switched off: the grammar at once
    answering.add_request(make_request("r"))
    masks, _ = step(answering, {"r": a})
    assert allowed(masks["r"]) == {a, start}
    masks, _ = step(answering, {"r": b})
    assert allowed(masks["r"]) == {b}  # no thinking later


def test_eos_while_thinking_ends_the_request_and_a_grammar_never_completes_it(tokenizer):
    scheduler = make_scheduler(structured_output(tokenizer, qwen3=False))
    scheduler.add_request(make_request("r"))
    masks, deltas = step(scheduler, {"r": EOS})
    assert masks == {}
    assert deltas[0].finished and deltas[0].finish_reason == "stop"

    limited = make_scheduler(structured_output(tokenizer, qwen3=False))
    limited.add_request(make_request("r", max_tokens=3))
    for _ in range(3):
        _, deltas = step(limited, {"r": tid(tokenizer, "x")})
    assert deltas[0].finish_reason == "length"  # thinking to the end: unconstrained


def test_forks_keep_their_own_thinking_state(tokenizer):
    scheduler = make_scheduler(structured_output(tokenizer, qwen3=False))
    scheduler.add_request(make_request("g", n=2, seed=5))
    x, end, a = (tid(tokenizer, t) for t in ("x", "</think>", "a"))
    plan = scheduler.schedule()
    assert plan.token_bitmasks == {}
    # The first sample forks: one row per sample.
    result = StepResult(plan.step_id, ["g", "g"], [end, x])
    scheduler.update_from_output(plan, result)
    child = next(r for r in scheduler.requests if r != "g")
    masks, _ = step(scheduler, {"g": a, child: x})
    assert set(masks) == {"g"} and allowed(masks["g"]) == {a}
    assert scheduler.requests[child].grammar.is_thinking
    assert scheduler.requests[child].status == RequestStatus.RUNNING


def test_drafts_across_the_end_of_the_thinking(tokenizer):
    structured = structured_output(tokenizer, qwen3=False)
    x, end, a, b = (tid(tokenizer, t) for t in ("x", "</think>", "a", "b"))
    matcher = structured.new_matcher(REGEX)
    assert matcher.forced_tokens() == []  # nothing forced while thinking
    assert matcher.usable_drafts([x, end, a, b, b]) == 5
    assert matcher.usable_drafts([x, end, b]) == 2  # b cannot open the answer
    assert not matcher.constrains([x, x]) and matcher.constrains([x, end])
    masks = matcher.draft_bitmasks([x, end, a])
    width = 4 * ((VOCAB_SIZE + 31) // 32)
    parts = [allowed(masks[i : i + width]) for i in range(0, len(masks), width)]
    assert parts == [set(range(VOCAB_SIZE))] * 2 + [{a}, {b}]
    # The matcher is where it was: still thinking, the grammar not advanced.
    assert matcher.is_thinking
    assert matcher.accept(end) and matcher.accept(a) and not matcher.is_thinking
    assert allowed(matcher.allowed_token_bitmask()) == {b}


def test_an_end_of_several_tokens_closes_the_thinking_only_when_whole(tokenizer):
    # gpt-oss's thinking ends at the header <|channel|>final<|message|>: three tokens, here
    # </think>, y and <think> standing in for them. Partial and broken runs keep it thinking;
    # a run that restarts inside a broken one (end end y start) still closes it.
    start, end, a, b, x, y = (
        tid(tokenizer, t) for t in ("<think>", "</think>", "a", "b", "x", "y")
    )
    vocabulary = GrammarVocabulary(tokenizer.to_str(), VOCAB_SIZE, [EOS], None, [end, y, start])
    matcher = StructuredOutput(vocabulary).new_matcher(REGEX)
    for token in (end, x, y, start, end, y, x, end, end, y):
        assert matcher.accept(token) and matcher.is_thinking
    assert not matcher.constrains([x]) and matcher.constrains([start])
    assert matcher.usable_drafts([start, a, b]) == 3 and matcher.usable_drafts([start, b]) == 1
    masks = matcher.draft_bitmasks([start, a])
    width = 4 * ((VOCAB_SIZE + 31) // 32)
    parts = [allowed(masks[i : i + width]) for i in range(0, len(masks), width)]
    assert parts == [set(range(VOCAB_SIZE)), {a}, {b}]
    fork = matcher.fork()
    assert matcher.accept(start) and not matcher.is_thinking  # the third token of the run
    assert allowed(matcher.allowed_token_bitmask()) == {a}
    assert fork.is_thinking and fork.accept(x) and fork.is_thinking  # its own state
    assert not fork.constrains([start])  # x broke the run: start alone does not close it


def test_glm45_s_newlines_before_think_pass_undecided(tokenizer):
    # GLM-4.5 writes "\n<think>": newlines before the opening marker pass unmasked and unseen
    # by the grammar, and what follows them decides: a thinking, or the grammar's answer.
    start, end, a, b, newline = (tid(tokenizer, t) for t in ("<think>", "</think>", "a", "b", "\n"))
    vocabulary = GrammarVocabulary(tokenizer.to_str(), VOCAB_SIZE, [EOS], start, [end], [newline])
    structured = StructuredOutput(vocabulary)
    thinking = structured.new_matcher(REGEX)
    assert allowed(thinking.allowed_token_bitmask()) == {a, start, newline}
    for token in (newline, newline):
        assert thinking.accept(token) and not thinking.is_thinking
        assert allowed(thinking.allowed_token_bitmask()) == {a, start, newline}
    assert thinking.constrains([newline, start])  # undecided: the first sample is masked
    assert thinking.usable_drafts([newline, start, b, end, a, b]) == 6
    assert thinking.accept(start) and thinking.is_thinking
    assert thinking.accept(end) and allowed(thinking.allowed_token_bitmask()) == {a}

    answering = structured.new_matcher(REGEX)
    assert answering.usable_drafts([newline, b]) == 1  # b cannot open the answer
    masks = answering.draft_bitmasks([newline, a])
    width = 4 * ((VOCAB_SIZE + 31) // 32)
    parts = [allowed(masks[i : i + width]) for i in range(0, len(masks), width)]
    assert parts == [{a, start, newline}] * 2 + [{b}]
    assert answering.accept(newline) and answering.accept(a)
    assert allowed(answering.allowed_token_bitmask()) == {b}  # the grammar took a, not "\n"
    assert not answering.accept(newline)  # no newline once the answer has begun
