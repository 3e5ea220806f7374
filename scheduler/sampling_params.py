"""Per-request generation settings, validated where the user hands them in."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedserve.scheduler.request_limits import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID_LIST,
    MIN_SAMPLING_TEMPERATURE,
    check_float,
    check_int,
    check_json_value,
    check_length,
    loads_json,
)

# The most logprobs (and prompt logprobs) a request may ask for unless the engine is told
# otherwise (vLLM's max_logprobs; the engine checks it, LLM.check_logprobs).
DEFAULT_MAX_LOGPROBS = 20


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language, vLLM's ``StructuredOutputsParams``: set exactly
    one of ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the
    output is one of these strings), ``grammar`` (Lark or GBNF) or ``json_object=True``
    (any JSON object).

    At each step the sampler may pick only tokens that keep the output a prefix of a
    string of the language (``scheduler/structured_output.py``), and EOS only where the
    output is complete; a request whose output completes the language ends there
    (finish reason ``stop``), even with ``ignore_eos``. ``max_tokens`` can still cut it
    short (finish reason ``length``). A JSON schema's ``"x-guidance"`` key takes
    llguidance's options (whitespace, for one).

    ``disable_any_whitespace`` (vLLM's option) makes ``json`` and ``json_object`` compact:
    no whitespace between JSON tokens, so a model cannot loop on it until ``max_tokens``
    (llguidance's ``whitespace_flexible: false``; a schema's own ``x-guidance`` setting
    wins). The other kinds ignore it: their grammar already says where whitespace goes.
    The engine's ``structured_outputs_disable_any_whitespace`` turns it on for every
    request.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            if isinstance(self.json, dict):
                # Kept as text: the form that crosses processes, and a copy the caller
                # cannot change under us.
                check_json_value("structured_outputs.json", self.json)
                self.json = json.dumps(self.json)
            elif not isinstance(self.json, str):
                raise TypeError(
                    f"structured_outputs.json must be a JSON schema (a dict or its text), "
                    f"got {self.json!r}"
                )
            try:
                schema = loads_json("structured_outputs.json", self.json)
            except ValueError as error:
                message = str(error)
                if not message.startswith("structured_outputs.json"):
                    message = f"structured_outputs.json is not valid JSON: {message}"
                raise ValueError(message) from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (an object), got {schema!r}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} must be a string, got {value!r}")
            if value == "":
                raise ValueError(f"structured_outputs.{name} must not be empty")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of strings, "
                    f"got {self.choice!r}"
                )
            self.choice = list(self.choice)
            check_length("structured_outputs.choice", len(self.choice), MAX_CHOICES, "strings")
            for index, text in enumerate(self.choice):
                if not isinstance(text, str):
                    raise TypeError(
                        f"structured_outputs.choice[{index}] must be a string, got {text!r}"
                    )
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}"
                )
        chosen = [name for name in STRUCTURED_OUTPUT_KINDS if self._is_set(name)]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                + (", ".join(chosen) if chosen else "none")
            )

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is True if name == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if self._is_set(name))


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    The sampler applies, in order: repetition / presence / frequency penalties, the
    ``min_tokens`` mask on EOS and stop tokens, then (greedy when ``temperature == 0``)
    temperature, top-k, top-p and min-p, and draws from what is left. A request with a
    ``seed`` draws the same tokens whatever else shares its batch; without one the engine
    assigns a seed from its own generator so runs stay reproducible.

    ``logprobs=k`` returns the log-probability of each chosen token plus the ``k`` most
    likely tokens; ``prompt_logprobs=k`` does the same for every prompt token after the
    first. Log-probabilities are those of the model's raw distribution (before
    penalties, temperature and filtering), as in vLLM.

    Several sequences per request share the prompt's KV blocks and copy a shared block
    only when they first write into it:

    - ``n`` parallel samples; with ``best_of > n``, ``best_of`` are drawn and the ``n``
      with the highest cumulative log-probability are returned. Sample ``i`` draws with
      ``derive_seed(seed, i)``, so a seeded request is reproducible as a whole.
    - ``beam_width > 1``: beam search with HF transformers' semantics (greedy only);
      ``n`` best beams are returned, scored by cumulative log-probability divided by
      ``length ** length_penalty``; ``early_stopping`` is True (stop once ``beam_width``
      hypotheses are done), False (stop when no running beam can beat them, judged at
      the current length) or "never" (judged at the longest possible length). Penalties,
      ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` act on each
      step's log-probabilities, which the beams then rank and score by (HF's processors).

    ``structured_outputs`` constrains what the output may be (``StructuredOutputsParams``:
    a JSON schema, a regex, a choice of strings, a grammar); not with beam search.
    ``logit_bias`` adds its value to the logit of each token id it names, before the
    penalties (vLLM's and HF's order); ``allowed_token_ids`` lets only those tokens be
    picked (as vLLM). Neither changes the reported logprobs (the raw distribution's).

    ``bad_words`` (vLLM's) are strings the output may not contain as tokens: the frontend
    tokenizes each (as it stands and after a space) into ``bad_words_token_ids``, and a
    step may not pick a sequence's last token where the output so far ends with the ones
    before it (a one-token word is never picked). Matched against output tokens only, as
    vLLM does; a word the tokenizer splits differently inside other text is not caught.

    The last five fields are the frontend's (the scheduler and workers ignore them).
    ``truncate_prompt_tokens`` keeps only a prompt's last k tokens (-1: as many as the
    context window holds), as vLLM does; the output's ``prompt_token_ids`` are those kept.
    ``stop`` strings end the output where one first appears in the text, even split
    across tokens (checked only after ``min_tokens``, as EOS is); the text is cut before
    it unless ``include_stop_str_in_output``, and the token ids run up to the token that
    completed it. ``skip_special_tokens`` leaves special tokens (EOS, chat markers) out of
    the text; when they are kept, ``spaces_between_special_tokens=False`` decodes the text
    between them on its own and joins it to them with nothing in between, as HF's
    Python tokenizers do (``True`` keeps the tokenizer's own spacing: ``decode``'s).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) keeps every token
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Several sequences per request, sharing the prompt's KV blocks (see class doc).
    n: int = 1
    best_of: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words as token sequences (LLM.resolve_bad_words); what the workers match.
    bad_words_token_ids: list[list[int]] | None = None
    stop: list[str] | str | None = None  # kept as a list
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    # False: no output text (token ids only), as vLLM's; saves the frontend's decoding.
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.max_tokens = check_int("max_tokens", self.max_tokens, "max_tokens")
        self.min_tokens = check_int("min_tokens", self.min_tokens, "min_tokens")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        self.temperature = check_float("temperature", self.temperature, "temperature")
        if self.temperature < MIN_SAMPLING_TEMPERATURE:
            self.temperature = 0.0  # as vLLM: logits / T would overflow; greedy is the limit
        self.top_k = check_int("top_k", self.top_k, "top_k")
        if self.top_k == -1:
            self.top_k = 0
        for name in (
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            setattr(self, name, check_float(name, getattr(self, name), name))
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, "seed")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r:.100}"
            )
        check_length("stop_token_ids", len(self.stop_token_ids), MAX_STOP_TOKEN_IDS, "ids")
        self.stop_token_ids = [
            check_int("stop_token_ids[]", token_id, "token_id") for token_id in self.stop_token_ids
        ]
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, check_int(name, value, name))
        self.stop = _check_stop_strings(self.stop)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of token ids, "
                    f"got {self.allowed_token_ids!r}"
                )
            check_length("allowed_token_ids", len(self.allowed_token_ids), MAX_TOKEN_ID_LIST, "ids")
            self.allowed_token_ids = [
                check_int("allowed_token_ids[]", token_id, "token_id")
                for token_id in self.allowed_token_ids
            ]
        self._check_bad_words()
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = check_int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens, "truncate_prompt_tokens"
            )
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be -1 or >= 1, got 0")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise TypeError(
                f"structured_outputs must be a StructuredOutputsParams, "
                f"got {self.structured_outputs!r}"
            )
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.detokenize and self.stop:
            raise ValueError(
                "stop strings are matched in the output text: they need detokenize=True"
            )
        self._check_sequences()

    def _check_bad_words(self) -> None:
        words = self.bad_words
        if words is not None:
            if isinstance(words, str) or not isinstance(words, (list, tuple)):
                raise TypeError(f"bad_words must be a list of strings, got {words!r:.100}")
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words must have <= {MAX_BAD_WORDS} words, got {len(words)}")
            for word in words:
                if not isinstance(word, str) or not word.strip():
                    raise ValueError(f"bad_words[] must be non-blank strings, got {word!r:.100}")
                check_length("bad_words[]", len(word), MAX_BAD_WORD_CHARS, "characters")
            self.bad_words = list(words) or None
        sequences = self.bad_words_token_ids
        if sequences is not None:
            if not isinstance(sequences, (list, tuple)):
                raise TypeError(
                    f"bad_words_token_ids must be a list of token id lists, got {sequences!r:.100}"
                )
            check_length("bad_words_token_ids", len(sequences), 2 * MAX_BAD_WORDS, "sequences")
            checked = []
            for sequence in sequences:
                if not isinstance(sequence, (list, tuple)) or not sequence:
                    raise ValueError(
                        f"bad_words_token_ids[] must be non-empty lists of token ids, "
                        f"got {sequence!r:.100}"
                    )
                check_length("bad_words_token_ids[]", len(sequence), MAX_BAD_WORD_CHARS, "ids")
                checked.append(
                    [
                        check_int("bad_words_token_ids[][]", token_id, "token_id")
                        for token_id in sequence
                    ]
                )
            self.bad_words_token_ids = checked

    def _check_sequences(self) -> None:
        self.n = check_int("n", self.n, "n")
        self.beam_width = check_int("beam_width", self.beam_width, "beam_width")
        if self.best_of is not None:
            self.best_of = check_int("best_of", self.best_of, "best_of")
            if self.best_of < self.n:
                raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        self.length_penalty = check_float("length_penalty", self.length_penalty, "length_penalty")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
        if self.use_beam_search:
            if self.n > self.beam_width:
                raise ValueError(f"n ({self.n}) must be <= beam_width ({self.beam_width})")
            if self.best_of is not None and self.best_of != self.beam_width:
                raise ValueError(
                    f"best_of ({self.best_of}) is the beam width in beam search; "
                    f"leave it unset or equal to beam_width ({self.beam_width})"
                )
            if self.temperature != 0.0:
                raise ValueError(
                    f"beam search is deterministic: temperature must be 0, got {self.temperature}"
                )
            if self.logprobs is not None:
                raise ValueError(
                    "logprobs is not supported with beam search (each output reports its "
                    "cumulative_logprob)"
                )
            if self.structured_outputs is not None:
                raise ValueError(
                    "structured_outputs is not supported with beam search (beams are "
                    "chosen from the unconstrained candidates)"
                )

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: the beams, or ``best_of`` (default ``n``) samples."""
        if self.use_beam_search:
            return self.beam_width
        return self.n if self.best_of is None else self.best_of

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def derive_seed(seed: int, sequence_index: int) -> int:
    """The seed of sample ``sequence_index`` of a request seeded with ``seed``: sample 0
    keeps the request's seed (so ``n=1`` draws what it always drew), the others get
    well-separated seeds that depend only on (seed, index)."""
    if sequence_index == 0:
        return seed
    mask = (1 << 64) - 1
    z = (seed + sequence_index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1  # 63 bits: seeds are non-negative int64 on the wire


def _check_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    check_length("logit_bias", len(bias), MAX_TOKEN_ID_LIST, "entries")
    checked = {}
    for token_id, value in bias.items():
        token_id = check_int("logit_bias key", token_id, "token_id")
        checked[token_id] = check_float(f"logit_bias[{token_id}]", value, "logit_bias")
    return checked or None


def token_ids_outside_vocabulary(params: SamplingParams, vocab_size: int) -> str | None:
    """Which of ``params``'s token-id fields names an id the model does not have, as an
    error message (None when all are inside ``[0, vocab_size)``)."""
    for name, token_ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias or ()),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words_token_ids", [t for ids in params.bad_words_token_ids or () for t in ids]),
    ):
        outside = [token_id for token_id in token_ids if token_id >= vocab_size]
        if outside:
            return f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
    return None


def _check_stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r:.100}")
    check_length("stop", len(stop), MAX_STOP_STRINGS, "strings")
    for index, text in enumerate(stop):
        if not isinstance(text, str):
            raise TypeError(f"stop[{index}] must be a string, got {text!r:.100}")
        if not text:
            raise ValueError(f"stop[{index}] must have at least 1 character, got ''")
        check_length(f"stop[{index}]", len(text), MAX_STOP_STRING_CHARS, "characters")
    return list(stop)
