"""A LoRA adapter's files are read only from inside its directory, and a refusal never
quotes what a file holds: a link to a file elsewhere is refused unopened, a file that is
not what it should be is described by its name and size. Torch-free: the frontend's checks
(``check_adapter_files``, ``check_adapter_weights``) on hand-made adapters."""

from __future__ import annotations

import json
import os
import signal
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pagedserve.gpu_worker.lora import check_adapter_files, check_adapter_weights
from pagedserve.gpu_worker.model_config import ModelConfig

FIELD = "lora_path of 'a'"
HIDDEN_SIZE = 32
RANK = 4
# What a file the server must not disclose holds; no refusal may show any of it.
SECRET = b"root:TOP-SECRET-PASSWORD-1234:0:0"
SECRET_PARTS = ("TOP-SECRET", "PASSWORD", "root:")
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HIDDEN_SIZE,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
ADAPTER_CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj"]}


@pytest.fixture
def model_config(tmp_path) -> ModelConfig:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    return ModelConfig.from_dir(model_dir)


def write_adapter(path: Path) -> Path:
    """A PEFT LoRA directory for ``LLAMA_CONFIG``: layer 0's q_proj, rank ``RANK``."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(ADAPTER_CONFIG))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    q_features = LLAMA_CONFIG["num_attention_heads"] * LLAMA_CONFIG["head_dim"]
    tensors = {
        f"{prefix}.lora_A.weight": np.zeros((RANK, HIDDEN_SIZE), np.float32),
        f"{prefix}.lora_B.weight": np.zeros((q_features, RANK), np.float32),
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def check_adapter(path: Path, config: ModelConfig) -> None:
    """The frontend's checks, as ``LLM.load_lora`` runs them."""
    check_adapter_files(FIELD, path)
    check_adapter_weights(FIELD, path, config)


def refusal(path: Path, config: ModelConfig) -> str:
    with pytest.raises(ValueError) as caught:
        check_adapter(path, config)
    message = str(caught.value)
    assert message.startswith(f"{FIELD}: "), message
    for part in SECRET_PARTS:
        assert part not in message, message
    return message


@pytest.fixture
def no_hang() -> Iterator[None]:
    """Fail, rather than hang, a test whose check blocks."""

    def fail(signum, frame):
        raise TimeoutError("the check blocked")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_plain_adapter_directory_passes(tmp_path, model_config):
    check_adapter(write_adapter(tmp_path / "adapter"), model_config)


def test_a_linked_directory_and_links_inside_it_pass(tmp_path, model_config):
    adapter = write_adapter(tmp_path / "adapter")
    # The weights one level down, linked to by a relative name, as some exports keep them.
    (adapter / "weights").mkdir()
    (adapter / "adapter_model.safetensors").rename(adapter / "weights" / "lora.safetensors")
    (adapter / "adapter_model.safetensors").symlink_to(Path("weights", "lora.safetensors"))
    linked = tmp_path / "current"
    linked.symlink_to(adapter, target_is_directory=True)
    check_adapter(linked, model_config)


@pytest.mark.parametrize("file_name", ["adapter_model.safetensors", "adapter_config.json"])
@pytest.mark.parametrize("outside", ["secret", "valid"])
def test_a_file_linked_outside_the_directory_is_refused_unread(
    tmp_path, model_config, file_name, outside
):
    adapter = write_adapter(tmp_path / "adapter")
    if outside == "secret":
        target = tmp_path / "elsewhere" / "passwd"
        target.parent.mkdir()
        target.write_bytes(SECRET)
    else:  # the same file elsewhere: passes every other check, so only the link is refused
        target = write_adapter(tmp_path / "elsewhere") / file_name
    (adapter / file_name).unlink()
    (adapter / file_name).symlink_to(target)
    message = refusal(adapter, model_config)
    assert f"{adapter / file_name} is a link to a file outside the adapter directory" in message
    assert str(target) not in message


def test_weights_that_are_not_safetensors_are_refused_by_name_and_size(tmp_path, model_config):
    adapter = write_adapter(tmp_path / "adapter")
    (adapter / "adapter_model.safetensors").write_bytes(SECRET)
    message = refusal(adapter, model_config)
    assert (
        f"{adapter / 'adapter_model.safetensors'} ({len(SECRET)} bytes) is not a safetensors "
        "file: the header length in its first 8 bytes exceeds its size"
    ) in message
    # The first 8 bytes read as a length are the bytes themselves, written as a number.
    (first_8_bytes,) = struct.unpack("<Q", SECRET[:8])
    assert str(first_8_bytes) not in message


def test_a_safetensors_header_that_is_not_json_is_refused_without_its_text(tmp_path, model_config):
    adapter = write_adapter(tmp_path / "adapter")
    header = b'{"' + SECRET + b'": '
    (adapter / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    message = refusal(adapter, model_config)
    assert "its header is not JSON" in message


@pytest.mark.parametrize(
    "content, problem",
    [
        (b'{"r": 4, ' + SECRET, "is not JSON: Expecting property name enclosed in double quotes"),
        (b"\xff\xfe" + SECRET, "is not UTF-8 text (byte 0)"),
        (b'["' + SECRET + b'"]', "is not a JSON object"),
    ],
)
def test_a_config_that_is_not_a_json_object_is_refused_without_its_text(
    tmp_path, model_config, content, problem
):
    adapter = write_adapter(tmp_path / "adapter")
    (adapter / "adapter_config.json").write_bytes(content)
    message = refusal(adapter, model_config)
    assert f"{adapter / 'adapter_config.json'} {problem}" in message
    assert "xff" not in message  # not even the byte that is not UTF-8


def test_a_fifo_in_place_of_a_file_is_refused_without_waiting_for_a_writer(
    tmp_path, model_config, no_hang
):
    adapter = write_adapter(tmp_path / "adapter")
    (adapter / "adapter_config.json").unlink()
    os.mkfifo(adapter / "adapter_config.json")
    message = refusal(adapter, model_config)
    assert f"{adapter / 'adapter_config.json'} is not a regular file" in message
