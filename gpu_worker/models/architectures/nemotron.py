"""NVIDIA's Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron): GQA with RoPE over part
of each head, LayerNorm1P norms and an ungated squared-ReLU MLP (models/nemotron.py)."""

from __future__ import annotations

from pagedserve.gpu_worker.models.architecture import UNGATED_PROJECTIONS, Architecture


class Nemotron(Architecture):
    model_module = "nemotron"
    model_class = "NemotronForCausalLM"
    lora = True
    lora_projections = UNGATED_PROJECTIONS
    lora_modules = {"up_proj": ("mlp.up_proj", None)}
    partial_rotary = True
    # NemotronConfig's: half of each head rotates, the squared ReLU.
    config_defaults = dict(
        partial_rotary_factor=0.5,
        norm_eps=1e-5,
        hidden_act="relu2",
        max_position_embeddings=4096,
    )
