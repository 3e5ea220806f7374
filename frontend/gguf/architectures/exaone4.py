"""llama.cpp's exaone4: EXAONE 4.0, OLMo 2's post-norm layers with q/k norms per head, RoPE on
halves (llama.cpp's NEOX, as HF: no permutation), and its window and global layers."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.architectures.olmo2 import POST_NORM_NAMES
from pagedserve.frontend.gguf.checks import sliding_layer_types
from pagedserve.frontend.gguf.metadata import GGUFMetadata


class Exaone4(Architecture):
    hf_architecture = "Exaone4ForCausalLM"
    model_type = "exaone4"
    layer_names = POST_NORM_NAMES

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """With a window (EXAONE 4.0 32B), the layers that slide; the others are global and
        rotate nothing, which HF's Exaone4 (and the engine) derive from the window being set.
        Without one (1.2B) every layer attends in full and rotates. The window and layer kinds
        written here are what llama.cpp's converter recorded from the HF config; llama.cpp
        itself windows only a 64-layer model (every fourth layer global) and rotates every
        layer of the others, whatever the file says."""
        window = metadata.key("attention.sliding_window")
        num_layers = metadata.num_layers
        if window is None:
            config.update(sliding_window=None, layer_types=["full_attention"] * num_layers)
            return
        config.update(
            sliding_window=int(window),
            layer_types=sliding_layer_types(metadata.architecture, metadata.key, num_layers),
        )
