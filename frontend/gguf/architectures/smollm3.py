"""llama.cpp's smollm3: Llama (Q/K interleaved) whose RoPE-less layers are llama.cpp's fixed
every fourth."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.metadata import GGUFMetadata

# llama.cpp fixes SmolLM3's step of RoPE-less layers (n_no_rope_layer_step).
_NO_ROPE_LAYER_INTERVAL = 4


class SmolLM3(Architecture):
    hf_architecture = "SmolLM3ForCausalLM"
    model_type = "smollm3"
    permuted_qk = True
    bias_field = "attention_bias"

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        config.update(no_rope_layer_interval=_NO_ROPE_LAYER_INTERVAL, use_sliding_window=False)
