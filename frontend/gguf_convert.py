"""Convert a GGUF file of one of llama.cpp's architectures (SUPPORTED_ARCHITECTURES) into a
local Hugging Face model directory.

The engine loads plain float32 HF directories, so a GGUF file is converted once:

    model.gguf ──read──> metadata ──> config.json, generation_config.json
              └─dequantize, rename, undo what llama.cpp did to the architecture's
                tensors──> model.safetensors or shards of it (float32, HF names)
              └─transformers' GGUF tokenizer converter──> tokenizer.json, chat_template.jinja, ...

The parts live in pagedserve.frontend.gguf: a shared layer that names no architecture, and
one module per llama.cpp architecture behind its hooks (gguf/registry.py lists them).

Everything is written into a temporary directory beside the target and renamed into place at
the end, so an interrupted conversion (error, Ctrl-C) never leaves a half-written model where
a reader would find it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import gguf

from pagedserve.frontend.gguf.config import generation_config, hf_config
from pagedserve.frontend.gguf.metadata import read_metadata
from pagedserve.frontend.gguf.progress import ConversionProgress, ProgressCallback, Reporter
from pagedserve.frontend.gguf.registry import SUPPORTED_ARCHITECTURES, architecture_for
from pagedserve.frontend.gguf.tensors import dequantized_tensors
from pagedserve.frontend.gguf.tokenizer import write_tokenizer
from pagedserve.frontend.gguf.writer import make_readable, write_json, write_weights

__all__ = [
    "CONVERTER_VERSION",
    "SHARD_BYTES",
    "SUPPORTED_ARCHITECTURES",
    "ConversionProgress",
    "ProgressCallback",
    "convert_gguf",
]

logger = logging.getLogger(__name__)

# The float32 weights go into files of about this many bytes each, so a conversion holds one
# file's tensors in memory, not the whole model's.
SHARD_BYTES = 2 << 30
# Bump whenever the converter's output changes: the resolver keys its cache on it, so old
# conversions are redone instead of being served stale.
CONVERTER_VERSION = 1


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: ProgressCallback | None = None,
) -> Path:
    """Convert `gguf_path` into the HF model directory `out_dir` and return `out_dir`.

    `out_dir` must not exist yet; it appears complete or not at all. If another process
    finishes the same `out_dir` first, its result is kept and ours is discarded.
    Raises ValueError for a GGUF whose architecture or layout this converter does not support.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    report = Reporter(gguf_path.name, progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Dot-prefixed and uniquely suffixed: never a cache entry's name, and hidden from `ls`.
    partial_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        _convert_into(gguf_path, partial_dir, report)
        _publish(partial_dir, out_dir)
    finally:
        # BaseException included: a Ctrl-C mid-conversion must not leave the partial dir behind.
        shutil.rmtree(partial_dir, ignore_errors=True)
    report("done")
    return out_dir


def _convert_into(gguf_path: Path, out_dir: Path, report: Reporter) -> None:
    report("reading")
    reader = gguf.GGUFReader(gguf_path)
    metadata = read_metadata(reader)
    fields, shapes = metadata.fields, metadata.tensor_shapes
    config = hf_config(fields, shapes, metadata.rope_freqs, metadata.rope_factors)
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", generation_config(config, fields))
    architecture = architecture_for(fields, shapes)
    tensors = dequantized_tensors(reader, architecture, fields, config, report)
    # SHARD_BYTES read here, at each conversion: tests and callers may change it.
    write_weights(tensors, out_dir, report, SHARD_BYTES)

    report("tokenizer")
    write_tokenizer(gguf_path, out_dir, fields, config["max_position_embeddings"])
    make_readable(out_dir)


def _publish(partial_dir: Path, out_dir: Path) -> None:
    try:
        partial_dir.rename(out_dir)
    except OSError:
        # A concurrent conversion of the same file won the race; both results are identical.
        if not (out_dir / "config.json").is_file():
            raise
        logger.info("%s was converted concurrently; keeping that copy", out_dir)
