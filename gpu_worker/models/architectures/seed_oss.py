"""ByteDance's Seed-OSS (``SeedOssForCausalLM``): Llama with q/k/v biases and a separate
switch for the output projection's (``attention_out_bias``)."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import Architecture


class SeedOss(Architecture):
    lora = True
    # SeedOssConfig's: q/k/v biases (none on the output projection), heads of 128.
    config_defaults = dict(
        attention_bias=True, attention_out_bias=False, head_dim=128, max_position_embeddings=524288
    )

    def output_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("attention_out_bias"))
