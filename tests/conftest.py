"""Shared fixtures: tiny random HF models, and the block integrity check after every test."""

from __future__ import annotations

import functools
import shutil
import weakref
from pathlib import Path

import pytest

# Before any helper is imported: pytest rewrites their asserts as it does a test module's,
# so a failed check inside a helper reports its values.
pytest.register_assert_rewrite("helpers")

from helpers.tiny_models import TINY_CONFIGS  # noqa: E402

# Every LLM built anywhere in the suite is checked after each test: those built during the
# test by strong reference (a local variable is gone by teardown, and a leak in it would go
# unseen), and those still alive from earlier tests (a module's fixture) by weak reference.
_live_llms: weakref.WeakSet = weakref.WeakSet()
_built_in_this_test: list = []
# Engines that already failed the check: reported once, not again by every later test.
_reported_llms: weakref.WeakSet = weakref.WeakSet()


def pytest_sessionstart(session: pytest.Session) -> None:
    from pagedserve.frontend.llm import LLM

    original_init = LLM.__init__

    @functools.wraps(original_init)
    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        _live_llms.add(self)
        _built_in_this_test.append(self)

    LLM.__init__ = recording_init


def check_engine_idle(llm) -> None:
    """DESIGN.md's invariant on one engine: once every request has ended, nothing is queued
    or running, all blocks are free on device and host, no ref count is negative and no
    table points at a free block. ``AssertionError`` naming what is left."""
    if not getattr(llm.engine, "stats_available", True):
        return  # its scheduler process was killed (a fault test): no accounting left
    llm.check_integrity()
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_free_host_blocks"] == stats["num_total_host_blocks"], stats


@pytest.fixture(autouse=True)
def _block_integrity_after_each_test():
    """Every engine the test built or could reach is idle at its end (``check_engine_idle``);
    a leak fails the test at teardown."""
    _built_in_this_test.clear()
    yield
    engines = {id(llm): llm for llm in [*_built_in_this_test, *_live_llms]}
    _built_in_this_test.clear()  # the test's own engines may go now
    for llm in engines.values():
        if llm not in _reported_llms:
            try:
                check_engine_idle(llm)
            except AssertionError:
                _reported_llms.add(llm)
                raise


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """Random HF models of tiny configs and HF's greedy tokens on them, each built once a
    session (``helpers.family_models.FamilyModels``)."""
    from helpers.family_models import FamilyModels

    return FamilyModels(tmp_path_factory.mktemp("family_models"))


@pytest.fixture(scope="session")
def tiny_model_dirs(family_models) -> dict[str, Path]:
    return {family: family_models.model_dir(config) for family, config in TINY_CONFIGS.items()}


@pytest.fixture(scope="session")
def byte_level_llama_dir(tiny_model_dirs, tmp_path_factory) -> Path:
    """The tiny Llama with a byte-level tokenizer of its 512-token vocabulary (bytes and
    filler words), so its output decodes to text. Shared: tests must not write into it."""
    from helpers.tiny_tokenizers import (
        BYTE_LEVEL_SPECIALS,
        byte_level_tokenizer,
        save_for_transformers,
    )

    path = tmp_path_factory.mktemp("tiny_llama_bytes")
    shutil.copytree(tiny_model_dirs["llama"], path, dirs_exist_ok=True)
    tokenizer = byte_level_tokenizer([], vocab_size=512)
    return save_for_transformers(tokenizer, path, BYTE_LEVEL_SPECIALS)


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    from pagedserve.frontend.model_resolver import resolve_model

    return resolve_model(None).path
