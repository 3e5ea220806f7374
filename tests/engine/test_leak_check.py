"""The suite's after-test check (tests/conftest.py) sees every engine a test built, a local
one too: a test that leaves a request queued in an engine held only by a local variable
fails at teardown (it once passed: the check held engines by weak reference only)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]

LEAKING_TEST = """
from helpers.tiny_models import make_tiny_model
from pagedserve.frontend.llm import LLM
from pagedserve.scheduler.sampling_params import SamplingParams


def test_leaves_a_request_queued(tmp_path):
    llm = LLM(make_tiny_model("llama", tmp_path / "llama"), num_blocks=16)
    llm.engine.add_request("left-behind", [1, 2, 3], SamplingParams(max_tokens=2), frozenset())


def test_ends_its_requests(tmp_path):
    llm = LLM(make_tiny_model("llama", tmp_path / "llama"), num_blocks=16)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
"""


def test_a_request_left_in_a_local_engine_fails_at_teardown(tmp_path):
    test_file = tmp_path / "test_leaking.py"
    test_file.write_text(textwrap.dedent(LEAKING_TEST))
    # The suite's conftest as a plugin of a run of this file alone.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider",
         str(test_file)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1]
    assert "2 passed, 1 error" in summary, result.stdout[-3000:]
    assert "ERROR at teardown of test_leaves_a_request_queued" in result.stdout
    assert "'num_waiting': 1" in result.stdout
