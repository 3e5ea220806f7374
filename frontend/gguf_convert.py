"""Convert a llama-architecture GGUF file into a local Hugging Face model directory.

The engine loads plain float32 HF directories, so a GGUF file is converted once:

    model.gguf ──read──> metadata ──> config.json, generation_config.json
              └─dequantize + un-permute Q/K──> model.safetensors (float32, HF names)
              └─transformers' GGUF tokenizer converter──> tokenizer.json, chat_template.jinja, ...

Everything is written into a temporary directory beside the target and renamed into place at
the end, so an interrupted conversion (error, Ctrl-C) never leaves a half-written model where
a reader would find it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file

logger = logging.getLogger(__name__)

# Bump whenever the converter's output changes: the resolver keys its cache on it, so old
# conversions are redone instead of being served stale.
CONVERTER_VERSION = 1
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF per-layer tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class ConversionProgress:
    """One progress event: `stage` is reading, dequantizing, writing, tokenizer or done;
    `done`/`total` count tensors while dequantizing and are 0 otherwise."""

    stage: str
    done: int
    total: int
    elapsed_s: float

    def __str__(self) -> str:
        count = f" {self.done}/{self.total} tensors" if self.total else ""
        return f"{self.stage}{count} ({self.elapsed_s:.1f} s)"


ProgressCallback = Callable[[ConversionProgress], None]


class _Reporter:
    """Sends each progress event to the logger and to the caller's callback."""

    def __init__(self, gguf_name: str, callback: ProgressCallback | None) -> None:
        self._gguf_name = gguf_name
        self._callback = callback
        self._start = time.perf_counter()

    def __call__(self, stage: str, done: int = 0, total: int = 0) -> None:
        event = ConversionProgress(stage, done, total, time.perf_counter() - self._start)
        logger.info("converting %s: %s", self._gguf_name, event)
        if self._callback is not None:
            self._callback(event)


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
    report = _Reporter(gguf_path.name, progress)
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


def _convert_into(gguf_path: Path, out_dir: Path, report: _Reporter) -> None:
    report("reading")
    reader = gguf.GGUFReader(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = _llama_config(fields, tensor_names)
    tensors = _dequantize_tensors(reader, config, report)

    report("writing")
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    del tensors  # ~4 bytes per parameter; no need to hold it while the tokenizer converts

    report("tokenizer")
    _write_tokenizer(gguf_path, out_dir, fields, config["max_position_embeddings"])
    _make_readable(out_dir)


def _publish(partial_dir: Path, out_dir: Path) -> None:
    try:
        partial_dir.rename(out_dir)
    except OSError:
        # A concurrent conversion of the same file won the race; both results are identical.
        if not (out_dir / "config.json").is_file():
            raise
        logger.info("%s was converted concurrently; keeping that copy", out_dir)


def _llama_config(fields: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    architecture = fields.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "GGUF has a rope_freqs tensor (llama3-style RoPE scaling), which this converter "
            "does not support; supported: no RoPE scaling, or linear/yarn scaling metadata"
        )

    def key(name: str, default: Any = None) -> Any:
        return fields.get(f"llama.{name}", default)

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"GGUF rope.dimension_count={rope_dim} differs from head_dim={head_dim}; partial "
            "rotary embeddings are not supported for llama"
        )
    vocab_size = key("vocab_size") or len(fields["tokenizer.ggml.tokens"])
    rope_theta = _float32_value(key("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _float32_value(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        # Without output.weight, llama.cpp reuses the embedding matrix as the LM head.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _optional_int(fields.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _optional_int(fields.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _optional_int(fields.get("tokenizer.ggml.padding_token_id")),
        # transformers 5 reads "dtype"; older readers (and other engines) read "torch_dtype".
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    rope_scaling = _rope_scaling(key)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    # transformers 5 keeps RoPE settings in rope_parameters; the legacy keys above stay for
    # readers that predate it.
    config["rope_parameters"] = {
        "rope_type": "default",
        **(rope_scaling or {}),
        "rope_theta": rope_theta,
    }
    return config


def _rope_scaling(key: Callable[[str], Any]) -> dict[str, Any] | None:
    scaling_type = key("rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type not in ("linear", "yarn"):
        raise ValueError(
            f"GGUF rope.scaling.type {scaling_type!r} is not supported; supported: none, "
            "linear, yarn"
        )
    scaling: dict[str, Any] = {
        "rope_type": scaling_type,
        "factor": _float32_value(key("rope.scaling.factor")),
    }
    original_context = key("rope.scaling.original_context_length")
    if original_context is not None:
        scaling["original_max_position_embeddings"] = int(original_context)
    return scaling


def _float32_value(value: float) -> float:
    # GGUF stores these as float32; the shortest float32 repr keeps 1e-5 reading as 1e-05 in
    # config.json instead of 9.999999747378752e-06 (the same float32 either way).
    return float(str(np.float32(value)))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSOR_NAMES:
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[suffix]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no llama equivalent in this converter")


def _dequantize_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any], report: _Reporter
) -> dict[str, np.ndarray]:
    num_tensors = len(reader.tensors)
    report_every = max(1, num_tensors // 10)
    tensors: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(reader.tensors, start=1):
        name = _hf_tensor_name(tensor.name)
        # GGUF lists dimensions fastest-first; torch wants them slowest-first.
        torch_shape = tuple(int(dim) for dim in reversed(tensor.shape))
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = weight.astype(np.float32, copy=False).reshape(torch_shape)
        if name.endswith("q_proj.weight"):
            weight = _undo_rope_permutation(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = _undo_rope_permutation(weight, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(weight)
        if index % report_every == 0 or index == num_tensors:
            report("dequantizing", index, num_tensors)
    return tensors


def _undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order so HF's rotate-half RoPE applies to the weights.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ...; HF rotates the two halves of each
    head. llama.cpp's converter therefore interleaves each head's rows: for head h it stores
    rows [r0, r(d/2), r1, r(d/2+1), ...]. Viewing the rows as (head, pair, half) and swapping
    the last two axes restores [r0, r1, ..., r(d/2), ...].
    """
    rows, columns = weight.shape
    half_head_dim = rows // num_heads // 2
    by_head = weight.reshape(num_heads, half_head_dim, 2, columns)
    return by_head.swapaxes(1, 2).reshape(rows, columns)


def _write_tokenizer(
    gguf_path: Path, out_dir: Path, fields: dict[str, Any], context_length: int
) -> None:
    # Imported here: transformers is slow to import and only this stage needs it.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    chat_template = fields.get("tokenizer.chat_template")
    if chat_template is not None and not tokenizer.chat_template:
        # Without it apply_chat_template fails after the directory is reloaded.
        tokenizer.chat_template = chat_template
    # The GGUF conversion leaves this "unlimited"; the model's context is the real limit.
    tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(out_dir)


def _make_readable(out_dir: Path) -> None:
    # mkdtemp creates the directory 0700 and safetensors writes 0600; a cache shared with
    # another user (a service account, a container) must still be able to read the model.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
