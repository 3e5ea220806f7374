"""The sampling defaults a request takes for the fields it leaves unset: the model's
generation_config.json, as vLLM's ``--generation-config`` / ``--override-generation-config``
read it.

    source "auto" (default)  the model directory's generation_config.json
    source "vllm"            none: SamplingParams' own defaults (temperature 1.0, ...)
    source DIR               DIR/generation_config.json
    override {field: value}  on top, whatever the source

From the file, ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``repetition_penalty``
become defaults when present (Qwen2.5-Instruct: 0.7, 20, 0.8, -, 1.05). The temperature
follows HF's ``generate``: a file that does not set ``do_sample`` means greedy (0), whatever
temperature it names; an override's temperature is used as given. A request's own values
always win; offline, ``LLM.generate`` without ``SamplingParams`` takes all of them.

``max_new_tokens`` (file or override) is, as in vLLM, the server's limit on output tokens:
a request that leaves ``max_tokens`` unset gets it, and one that asks for more is cut to it
(``max_tokens_limit``; the start-up log says so, since the cap is otherwise silent). Offline,
it is the default ``max_tokens`` and an explicit ``SamplingParams`` is taken as it is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.scheduler.sampling_params import SamplingParams

GENERATION_CONFIG_SOURCES = ("auto", "vllm")
# generation_config.json's sampling fields that become request defaults (vLLM's set).
DEFAULT_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
_FILE_NAME = "generation_config.json"
# The file's (and the override's) limit on output tokens, as vLLM reads it.
LIMIT_FIELD = "max_new_tokens"
# SamplingParams' own defaults of those fields.
_BASELINE = {name: getattr(SamplingParams(), name) for name in DEFAULT_FIELDS}


@dataclass(frozen=True)
class GenerationDefaults:
    """``values``: the fields whose default is not SamplingParams' own, and what it is."""

    values: dict[str, Any]
    # Where they came from, for the start-up log: "model", "vllm" or a directory.
    source: str
    # max_new_tokens: the most output tokens a server request gets (None: no limit).
    max_tokens_limit: int | None = None

    def sampling_params(self) -> SamplingParams:
        """A request that sets nothing."""
        if self.max_tokens_limit is None:
            return SamplingParams(**self.values)
        return SamplingParams(**self.values, max_tokens=self.max_tokens_limit)

    def describe(self) -> str:
        fields = [f"{name}={value}" for name, value in self.values.items()]
        if self.max_tokens_limit is not None:
            fields.append(f"max_tokens<={self.max_tokens_limit} ({LIMIT_FIELD})")
        return f"{', '.join(fields) or 'none'} (from {self.source})"


def load_generation_defaults(
    model_path: Path,
    source: str = "auto",
    override: dict[str, Any] | None = None,
) -> GenerationDefaults:
    """Raises ValueError naming ``generation_config`` or ``override_generation_config``, the
    value and what is allowed."""
    if not isinstance(source, str):
        raise TypeError(f"generation_config must be a string, got {source!r}")
    if source == "vllm":
        config: dict[str, Any] = {}
    else:
        directory = model_path if source == "auto" else Path(source)
        if source != "auto" and not (directory / _FILE_NAME).is_file():
            raise ValueError(
                f"generation_config={source!r} is not 'auto', 'vllm' or a directory with a "
                f"{_FILE_NAME}"
            )
        config = _read(directory / _FILE_NAME)
    values = {name: config[name] for name in DEFAULT_FIELDS if config.get(name) is not None}
    if source != "vllm":
        # HF's generate: without do_sample the model decodes greedily.
        sampled = config.get("do_sample")
        values["temperature"] = config.get("temperature", 1.0) if sampled else 0.0
    # Each value checked as a request's would be, the error naming where it came from.
    _check(values, f"{source} {_FILE_NAME}")
    limit = _limit(config.get(LIMIT_FIELD), f"{source} {_FILE_NAME}")
    overridden = _checked_override(override)
    if LIMIT_FIELD in overridden:
        limit = _limit(overridden.pop(LIMIT_FIELD), "override_generation_config")
    values.update(overridden)
    checked = _check(values, "override_generation_config")
    # As SamplingParams reads them (top_k -1 is 0), those that differ from its own.
    defaults = {
        name: getattr(checked, name) for name in values if getattr(checked, name) != _BASELINE[name]
    }
    label = {"auto": "model", "vllm": "vllm"}.get(source, source)
    return GenerationDefaults(defaults, label + (" + override" if override else ""), limit)


def limit_max_tokens(max_tokens: int, min_tokens: int, limit: int | None) -> int:
    """A server request's ``max_tokens`` under the limit (``max_tokens_limit``). Raises
    ValueError starting ``min_tokens=`` when the request needs more than the limit gives."""
    if limit is None:
        return max_tokens
    if min_tokens > limit:
        raise ValueError(
            f"min_tokens={min_tokens} is more than the {limit} output tokens this server gives "
            f"a request ({LIMIT_FIELD} of its generation config)"
        )
    return min(max_tokens, limit)


def _limit(value: Any, where: str) -> int | None:
    """``max_new_tokens`` as a limit: None (unset) or a positive integer."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {LIMIT_FIELD} must be an integer >= 1, got {value!r}")
    return value


def _check(values: dict[str, Any], where: str) -> SamplingParams:
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: {error}") from None


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} is not readable JSON: {error}") from None
    return config if isinstance(config, dict) else {}


def _checked_override(override: dict[str, Any] | None) -> dict[str, Any]:
    if override is None:
        return {}
    if not isinstance(override, dict):
        raise TypeError(f"override_generation_config must be a dict, got {override!r}")
    unknown = sorted(set(override) - {*DEFAULT_FIELDS, LIMIT_FIELD})
    if unknown:
        raise ValueError(
            f"override_generation_config: {', '.join(map(repr, unknown))} not supported; "
            f"supported: {', '.join(DEFAULT_FIELDS)}, {LIMIT_FIELD}"
        )
    for name, value in override.items():
        if name == LIMIT_FIELD:
            continue  # an integer, checked by _limit
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise ValueError(f"override_generation_config: {name} must be a number, got {value!r}")
    return dict(override)
