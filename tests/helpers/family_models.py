"""One random HF model per tiny config for the whole session, and HF's greedy tokens on it:
the parity matrix (tests/engine/test_architecture_parity.py) and each family's own module
ask for the same config and share what the first of them built."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.parity import hf_greedy
from helpers.tiny_family import prompts
from helpers.tiny_models import random_hf_model


class FamilyModels:
    """Models saved under ``root``, keyed by their config; tests must not write into them
    (``rewritten`` makes a copy to change)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._dirs: dict[str, Path] = {}
        self._references: dict[str, list[list[int]]] = {}

    def model_dir(self, config: dict) -> Path:
        key = _key(config)
        if key not in self._dirs:
            name = f"{config['architectures'][0]}-{len(self._dirs)}"
            self._dirs[key] = random_hf_model(config, self._root / name)
        return self._dirs[key]

    def reference(self, config: dict) -> list[list[int]]:
        """HF's greedy tokens for ``prompts()`` on ``config``'s model."""
        key = _key(config)
        if key not in self._references:
            self._references[key] = hf_greedy(self.model_dir(config), prompts())
        return self._references[key]


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)
