"""The converted directory's files: the weights in safetensors shards, JSON, permissions."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file


def write_weights(
    tensors: Iterator[tuple[str, np.ndarray]],
    out_dir: Path,
    report: Callable[..., None],
    shard_bytes: int,
) -> None:
    """Writes the tensors as HF does: model.safetensors, or shards of about ``shard_bytes``
    (model-00001-of-00003.safetensors, ...) listed in model.safetensors.index.json. Only
    one shard is ever held in memory."""
    shard_paths: list[Path] = []
    shard_names: list[list[str]] = []
    shard: dict[str, np.ndarray] = {}
    bytes_in_shard = total_bytes = 0

    def write_shard() -> None:
        # Numbered once the count is known; the directory is not published before then.
        path = out_dir / f"shard-{len(shard_paths)}.partial"
        report("writing")
        save_file(shard, path, metadata={"format": "pt"})
        shard_paths.append(path)
        shard_names.append(list(shard))
        shard.clear()

    for name, weight in tensors:
        if shard and bytes_in_shard + weight.nbytes > shard_bytes:
            write_shard()
            bytes_in_shard = 0
        shard[name] = weight
        bytes_in_shard += weight.nbytes
        total_bytes += weight.nbytes
    write_shard()
    if len(shard_paths) == 1:
        shard_paths[0].rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for index, (path, names) in enumerate(zip(shard_paths, shard_names, strict=True), start=1):
        file_name = f"model-{index:05d}-of-{len(shard_paths):05d}.safetensors"
        path.rename(out_dir / file_name)
        weight_map.update(dict.fromkeys(names, file_name))
    index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    write_json(out_dir / "model.safetensors.index.json", index_json)


def write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def make_readable(out_dir: Path) -> None:
    # mkdtemp creates the directory 0700 and safetensors writes 0600; a cache shared with
    # another user (a service account, a container) must still be able to read the model.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)
