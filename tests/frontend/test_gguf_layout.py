"""The GGUF converter's layout: the shared layer names no architecture. A quirk of one
belongs in its module under frontend/gguf/architectures/, behind a hook of the shared layer;
a string naming an architecture in the shared layer is a branch on it."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

from pagedserve.frontend import gguf_convert
from pagedserve.frontend.gguf import registry
from pagedserve.frontend.gguf.architecture import Architecture

# The entry point and the package's modules, but for the registry (its table names each
# architecture) and the architectures' own modules (a level down).
SHARED_LAYER = [
    Path(gguf_convert.__file__),
    *sorted(p for p in Path(registry.__file__).parent.glob("*.py") if p.name != "registry.py"),
]


def _architecture_names() -> set[str]:
    """llama.cpp's registered names, and the HF architecture and model_type of every class in
    their modules (the variants a name may convert to included)."""
    names = set(registry.SUPPORTED_ARCHITECTURES)
    for name in registry.SUPPORTED_ARCHITECTURES:
        module = inspect.getmodule(type(registry.architecture(name)))
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, Architecture):
                names.update(
                    getattr(value, field)
                    for field in ("hf_architecture", "model_type")
                    if hasattr(value, field)
                )
    return names


def _string_literals(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_the_shared_layer_names_no_architecture():
    names = _architecture_names()
    assert {"llama", "gpt-oss", "MixtralForCausalLM", "deepseek_v3", "olmo3"} <= names
    found = []
    for path in SHARED_LAYER:
        for line, text in _string_literals(path):
            # llama.cpp is the project, not its llama architecture.
            words = set(re.findall(r"[\w\-]+", text.replace("llama.cpp", "")))
            found += [f"{path.name}:{line}: {word!r}" for word in sorted(words & names)]
    assert len(SHARED_LAYER) > 5
    assert not found, found
