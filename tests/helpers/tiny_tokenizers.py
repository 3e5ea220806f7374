"""Small tokenizers built in code (nothing downloads), shaped like the two kinds the engine
meets: SentencePiece with byte fallback (Llama: ``▁`` for spaces, ``<0xE2>`` tokens for
bytes no piece covers) and byte-level BPE (GPT-2, SmolLM2: every byte a printable
character, ``Ġ`` for a space). Pieces are given as text, or as bytes for a piece that
holds part of a character.

Test modules import it as ``helpers.tiny_tokenizers``: pytest puts ``tests/`` (the folder
of ``tests/conftest.py``) on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

Piece = str | bytes

SENTENCEPIECE_SPECIALS = ("<unk>", "<s>", "</s>")
BYTE_LEVEL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_fallback_tokenizer(pieces: Sequence[str], vocab_size: int | None = None) -> Tokenizer:
    """Llama-style: ids 0-2 are ``<unk> <s> </s>``, 3-258 the byte tokens ``<0x00>`` ...
    ``<0xFF>``, then ``▁`` and ``pieces`` (``▁`` marks a space), then filler pieces up to
    ``vocab_size``. No merges: encoding gives one token per character, and a byte token
    per UTF-8 byte of a character that has no piece."""
    vocab = {token: index for index, token in enumerate(SENTENCEPIECE_SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ["▁", *pieces]:
        vocab.setdefault(piece, len(vocab))
    _fill(vocab, vocab_size, lambda word: "▁" + word)
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SENTENCEPIECE_SPECIALS])
    return tokenizer


def byte_level_tokenizer(pieces: Sequence[Piece], vocab_size: int | None = None) -> Tokenizer:
    """GPT-2-style: ids 0-2 are ``<|endoftext|> <|im_start|> <|im_end|>``, then the 256
    single bytes, then ``pieces`` (text, or bytes that may split a character), then
    filler pieces up to ``vocab_size``. No merges: encoding gives one token per byte."""
    vocab = {token: index for index, token in enumerate(BYTE_LEVEL_SPECIALS)}
    for byte in range(256):
        vocab[_BYTE_TO_CHAR[byte]] = len(vocab)
    for piece in pieces:
        vocab.setdefault(byte_level_piece(piece), len(vocab))
    _fill(vocab, vocab_size, lambda word: byte_level_piece(" " + word))
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in BYTE_LEVEL_SPECIALS])
    return tokenizer


def byte_level_piece(piece: Piece) -> str:
    """A piece as byte-level BPE writes it in its vocabulary: " hi" -> "Ġhi"."""
    data = piece.encode() if isinstance(piece, str) else piece
    return "".join(_BYTE_TO_CHAR[byte] for byte in data)


def ids_of(tokenizer: Tokenizer, tokens: Sequence[str]) -> list[int]:
    """Token ids of vocabulary entries, failing loudly on a typo."""
    ids = [tokenizer.token_to_id(token) for token in tokens]
    missing = [token for token, token_id in zip(tokens, ids) if token_id is None]
    assert not missing, f"not in the vocabulary: {missing}"
    return ids


def save_for_transformers(tokenizer: Tokenizer, directory: Path, specials: Sequence[str]) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` so that
    ``AutoTokenizer.from_pretrained(directory)`` (and so ``Tokenizer``) loads it."""
    from transformers import PreTrainedTokenizerFast

    unk, bos, eos = specials
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token=unk, bos_token=bos, eos_token=eos
    )
    wrapped.save_pretrained(directory)
    return directory


def _fill(vocab: dict[str, int], vocab_size: int | None, spell) -> None:
    """Deterministic two-syllable words ("▁bako", "Ġbako") until the vocabulary is full."""
    if vocab_size is None:
        return
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = (first + second for first in syllables for second in syllables)
    while len(vocab) < vocab_size:
        vocab.setdefault(spell(next(words)), len(vocab))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (printable ASCII maps to itself)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_CHAR = _bytes_to_unicode()
