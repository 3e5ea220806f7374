"""Arcee's AFM (``ArceeForCausalLM``): Llama with an ungated MLP, ``down(relu(up(x))^2)``."""

from __future__ import annotations

from pagedserve.gpu_worker.models.architecture import UNGATED_PROJECTIONS, Architecture


class Arcee(Architecture):
    lora = True
    ungated_mlp = True
    # Its up_proj is a layer of its own, its MLP ungated.
    lora_projections = UNGATED_PROJECTIONS
    lora_modules = {"up_proj": ("mlp.up_proj", None)}
    # ArceeConfig's: the squared ReLU.
    config_defaults = dict(hidden_act="relu2", rms_norm_eps=1e-5, max_position_embeddings=4096)
