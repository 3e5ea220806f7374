"""One request's output text: decoded as its tokens arrive, and cut at a stop string.

Decoding token by token is not ``decode([token])`` per token: a character may be split
across tokens (byte-level BPE pieces, SentencePiece ``<0xF0>`` byte-fallback tokens), and
some decoders drop the first token's leading space. So, as vLLM and TGI do, the
detokenizer decodes a short window of recent tokens twice and emits the difference, and
only once it no longer ends with U+FFFD, the replacement character of an incomplete
UTF-8 sequence::

    token_ids  [ ... already emitted ... | t5 t6 | t7 t8 ]
                                         ^       ^       ^
                              prefix_offset  read_offset  end
    prefix_text = decode(t5 t6)         (emitted last time)
    window_text = decode(t5 t6 t7 t8)   -> emits window_text[len(prefix_text):]
                                           unless it ends with U+FFFD (wait for more)

After an emission the window slides: ``prefix_offset`` to ``read_offset``, ``read_offset``
to the end. Each step costs two decodes of a few tokens, whatever the output's length.
Concatenated, the emissions equal ``Tokenizer.decode`` of all the output tokens whenever
the output is valid UTF-8 (when it ends on an incomplete character, the replacement
characters are emitted as ``decode`` shows them), and for byte-level BPE always. A
byte-fallback decoder is the exception on invalid UTF-8: it turns a whole run of byte
tokens into replacement characters, characters already shown included; those stay shown.

Stop strings are looked for in the text each token adds plus the ``len(stop) - 1``
characters before it, so one split across tokens is found; the first to complete wins.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.frontend.tokenizer import Tokenizer
from pagedserve.scheduler.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The text of one request's output so far, and whether a stop string ended it.

    Feed it every generated token, in order, with ``append``. ``text`` only ever grows
    while the request runs (a tail that may yet turn out to start a stop string is held
    back), and is final once ``finished``.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        # Kept special tokens split the text into segments, each decoded on its own.
        self._split_at_special_tokens = not (
            params.skip_special_tokens or params.spaces_between_special_tokens
        )
        self._special_token_ids = tokenizer.special_token_ids
        self._stop_strings = params.stop
        self._include_stop_str = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Text that a stop string starting in it would remove is not shown yet.
        self._hold_back_chars = (
            max(map(len, params.stop)) - 1 if params.stop and not self._include_stop_str else 0
        )
        # The tokens that reach the decoder (skipped special tokens never do).
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text: str | None = ""  # decode of [prefix_offset, read_offset); lazy
        self._text = ""
        self.num_tokens = 0  # every token appended, decoded or not
        self.finished = False
        self.stop_string: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """The output text: all of it once finished, else what can no longer change."""
        if self.finished or not self._hold_back_chars:
            return self._text
        return self._text[: max(0, len(self._text) - self._hold_back_chars)]

    def append(self, token_ids: Sequence[int], finished: bool = False) -> int:
        """Decode the request's next tokens; ``finished`` when the engine ended the request
        with the last of them. Returns how many of them belong to the output: all,
        unless one completes a stop string, which ends the output at that token
        (``stop_string`` is then set and the engine must end the request)."""
        if self.finished:
            raise RuntimeError("append() after the output has finished")
        last = len(token_ids) - 1
        for index, token_id in enumerate(token_ids):
            self.num_tokens += 1
            num_chars_before = len(self._text)
            self._push(token_id)
            if not self._stop_strings:
                continue  # decoded once per call, below
            # NOTE: a decode per token, not per call, only for requests with stop strings:
            # the token that completes one is the last the output keeps.
            self._decode_window(flush=finished and index == last)
            # As for EOS, the first min_tokens tokens cannot end the request.
            if self.num_tokens > self._min_tokens and self._find_stop_string(
                len(self._text) - num_chars_before
            ):
                self.finished = True
                return index + 1
        if not self._stop_strings:
            self._decode_window(flush=finished)
        self.finished = finished
        return len(token_ids)

    # ------------------------------------------------------------------ internals

    def _push(self, token_id: int) -> None:
        if token_id in self._special_token_ids:
            if self._skip_special_tokens:
                return
            if self._split_at_special_tokens:
                # The segment before it ends here, complete or not; the next starts fresh.
                self._decode_window(flush=True)
                self._text += self._tokenizer.token_text(token_id)
                self._prefix_offset = self._read_offset = len(self._token_ids)
                self._prefix_text = ""
                return
        self._token_ids.append(token_id)

    def _decode_window(self, flush: bool) -> None:
        """Emit the text of the tokens past ``read_offset`` if it is complete (or if
        ``flush``: the output or its segment ends here)."""
        token_ids = self._token_ids
        if self._read_offset == len(token_ids):
            return
        decode = self._tokenizer.decode
        if self._prefix_text is None:
            self._prefix_text = decode(
                token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=False
            )
        window_text = decode(token_ids[self._prefix_offset :], skip_special_tokens=False)
        if len(window_text) <= len(self._prefix_text):
            return  # nothing visible yet (e.g. a token that decodes to nothing)
        if window_text.endswith(REPLACEMENT_CHAR) and not flush:
            return  # a character still incomplete: wait for its next bytes
        self._text += window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        self._prefix_text = None

    def _find_stop_string(self, num_new_chars: int) -> bool:
        """Look for a stop string ending in the last ``num_new_chars`` characters; on a
        match, cut the text there and record it."""
        if num_new_chars <= 0:
            return False
        text = self._text
        first: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop_strings:
            # Earlier text was searched before: a match must end in the new characters.
            start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if start != -1 and (first is None or (start + len(stop), start) < first[:2]):
                first = (start + len(stop), start, stop)
        if first is None:
            return False
        end, start, self.stop_string = first
        self._text = text[: end if self._include_stop_str else start]
        return True
