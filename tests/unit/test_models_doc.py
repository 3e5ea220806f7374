"""docs/models.md's table against the registry: every registered architecture has a row,
whose description file and LoRA column say what the registry does, and every row names a
registered architecture (or a vision-language one)."""

from __future__ import annotations

import re
from pathlib import Path

from pagedserve.gpu_worker.models import registry
from pagedserve.gpu_worker.models.architectures.vision_language import VISION_LANGUAGE_MODELS

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def table_rows() -> dict[str, dict[str, str]]:
    """Architecture name -> its row's cells by column title."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| architecture (HF class)"))
    titles = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = dict(zip(titles, (cell.strip() for cell in line.strip("|").split("|"))))
        for name in re.findall(r"`(\w+)`", cells["architecture (HF class)"]):
            rows[name] = cells
    return rows


def test_every_registered_architecture_has_a_true_row():
    rows = table_rows()
    missing = [name for name in registry.SUPPORTED_ARCHITECTURES if name not in rows]
    assert not missing, f"docs/models.md lacks rows for {missing}"
    for name in registry.SUPPORTED_ARCHITECTURES:
        spec, row = registry.architecture(name), rows[name]
        module = type(spec).__module__.rpartition(".")[2]
        assert row["description"] == f"`architectures/{module}.py`", name
        assert row["LoRA"] == ("yes" if spec.lora else ""), name


def test_every_row_names_an_architecture_the_engine_reads():
    known = {*registry.SUPPORTED_ARCHITECTURES, *VISION_LANGUAGE_MODELS}
    assert set(table_rows()) <= known, set(table_rows()) - known
