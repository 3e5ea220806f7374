"""The code stays in rooms one can read (issue 35): the scheduler under 700 lines, and no
module of the engine's three packages over 1,000. A file that grows past them is split by
concern, as scheduler.py's mixins and the frontend's openai_* modules were."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("frontend", "scheduler", "gpu_worker")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_scheduler_stays_under_700_lines():
    assert _lines(ROOT / "scheduler" / "scheduler.py") < 700


def test_no_module_of_the_engine_is_over_1000_lines():
    too_long = {
        str(path.relative_to(ROOT)): _lines(path)
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if _lines(path) > 1000
    }
    assert not too_long, too_long
