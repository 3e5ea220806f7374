"""What the engine needs to know about a model, read from its HF ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.gpu_worker.layers.rope_config import rope_context_window, rope_parameters

# HF architecture name -> the model family implemented in gpu_worker/models.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "OPTForCausalLM": "opt",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and special tokens of a model; ``hf_config`` keeps the raw fields that
    only one family reads (biases, RoPE scaling, OPT's projections)."""

    path: Path
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    # Each layer's sliding window in tokens, 0 for full attention (see _layer_sliding_windows).
    layer_sliding_windows: tuple[int, ...]
    hf_config: dict[str, Any] = field(repr=False, compare=False)

    @property
    def embedding_size(self) -> int:
        """Values in the model's output hidden state, what an embedding pools: the hidden
        size, or OPT's ``word_embed_proj_dim`` when it projects out."""
        return self.hf_config.get("word_embed_proj_dim") or self.hidden_size

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: {str(path)!r} has no config.json")
        hf_config = json.loads(config_file.read_text())
        architectures = hf_config.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ValueError(
                f"model: architecture {architectures or hf_config.get('model_type')!r} in "
                f"{str(config_file)!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[architecture]
        num_heads = hf_config["num_attention_heads"]
        hidden_size = hf_config["hidden_size"]
        head_size = hf_config.get("head_dim") or hidden_size // num_heads
        return cls(
            path=path,
            architecture=architecture,
            family=family,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hidden_size,
            num_layers=hf_config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
            head_size=head_size,
            max_position_embeddings=_max_positions(hf_config),
            eos_token_ids=_eos_token_ids(path, hf_config),
            layer_sliding_windows=_layer_sliding_windows(architecture, hf_config),
            hf_config=hf_config,
        )


def _max_positions(hf_config: dict[str, Any]) -> int:
    max_positions = hf_config.get("max_position_embeddings", 2048)
    # YaRN extends the context past the configured positions (the original times the factor).
    # A sliding window does not bound it: the attention ops honour each layer's window.
    return rope_context_window(rope_parameters(hf_config), max_positions)


def _layer_sliding_windows(architecture: str, hf_config: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window in tokens (0: full attention), as HF transformers 5.x
    builds the model:

    - Mistral: ``sliding_window`` (when set) on every layer; MistralConfig ignores
      ``layer_types`` and ``use_sliding_window``.
    - Qwen2 / Qwen3: ``sliding_window`` counts only with ``use_sliding_window`` (default
      false); then the layers whose ``layer_types`` entry is ``"sliding_attention"`` use it, and
      without ``layer_types`` the layers from ``max_window_layers`` (default 28) on do.
    - Llama and OPT have no sliding window.
    """
    num_layers = hf_config["num_hidden_layers"]
    window = hf_config.get("sliding_window") or 0
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"model: sliding_window must be a non-negative integer, got {window!r}")
    if architecture == "MistralForCausalLM":
        return (window,) * num_layers
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return (0,) * num_layers
    if not hf_config.get("use_sliding_window", False):
        window = 0
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        first_windowed = hf_config.get("max_window_layers", 28)
        layer_types = [
            "sliding_attention" if i >= first_windowed else "full_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError(
            f"model: layer_types has {len(layer_types)} entries but num_hidden_layers is "
            f"{num_layers}; they must match"
        )
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


def _eos_token_ids(path: Path, hf_config: dict[str, Any]) -> frozenset[int]:
    """EOS ids from generation_config.json (what HF generate stops on), else config.json."""
    eos: Any = None
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        eos = json.loads(generation_file.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf_config.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming the field, its value and the limit if the model cannot
    be split over ``size`` ranks: query heads and the MLP's intermediate rows must divide
    evenly; KV heads must divide evenly, or divide ``size`` (then they are replicated).
    The vocabulary needs nothing: its last shard is padded."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    _check_divisible("num_attention_heads", config.num_heads, size)
    if config.num_kv_heads >= size:
        _check_divisible("num_key_value_heads", config.num_kv_heads, size)
    elif size % config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's num_key_value_heads="
            f"{config.num_kv_heads} is below it, so each KV head is replicated on "
            f"tensor_parallel_size / num_key_value_heads ranks, which must be a whole "
            f"number; use a multiple of {config.num_kv_heads} or a size at most it"
        )
    mlp_field = "ffn_dim" if config.family == "opt" else "intermediate_size"
    _check_divisible(mlp_field, config.hf_config[mlp_field], size)


def _check_divisible(field: str, value: int, size: int) -> None:
    if value % size:
        divisors = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {field}={value} "
            f"(each rank holds {field} / tensor_parallel_size of them); "
            f"sizes that do: {', '.join(map(str, divisors))}"
        )


# The weight and KV cache dtypes a worker runs (gpu_worker/worker.py maps them to torch's).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_dtype_name(dtype: str) -> None:
    """Raise ``ValueError`` naming the value and the choices for an unknown dtype."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
