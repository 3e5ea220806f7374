"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``): GQA with RoPE, LayerNorm, biases, a
two-layer MLP (``c_fc``, ``c_proj``), ``sliding_window`` (when set) on every layer
(models/starcoder2.py)."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import Architecture, sliding_window


class Starcoder2(Architecture):
    model_module = "starcoder2"
    model_class = "Starcoder2ForCausalLM"
    lora = True
    lora_projections = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")
    config_defaults = dict(
        max_position_embeddings=4096, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True
    )

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        return (sliding_window(hf_config),) * hf_config["num_hidden_layers"]
