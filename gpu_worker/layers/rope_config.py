"""RoPE settings as HF configs write them: which scaling, and the context window it gives.

Torch-free, so the frontend process (the gRPC server) can read a model's limits without
importing the worker; ``rotary.py`` turns these settings into frequencies.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Hunyuan's "dynamic" RoPE with an ``alpha`` (architectures/hunyuan.py), its own only.
NTK_ALPHA = "ntk_alpha"


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either config style: transformers 5's ``rope_parameters`` or the
    older ``rope_theta`` + ``rope_scaling`` pair, completed as transformers completes them."""
    parameters = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    parameters = {**scaling, **parameters}
    parameters.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    parameters["rope_type"] = parameters.get("rope_type") or parameters.get("type") or "default"
    if hf_config.get("partial_rotary_factor") is not None:  # the nested value wins, as in HF
        parameters.setdefault("partial_rotary_factor", hf_config["partial_rotary_factor"])
    if parameters["rope_type"] in ("llama3", "yarn", "longrope"):
        # The pretraining context: a top-level value wins (Phi-3 keeps it there), then the
        # scaling's own, then the model's.
        original = hf_config.get("original_max_position_embeddings")
        if original is None:
            original = parameters.get(
                "original_max_position_embeddings", hf_config.get("max_position_embeddings")
            )
        parameters["original_max_position_embeddings"] = original
    if parameters["rope_type"] == "yarn":
        original = parameters["original_max_position_embeddings"]
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(
                f"rope original_max_position_embeddings must be an integer >= 1 for YaRN, "
                f"got {original!r}"
            )
        if parameters.get("factor") is None:
            # DeepSeek-V3 style: the factor is the extended over the original context.
            parameters["factor"] = hf_config["max_position_embeddings"] / original
        factor = parameters["factor"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
            raise ValueError(f"rope factor must be a number >= 1 for YaRN, got {factor!r}")
    if parameters["rope_type"] == "longrope":
        _check_longrope(parameters, hf_config)
    return parameters


def _check_longrope(parameters: dict[str, Any], hf_config: dict[str, Any]) -> None:
    """Phi-3's LongRoPE settings, completed as transformers completes them: ``factor``
    (unset: the extended over the original context) sets the attention factor."""
    original = parameters["original_max_position_embeddings"]
    if isinstance(original, bool) or not isinstance(original, int) or original < 2:
        raise ValueError(
            f"rope original_max_position_embeddings must be an integer >= 2 for longrope, "
            f"got {original!r}"
        )
    if parameters.get("factor") is None:
        parameters["factor"] = hf_config.get("max_position_embeddings", original) / original
    for name in ("short_factor", "long_factor"):
        factors = parameters.get(name)
        if not isinstance(factors, list) or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors
        ):
            raise ValueError(
                f"rope {name} must be a list of positive numbers for longrope, got {factors!r:.100}"
            )


def rope_context_window(parameters: dict[str, Any], max_position_embeddings: int) -> int:
    """The positions the model is meant to take: YaRN's extended context (the original times
    the factor, as vLLM derives it), else ``max_position_embeddings`` (LongRoPE's whole
    window: its long factors past the original context, ``long_rope_switch``)."""
    if parameters["rope_type"] == "yarn":
        return int(parameters["original_max_position_embeddings"] * parameters["factor"])
    return max_position_embeddings


def long_rope_switch(parameters: dict[str, Any]) -> int:
    """LongRoPE's original context in tokens (0 for other RoPE types). HF rotates the tokens
    a forward pass computes with the short factors while the pass stays within it, and with
    the long factors once it reaches past it, keeping the keys it cached before as they
    were: under ``generate`` a token at position p is rotated with the long factors when
    max(prompt length, p + 1) exceeds it. The engine rotates each token by that rule (the
    prompt's length, not a pass's, so chunked prefill and recompute rotate alike), and keeps
    the cached prefixes of prompts past it apart from the others'."""
    if parameters["rope_type"] != "longrope":
        return 0
    return int(parameters["original_max_position_embeddings"])


# Why a dynamic-NTK model's window stops at max_position_embeddings. Within it HF rotates with
# the plain frequencies; a forward pass that reaches past it re-bases every position of the
# pass for that pass's length, which keys cached at other lengths (prefix caching, chunked
# prefill, recompute) do not share.
DYNAMIC_WINDOW_REASON = (
    "dynamic: positions past max_position_embeddings (RoPE re-based per pass) are not supported yet"
)


# Gemma 3's two kinds of layers and the RoPE base each uses when a config does not say
# (Gemma3TextConfig.default_theta): local (sliding-window) layers rotate slower than global.
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")
_GEMMA3_DEFAULT_THETA = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
# The older (transformers 4) top-level field holding each kind's base.
_GEMMA3_THETA_FIELD = {"sliding_attention": "rope_local_base_freq", "full_attention": "rope_theta"}


def layer_type_rope_parameters(hf_config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """Gemma 3's RoPE settings for the layers of ``layer_type``, from either config style:
    transformers 5's ``rope_parameters`` keyed by layer type, or transformers 4's
    ``rope_theta`` (global layers), ``rope_local_base_freq`` (sliding layers) and
    ``rope_scaling`` (global layers only), completed as Gemma3TextConfig completes them."""
    if layer_type not in GEMMA3_LAYER_TYPES:
        raise ValueError(
            f"model: layer type {layer_type!r} is not supported; "
            f"supported: {', '.join(GEMMA3_LAYER_TYPES)}"
        )
    by_layer_type = hf_config.get("rope_parameters") or {}
    parameters = dict(by_layer_type.get(layer_type) or {"rope_type": "default"})
    if layer_type == "full_attention":
        parameters.update(hf_config.get("rope_scaling") or {})
    parameters.setdefault(
        "rope_theta",
        hf_config.get(_GEMMA3_THETA_FIELD[layer_type], _GEMMA3_DEFAULT_THETA[layer_type]),
    )
    # The per-type settings nest no further, and a scaling's pretraining context comes from
    # them or max_position_embeddings (HF's standardize_rope_params for nested settings).
    return rope_parameters(
        {
            "rope_parameters": parameters,
            "max_position_embeddings": hf_config.get("max_position_embeddings"),
        }
    )


# OLMo 3's RoPE base when its config gives none (Olmo3Config.default_theta).
_OLMO3_DEFAULT_THETA = 500_000.0


def olmo3_layer_rope_parameters(hf_config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """OLMo 3's RoPE settings for the layers of ``layer_type``, completed as Olmo3Config
    completes them: transformers 5's ``rope_parameters`` keyed by layer type, or
    transformers 4's top-level ``rope_scaling`` and ``rope_theta``, which reach the full
    attention layers only (the config takes ``rope_theta`` once, for them; the sliding
    layers keep the default base)."""
    if layer_type not in GEMMA3_LAYER_TYPES:
        raise ValueError(
            f"model: layer type {layer_type!r} is not supported; "
            f"supported: {', '.join(GEMMA3_LAYER_TYPES)}"
        )
    by_layer_type = hf_config.get("rope_parameters") or {}
    parameters = dict(by_layer_type.get(layer_type) or {"rope_type": "default"})
    if layer_type == "full_attention":
        parameters.update(hf_config.get("rope_scaling") or {})
        parameters.setdefault("rope_theta", hf_config.get("rope_theta", _OLMO3_DEFAULT_THETA))
    else:
        parameters.setdefault("rope_theta", _OLMO3_DEFAULT_THETA)
    return rope_parameters(
        {
            "rope_parameters": parameters,
            "max_position_embeddings": hf_config.get("max_position_embeddings"),
        }
    )
