"""Microsoft's Phi-3 (and Phi-4, ``Phi3ForCausalLM``): Llama whose checkpoint stores q/k/v
as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (split on loading, models/phi3.py,
so each tensor-parallel rank takes its heads and rows as from separate tensors), RoPE over
part of each head, LongRoPE, and ``sliding_window`` (when set) on every layer."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.models.architecture import Architecture, sliding_window


class Phi3(Architecture):
    model_module = "phi3"
    model_class = "Phi3ForCausalLM"
    lora = True
    # Its adapters target the fused projections: an adapter's B spans the whole fused
    # output, whose rows [q | k | v] and [gate | up] the fused layers keep in the same order.
    lora_projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    partial_rotary = True
    config_defaults = dict(rms_norm_eps=1e-5, max_position_embeddings=4096)

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        return (sliding_window(hf_config),) * hf_config["num_hidden_layers"]
