"""The GGUF's tensors as HF's: renamed, dequantized to float32, and undone what llama.cpp did
(its Q/K row order, 1 + w norms, stacked experts), one GGUF tensor at a time; the
architecture's hooks join or add what it keeps otherwise."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

if TYPE_CHECKING:
    from pagedserve.frontend.gguf.architecture import Architecture

# GGUF per-layer tensor name (after "blk.N.", before ".weight" / ".bias") -> HF name (after
# "model.layers.N.", likewise).
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    # An RMSNorm over each query and key head.
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture-of-experts: the router, and a shared expert with its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# GGUF per-layer tensors whose HF name has no .weight / .bias: a router's bias that only
# steers the choice of experts (a buffer in HF).
UNSUFFIXED_LAYER_TENSOR_NAMES = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def shared_mlp_names(module: str) -> tuple[tuple[str, str], ...]:
    """llama.cpp's shared-expert projections (``ffn_*_shexp``) under the HF ``module`` that
    holds them."""
    return tuple(
        (f"ffn_{projection}_shexp", f"{module}.{projection}_proj")
        for projection in ("gate", "up", "down")
    )


def dequantized_tensors(
    reader: gguf.GGUFReader,
    architecture: Architecture,
    fields: dict[str, Any],
    config: dict[str, Any],
    report: Callable[..., None],
) -> Iterator[tuple[str, np.ndarray]]:
    """Each HF tensor in float32, one GGUF tensor at a time."""
    num_tensors = len(reader.tensors)
    report_every = max(1, num_tensors // 10)
    skipped = architecture.tensors_without_weights(
        [tensor.name for tensor in reader.tensors], config["num_hidden_layers"]
    )

    def each_tensor() -> Iterator[tuple[str, np.ndarray]]:
        for index, tensor in enumerate(reader.tensors, start=1):
            if tensor.name not in skipped:
                yield from _hf_tensors(tensor, architecture, config)
            if index % report_every == 0 or index == num_tensors:
                report("dequantizing", index, num_tensors)

    yield from architecture.joined_tensors(each_tensor(), config)
    yield from architecture.extra_tensors(fields, config)


def layer_of(gguf_name: str) -> int | None:
    """N for a tensor of block N ("blk.N. ..."), None for a global one."""
    prefix, _, rest = gguf_name.partition(".")
    layer = rest.partition(".")[0]
    return int(layer) if prefix == "blk" and layer.isdigit() else None


def hf_tensor_names(gguf_name: str, architecture: Architecture, num_experts: int) -> list[str]:
    """The HF names of a GGUF tensor: one, or one per expert for a stacked expert tensor."""
    global_names = {**GLOBAL_TENSOR_NAMES, **dict(architecture.global_names)}
    if gguf_name in global_names:
        return [global_names[gguf_name]]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    base, _, kind = suffix.rpartition(".")
    layer_names = {**LAYER_TENSOR_NAMES, **dict(architecture.layer_names)}
    unsuffixed_names = {**UNSUFFIXED_LAYER_TENSOR_NAMES, **dict(architecture.unsuffixed_names)}
    if prefix == "blk" and layer.isdigit() and kind in ("weight", "bias"):
        if suffix in unsuffixed_names:
            return [f"model.layers.{layer}.{unsuffixed_names[suffix]}"]
        if base in layer_names:
            return [f"model.layers.{layer}.{layer_names[base]}.{kind}"]
        # llama.cpp stacks a layer's experts into one [num_experts, rows, columns] tensor per
        # projection; HF has one matrix per expert.
        stacked = dict(architecture.expert_projections)
        if base in stacked and kind == "weight":
            return [
                f"model.layers.{layer}.{architecture.expert_format}.weight".format(
                    expert=expert, projection=stacked[base]
                )
                for expert in range(num_experts)
            ]
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF equivalent in this converter")


def _hf_tensors(
    tensor: Any, architecture: Architecture, config: dict[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """One GGUF tensor as HF tensors: dequantized, renamed, and undone what llama.cpp did."""
    num_experts = (
        config.get("num_experts")
        or config.get("num_local_experts")
        or config.get("n_routed_experts")
        or config.get("moe_num_experts", 0)
    )
    names = hf_tensor_names(tensor.name, architecture, num_experts)
    torch_shape = tuple(int(dim) for dim in reversed(tensor.shape))
    weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    weight = weight.astype(np.float32, copy=False).reshape(torch_shape)
    if len(names) > 1:  # stacked experts: [num_experts, rows, columns]
        for name, expert_weight in zip(names, weight, strict=True):
            yield name, np.ascontiguousarray(expert_weight)
        return
    name = names[0]
    if architecture.permuted_qk and ".q_proj." in name:
        weight = _undo_rope_permutation(weight, config["num_attention_heads"])
    elif architecture.permuted_qk and ".k_proj." in name:
        weight = _undo_rope_permutation(weight, config["num_key_value_heads"])
    elif architecture.one_plus_norms and name.endswith("norm.weight"):
        weight = weight - 1.0
    elif name.endswith("shared_expert_gate.weight"):
        weight = weight.reshape(1, -1)  # llama.cpp drops HF's leading 1
    weight = architecture.fix_tensor(name, weight)
    yield name, np.ascontiguousarray(weight)


def _undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order so HF's rotate-half RoPE applies to the weights.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ...; HF rotates the two halves of each
    head. llama.cpp's converter therefore interleaves each head's rows: for head h it stores
    rows [r0, r(d/2), r1, r(d/2+1), ...]. Viewing the rows as (head, pair, half) and swapping
    the last two axes restores [r0, r1, ..., r(d/2), ...].
    """
    rows = weight.shape[0]
    half_head_dim = rows // num_heads // 2
    # A bias permutes as a matrix of one column.
    by_head = weight.reshape(num_heads, half_head_dim, 2, -1)
    return by_head.swapaxes(1, 2).reshape(weight.shape)
