"""Structured output: which tokens keep a request's output inside its grammar.

The scheduler owns one grammar matcher per constrained sequence (llguidance's
``LLMatcher``, an Earley parser over the model's vocabulary). Before a step, each
constrained sequence that samples gets a bitmask of the tokens its grammar allows next
(``StepPlan.token_bitmasks``); the worker's sampler sets every other logit to -inf. After
the step the sampled token advances the matcher (``Request.append_output_token``). Keeping
the matchers here, not in the workers, means one matcher per sequence whatever the
tensor-parallel size, and a preempted sequence keeps its parser state: recompute and swap
move K/V, not grammar state. A fork (``n > 1``) copies its parent's matcher.

Everything here is torch-free (llguidance is Rust with numpy-free Python bindings). The
frontend imports it to check constraints; an engine with a tokenizer builds llguidance's
tokenizer at start-up (``StructuredOutput``).

A reasoning model thinks before it answers (``<think> ... </think>``); with the engine's
``reasoning_parser`` a grammar constrains only the answer, as vLLM's does: no mask while the
output thinks, the grammar from the token after the end of the thinking on
(``ThinkingGate``): one token (``</think>``), or a run of them (gpt-oss's harmony header
``<|channel|>final<|message|>``).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from pagedserve.scheduler.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# llguidance's log level for matchers: 0 keeps grammar warnings out of the engine's log
# (a request's grammar errors reach its caller instead).
_MATCHER_LOG_LEVEL = 0


@dataclass(frozen=True)
class GrammarVocabulary:
    """What matching a grammar needs to know of the model's tokens, sent once by the
    frontend (which owns the tokenizer; the scheduler never reads model files).

    ``tokenizer_json`` is the HF ``tokenizers`` serialization (``tokenizer.json``'s
    text, added tokens included); ``vocab_size`` is the width of the model's logits, which
    may exceed the tokenizer's (padded embeddings): ids past the tokenizer's are never
    allowed. ``eos_token_ids`` are allowed exactly where the output is complete.
    """

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: list[int]
    # A reasoning model's markers (``ThinkingGate``); None: grammars constrain everything.
    think_start_token_id: int | None = None
    think_end_token_ids: list[int] | None = None
    think_lead_token_ids: list[int] | None = None

    @property
    def thinking_gate(self) -> ThinkingGate | None:
        if not self.think_end_token_ids:
            return None
        return ThinkingGate(
            tuple(self.think_end_token_ids),
            self.think_start_token_id,
            tuple(self.think_lead_token_ids or ()),
        )


@dataclass(frozen=True)
class ThinkingGate:
    """Where a reasoning model's thinking ends, so that its grammar constrains the answer
    only: the thinking closes once its last tokens are ``end_token_ids`` (``</think>``'s one
    token; gpt-oss's ``<|channel|>final<|message|>``, three); with ``start_token_id`` (Qwen3)
    the output thinks only if its first token is that one (otherwise, thinking switched off,
    the grammar holds from the first token, which may also be ``start_token_id``); without
    it (DeepSeek-R1, whose chat template opens the thinking; gpt-oss) the output thinks from
    its start. ``lead_token_ids`` (GLM-4.5's newline, which it writes before ``<think>``)
    may come before ``start_token_id``, any number of them, without deciding: they pass
    unmasked and unseen by the grammar (the reasoning parser drops them from both parts)."""

    end_token_ids: tuple[int, ...]
    start_token_id: int | None = None
    lead_token_ids: tuple[int, ...] = ()

    def after(self, recent: tuple[int, ...], token_id: int) -> tuple[bool, tuple[int, ...]]:
        """A thinking output's next token: (whether it closes the thinking, the tokens to
        remember: the ones that may begin ``end_token_ids``)."""
        tail = (*recent, token_id)[-len(self.end_token_ids) :]
        if tail == self.end_token_ids:
            return True, ()
        return False, tail[1:] if len(tail) == len(self.end_token_ids) else tail


# Where a gated output stands: before its first token (Qwen3: it may open a thinking),
# thinking (no mask), or under its grammar.
_UNDECIDED = "undecided"
_THINKING = "thinking"
_GRAMMAR = "grammar"


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``; ``ValueError`` naming the field when the
    constraint does not compile (a bad regex, an invalid schema, a grammar's syntax).
    Needs no tokenizer, so the frontend checks requests with it before admitting them."""
    from llguidance import LLMatcher

    grammar = _unchecked_grammar_text(params, params.disable_any_whitespace)
    error = LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"structured_outputs.{params.kind} does not compile: {error.strip()}")
    return grammar


def _unchecked_grammar_text(params: StructuredOutputsParams, disable_any_whitespace: bool) -> str:
    """``params`` in llguidance's grammar format, not yet checked for compiling (the matcher
    built from it checks that too: the scheduler need not parse the grammar twice).
    ``disable_any_whitespace`` makes JSON compact; other kinds ignore it."""
    import llguidance
    from llguidance import LLMatcher

    kind = params.kind
    # As defaults, not overrides: llguidance applies defaults, then the schema's own
    # "x-guidance", then overrides, so a schema that asks for whitespace still gets it.
    json_options = {"whitespace_flexible": False} if disable_any_whitespace else None
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(params.json, defaults=json_options)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema(
                json.dumps({"type": "object"}), defaults=json_options
            )
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # Each choice is matched as a literal string (no regex meaning).
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(text) for text in params.choice)
            )
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as error:
        raise ValueError(f"structured_outputs.{kind}: {error}") from None


# A gated output's state: where it stands, and while it thinks the last tokens it wrote that
# may begin the end of the thinking (``ThinkingGate.after``).
_State = tuple[str, tuple[int, ...]]


class GrammarMatcher:
    """One sequence's position in its grammar, behind its ``ThinkingGate`` if any."""

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        gate: ThinkingGate | None = None,
        state: _State | None = None,
    ) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._num_words = (vocab_size + 31) // 32
        self._gate = gate
        if state is None:
            state = (_GRAMMAR, ())
            if gate is not None:
                state = (_THINKING if gate.start_token_id is None else _UNDECIDED, ())
        self._state = state

    def allowed_token_bitmask(self) -> bytes:
        """Bit ``t`` (little-endian, 32 tokens per int32 word) is set when token ``t`` may
        come next; exactly the model's vocabulary wide."""
        return self._bitmask(self._state)

    def _bitmask(self, state: _State) -> bytes:
        if state[0] == _THINKING:
            return _all_tokens_bitmask(self._vocab_size)
        mask = self._matcher.compute_bitmask()[: 4 * self._num_words]
        if state[0] == _UNDECIDED:  # the grammar's tokens, or those that may open a thinking
            mask = bytearray(mask)
            for token_id in (self._gate.start_token_id, *self._gate.lead_token_ids):
                word, bit = divmod(token_id, 32)
                mask[4 * word + bit // 8] |= 1 << (bit % 8)
            mask = bytes(mask)
        return mask

    def _next_state(self, state: _State, token_id: int) -> tuple[_State, bool]:
        """The state after ``token_id``, and whether the grammar must consume it."""
        if state[0] == _UNDECIDED:
            if token_id == self._gate.start_token_id:
                return (_THINKING, ()), False
            if token_id in self._gate.lead_token_ids:
                return state, False
            return (_GRAMMAR, ()), True
        if state[0] == _THINKING:
            closes, recent = self._gate.after(state[1], token_id)
            return ((_GRAMMAR, ()) if closes else (_THINKING, recent)), False
        return state, True

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it (the matcher
        is then in its error state, and ``error`` says why)."""
        state, by_grammar = self._next_state(self._state, token_id)
        if by_grammar and not self._matcher.consume_token(token_id):
            return False
        self._state = state
        return True

    @property
    def is_thinking(self) -> bool:
        """The output thinks: its grammar waits for the end of the thinking."""
        return self._state[0] == _THINKING

    def constrains(self, drafts: list[int]) -> bool:
        """Whether a step that samples after 0, 1, ... of ``drafts`` needs masks: not while
        the output thinks throughout."""
        state = self._state
        for token_id in drafts:
            if state[0] != _THINKING:
                break
            state, _ = self._next_state(state, token_id)
        return state[0] != _THINKING

    @property
    def is_finished(self) -> bool:
        """The output is complete and nothing may follow (EOS, if any, was consumed, or the
        language has no longer strings)."""
        return self._state[0] == _GRAMMAR and self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self._vocab_size, self._gate, self._state)

    # ---------------------------------------------------- speculative decoding

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (a JSON key, punctuation): speculation's best
        drafts, since sampling under the mask can hardly disagree. None while thinking."""
        if self._state[0] != _GRAMMAR:
            return []
        return self._matcher.compute_ff_tokens()

    def usable_drafts(self, drafts: list[int]) -> int:
        """How many of ``drafts`` a speculating sequence may score: each allowed after the
        ones before it, and none after which the grammar is complete (that position would
        have no token to allow). The matcher ends where it began."""
        # The gate passes a thinking prefix through; the grammar takes the rest.
        state = self._state
        first = 0
        while first < len(drafts):
            state, by_grammar = self._next_state(state, drafts[first])
            if by_grammar:
                break
            first += 1
        rest = drafts[first:]
        if not rest:
            return len(drafts)
        matcher = self._matcher
        # validate_tokens leaves the matcher as it is; consume_token on a token the
        # grammar refuses would put it in its error state, where only EOS is allowed.
        num_valid = matcher.validate_tokens(rest)
        usable = 0
        for token_id in rest[:num_valid]:
            matcher.consume_token(token_id)
            if matcher.is_stopped():
                matcher.rollback(1)
                break
            usable += 1
        if usable:
            matcher.rollback(usable)
        return first + usable

    def draft_bitmasks(self, drafts: list[int]) -> bytes:
        """The allowed-token bitmasks at the ``len(drafts) + 1`` positions a speculating
        sequence samples (after 0, 1, ... of its drafts), concatenated; the drafts must be
        usable (``usable_drafts``). The matcher ends where it began."""
        state = self._state
        masks = [self._bitmask(state)]
        consumed = 0
        for token_id in drafts:
            state, by_grammar = self._next_state(state, token_id)
            if by_grammar:
                self._matcher.consume_token(token_id)
                consumed += 1
            masks.append(self._bitmask(state))
        if consumed:
            self._matcher.rollback(consumed)
        return b"".join(masks)


@functools.lru_cache(maxsize=4)
def _all_tokens_bitmask(vocab_size: int) -> bytes:
    """The bitmask that allows every token of the vocabulary (a thinking output's)."""
    full_words, rest = divmod(vocab_size, 32)
    tail = ((1 << rest) - 1).to_bytes(4, "little") if rest else b""
    return b"\xff\xff\xff\xff" * full_words + tail


class StructuredOutput:
    """Builds grammar matchers over one model's vocabulary.

    llguidance's tokenizer (about 0.5 s for a 49k vocabulary) starts building on a thread
    as soon as this is made, not at the first constrained request, and ``new_matcher``
    waits for it. NOTE: the build holds the GIL throughout (measured on the embedded
    model: a loop ticking on the main thread stalled 0.48 s of the 0.51 s build), so built
    beside the engine loop it would still pause every stream once. The thread pays off
    only where the main thread is waiting anyway: the scheduler process makes this while
    its workers load and calls ``wait_until_built`` before it reports ready, so there no
    request ever waits for the tokenizer.

    ``disable_any_whitespace`` is the engine's default for every request's
    ``StructuredOutputsParams.disable_any_whitespace`` (either one turns it on).
    """

    def __init__(
        self, vocabulary: GrammarVocabulary | None, disable_any_whitespace: bool = False
    ) -> None:
        self._vocabulary = vocabulary
        self._disable_any_whitespace = disable_any_whitespace
        self._tokenizer: Any = None
        self._build_error: Exception | None = None
        self._build: threading.Thread | None = None
        if vocabulary is not None:
            # Not a daemon: the interpreter waits for the build before it finalizes. A
            # daemon thread still inside llguidance at exit is ended by a forced unwind
            # through its Rust frames, which crashed the process (SIGSEGV) after a short
            # offline run about one time in ten.
            self._build = threading.Thread(
                target=self._build_tokenizer, name="pagedserve-grammar-tokenizer", daemon=False
            )
            self._build.start()

    @property
    def available(self) -> bool:
        return self._vocabulary is not None

    def wait_until_built(self) -> bool:
        """Block until llguidance's tokenizer is built; False when there is no vocabulary or
        the build failed (the first constrained request then reports why)."""
        if self._build is not None:
            self._build.join()
        return self._tokenizer is not None

    def new_matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A matcher at the start of ``params``'s grammar; ``ValueError`` naming the field
        when it cannot be built."""
        if self._vocabulary is None:
            raise ValueError(
                f"structured_outputs.{params.kind}: this engine has no tokenizer (the model "
                "directory has no tokenizer files), so it cannot constrain text"
            )
        from llguidance import LLMatcher

        disable_any_whitespace = params.disable_any_whitespace or self._disable_any_whitespace
        grammar = _unchecked_grammar_text(params, disable_any_whitespace)
        if not self.wait_until_built():
            raise ValueError(
                f"structured_outputs.{params.kind}: the model's tokenizer could not be used "
                f"for grammars: {self._build_error}"
            )
        matcher = LLMatcher(self._tokenizer, grammar, log_level=_MATCHER_LOG_LEVEL)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error().strip()}")
        return GrammarMatcher(matcher, self._vocabulary.vocab_size, self._vocabulary.thinking_gate)

    def _build_tokenizer(self) -> None:
        from llguidance import LLTokenizer

        vocabulary = self._vocabulary
        try:
            self._tokenizer = LLTokenizer(
                vocabulary.tokenizer_json,
                n_vocab=vocabulary.vocab_size,
                eos_token=list(vocabulary.eos_token_ids) or None,
            )
        except Exception as error:  # reported to each constrained request, not the engine
            self._build_error = error
            return
        logger.info("structured output: grammar tokenizer built (%d tokens)", vocabulary.vocab_size)
