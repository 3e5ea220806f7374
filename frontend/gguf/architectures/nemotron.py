"""llama.cpp's nemotron: Nemotron-4 and Minitron, LayerNorm1P (a LayerNorm with a bias, scaled
by 1 + w, which llama.cpp stores as 1 + w), RoPE on halves over the first
rope.dimension_count values of each head (llama.cpp's NEOX, as HF: no permutation), an
ungated squared-ReLU MLP."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.checks import (
    ATTENTION_PROJECTIONS,
    biases_switched,
    check_ungated,
    listed,
)
from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value


class Nemotron(Architecture):
    hf_architecture = "NemotronForCausalLM"
    model_type = "nemotron"
    bias_field = "attention_bias"
    partial_rotary = True
    one_plus_norms = True
    global_names = (("output_norm.bias", "model.norm.bias"),)

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """LayerNorm1P with its epsilon (attention.layer_norm_epsilon) and a bias in every
        norm (both required by llama.cpp's graph, and HF's), RoPE over rope.dimension_count of
        each head (HF's partial_rotary_factor), the ungated squared-ReLU MLP, and biases on the
        attention (attention_bias) and on the MLP (mlp_bias), each all or none."""
        # LayerNorms, whose epsilon is norm_eps (below), not an RMSNorm's.
        del config["rms_norm_eps"]
        tensor_shapes, num_layers = metadata.tensor_shapes, metadata.num_layers
        eps = metadata.key("attention.layer_norm_epsilon")
        if eps is None:
            raise ValueError(
                "GGUF nemotron has no attention.layer_norm_epsilon (its LayerNorms' epsilon, "
                "which llama.cpp requires)"
            )
        norm_biases = [
            "output_norm.bias",
            *(
                f"blk.{i}.{norm}.bias"
                for i in range(num_layers)
                for norm in ("attn_norm", "ffn_norm")
            ),
        ]
        missing = [name for name in norm_biases if name not in tensor_shapes]
        if missing:
            raise ValueError(
                f"GGUF nemotron has no {listed(missing)}; every Nemotron LayerNorm1P has a bias"
            )
        check_ungated("nemotron", tensor_shapes, num_layers)
        biases_switched(
            "nemotron", "attention_bias", ATTENTION_PROJECTIONS, tensor_shapes, num_layers
        )
        mlp_bias = biases_switched(
            "nemotron", "mlp_bias", ("ffn_up", "ffn_down"), tensor_shapes, num_layers
        )
        config.update(
            {
                "hidden_act": "relu2",
                "norm_eps": float32_value(eps),
                "partial_rotary_factor": metadata.rope_dim / metadata.head_dim,
                "mlp_bias": mlp_bias,
            }
        )

    def add_rope(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        super().add_rope(config, metadata)
        # transformers 5 reads the rotated share there; older readers at the top level.
        config["rope_parameters"]["partial_rotary_factor"] = config["partial_rotary_factor"]
