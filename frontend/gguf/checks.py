"""Layout checks several architectures share (routers, experts, biases, q/k norms, sliding
layers): each refuses a file the HF model cannot hold, naming the architecture given."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf

# llama.cpp's expert_gating_func values.
SOFTMAX = int(gguf.ExpertGatingFuncType.SOFTMAX)
SIGMOID = int(gguf.ExpertGatingFuncType.SIGMOID)
# The projections HF's attention_bias gives a bias (llama.cpp's names).
ATTENTION_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output")


def check_fixed_router(
    architecture: str, key: Callable[..., Any], gating: int, renormalize: bool
) -> None:
    """A router whose scoring and renormalisation llama.cpp's graph (and HF's class) fix: the
    keys a file may carry about it must agree, and none scales its weights or groups its
    experts."""
    names = {SOFTMAX: "softmax", SIGMOID: "sigmoid"}
    fixed = {
        "expert_gating_func": (gating, f"{gating} ({names[gating]})"),
        "expert_weights_norm": (renormalize, str(renormalize).lower()),
        "expert_weights_scale": (1.0, "1"),
        "expert_group_count": (1, "1"),
        "expert_group_used_count": (1, "1"),
    }
    for name, (value, spelled) in fixed.items():
        found = key(name)
        if found is not None and found != value:
            raise ValueError(
                f"GGUF {architecture} {name}={found} is not supported (llama.cpp's graph and "
                f"HF's model fix the router); supported: {spelled} or none"
            )


def experts_in_every_layer(
    architecture: str,
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
) -> tuple[int, int, int]:
    """(experts, their intermediate size, experts per token) of a model whose every layer is
    sparse, the sizes from the tensors: llama.cpp's graphs for those need a router and experts
    in each layer."""
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes]
    if dense:
        raise ValueError(
            f"GGUF {architecture} has no expert router (ffn_gate_inp) in layers {dense}; every "
            f"{architecture} layer has experts"
        )
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    num_experts, intermediate_size, _ = tensor_shapes["blk.0.ffn_gate_exps.weight"]
    return num_experts, intermediate_size, int(top_k)


def check_whole_projection_norms(
    architecture: str, tensor_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> None:
    """q/k norms in every layer over the whole query and key projections (a weight per row of
    each, all heads at once, as both llama.cpp and HF keep them), not one head's."""
    for layer in range(num_layers):
        for projection in ("attn_q", "attn_k"):
            rows = tensor_shapes[f"blk.{layer}.{projection}.weight"][0]
            shape = tensor_shapes.get(f"blk.{layer}.{projection}_norm.weight")
            if shape != (rows,):
                found = "no such tensor" if shape is None else f"shape {shape}"
                raise ValueError(
                    f"GGUF {architecture} blk.{layer}.{projection}_norm: {found}; expected "
                    f"({rows},), a norm over the whole {projection} projection"
                )


def check_per_head_qk_norms(
    architecture: str, tensor_shapes: dict[str, tuple[int, ...]], num_layers: int, head_dim: int
) -> None:
    """q/k norms in every layer, one weight per value of a head, shared by all heads (where
    llama.cpp's graph needs them and HF's model always has them)."""
    for layer in range(num_layers):
        for projection in ("attn_q", "attn_k"):
            shape = tensor_shapes.get(f"blk.{layer}.{projection}_norm.weight")
            if shape != (head_dim,):
                found = "no such tensor" if shape is None else f"shape {shape}"
                raise ValueError(
                    f"GGUF {architecture} blk.{layer}.{projection}_norm: {found}; expected "
                    f"({head_dim},), a norm over each head"
                )


def biases_switched(
    architecture: str,
    field: str,
    projections: tuple[str, ...],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
) -> bool:
    """Whether the file has the biases HF's one switch ``field`` gives ``projections`` in
    every layer: all of them, or none (a file with some is another model)."""
    names = [f"blk.{i}.{projection}.bias" for i in range(num_layers) for projection in projections]
    present = [name for name in names if name in tensor_shapes]
    if present and len(present) < len(names):
        missing = [name for name in names if name not in tensor_shapes]
        raise ValueError(
            f"GGUF {architecture} has {listed(present)} but not {listed(missing)}; HF's "
            f"{field} gives {', '.join(projections)} a bias in every layer, or none"
        )
    return bool(present)


def listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")


def check_ungated(
    architecture: str, tensor_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> None:
    """An MLP of down(act(up(x))), no gate in HF's model or llama.cpp's graph."""
    gated = [i for i in range(num_layers) if f"blk.{i}.ffn_gate.weight" in tensor_shapes]
    if gated:
        raise ValueError(
            f"GGUF {architecture} has a gated MLP (ffn_gate) in layers {gated}; "
            f"{architecture}'s MLP is ungated"
        )


def sliding_layer_types(architecture: str, key: Callable[..., Any], num_layers: int) -> list[str]:
    """HF's layer_types from llama.cpp's sliding_window_pattern: one flag per layer, true for
    the layers that slide, as llama.cpp's converters write it from HF's layer_types."""
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(
            f"GGUF {architecture} file with a sliding window needs "
            f"attention.sliding_window_pattern, one flag per layer ({num_layers}), "
            f"got {pattern!r:.100}"
        )
    return ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
