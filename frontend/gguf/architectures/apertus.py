"""llama.cpp's apertus: Apertus, Llama with per-head q/k norms before RoPE on halves
(llama.cpp's NEOX, as HF: no permutation), its norms under its own names, and an ungated MLP
whose xIELU activation's scalars llama.cpp keeps as metadata, one per layer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.checks import (
    ATTENTION_PROJECTIONS,
    biases_switched,
    check_per_head_qk_norms,
    check_ungated,
)
from pagedserve.frontend.gguf.metadata import GGUFMetadata

# xIELU's scalars: llama.cpp's metadata key (one value per layer, each as HF stores it:
# alpha_p and alpha_n before their softplus, which both apply) -> HF's tensor and shape.
_XIELU = {
    "alpha_p": (gguf.Keys.xIELU.ALPHA_P, (1,)),
    "alpha_n": (gguf.Keys.xIELU.ALPHA_N, (1,)),
    "beta": (gguf.Keys.xIELU.BETA, ()),
    "eps": (gguf.Keys.xIELU.EPS, ()),
}


class Apertus(Architecture):
    hf_architecture = "ApertusForCausalLM"
    model_type = "apertus"
    bias_field = "attention_bias"
    layer_names = (("attn_norm", "attention_layernorm"), ("ffn_norm", "feedforward_layernorm"))

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """xIELU (its scalars: _xielu_values), per-head q/k norms in every layer, the ungated
        MLP, the attention's biases all or none (attention_bias)."""
        tensor_shapes, num_layers = metadata.tensor_shapes, metadata.num_layers
        _xielu_values(metadata.fields, num_layers)
        check_per_head_qk_norms("apertus", tensor_shapes, num_layers, metadata.head_dim)
        check_ungated("apertus", tensor_shapes, num_layers)
        biases_switched(
            "apertus", "attention_bias", ATTENTION_PROJECTIONS, tensor_shapes, num_layers
        )
        config["hidden_act"] = "xielu"

    def extra_tensors(
        self, fields: dict[str, Any], config: dict[str, Any]
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The xIELU scalars as HF's weights: model.layers.N.mlp.act_fn.alpha_p and alpha_n of
        one value, beta and eps of none (scalars)."""
        num_layers = config["num_hidden_layers"]
        values = _xielu_values(fields, num_layers)
        for layer in range(num_layers):
            for name, (_, shape) in _XIELU.items():
                value = np.full(shape, values[name][layer], dtype=np.float32)
                yield f"model.layers.{layer}.mlp.act_fn.{name}", value


def _xielu_values(fields: dict[str, Any], num_layers: int) -> dict[str, list[float]]:
    """The xIELU scalars by name, one per layer, as llama.cpp's converter keeps them
    (metadata arrays, which its graph reads per layer)."""
    values = {}
    for name, (gguf_key, _) in _XIELU.items():
        found = fields.get(gguf_key)
        if not isinstance(found, list) or len(found) != num_layers:
            raise ValueError(
                f"GGUF apertus needs {gguf_key}, one value per layer ({num_layers}), "
                f"got {found!r:.100}"
            )
        values[name] = [float(value) for value in found]
    return values
