"""llama.cpp's dots1: dots.llm1, Qwen3's attention (q/k norms per head, RoPE on halves as HF:
no permutation) with DeepSeek-V3's experts."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.architectures.deepseek2 import (
    SHARED_EXPERTS_NAMES,
    routed_experts_config,
)
from pagedserve.frontend.gguf.checks import SIGMOID
from pagedserve.frontend.gguf.metadata import GGUFMetadata


class Dots1(Architecture):
    hf_architecture = "Dots1ForCausalLM"
    model_type = "dots1"
    bias_field = "attention_bias"
    layer_names = SHARED_EXPERTS_NAMES

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """DeepSeek-V3's experts (routed_experts_config) under a sigmoid router with a
        selection bias, the only router HF's Dots1 has, so a file that does not name its
        gating function is read as that one (llama.cpp's first dots1 converter wrote it;
        llama.cpp will not run a dots1 file without it). No layer slides: llama.cpp's converter
        keeps no window for dots1 and llama.cpp attends in full everywhere, so the config says
        so explicitly (Dots1Config's defaults would window the layers from max_window_layers
        on)."""
        gating = metadata.key("expert_gating_func", SIGMOID)
        if gating != SIGMOID:
            raise ValueError(
                f"GGUF dots1 expert_gating_func={gating} is not supported; supported: "
                f"{SIGMOID} (sigmoid, dots.llm1's router)"
            )
        num_layers = metadata.num_layers
        config.update(
            {
                "sliding_window": None,
                "max_window_layers": num_layers,
                "layer_types": ["full_attention"] * num_layers,
                **routed_experts_config(metadata, sigmoid=True),
            }
        )
