"""Fixtures of the engine tests that more than one module compares against."""

from __future__ import annotations

import pytest

from helpers.parity import EMBEDDED_PROMPTS, hf_greedy
from pagedserve.frontend.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def embedded_hf_greedy(embedded_model_dir) -> tuple[list[list[int]], list[list[int]]]:
    """``EMBEDDED_PROMPTS`` as the engine tokenizes them, and HF transformers' greedy
    continuations of them on the embedded model (float32): computed once, about 40 s on
    2 cores, for the one-rank and the three-rank comparisons."""
    tokenizer = Tokenizer(embedded_model_dir)
    prompts = [tokenizer.encode(text) for text in EMBEDDED_PROMPTS]
    return prompts, hf_greedy(embedded_model_dir, prompts)
