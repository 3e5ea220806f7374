"""The record and hooks by which one of llama.cpp's architectures maps onto an HF one.

Each module under ``architectures/`` subclasses ``Architecture``, sets its names and
overrides the hooks where it differs; the shared layer (config.py, tensors.py) reads only
these, so it never names an architecture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pagedserve.frontend.gguf import rope
from pagedserve.frontend.gguf.metadata import (
    ROPE_FACTOR_TENSORS,
    ROPE_FREQS_TENSOR,
    GGUFMetadata,
)
from pagedserve.frontend.gguf.registry import architectures_with
from pagedserve.frontend.gguf.tensors import layer_of


class Architecture:
    """One HF architecture a llama.cpp architecture's files convert to; the defaults are a
    llama-like model's."""

    hf_architecture: str
    model_type: str
    # llama.cpp rotates adjacent pairs for Llama and interleaves each head's Q/K rows to
    # match (undone in tensors.py); where it rotates halves, as HF does, or both
    # rotate adjacent pairs, the rows are stored as HF has them.
    permuted_qk: bool = False
    # The HF config field saying whether q/k/v have biases (None: the HF class always has
    # them, or never), set from whether the GGUF has them.
    bias_field: str | None = None
    # Whether RoPE may rotate part of each head (rope.dimension_count below head_dim).
    partial_rotary: bool = False
    # Whether LongRoPE's factor tensors (rope_factors_long / _short) are read.
    reads_rope_factors: bool = False
    # llama.cpp stores every norm's weight as 1 + w (its norms multiply by the weight; the
    # HF model's multiply by 1 + w).
    one_plus_norms: bool = False
    # The architecture's own names for per-layer tensors (GGUF name -> HF name), which
    # override tensors.LAYER_TENSOR_NAMES.
    layer_names: tuple[tuple[str, str], ...] = ()
    # Where HF keeps expert E's projections, and their names (llama.cpp's stacked tensor ->
    # HF's projection).
    expert_format: str = "mlp.experts.{expert}.{projection}"
    expert_projections: tuple[tuple[str, str], ...] = (
        ("ffn_gate_exps", "gate_proj"),
        ("ffn_up_exps", "up_proj"),
        ("ffn_down_exps", "down_proj"),
    )
    # The architecture's own names for the tensors of tensors.UNSUFFIXED_LAYER_TENSOR_NAMES
    # and tensors.GLOBAL_TENSOR_NAMES (GGUF name -> HF name), which override those.
    unsuffixed_names: tuple[tuple[str, str], ...] = ()
    global_names: tuple[tuple[str, str], ...] = ()

    def variant(self, metadata: GGUFMetadata) -> Architecture:
        """The architecture a file of this llama.cpp name is, where one name holds two HF
        models (told apart by the file's keys or tensors)."""
        return self

    def check_rope_dim(self, metadata: GGUFMetadata) -> None:
        """Refuses RoPE over part of each head where the architecture rotates all of it."""
        if metadata.rope_dim != metadata.head_dim and not self.partial_rotary:
            raise ValueError(
                f"GGUF rope.dimension_count={metadata.rope_dim} differs from "
                f"head_dim={metadata.head_dim}; partial rotary embeddings are supported for "
                f"{', '.join(architectures_with('partial_rotary'))} only, not "
                f"{metadata.architecture}"
            )

    def update_config(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Adds the architecture's config fields to the generic ones (or changes those)."""

    def rope_scaling(self, metadata: GGUFMetadata) -> dict[str, Any] | None:
        """HF's rope_scaling: Llama 3's from a rope_freqs tensor, LongRoPE's from factor
        tensors, else the rope.scaling keys'."""
        if metadata.rope_freqs is not None:
            return rope.llama3_rope_scaling(
                metadata.rope_freqs, metadata.rope_theta, metadata.head_dim
            )
        factors = metadata.rope_factors
        if factors:
            if not self.reads_rope_factors or set(factors) != {"long_factor", "short_factor"}:
                raise ValueError(
                    f"GGUF rope factor tensors ({', '.join(sorted(factors))}) are supported "
                    f"for {', '.join(architectures_with('reads_rope_factors'))} with both "
                    f"rope_factors_long and rope_factors_short, not {metadata.architecture}"
                )
            return rope.longrope_scaling(factors)
        return rope.scaling_from_keys(metadata.key)

    def add_rope(self, config: dict[str, Any], metadata: GGUFMetadata) -> None:
        """Writes rope_scaling and rope_parameters into ``config``."""
        rope_scaling = self.rope_scaling(metadata)
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        # transformers 5 keeps RoPE settings in rope_parameters; the legacy keys above stay
        # for readers that predate it.
        config["rope_parameters"] = {
            "rope_type": "default",
            **(rope_scaling or {}),
            "rope_theta": metadata.rope_theta,
        }

    def tensors_without_weights(self, names: list[str], num_layers: int) -> set[str]:
        """The GGUF tensors that become no HF weight: rope_freqs and the rope factors, which
        the config's rope_scaling holds; the multi-token-prediction blocks llama.cpp appends
        past the model's layers (HF's model skips them too)."""
        skipped = {ROPE_FREQS_TENSOR, *ROPE_FACTOR_TENSORS}
        for name in names:
            layer = layer_of(name)
            if layer is not None and layer >= num_layers:
                skipped.add(name)
        return skipped

    def fix_tensor(self, name: str, weight: np.ndarray) -> np.ndarray:
        """``weight`` as HF holds the tensor ``name``, where llama.cpp stores it otherwise."""
        return weight

    def joined_tensors(
        self, tensors: Iterator[tuple[str, np.ndarray]], config: dict[str, Any]
    ) -> Iterator[tuple[str, np.ndarray]]:
        """The HF tensors, from renamed GGUF ones some of which llama.cpp split or stacked
        otherwise than HF (joined back here)."""
        return tensors

    def extra_tensors(
        self, fields: dict[str, Any], config: dict[str, Any]
    ) -> Iterator[tuple[str, np.ndarray]]:
        """HF weights that llama.cpp keeps as metadata, not tensors."""
        return iter(())
