"""The Swiss AI Initiative's Apertus (``ApertusForCausalLM``): Llama with per-head q/k norms
and an ungated MLP whose xIELU activation has learned scalars per layer (``basic.XIELU``);
its norms' names are its own. HF has no Apertus classifier."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import HEAD_NORM, UNGATED_PROJECTIONS, Architecture

# Its names for Llama's layer norms and the MLP's activation.
_NAMES = {
    ".attention_layernorm.": ".input_layernorm.",
    ".feedforward_layernorm.": ".post_attention_layernorm.",
    ".mlp.act_fn.": ".mlp.act.",
}


class Apertus(Architecture):
    has_classifier = False
    lora = True
    lora_projections = UNGATED_PROJECTIONS
    lora_modules = {"up_proj": ("mlp.up_proj", None)}
    qk_norm = HEAD_NORM
    ungated_mlp = True
    # ApertusConfig's: xIELU, Llama 3's RoPE scaling over a base of 12M.
    config_defaults = dict(
        hidden_act="xielu",
        rms_norm_eps=1e-5,
        max_position_embeddings=65536,
        rope_theta=12_000_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    )

    def checkpoint_name(self, name: str, hf_config: dict[str, Any]) -> str:
        for apertus, llama in _NAMES.items():
            name = name.replace(apertus, llama)
        return name
