"""The tests' own layout: what test modules share lives in ``tests/helpers/``, a package.
No test module imports another test module, or a conftest (every folder's is named
``conftest``, so which one an import finds depends on ``sys.path``'s order), and every
helper module is imported by a test module or a conftest."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
HELPERS_DIR = TESTS_DIR / "helpers"


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of everything ``source`` imports, a function's lazy imports and
    ``importlib.import_module("...")`` included: ``from a import b`` gives both ``a`` and
    ``a.b``, since ``b`` may be a module; a relative import keeps its leading dots."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.append((node.lineno, module))
            separator = "" if module.endswith(".") else "."
            found += [(node.lineno, f"{module}{separator}{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def forbidden_imports(source: str) -> list[tuple[int, str]]:
    """The imports in ``source`` of a test module (``test_*``) or of a conftest."""
    return [
        (line, module)
        for line, module in imported_modules(source)
        if (last := module.rsplit(".", 1)[-1]).startswith("test_") or last == "conftest"
    ]


def helper_modules() -> set[str]:
    """Every module of the helpers package, as ``helpers.name``."""
    return {
        ".".join(path.relative_to(TESTS_DIR).with_suffix("").parts)
        for path in HELPERS_DIR.rglob("*.py")
        if path.name != "__init__.py"
    }


def importers_of_helpers() -> list[Path]:
    """The test modules and conftests: what helpers are there for."""
    return sorted(
        path
        for pattern in ("test_*.py", "conftest.py")
        for path in TESTS_DIR.rglob(pattern)
        if HELPERS_DIR not in path.parents
    )


@pytest.mark.parametrize(
    "source",
    [
        "from engine.test_parity import hf_greedy",
        "from test_http_api import post",
        "from tests.unit.test_scheduler import EOS",
        "import server.test_http_api",
        "from conftest import SERVED_MODEL_NAME",
        "from . import test_sharing",
        "def test_lora(tmp_path):\n    from engine.test_lora import make_lora_adapter\n",
        "importlib.import_module('engine.test_olmo2')",
    ],
)
def test_the_check_finds_each_way_to_import_a_test_module_or_a_conftest(source):
    assert forbidden_imports(source), source


def test_the_check_lets_helpers_and_libraries_through():
    source = (
        "import unittest\nimport pytest\nfrom helpers.parity import hf_greedy\n"
        "from helpers import tiny_models\nfrom pagedserve.frontend import LLM\n"
    )
    assert forbidden_imports(source) == []


def test_no_module_of_the_tests_imports_a_test_module_or_a_conftest():
    offenders = [
        f"{path.relative_to(TESTS_DIR)}:{line}: {module}"
        for path in sorted(TESTS_DIR.rglob("*.py"))
        for line, module in forbidden_imports(path.read_text())
    ]
    assert not offenders, "import it from tests/helpers/ instead:\n" + "\n".join(offenders)


def test_every_helper_module_is_imported_by_a_test_module_or_a_conftest():
    assert (HELPERS_DIR / "__init__.py").is_file(), "tests/helpers/ must be a package"
    imported = {
        module.removeprefix("tests.")
        for path in importers_of_helpers()
        for _, module in imported_modules(path.read_text())
    }
    assert helper_modules(), "no helper modules found: is HELPERS_DIR right?"
    unused = sorted(helper_modules() - imported)
    assert not unused, f"helper modules nothing imports (dead code): {unused}"
