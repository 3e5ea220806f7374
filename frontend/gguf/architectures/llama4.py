"""llama.cpp's llama4: Llama 4 Scout's and Maverick's language model.

RoPE on adjacent pairs in both llama.cpp (NORM) and HF, so no permutation; its feed-forward
block under HF's feed_forward names: a dense MLP, or a sigmoid router over stacked experts
beside one ungated shared expert. llama.cpp's converter splits HF's gate_up into gate and up
and transposes both and the down; joined_tensors restacks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pagedserve.frontend.gguf import rope
from pagedserve.frontend.gguf.architecture import Architecture
from pagedserve.frontend.gguf.checks import SIGMOID, check_fixed_router
from pagedserve.frontend.gguf.metadata import GGUFMetadata, float32_value
from pagedserve.frontend.gguf.tensors import shared_mlp_names

# What llama.cpp fixes rather than reading from the file (its llama4 hparams): attention in
# chunks of 8192 positions on the first three layers of every four (the chunk is no key; a
# sliding_window of 0 turns the chunks off and RoPE on in every layer), no RoPE on every
# fourth layer, whose queries it scales by 1 + 0.1 * log(1 + floor((position + 1) / 8192)),
# and q/k norms unless the model has 128 experts (Maverick's have none).
_CHUNK = 8192
_NO_ROPE_EVERY = 4
_FLOOR_SCALE = 8192
_ATTN_SCALE = 0.1
_EXPERTS_WITHOUT_QK_NORM = 128


class Llama4(Architecture):
    hf_architecture = "Llama4ForCausalLM"
    model_type = "llama4_text"
    bias_field = "attention_bias"
    layer_names = (
        ("ffn_gate", "feed_forward.gate_proj"),
        ("ffn_up", "feed_forward.up_proj"),
        ("ffn_down", "feed_forward.down_proj"),
        ("ffn_gate_inp", "feed_forward.router"),
        *shared_mlp_names("feed_forward.shared_expert"),
        # Interim names, restacked by joined_tensors.
        ("ffn_gate_exps", "feed_forward.experts.gate"),
        ("ffn_up_exps", "feed_forward.experts.up"),
        ("ffn_down_exps", "feed_forward.experts.down"),
    )
    expert_projections = ()

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Experts at every interleave_moe_layer_step-th layer (the only way llama.cpp places
        them, so the file's routers must be there), each of the size the tensors give beside a
        shared expert of that size, the top expert_used_count by a sigmoid that scales their
        input, unrenormalised (llama.cpp's graph and HF's model fix that router); dense layers
        of feed_forward_length (HF's intermediate_size_mlp); the layers' chunks, RoPE,
        temperature and q/k norms as llama.cpp fixes them (_CHUNK and the rest), written out
        per layer (layer_types, no_rope_layers, moe_layers), as HF's config holds them."""
        key, tensor_shapes, num_layers = metadata.key, metadata.tensor_shapes, metadata.num_layers
        check_fixed_router("llama4", key, SIGMOID, renormalize=False)
        step = key("interleave_moe_layer_step")
        if step is None or int(step) < 1:
            raise ValueError(
                "GGUF llama4 needs interleave_moe_layer_step >= 1 (the experts are at every "
                f"step-th layer, where llama.cpp puts them), got {step!r}"
            )
        step = int(step)
        sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
        expected = [i for i in range(num_layers) if (i + 1) % step == 0]
        if not sparse or sparse != expected:
            raise ValueError(
                f"GGUF llama4 has an expert router (ffn_gate_inp) in layers {sparse}; expected "
                f"the layers whose number + 1 is a multiple of interleave_moe_layer_step={step} "
                f"({expected}), and llama.cpp's llama4 needs experts"
            )
        top_k = key("expert_used_count")
        if top_k is None:
            raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
        num_experts, intermediate_size, _ = tensor_shapes[f"blk.{sparse[0]}.ffn_gate_exps.weight"]
        for layer in sparse:
            shape = tensor_shapes.get(f"blk.{layer}.ffn_gate_shexp.weight")
            if shape is None or shape[0] != intermediate_size:
                found = "no such tensor" if shape is None else f"{shape[0]} rows"
                raise ValueError(
                    f"GGUF llama4 blk.{layer}.ffn_gate_shexp: {found}; expected "
                    f"{intermediate_size} (HF's and llama.cpp's shared expert has the experts' "
                    "intermediate_size rows)"
                )
        chunked = _chunked(key, metadata.rope_theta)
        # Newer llama.cpp reads the chunked layers' period from the file (not the RoPE-less
        # layers' step, which stays 4); its converter writes none.
        period = key("attention.sliding_window_pattern", _NO_ROPE_EVERY)
        if isinstance(period, list) or int(period) < 1:
            raise ValueError(
                f"GGUF llama4 attention.sliding_window_pattern={period!r:.100} is not "
                "supported; supported: an integer >= 1 (every period-th layer attends in "
                "full), or none (4)"
            )
        period = int(period)
        config.update(
            {
                "intermediate_size": intermediate_size,
                "intermediate_size_mlp": int(key("feed_forward_length")),
                "num_local_experts": num_experts,
                "num_experts_per_tok": int(top_k),
                "interleave_moe_layer_step": step,
                "moe_layers": sparse,
                "use_qk_norm": num_experts != _EXPERTS_WITHOUT_QK_NORM,
                "no_rope_layer_interval": _NO_ROPE_EVERY,
                "no_rope_layers": [
                    int(not chunked or (i + 1) % _NO_ROPE_EVERY != 0) for i in range(num_layers)
                ],
                "attention_chunk_size": _CHUNK if chunked else None,
                "layer_types": [
                    "chunked_attention" if chunked and i % period < period - 1 else "full_attention"
                    for i in range(num_layers)
                ],
                # Without chunks llama.cpp scales no query (and every layer rotates).
                "attn_temperature_tuning": chunked,
                "floor_scale": _FLOOR_SCALE,
                "attn_scale": _ATTN_SCALE,
            }
        )

    def rope_scaling(self, metadata: GGUFMetadata) -> dict[str, Any] | None:
        if metadata.rope_freqs is None:
            return super().rope_scaling(metadata)
        # Scout's settings first: where no frequency falls in Llama 3's band both give back
        # the divisors alike, and the file is Scout's.
        return rope.llama3_rope_scaling(
            metadata.rope_freqs,
            metadata.rope_theta,
            metadata.head_dim,
            candidates=(rope.SCOUT_ROPE, rope.LLAMA3_ROPE),
        )

    def joined_tensors(
        self, tensors: Iterator[tuple[str, np.ndarray]], config: dict[str, Any]
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The experts as HF stacks them: llama.cpp's gate and up ([experts, intermediate,
        hidden] each, HF's gate_up split in halves and transposed) side by side into
        ``gate_up_proj`` [experts, hidden, 2 x intermediate], gate columns first (HF's
        ``chunk(2)``); its down [experts, hidden, intermediate] transposed into ``down_proj``
        [experts, intermediate, hidden]. HF's names for both have no .weight."""
        halves: dict[str, dict[str, np.ndarray]] = {}
        for name, tensor in tensors:
            stem, _, rest = name.partition(".feed_forward.experts.")
            if not rest:
                yield name, tensor
                continue
            projection = rest.removesuffix(".weight")
            prefix = f"{stem}.feed_forward.experts."
            if projection == "down":
                yield prefix + "down_proj", np.ascontiguousarray(tensor.swapaxes(1, 2))
                continue
            pair = halves.setdefault(prefix, {})
            pair[projection] = tensor
            if len(pair) < 2:
                continue
            del halves[prefix]
            gate_up = np.concatenate([pair["gate"], pair["up"]], axis=1).swapaxes(1, 2)
            # C order: safetensors writes the array's memory as it lies.
            yield prefix + "gate_up_proj", np.ascontiguousarray(gate_up)
        if halves:
            missing = ", ".join(f"{prefix}: {sorted(pair)}" for prefix, pair in halves.items())
            raise ValueError(
                f"GGUF llama4 has an expert gate or up tensor without the other: {missing}"
            )


def _chunked(key: Callable[..., Any], rope_theta: float) -> bool:
    """Whether llama.cpp runs the file with Llama 4's chunks (and RoPE-less layers): unless
    attention.sliding_window is 0 (llama.cpp's converter writes 0 for a config whose layers
    all attend in full, MobileLLM-R1's). Any other window it ignores for 8192, so only that
    one is read; a separate RoPE base for the chunked layers (rope.freq_base_swa) is one HF's
    Llama 4 does not have."""
    window = key("attention.sliding_window")
    if window is not None and int(window) not in (0, _CHUNK):
        raise ValueError(
            f"GGUF llama4 attention.sliding_window={window} is not supported (llama.cpp chunks "
            f"by {_CHUNK} whatever a nonzero window says); supported: 0 (no chunks), "
            f"{_CHUNK} or none"
        )
    base = key("rope.freq_base_swa")
    if base is not None and float32_value(base) != rope_theta:
        raise ValueError(
            f"GGUF llama4 rope.freq_base_swa={base} differs from rope.freq_base={rope_theta}; "
            "HF's Llama 4 rotates every layer with one base"
        )
    return window is None or int(window) != 0
