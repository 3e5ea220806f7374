"""LoRA adapters served beside the base model (vLLM's multi-LoRA), on the architectures whose
description says so (``Architecture.lora``: mixture-of-experts models' attention and dense
MLPs included; an expert's or a shared expert's projection is refused by name).

Each adapter is a PEFT LoRA directory (``adapter_config.json``, ``adapter_model.safetensors``),
loaded at start-up or at run time (``LLM.load_lora``; the scheduler hands the load to the
workers in the next step's plan, and an unload once no request uses the adapter any more);
adapter ``k`` (from 1; 0 is the base model; ids are never reused) adds
``scale * (x A_k^T) B_k^T`` to each projection it targets, ``scale = lora_alpha / r``
(``/ sqrt(r)`` with rsLoRA). A step's tokens may belong to different adapters: before
the forward pass the model runner sets, per adapter in the batch, which token rows are
its (``LoRABatch``); every targeted linear layer then adds each adapter's product to its
rows only, one pair of small matmuls per adapter present, never a per-token gather of
weights. The base weights are untouched (and stay packed where the CPU packs them).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from pagedserve.gpu_worker.models import registry

if TYPE_CHECKING:  # torch-free at import: the frontend checks adapters without it
    import torch
    from torch import nn

    from pagedserve.gpu_worker.model_config import ModelConfig

# A checkpoint projection -> (the model's module under a decoder layer, its part when fused).
TARGET_MODULES = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
    # Phi-3's own fused projections: an adapter's B spans the whole fused output, whose
    # rows [q | k | v] and [gate | up] the fused layers keep in the same order.
    "qkv_proj": ("self_attn.qkv_proj", None),
    "gate_up_proj": ("mlp.gate_up_proj", None),
    # StarCoder2's two-layer MLP.
    "c_fc": ("mlp.c_fc", None),
    "c_proj": ("mlp.c_proj", None),
}
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "c_fc", "c_proj")
_WEIGHTS_FILE = "adapter_model.safetensors"
_CONFIG_FILE = "adapter_config.json"
# A PEFT config is a few hundred bytes; a safetensors header a few bytes per tensor.
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 << 20


@dataclass
class LoRABatch:
    """Which token rows of the step belong to which adapter: ``(adapter id, rows)``,
    rows None when the adapter has every token (no indexing at all). Empty: no adapter
    in this step."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


@dataclass
class _Product:
    """One adapter's low-rank product on one (part of a) layer's output."""

    out_offset: int  # where the part starts in the layer's output features
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out_part, r], scaled


class LoRALayer:
    """The adapters of one linear layer; ``add`` runs after the layer's own product."""

    def __init__(self, batch: LoRABatch) -> None:
        self.batch = batch
        self.products: dict[int, list[_Product]] = {}

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += scale (x A^T) B^T`` for each adapter's rows, in place."""
        for adapter_id, rows in self.batch.groups:
            for product in self.products.get(adapter_id, ()):
                end = product.out_offset + product.b.shape[0]
                if rows is None:
                    y[:, product.out_offset : end] += (x @ product.a.T) @ product.b.T
                else:
                    y[rows, product.out_offset : end] += (x[rows] @ product.a.T) @ product.b.T


def check_lora_support(architecture: str, tensor_parallel_size: int, cuda_graphs: int) -> None:
    """Raise ``ValueError`` where adapters cannot be served (the frontend checks first)."""
    if not registry.architecture(architecture).lora:
        raise ValueError(
            f"lora_modules: LoRA adapters are served on "
            f"{', '.join(registry.architectures_with('lora'))}, not {architecture}"
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"lora_modules: LoRA adapters need tensor_parallel_size 1, got {tensor_parallel_size}"
        )
    if cuda_graphs:
        raise ValueError("lora_modules: LoRA adapters do not run in CUDA graphs; drop cuda_graphs")


def check_adapter_files(field: str, path: str | Path) -> None:
    """The checks that need no model: a PEFT LoRA directory with a supported config and
    a weights file, both inside it (raises ``ValueError`` naming ``field``, the option that
    gave the directory: ``lora_modules['name']``, ``lora_path of 'name'``)."""
    path = Path(path)
    _read_config(field, path)
    file, _ = _open_adapter_file(field, path, _WEIGHTS_FILE)
    file.close()


def check_adapter_weights(field: str, path: str | Path, config: ModelConfig) -> None:
    """Every tensor of the adapter's weights file against the model's projections, from
    the safetensors header alone (torch-free, nothing loaded): a LoRA A or B weight of a
    decoder layer the model has, of a projection an adapter may target, in pairs whose
    shapes fit the projection. Raises ``ValueError`` naming ``field`` and the tensor, so
    that a worker never fails to load an adapter the frontend accepted."""
    path = Path(path)
    header = _safetensors_header(field, path)
    hidden, heads = config.hidden_size, config.num_heads * config.head_size
    kv_heads = config.num_kv_heads * config.head_size
    intermediate = config.hf_config.get("intermediate_size", 0)
    # projection -> (out features, in features), as the checkpoint stores it
    shapes = {
        "q_proj": (heads, hidden),
        "k_proj": (kv_heads, hidden),
        "v_proj": (kv_heads, hidden),
        "o_proj": (hidden, heads),
        "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden),
        "down_proj": (hidden, intermediate),
        "qkv_proj": (heads + 2 * kv_heads, hidden),
        "gate_up_proj": (2 * intermediate, hidden),
        "c_fc": (intermediate, hidden),
        "c_proj": (hidden, intermediate),
    }
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for tensor_name, entry in header.items():
        if tensor_name == "__metadata__":
            continue
        layer, projection, which = _checked_weight_name(
            field,
            tensor_name,
            config.num_layers,
            _sparse_layers(config.layer_experts),
            config.architecture,
        )
        pairs.setdefault((layer, projection), {})[which] = list(entry.get("shape", []))
    for (layer, projection), pair in sorted(pairs.items()):
        _check_pair(field, layer, projection, pair)
        out_size, in_size = shapes[projection]
        a, b = pair["lora_A"], pair["lora_B"]
        if len(a) != 2 or len(b) != 2 or a[1] != in_size or b[0] != out_size or a[0] != b[1]:
            raise ValueError(
                f"{field}: layer {layer} {projection}: lora_A {tuple(a)} and "
                f"lora_B {tuple(b)} do not fit the model's [{out_size}, {in_size}] projection"
            )


def _open_adapter_file(field: str, directory: Path, file_name: str) -> tuple[BinaryIO, int]:
    """``directory/file_name`` open for reading, and its size in bytes, once it is a regular
    file inside the directory's own resolved path (the directory may be a link; a file that
    is a link to one elsewhere is refused, never opened). Raises ``ValueError`` naming
    ``field`` and the file, never quoting what the file holds: it may be anyone's."""
    given = directory / file_name
    try:
        root = directory.resolve(strict=True)
        resolved = (root / file_name).resolve(strict=True)
    except FileNotFoundError:
        raise ValueError(f"{field}: {given} is missing (a PEFT LoRA directory)") from None
    except (OSError, RuntimeError) as error:  # RuntimeError: a link loop (Python < 3.13)
        reason = error.strerror if isinstance(error, OSError) else "a loop of links"
        raise ValueError(f"{field}: {given} cannot be opened: {reason}") from None
    if not resolved.is_relative_to(root):
        raise ValueError(f"{field}: {given} is a link to a file outside the adapter directory")
    try:
        # O_NOFOLLOW: a link swapped in since the check is not followed; O_NONBLOCK: a FIFO
        # does not block the caller (the server's event loop) waiting for a writer.
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise ValueError(f"{field}: {given} cannot be opened: {error.strerror}") from None
    file = os.fdopen(fd, "rb")
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        file.close()
        raise ValueError(f"{field}: {given} is not a regular file")
    return file, status.st_size


def _safetensors_header(field: str, directory: Path) -> dict:
    """The JSON header of the adapter's safetensors file: tensor name -> dtype, shape,
    offsets. Errors give the file's size, never its bytes (its first 8 are the length)."""
    file, size_bytes = _open_adapter_file(field, directory, _WEIGHTS_FILE)
    refusal = f"{field}: {directory / _WEIGHTS_FILE} ({size_bytes} bytes) is not a safetensors file"
    with file:
        if size_bytes < 8:
            raise ValueError(f"{refusal}: it is shorter than the 8-byte header length")
        (header_bytes,) = struct.unpack("<Q", file.read(8))
        if header_bytes > size_bytes - 8:
            raise ValueError(f"{refusal}: the header length in its first 8 bytes exceeds its size")
        if header_bytes > _MAX_HEADER_BYTES:
            raise ValueError(f"{refusal}: its header exceeds the {_MAX_HEADER_BYTES}-byte limit")
        header = _parse_json(refusal + ": its header", file.read(header_bytes), first_byte=8)
    if not isinstance(header, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("shape", []), list)
        for key, entry in header.items()
        if key != "__metadata__"
    ):
        raise ValueError(f"{refusal}: its header is not a JSON object of tensor entries")
    return header


def _parse_json(what: str, data: bytes, first_byte: int = 0) -> object:
    """``data`` parsed; an error names ``what`` and the byte offset, not the text there
    (``first_byte``: where ``data`` starts in its file)."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} is not UTF-8 text (byte {first_byte + error.start})") from None
    except json.JSONDecodeError as error:
        # The message is one of the parser's fixed phrases; error.doc, the text, stays out.
        raise ValueError(
            f"{what} is not JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        ) from None


def _checked_weight_name(
    field: str,
    tensor_name: str,
    num_layers: int,
    sparse_layers: frozenset[int],
    architecture: str,
) -> tuple[int, str, str]:
    """(layer, projection, "lora_A" | "lora_B") of an adapter tensor, or ``ValueError``.
    ``sparse_layers``: the layers whose MLP is a mixture of experts, which no adapter
    reaches; ``architecture``: whose projections (``Architecture.lora_projections``) the
    adapter may target."""
    parsed = _weight_name(tensor_name)
    if parsed is None:
        raise ValueError(
            f"{field}: tensor {tensor_name!r} is not a LoRA A or B weight of a decoder layer"
        )
    layer, projection, _ = parsed
    if projection not in TARGET_MODULES:
        raise ValueError(
            f"{field}: tensor {tensor_name!r} targets {projection!r}; "
            f"an adapter may target {', '.join(TARGET_MODULES)}"
        )
    if layer >= num_layers:
        raise ValueError(
            f"{field}: tensor {tensor_name!r} names layer {layer}; the model has {num_layers}"
        )
    has = registry.architecture(architecture).lora_projections
    if projection not in has:
        raise ValueError(
            f"{field}: tensor {tensor_name!r} targets {projection!r}, which "
            f"{architecture} does not have; its projections: {', '.join(has)}"
        )
    # The projection must sit where the layer keeps it (self_attn.q_proj, mlp.gate_proj), not
    # in an expert (mlp.experts.3.gate_proj) or a shared expert (mlp.shared_expert.up_proj).
    expected = TARGET_MODULES[projection][0].partition(".")[0]
    parts = tensor_name.split(".")
    parent = ".".join(parts[parts.index("layers") + 2 : -3])
    if parent != expected or (projection in _MLP_PROJECTIONS and layer in sparse_layers):
        where = "mixture-of-experts " if layer in sparse_layers else ""
        raise ValueError(
            f"{field}: tensor {tensor_name!r} targets {parent}.{projection} of "
            f"{where}layer {layer}; adapters may target self_attn's projections and a dense "
            "mlp's, not an expert's"
        )
    return parsed


def _sparse_layers(layer_experts: tuple) -> frozenset[int]:
    return frozenset(index for index, experts in enumerate(layer_experts) if experts is not None)


def _check_pair(field: str, layer: int, projection: str, pair: dict) -> None:
    """A targeted projection needs both its LoRA A and B weights."""
    if set(pair) != {"lora_A", "lora_B"}:
        raise ValueError(
            f"{field}: layer {layer} {projection} lacks its "
            f"{'lora_B' if 'lora_A' in pair else 'lora_A'} weight"
        )


def _read_config(field: str, path: Path) -> tuple[float, list[str]]:
    file, size_bytes = _open_adapter_file(field, path, _CONFIG_FILE)
    config_file = path / _CONFIG_FILE
    with file:
        if size_bytes > _MAX_CONFIG_BYTES:
            raise ValueError(
                f"{field}: {config_file} is {size_bytes} bytes, more than the "
                f"{_MAX_CONFIG_BYTES} a PEFT config may take"
            )
        config = _parse_json(f"{field}: {config_file}", file.read(_MAX_CONFIG_BYTES))
    if not isinstance(config, dict):
        raise ValueError(f"{field}: {config_file} is not a JSON object (a PEFT config)")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{field}: peft_type is {config['peft_type']!r}, not LORA")
    for key, allowed in (("bias", ("none", None)), ("fan_in_fan_out", (False, None))):
        if config.get(key) not in allowed:
            raise ValueError(
                f"{field}: {key}={config.get(key)!r} is not supported (only {allowed[0]!r})"
            )
    if config.get("modules_to_save"):
        raise ValueError(
            f"{field}: modules_to_save={config['modules_to_save']!r} is not "
            "supported: an adapter may only add low-rank products to projections"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(
            f"{field}: r={rank!r} and lora_alpha={alpha!r} must be a positive integer and a number"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{field}: per-module rank_pattern / alpha_pattern is not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(
            f"{field}: target_modules {', '.join(unknown)} are not supported; "
            f"an adapter may target {', '.join(TARGET_MODULES)}"
        )
    return scale, list(targets)


def _weight_name(name: str) -> tuple[int, str, str] | None:
    """(layer index, projection, "lora_A" | "lora_B") of a PEFT tensor name."""
    parts = name.split(".")
    try:
        layer = int(parts[parts.index("layers") + 1])
    except (ValueError, IndexError):
        return None
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        return None
    return layer, parts[-3], parts[-2]


def load_adapters(model: nn.Module, adapters: list[tuple[str, str]]) -> LoRABatch:
    """Load the ``(name, directory)`` adapters (ids 1, 2, ... in that order) into
    ``model``'s targeted layers; returns the batch mapping the runner sets each step."""
    batch = LoRABatch()
    for adapter_id, (name, path) in enumerate(adapters, start=1):
        load_adapter(model, batch, adapter_id, name, path)
    return batch


def load_adapter(model: nn.Module, batch: LoRABatch, adapter_id: int, name: str, path: str) -> None:
    """Load one adapter as ``adapter_id``: every product is built and checked first, then
    attached, so a failure leaves the model as it was."""
    from safetensors.torch import load as load_safetensors

    field = f"lora_modules[{name!r}]"
    layers = model.layers
    weight = model.embed_tokens.weight
    path = Path(path)
    scale, _ = _read_config(field, path)
    file, _ = _open_adapter_file(field, path, _WEIGHTS_FILE)
    # NOTE: the file is read whole, from the descriptor checked to be inside the directory,
    # rather than mapped by name; an adapter is small next to the model.
    with file:
        tensors = load_safetensors(file.read())
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        layer, projection, which = _checked_weight_name(
            field,
            tensor_name,
            len(layers),
            _sparse_layers(model.config.layer_experts),
            model.config.architecture,
        )
        pairs.setdefault((layer, projection), {})[which] = tensor
    products: list[tuple[nn.Module, _Product]] = []
    for (layer, projection), pair in sorted(pairs.items()):
        _check_pair(field, layer, projection, pair)
        module_path, part = model.config.spec.lora_modules.get(
            projection, TARGET_MODULES[projection]
        )
        module = layers[layer].get_submodule(module_path)
        # B's rows are the projection's output rows, which the model may keep reordered.
        a, b = pair["lora_A"], model.checkpoint_rows(projection, pair["lora_B"])
        if part is None:
            out_offset, out_size = 0, module.weight.shape[0]
        else:
            out_offset = module.component_offsets[part]
            out_size = module.component_offsets[part + 1] - out_offset
        in_size = module.weight.shape[1]
        if a.shape[1] != in_size or b.shape[0] != out_size or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{field}: layer {layer} {projection}: lora_A "
                f"{tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's "
                f"[{out_size}, {in_size}] projection"
            )
        product = _Product(
            out_offset,
            a.to(device=weight.device, dtype=weight.dtype),
            (b * scale).to(device=weight.device, dtype=weight.dtype),
        )
        products.append((module, product))
    for module, product in products:
        if module.lora is None:
            module.lora = LoRALayer(batch)
        module.lora.products.setdefault(adapter_id, []).append(product)


def unload_adapter(model: nn.Module, adapter_id: int) -> None:
    """Drop adapter ``adapter_id``'s products from every layer (no-op for an unknown id)."""
    for module in model.modules():
        lora = getattr(module, "lora", None)
        if isinstance(lora, LoRALayer):
            lora.products.pop(adapter_id, None)
