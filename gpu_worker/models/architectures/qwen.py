"""Alibaba's Qwen2 (Llama with q/k/v biases) and Qwen3 (Llama with an RMSNorm over each
query and key head before RoPE), and their mixture-of-experts models Qwen2-MoE (a shared
expert behind a sigmoid gate) and Qwen3-MoE, whose layers swap the MLP for experts
(layers/moe.py; Qwen3-VL-MoE's stacked experts are split on loading: models/qwen_moe.py).

Sliding windows as HF transformers 5.x builds them: ``sliding_window`` counts only with
``use_sliding_window`` (default false); then the layers whose ``layer_types`` entry is
``"sliding_attention"`` use it, and without ``layer_types`` the layers from
``max_window_layers`` (default 28) on do (Qwen2 / Qwen3), or the even-numbered layers below
it (Qwen2-MoE); Qwen3-MoE's every layer does."""

from __future__ import annotations

from typing import Any

from pagedserve.gpu_worker.model_config import ExpertsSpec
from pagedserve.gpu_worker.models.architecture import (
    HEAD_NORM,
    Architecture,
    check_layer_count,
    checked_experts,
    num_experts,
    sliding_window,
    windows_of,
)


class Qwen2(Architecture):
    lora = True

    def qkv_bias(self, hf_config: dict[str, Any]) -> bool:
        return True

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        num_layers = hf_config["num_hidden_layers"]
        window = sliding_window(hf_config)
        if not hf_config.get("use_sliding_window", False):
            window = 0
        layer_types = hf_config.get("layer_types")
        if layer_types is None:
            first_windowed = hf_config.get("max_window_layers", 28)
            layer_types = [
                "sliding_attention"
                if self.windowed_by_default(i, first_windowed)
                else "full_attention"
                for i in range(num_layers)
            ]
        check_layer_count(layer_types, num_layers)
        return windows_of(layer_types, window)

    def windowed_by_default(self, layer: int, max_window_layers: int) -> bool:
        """Whether a layer slides when the config has no ``layer_types``."""
        return layer >= max_window_layers


class Qwen3(Qwen2):
    qk_norm = HEAD_NORM

    def qkv_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("attention_bias"))


class Qwen2Moe(Qwen2):
    """``num_experts`` (default 60) experts of ``moe_intermediate_size``, top
    ``num_experts_per_tok`` (default 4), renormalised with ``norm_topk_prob``, plus a shared
    expert of ``shared_expert_intermediate_size``; sparse at the layers not in
    ``mlp_only_layers`` whose number + 1 is a multiple of ``decoder_sparse_step``, the others
    a dense MLP of ``intermediate_size``. q/k/v biases unless ``qkv_bias`` is false."""

    default_experts, default_top_k = 60, 4

    def qkv_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("qkv_bias", True))

    def windowed_by_default(self, layer: int, max_window_layers: int) -> bool:
        return layer % 2 == 0 and layer < max_window_layers

    def shared_expert_size(self, hf_config: dict[str, Any]) -> Any:
        return hf_config.get("shared_expert_intermediate_size", 5632)

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        num_layers = hf_config["num_hidden_layers"]
        count, field = num_experts(hf_config, self.default_experts)
        if count == 0:
            return (None,) * num_layers  # HF: no expert anywhere, every layer dense
        spec = checked_experts(
            hf_config,
            num_experts=count,
            num_experts_field=field,
            top_k=hf_config.get("num_experts_per_tok", self.default_top_k),
            intermediate_field="moe_intermediate_size",
            renormalize=bool(hf_config.get("norm_topk_prob", False)),
            weights_in_float32=False,
            shared_intermediate_size=self.shared_expert_size(hf_config),
        )
        step = hf_config.get("decoder_sparse_step", 1)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"model: decoder_sparse_step must be a positive integer, got {step!r}")
        dense = set(hf_config.get("mlp_only_layers") or [])
        return tuple(
            spec if i not in dense and (i + 1) % step == 0 else None for i in range(num_layers)
        )


class Qwen3Moe(Qwen2Moe):
    """Qwen2-MoE's experts (default 128, top 8) without the shared one, Qwen3's attention,
    and with ``use_sliding_window`` a window on every layer."""

    model_module = "qwen_moe"
    model_class = "Qwen3MoeForCausalLM"
    qk_norm = HEAD_NORM
    default_experts, default_top_k = 128, 8

    def qkv_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("attention_bias"))

    def shared_expert_size(self, hf_config: dict[str, Any]) -> Any:
        return 0

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        window = sliding_window(hf_config)
        if not hf_config.get("use_sliding_window", False):
            window = 0
        return (window,) * hf_config["num_hidden_layers"]
