"""LG AI's EXAONE 4 (``Exaone4ForCausalLM``): OLMo 2's layer (norms after each sublayer) with
Qwen3's per-head query and key norms and Llama's norm arithmetic (models/olmo2.py); three
sliding-window layers to each global one, which has no RoPE."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import (
    Architecture,
    check_layer_count,
    sliding_window,
    windows_of,
)


class Exaone4(Architecture):
    model_module = "olmo2"
    model_class = "Olmo2ForCausalLM"
    lora = True
    # Exaone4Config's: three sliding-window layers to each global one, which has no RoPE.
    config_defaults = dict(
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        sliding_window=4096,
        sliding_window_pattern=4,
    )

    def layer_types(self, hf_config: dict[str, Any]) -> list[str]:
        """Each layer's kind: none windowed without a ``sliding_window``; else the config's
        ``layer_types``, or every ``sliding_window_pattern``-th layer global and the others
        windowed (Exaone4Config's derivation)."""
        num_layers = hf_config["num_hidden_layers"]
        if not hf_config.get("sliding_window"):
            return ["full_attention"] * num_layers
        layer_types = hf_config.get("layer_types")
        if layer_types is None:
            pattern = hf_config["sliding_window_pattern"]
            if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
                raise ValueError(
                    "model: EXAONE 4 without layer_types needs sliding_window_pattern, an "
                    f"integer >= 1 (every pattern-th layer global), got {pattern!r}"
                )
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)
            ]
        check_layer_count(layer_types, num_layers)
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(
                f"model: layer_types holds {', '.join(map(repr, unknown))}; supported: "
                "sliding_attention, full_attention"
            )
        return list(layer_types)

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        return windows_of(self.layer_types(hf_config), sliding_window(hf_config))

    def rope_layers(self, hf_config: dict[str, Any]) -> tuple[bool, ...]:
        """Its global layers attend without RoPE when the model has windowed ones."""
        if not hf_config.get("sliding_window"):
            return (True,) * hf_config["num_hidden_layers"]
        return tuple(kind == "sliding_attention" for kind in self.layer_types(hf_config))
