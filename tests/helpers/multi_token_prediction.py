"""Checkpoints with a multi-token-prediction layer (DeepSeek-V3's and GLM-4.5's
``num_nextn_predict_layers``) made from tiny random models: a random layer, or one whose
guesses are always right."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.family_configs import DEEPSEEK_CONFIGS, GLM4_MOE

# The tiny families whose checkpoints carry an MTP layer.
CONFIGS = {
    "deepseek_v3": DEEPSEEK_CONFIGS["v3"],
    "glm4_moe": GLM4_MOE,
    "glm4_moe_lite": DEEPSEEK_CONFIGS["glm4_moe_lite"],
}


def with_mtp_layer(model_dir: Path, path: Path, own_tables: bool = True, seed: int = 0) -> Path:
    """A copy of ``model_dir`` with a random multi-token-prediction layer after its decoder
    layers, named as DeepSeek-V3's checkpoint names it: the last layer with experts' tensors
    plus noise, random norms and ``eh_proj``, and (``own_tables``) copies of the embedding and
    the LM head as ``embed_tokens`` and ``shared_head.head``."""
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)

    def noise(shape) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    layer = config["num_hidden_layers"]
    # The MTP layer has experts: the last decoder layer that has them is copied.
    source = max(
        index for index in range(layer) if f"model.layers.{index}.mlp.gate.weight" in tensors
    )
    for name in [n for n in tensors if n.startswith(f"model.layers.{source}.")]:
        tensor = tensors[name]
        copy = tensor + 0.05 * noise(tensor.shape) if tensor.is_floating_point() else tensor
        tensors[name.replace(f".{source}.", f".{layer}.", 1)] = copy.clone()
    hidden = config["hidden_size"]
    prefix = f"model.layers.{layer}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = 1 + 0.1 * noise(hidden)
    tensors[f"{prefix}eh_proj.weight"] = 0.08 * noise((hidden, 2 * hidden))
    if own_tables:
        embedding = tensors["model.embed_tokens.weight"]
        tensors[f"{prefix}embed_tokens.weight"] = embedding.clone()
        head = tensors.get("lm_head.weight", embedding)
        tensors[f"{prefix}shared_head.head.weight"] = (head + 0.02 * noise(head.shape)).clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def predictable_copy(model_dir: Path, path: Path) -> Path:
    """A copy of ``model_dir`` (with its MTP layer) whose next token is a function of the
    current one and whose MTP layer computes that function of its input token, so its
    guesses are right: every layer's attention and MLP outputs are zeroed (the token's
    embedding goes through the final norm and head), ``eh_proj`` passes the normed embedding
    of its token through, and the MTP head is the target's final norm and head. Every matrix
    keeps its shape: a step costs what it costs on the model itself."""
    shutil.copytree(model_dir, path)
    tensors = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    for name in list(tensors):
        if ".layers." in name and name.endswith(
            ("o_proj.weight", "down_proj.weight", "o_proj.bias", "down_proj.bias")
        ):
            tensors[name] = torch.zeros_like(tensors[name])
    prefix = f"model.layers.{config['num_hidden_layers']}."
    hidden = config["hidden_size"]
    tensors[f"{prefix}eh_proj.weight"] = torch.cat(
        [torch.eye(hidden), torch.zeros(hidden, hidden)], 1
    )
    tensors[f"{prefix}enorm.weight"] = torch.ones(hidden)
    tensors[f"{prefix}shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    tensors[f"{prefix}shared_head.head.weight"] = head.clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
