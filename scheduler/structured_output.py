"""Structured output: which tokens keep a request's output inside its grammar.

The scheduler owns one grammar matcher per constrained sequence (llguidance's
``LLMatcher``, an Earley parser over the model's vocabulary). Before a step, each
constrained sequence that samples gets a bitmask of the tokens its grammar allows next
(``StepPlan.token_bitmasks``); the worker's sampler sets every other logit to -inf. After
the step the sampled token advances the matcher (``Request.append_output_token``). Keeping
the matchers here, not in the workers, means one matcher per sequence whatever the
tensor-parallel size, and a preempted sequence keeps its parser state: recompute and swap
move K/V, not grammar state. A fork (``n > 1``) copies its parent's matcher.

Everything here is torch-free (llguidance is Rust with numpy-free Python bindings); it is
imported only when a request asks for structured output, so an engine that never sees one
never loads it.
"""

from __future__ import annotations

import json
import logging
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

    grammar = _unchecked_grammar_text(params)
    error = LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(f"structured_outputs.{params.kind} does not compile: {error.strip()}")
    return grammar


def _unchecked_grammar_text(params: StructuredOutputsParams) -> str:
    """``params`` in llguidance's grammar format, not yet checked for compiling (the matcher
    built from it checks that too: the scheduler need not parse the grammar twice)."""
    import llguidance
    from llguidance import LLMatcher

    kind = params.kind
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(params.json)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
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


class StructuredOutput:
    """Builds grammar matchers over one model's vocabulary. The llguidance tokenizer (about
    0.4 s for a 49k vocabulary) is built at the first constrained request, not at start-up."""

    def __init__(self, vocabulary: GrammarVocabulary | None) -> None:
        self._vocabulary = vocabulary
        self._tokenizer: Any = None

    @property
    def available(self) -> bool:
        return self._vocabulary is not None

    def new_matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A matcher at the start of ``params``'s grammar; ``ValueError`` naming the field
        when it cannot be built."""
        if self._vocabulary is None:
            raise ValueError(
                f"structured_outputs.{params.kind}: this engine has no tokenizer (the model "
                "directory has no tokenizer files), so it cannot constrain text"
            )
        from llguidance import LLMatcher

        grammar = _unchecked_grammar_text(params)
        matcher = LLMatcher(self._llguidance_tokenizer(), grammar, log_level=_MATCHER_LOG_LEVEL)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error().strip()}")
        return GrammarMatcher(matcher, (self._vocabulary.vocab_size + 31) // 32)

    def _llguidance_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            vocabulary = self._vocabulary
            self._tokenizer = LLTokenizer(
                vocabulary.tokenizer_json,
                n_vocab=vocabulary.vocab_size,
                eos_token=list(vocabulary.eos_token_ids) or None,
            )
            logger.info(
                "structured output: grammar tokenizer built (%d tokens)", vocabulary.vocab_size
            )
        return self._tokenizer
