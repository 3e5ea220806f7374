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
"""

from __future__ import annotations

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


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, num_words: int) -> None:
        self._matcher = matcher
        self._num_words = num_words

    def allowed_token_bitmask(self) -> bytes:
        """Bit ``t`` (little-endian, 32 tokens per int32 word) is set when token ``t`` may
        come next; exactly the model's vocabulary wide."""
        mask = self._matcher.compute_bitmask()
        return mask[: 4 * self._num_words]

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it (the matcher
        is then in its error state, and ``error`` says why)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The output is complete and nothing may follow (EOS, if any, was consumed, or the
        language has no longer strings)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self._num_words)

    # ---------------------------------------------------- speculative decoding

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (a JSON key, punctuation): speculation's best
        drafts, since sampling under the mask can hardly disagree."""
        return self._matcher.compute_ff_tokens()

    def usable_drafts(self, drafts: list[int]) -> int:
        """How many of ``drafts`` a speculating sequence may score: each allowed after the
        ones before it, and none after which the grammar is complete (that position would
        have no token to allow). The matcher ends where it began."""
        matcher = self._matcher
        usable = 0
        for token_id in drafts:
            if not matcher.consume_token(token_id):
                break
            if matcher.is_stopped():
                matcher.rollback(1)
                break
            usable += 1
        if usable:
            matcher.rollback(usable)
        return usable

    def draft_bitmasks(self, drafts: list[int]) -> bytes:
        """The allowed-token bitmasks at the ``len(drafts) + 1`` positions a speculating
        sequence samples (after 0, 1, ... of its drafts), concatenated; the drafts must be
        usable (``usable_drafts``). The matcher ends where it began."""
        masks = [self.allowed_token_bitmask()]
        for token_id in drafts:
            self._matcher.consume_token(token_id)
            masks.append(self.allowed_token_bitmask())
        if drafts:
            self._matcher.rollback(len(drafts))
        return b"".join(masks)


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
            self._build = threading.Thread(
                target=self._build_tokenizer, name="pagedserve-grammar-tokenizer", daemon=True
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
        return GrammarMatcher(matcher, (self._vocabulary.vocab_size + 31) // 32)

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
