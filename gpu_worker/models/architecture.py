"""The record and hooks by which one HF architecture differs from Llama.

Each module under ``architectures/`` subclasses ``Architecture``, sets what is special about
its architectures and overrides the hooks where they differ; the shared code (model_config.py,
the layers, lora.py, Llama's model) reads only these, so it never names an architecture.
Torch-free: the frontend reads a model's config before any worker (or torch) has loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedserve.gpu_worker.layers.rope_config import (
    SUPPORTED_ROPE_TYPES,
    rope_context_window,
    rope_parameters,
)
from pagedserve.gpu_worker.model_config import ExpertsSpec

if TYPE_CHECKING:
    from pagedserve.gpu_worker.model_config import ModelConfig

# The projections of Llama's decoder layer, which a LoRA adapter may target.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# An ungated MLP's (``down(act(up(x)))``): no gate_proj.
UNGATED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")

# How an attention layer normalises its queries and keys (``Architecture.qk_norm``):
# each head by one weight of head_size between projection and RoPE (Qwen3's), the whole
# projection at once (OLMoE's), each head after RoPE (Hunyuan's), or each head after RoPE
# without a learned scale (Llama 4's).
HEAD_NORM = "head"
PROJECTION_NORM = "projection"
ROTATED_HEAD_NORM = "rotated_head"
WEIGHTLESS_ROTATED_HEAD_NORM = "weightless_rotated_head"


class Architecture:
    """One HF architecture (``name``, the string config.json's ``architectures`` holds); the
    defaults are Llama's."""

    # The module under gpu_worker/models and the class that implement it in torch.
    model_module = "llama"
    model_class = "LlamaForCausalLM"
    # The HF config class's defaults for fields a config.json may leave out, where they differ
    # from what the engine would otherwise assume.
    config_defaults: Mapping[str, Any] = {}
    # Fields the config names its own way (the HF config class's attribute_map): the
    # config's name -> the one the engine reads.
    field_aliases: Mapping[str, str] = {}
    # Whether HF has a sequence classifier of the name (``*ForSequenceClassification``).
    has_classifier = True
    # Whether RoPE may rotate only part of each head (``partial_rotary_factor``).
    partial_rotary = False
    # Whether RoPE is set per layer type (sliding / full attention), not one for the model.
    rope_per_layer_type = False
    # RoPE types beyond the common ones that ``prepare`` may produce.
    extra_rope_types: tuple[str, ...] = ()
    # The ``quantization_config`` methods its checkpoints may come in (widened on loading).
    checkpoint_quantizations: tuple[str, ...] = ()
    # Whether the KV cache holds DeepSeek's latents (layers/latent_attention.py).
    latent_attention = False
    # Whether its checkpoints carry multi-token-prediction layers (method "mtp").
    next_token_layers = False
    # The config field of a dense MLP's intermediate width.
    dense_width_field = "intermediate_size"
    # LoRA: whether adapters are served, the projections they may target, and where the
    # model keeps a projection when not where Llama's does (projection -> (module, part)).
    lora = False
    lora_projections: tuple[str, ...] = LLAMA_PROJECTIONS
    lora_modules: Mapping[str, tuple[str, int | None]] = {}

    # What Llama's model (models/llama.py) reads of the members of its family.
    # The query and key norm (one of the *_NORM names above; None: none).
    qk_norm: str | None = None
    # An MLP without a gate (Arcee's squared ReLU, Apertus's xIELU).
    ungated_mlp = False
    # Granite's four scalars (embedding, attention, residual, logits multipliers).
    granite_scalars = False
    # Whether the checkpoint's query and key rows rotate interleaved pairs (reordered to
    # halves on loading).
    interleaved_rope = False
    # Whether OLMoE's ``clip_qkv`` clamps the q/k/v projections.
    clips_qkv = False

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def classifier_name(self) -> str | None:
        """HF's sequence classifier of this decoder, which the engine reads as this
        architecture with a ``score`` head; None when HF has none."""
        if not self.has_classifier:
            return None
        return self.name.replace("ForCausalLM", "ForSequenceClassification")

    # -- reading the config --------------------------------------------------------------

    def prepare(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The config after its defaults are filled in, as the HF config class reads it."""
        return hf_config

    def check_fields(self, hf_config: dict[str, Any]) -> None:
        """Refuse config values the HF model honours but this engine's ops cannot."""
        if self.rope_per_layer_type:
            return  # read and checked per layer type
        parameters = rope_parameters(hf_config)
        supported = (*SUPPORTED_ROPE_TYPES, *self.extra_rope_types)
        if parameters["rope_type"] not in supported:
            raise ValueError(
                f"model: rope_type {parameters['rope_type']!r} is not supported yet; "
                f"supported: {', '.join(supported)}"
            )
        partial = parameters.get("partial_rotary_factor")
        if partial not in (None, 1, 1.0) and not self.partial_rotary:
            raise ValueError(
                f"model: partial_rotary_factor={partial!r} is not supported for {self.name} "
                f"(RoPE over part of each head: {', '.join(_partial_rotary_names())}); "
                "supported: 1.0"
            )

    def full_attention_rope(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The RoPE settings of the layers that attend to the whole context, whose scaling
        sets the context window."""
        return rope_parameters(hf_config)

    def max_positions(self, hf_config: dict[str, Any]) -> int:
        """The longest context: YaRN extends it past the configured positions (the original
        times the factor); LongRoPE's is the configured one. A sliding window does not bound
        it: the attention ops honour each layer's window."""
        max_positions = hf_config.get("max_position_embeddings", 2048)
        return rope_context_window(self.full_attention_rope(hf_config), max_positions)

    def rope_switch_parameters(self, hf_config: dict[str, Any]) -> dict[str, Any] | None:
        """The model-wide RoPE settings whose type may stop the window early (dynamic NTK)
        or switch factors at a length (LongRoPE); None where RoPE is set per layer type."""
        return None if self.rope_per_layer_type else rope_parameters(hf_config)

    def layer_sliding_windows(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        """Each layer's sliding window in tokens (0: full attention)."""
        return (0,) * hf_config["num_hidden_layers"]

    def rope_layers(self, hf_config: dict[str, Any]) -> tuple[bool, ...]:
        """Whether each layer rotates its queries and keys."""
        return (True,) * hf_config["num_hidden_layers"]

    def layer_attention_chunks(self, hf_config: dict[str, Any]) -> tuple[int, ...]:
        """Each layer's attention chunk in tokens (0: the whole context)."""
        return (0,) * hf_config["num_hidden_layers"]

    def layer_experts(self, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
        """Each layer's experts; None for a dense MLP."""
        return (None,) * hf_config["num_hidden_layers"]

    def cache_head(self, hf_config: dict[str, Any]) -> tuple[int, int] | None:
        """(head size, KV heads) of the cache where it is not the attention's."""
        return None

    def next_token_layer_fields(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The config as if its first multi-token-prediction layer were one more decoder
        layer (``num_hidden_layers`` already counts it)."""
        return hf_config

    # -- what Llama's model reads --------------------------------------------------------

    def qkv_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("attention_bias"))

    def output_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("attention_bias"))

    def mlp_bias(self, hf_config: dict[str, Any]) -> bool:
        return bool(hf_config.get("mlp_bias"))

    def lm_head_bias(self, hf_config: dict[str, Any]) -> bool:
        return False

    def query_norm(self, hf_config: dict[str, Any], rotates: bool) -> str | None:
        """The query and key norm of a layer that rotates (or not)."""
        return self.qk_norm

    def query_scaling(self, config: ModelConfig) -> tuple[float, int] | None:
        """Llama 4's attention temperature after RoPE: (beta, the original context L), each
        query scaled by ``1 + beta * log(1 + floor(position / L))``; None: none."""
        return None

    def nope_temperature(self, config: ModelConfig, rotates: bool) -> tuple[float, int] | None:
        """Llama 4's temperature on layers without RoPE: (scale, floor scale); None: none."""
        return None

    def checkpoint_name(self, name: str, hf_config: dict[str, Any]) -> str:
        """A checkpoint tensor's name as Llama's model names it."""
        return name


def _partial_rotary_names() -> list[str]:
    from pagedserve.gpu_worker.models.registry import architectures_with

    return architectures_with("partial_rotary")


# -- shared readings of config fields -------------------------------------------------------


def check_layer_count(layer_types: list[str], num_layers: int) -> None:
    if len(layer_types) != num_layers:
        raise ValueError(
            f"model: layer_types has {len(layer_types)} entries but num_hidden_layers is "
            f"{num_layers}; they must match"
        )


def windows_of(layer_types: list[str], window: int) -> tuple[int, ...]:
    """Each layer's window: ``window`` on its ``"sliding_attention"`` layers, 0 elsewhere."""
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


def sliding_window(hf_config: dict[str, Any]) -> int:
    """The config's ``sliding_window`` in tokens (null or absent: 0)."""
    window = hf_config.get("sliding_window") or 0
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"model: sliding_window must be a non-negative integer, got {window!r}")
    return window


def checked_int(name: str, value: Any, low: int) -> int:
    """``value`` when it is an integer of at least ``low``, else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"model: {name} must be an integer >= {low}, got {value!r}")
    return value


def checked_positive_number(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"model: {name} must be a positive finite number, got {value!r}")
    return float(value)


def num_experts(hf_config: dict[str, Any], default: int) -> tuple[Any, str]:
    """(the expert count, the field that gave it): HF treats ``num_experts`` and
    ``num_local_experts`` as one attribute, and checkpoints write either."""
    for name in ("num_experts", "num_local_experts"):
        if name in hf_config:
            return hf_config[name], name
    return default, "num_experts"


def checked_experts(
    hf_config: dict[str, Any],
    num_experts: Any,
    num_experts_field: str,
    top_k: Any,
    intermediate_field: str,
    renormalize: bool,
    weights_in_float32: bool,
    shared_intermediate_size: Any = 0,
    softmax_over_top_k: bool = False,
) -> ExpertsSpec:
    """An ``ExpertsSpec`` from checked fields (``ValueError`` naming a bad one)."""
    intermediate_size = hf_config.get(intermediate_field)
    for name, value, low in (
        (num_experts_field, num_experts, 1),
        ("num_experts_per_tok", top_k, 1),
        (intermediate_field, intermediate_size, 1),
        ("shared_expert_intermediate_size", shared_intermediate_size, 0),
    ):
        checked_int(name, value, low)
    if top_k > num_experts:
        raise ValueError(
            f"model: num_experts_per_tok={top_k} exceeds {num_experts_field}={num_experts}"
        )
    return ExpertsSpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=intermediate_size,
        intermediate_field=intermediate_field,
        renormalize=renormalize,
        weights_in_float32=weights_in_float32,
        shared_intermediate_size=shared_intermediate_size,
        softmax_over_top_k=softmax_over_top_k,
    )


def no_rope_layers(hf_config: dict[str, Any], lenient: bool = False) -> tuple[bool, ...]:
    """Whether each layer rotates, from ``no_rope_layers`` (1: RoPE, 0: none); without it
    every ``no_rope_layer_interval``-th layer (default 4) has none, as SmolLM3's and Llama 4's
    configs derive it. ``lenient`` (Llama 4's): a longer list is cut to the layers (its config
    reads one per layer, by index), and an empty one is none."""
    num_layers = hf_config["num_hidden_layers"]
    flags = hf_config.get("no_rope_layers")
    if lenient and isinstance(flags, list) and len(flags) > num_layers:
        flags = flags[:num_layers]
    if flags is None or (lenient and flags == []):
        interval = hf_config.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"model: no_rope_layer_interval must be an integer >= 1, got {interval!r}"
            )
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if (
        not isinstance(flags, list)
        or len(flags) != num_layers
        or any(f not in (0, 1) for f in flags)
    ):
        raise ValueError(
            f"model: no_rope_layers must hold one 0 or 1 per layer ({num_layers}), "
            f"got {flags!r:.200}"
        )
    return tuple(bool(flag) for flag in flags)
