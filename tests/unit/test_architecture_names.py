"""Where the code may name an architecture: only in its own description
(``gpu_worker/models/``: the registry, ``architectures/`` and the torch models) and in the
GGUF converter's per-architecture modules (``frontend/gguf/architectures/``). Everywhere else
reads what an architecture declares, so that adding one touches its own files alone.

Found by parsing every source file: a string that is an HF architecture name
(``...ForCausalLM`` and the like), or a comparison of ``architecture``, ``family`` or
``model_type`` with a string. Docstrings and comments may name models freely."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("frontend", "scheduler", "gpu_worker")
# The homes of architecture knowledge, where naming one is the point.
ALLOWED = ("gpu_worker/models/", "frontend/gguf/architectures/")
ARCHITECTURE_NAME = re.compile(
    r"^[A-Za-z0-9_]+For(CausalLM|ConditionalGeneration|\w*Classification)$"
)
COMPARED_FIELDS = {"architecture", "declared_architecture", "family", "model_type"}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the nodes that are docstrings (a module's, a class's, a function's)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _field_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if (  # hf_config["model_type"], hf.get("model_type")
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        return node.slice.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        return node.args[0].value
    return None


def _strings(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_strings(element) for element in node.elts)
    return False


def architecture_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) for each architecture name or architecture comparison in ``source``."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and ARCHITECTURE_NAME.match(node.value)
        ):
            found.append((node.lineno, f"names {node.value!r}"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            fields = {_field_name(side) for side in sides} & COMPARED_FIELDS
            if fields and any(_strings(side) for side in sides):
                found.append((node.lineno, f"compares {', '.join(sorted(fields))} with a name"))
    return found


def source_files() -> list[Path]:
    files = []
    for directory in SOURCE_DIRS:
        for path in sorted((ROOT / directory).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if not relative.startswith(ALLOWED):
                files.append(path)
    return files


def test_no_source_file_outside_the_models_names_an_architecture():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in source_files()
        for line, what in architecture_branches(path.read_text())
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    "source",
    [
        'if config.architecture == "Gemma2ForCausalLM":\n    pass\n',
        'NAMES = ("MistralForCausalLM",)\n',
        'x = config.family in ("llama", "opt")\n',
        'if hf_config.get("model_type") == "exaone":\n    pass\n',
    ],
)
def test_the_check_finds_a_branch(source):
    assert architecture_branches(source)


def test_the_check_passes_docstrings_and_other_comparisons():
    source = (
        '"""Gemma2ForCausalLM is described in architectures/gemma.py."""\n'
        "def f(spec):\n"
        '    """LlamaForCausalLM\'s defaults."""\n'
        '    return spec.rope_type == "yarn"\n'
    )
    assert architecture_branches(source) == []
