"""LG AI's EXAONE 3.0 / 3.5 (``ExaoneForCausalLM``): Llama under GPT-2-style names
(``transformer.h.N.attn.attention``, ``c_fc_0`` / ``c_fc_1``), renamed on loading as
transformers renames them. HF has no EXAONE classifier."""

from __future__ import annotations

import re
from typing import Any

from pagedserve.gpu_worker.models.architecture import Architecture

# Its checkpoint names -> Llama's (transformers' own renaming, in order).
_NAMES = (
    (re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.h\."), "model.layers."),
    (re.compile(r"^transformer\.ln_f\."), "model.norm."),
    (re.compile(r"\.attn\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
    (re.compile(r"\.ln_1\."), ".input_layernorm."),
    (re.compile(r"\.ln_2\."), ".post_attention_layernorm."),
    (re.compile(r"\.mlp\.c_fc_0\."), ".mlp.gate_proj."),
    (re.compile(r"\.mlp\.c_fc_1\."), ".mlp.up_proj."),
    (re.compile(r"\.mlp\.c_proj\."), ".mlp.down_proj."),
)


class Exaone(Architecture):
    has_classifier = False
    # ExaoneConfig's (EXAONE-3.0-7.8B's): Llama's with a RoPE base of 500000.
    config_defaults = dict(
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        num_key_value_heads=8,
        intermediate_size=14336,
    )
    field_aliases = {
        "num_layers": "num_hidden_layers",
        "layer_norm_epsilon": "rms_norm_eps",
        "activation_function": "hidden_act",
    }

    def checkpoint_name(self, name: str, hf_config: dict[str, Any]) -> str:
        return llama_name(name)


def llama_name(name: str) -> str:
    """An EXAONE 3.x tensor name as Llama's model names it."""
    for pattern, llama in _NAMES:
        name = pattern.sub(llama, name)
    return name
