"""Zhipu's GLM-4 (``Glm4ForCausalLM``: GLM-4-9B-0414, GLM-4-32B, GLM-Z1): GQA with q/k/v
biases, RoPE over half of each head on interleaved pairs, a fused gate/up projection and
norms after attention and MLP (models/glm4.py)."""

from __future__ import annotations

from pagedserve.gpu_worker.models.architecture import Architecture


class Glm4(Architecture):
    model_module = "glm4"
    model_class = "Glm4ForCausalLM"
    lora = True
    # Its query and key rows are reordered on loading (``CausalLM.checkpoint_rows``); an
    # adapter's B matrices on them are reordered alike. It fuses gate/up only.
    lora_projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
    partial_rotary = True
    # Glm4Config gives a config without the field partial_rotary_factor 0.5.
    config_defaults = dict(
        partial_rotary_factor=0.5,
        rms_norm_eps=1.5625e-07,
        attention_bias=True,
        head_dim=128,
        max_position_embeddings=131072,
    )
