"""How an embedding model pools its hidden states (vLLM's ``PoolerConfig``): which tokens'
final hidden states make the vector, and whether it is L2-normalized by default.

A sentence-transformers model says it in its own files, which vLLM reads and so do we:
``modules.json`` lists the modules (the transformer, then ``Pooling``, and ``Normalize``
when the vectors are normalized), and the Pooling module's ``config.json`` its mode
(``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``).
A model without them pools its last token, normalized (e5-mistral, gte-Qwen2 and
Qwen3-Embedding ship last-token configs). ``pooler_config`` (``--pooler-config``) replaces
what the files say: ``{"pooling_type": "MEAN", "normalize": false}``.

Pooling types: ``LAST`` (the last prompt token's state), ``MEAN`` (the mean over every prompt
token's state, sentence-transformers' ``mean_tokens``) and ``CLS`` (the first token's). A
mode or module this engine cannot reproduce (max or weighted-mean pooling, an instruction
excluded from the pool, a Dense projection after it) is refused when the model loads,
naming the file and the field, rather than answered with another vector.

Its ``sentence_bert_config.json`` says two more things vLLM honours: ``max_seq_length`` (the
context window; a longer ``max_model_len`` is refused) and ``do_lower_case`` (texts are
lowercased before they are tokenized).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes -> ours (the others are refused by name).
_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_ST = "sentence_transformers.models."
# Modules that change nothing the engine computes (the transformer is the model itself).
_NEUTRAL_MODULES = {_ST + "Transformer", _ST + "Pooling", _ST + "Normalize"}


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type``: one of ``POOLING_TYPES``. ``normalize``: the default of a request
    that does not say (the OpenAI API's embeddings are normalized; a sentence-transformers
    model without a Normalize module is not). ``source``: where it was read, for the log."""

    pooling_type: str = "LAST"
    normalize: bool = True
    source: str = "default"

    @property
    def needs_whole_prompt(self) -> bool:
        """MEAN and CLS read tokens a chunked or prefix-cached prompt would not compute in
        its last step: such a model runs with both off."""
        return self.pooling_type != "LAST"


def read_pooler_config(model_dir: Path, override: dict[str, Any] | None = None) -> PoolerConfig:
    """The model's pooling: ``override`` (``pooler_config``) if given, else its
    sentence-transformers files, else last-token pooling, normalized. ``ValueError`` naming
    the file or field for what it cannot honour."""
    if override is not None:
        return _from_override(override)
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    modules = _json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"model: {modules_file} must be a list of module objects")
    types = [str(module.get("type", "")) for module in modules]
    unsupported = [name for name in types if name not in _NEUTRAL_MODULES]
    if unsupported:
        raise ValueError(
            f"model: {modules_file} lists {', '.join(unsupported)}, which this engine does "
            f"not run after the model (its embeddings would differ); supported modules: "
            f"Transformer, Pooling, Normalize. pooler_config (--pooler-config) sets the "
            "pooling explicitly"
        )
    pooling = [m for m in modules if m.get("type") == _ST + "Pooling"]
    if not pooling:
        return PoolerConfig(source=str(modules_file))
    pooling_file = model_dir / str(pooling[0].get("path", "")) / "config.json"
    if not pooling_file.is_file():
        raise ValueError(f"model: {modules_file} names a Pooling module without {pooling_file}")
    fields = _json(pooling_file)
    if not isinstance(fields, dict):
        raise ValueError(f"model: {pooling_file} must be a JSON object")
    for name in _UNSUPPORTED_MODES:
        if fields.get(name):
            raise ValueError(
                f"model: {pooling_file}: {name} is not supported; supported modes: "
                f"{', '.join(_MODES)}. pooler_config (--pooler-config) sets the pooling explicitly"
            )
    if fields.get("include_prompt") is False:
        raise ValueError(
            f"model: {pooling_file}: include_prompt=false (an instruction left out of the pool) "
            "is not supported: the engine pools every prompt token"
        )
    chosen = [kind for name, kind in _MODES.items() if fields.get(name)]
    if len(chosen) != 1:
        raise ValueError(
            f"model: {pooling_file} must set exactly one of {', '.join(_MODES)}, got {len(chosen)}"
        )
    normalize = _ST + "Normalize" in types
    return PoolerConfig(chosen[0], normalize, str(pooling_file))


@dataclass(frozen=True)
class SentenceTransformerConfig:
    """A sentence-transformers model's ``sentence_bert_config.json`` (or a sibling
    ``sentence_*_config.json``), as vLLM reads it: ``max_seq_length`` caps the context
    window (the longest input the model was trained to embed), ``do_lower_case`` lowercases
    every text before it is tokenized. ``source``: the file."""

    max_seq_length: int | None = None
    do_lower_case: bool = False
    source: str = ""


def read_sentence_transformer_config(model_dir: Path) -> SentenceTransformerConfig:
    """The model's sentence-transformers tokenizer settings (none when it has no such file);
    ``ValueError`` naming the file and the field for a value that is not one."""
    files = sorted(model_dir.glob("sentence_*_config.json"))
    preferred = model_dir / "sentence_bert_config.json"
    path = preferred if preferred.is_file() else (files[0] if files else None)
    if path is None:
        return SentenceTransformerConfig()
    fields = _json(path)
    if not isinstance(fields, dict):
        raise ValueError(f"model: {path} must be a JSON object")
    max_seq_length = fields.get("max_seq_length")
    if max_seq_length is not None and (
        isinstance(max_seq_length, bool)
        or not isinstance(max_seq_length, int)
        or max_seq_length < 1
    ):
        raise ValueError(
            f"model: {path}: max_seq_length must be a positive integer, got {max_seq_length!r}"
        )
    do_lower_case = fields.get("do_lower_case", False)
    if not isinstance(do_lower_case, bool):
        raise ValueError(
            f"model: {path}: do_lower_case must be true or false, got {do_lower_case!r}"
        )
    return SentenceTransformerConfig(max_seq_length, do_lower_case, str(path))


def _from_override(override: Any) -> PoolerConfig:
    if not isinstance(override, dict):
        raise TypeError(f"pooler_config must be a dict, got {override!r}")
    unknown = sorted(set(override) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(
            f"pooler_config: {', '.join(map(repr, unknown))} not supported; supported: "
            "'pooling_type', 'normalize'"
        )
    pooling_type = override.get("pooling_type", "LAST")
    if pooling_type not in POOLING_TYPES:
        raise ValueError(
            f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
            f"got {pooling_type!r}"
        )
    normalize = override.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    return PoolerConfig(pooling_type, normalize, "pooler_config")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"model: {path} is not readable JSON: {error}") from None
