"""Kyutai's Helium (``HeliumForCausalLM``): Llama with RoPE on interleaved pairs (GPT-J's
rotation, reordered to halves on loading), q/k/v biases when ``attention_bias`` says and none
on the output projection, and HeliumConfig's defaults (its RoPE base, an RMSNorm epsilon of
1e-8)."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import Architecture


class Helium(Architecture):
    interleaved_rope = True
    # HeliumConfig's (Helium 2B's heads and context).
    config_defaults = dict(
        head_dim=128,
        rope_theta=100000.0,
        rms_norm_eps=1e-8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )

    def output_bias(self, hf_config: dict[str, Any]) -> bool:
        return False
