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
# SamplingParams' own defaults of those fields.
_BASELINE = {name: getattr(SamplingParams(), name) for name in DEFAULT_FIELDS}


@dataclass(frozen=True)
class GenerationDefaults:
    """``values``: the fields whose default is not SamplingParams' own, and what it is."""

    values: dict[str, Any]
    # Where they came from, for the start-up log: "model", "vllm" or a directory.
    source: str

    def sampling_params(self) -> SamplingParams:
        """A request that sets nothing."""
        return SamplingParams(**self.values)

    def describe(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in self.values.items())
        return f"{fields or 'none'} (from {self.source})"


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
    values.update(_checked_override(override))
    checked = _check(values, "override_generation_config")
    # As SamplingParams reads them (top_k -1 is 0), those that differ from its own.
    defaults = {
        name: getattr(checked, name) for name in values if getattr(checked, name) != _BASELINE[name]
    }
    label = {"auto": "model", "vllm": "vllm"}.get(source, source)
    return GenerationDefaults(defaults, label + (" + override" if override else ""))


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
    unknown = sorted(set(override) - set(DEFAULT_FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config: {', '.join(map(repr, unknown))} not supported; "
            f"supported: {', '.join(DEFAULT_FIELDS)}"
        )
    for name, value in override.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise ValueError(f"override_generation_config: {name} must be a number, got {value!r}")
    return dict(override)
