"""Linear weights packed once for oneDNN's blocked layout on CPU, in bfloat16 / float16.

``F.linear`` in bfloat16 on a CPU runs oneDNN, which reorders the plain ``[out, in]``
weight into its blocked layout (AMX tiles, AVX-512 BF16 pairs) inside every call: a
decode step pays for one more pass over every weight of the model. Packing once after
loading removes that pass. Measured on the embedded model's layer shapes (30 layers,
2 threads, weights larger than the caches): 1.2-1.5x faster at 8 to 200 rows, and the
same results.

float32 stays on ``F.linear`` (MKL): the HF parity tests pin its arithmetic. GPUs never
pack. A packed layer keeps the packed tensor as ``weight`` (a plain attribute, no longer
a parameter), so the plain copy's memory is returned.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedserve.gpu_worker.lora import LoRALayer

# The row count oneDNN tunes the blocked layout for. Decode batches (8-256 rows) run
# equally fast with any hint measured; prefill chunks of max_num_batched_tokens (2048 by
# default) ran 1.3x faster packed for 2048 rows than for 32 or 256.
PACKING_ROWS_HINT = 2048
PACKED_DTYPES = (torch.bfloat16, torch.float16)


def packing_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.dim() == 2
        and _cpu_packs(weight.dtype)
    )


@functools.cache
def _cpu_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` on this CPU: it refuses where the ISA lacks the dtype's
    instructions (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, float16 AVX512-FP16 or
    AVX-NE-CONVERT, e.g. on AVX2-only CPUs), and those CPUs keep ``F.linear``. Asked by
    packing a small matrix once: torch's own check, whatever its version requires."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    weight = torch.ones(16, 16, dtype=dtype)
    try:
        packed_linear(torch.ones(1, 16, dtype=dtype), pack_weight(weight), None)
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] plain -> the same matrix in oneDNN's layout (an mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACKING_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@runtime_checkable
class Packable(Protocol):
    def pack(self) -> bool:
        """Packs this layer's matrix if this device and dtype have a packed path; True if
        it did."""


class PackableLinear(nn.Module):
    """A layer computing ``x W^T + b`` with ``self.weight`` and ``self.bias``, which can
    swap its weight for the packed form once loading is over."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_packed: bool = False
    # LoRA adapters' products on this layer (gpu_worker/lora.py), added to its output.
    lora: LoRALayer | None = None

    def pack(self) -> bool:
        """Packs ``weight`` when this device and dtype have a packed path; True if so."""
        if self.weight_packed or not packing_available(self.weight):
            return False
        packed = pack_weight(self.weight)
        del self.weight  # the parameter; the packed tensor replaces it
        self.weight = packed
        self.weight_packed = True
        return True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_packed:
            y = packed_linear(x, self.weight, bias)
        else:
            y = F.linear(x, self.weight, bias)
        if self.lora is not None:
            self.lora.add(x, y)
        return y


def pack_linear_weights(model: nn.Module) -> int:
    """Packs every layer of ``model`` that can be packed; returns how many it packed."""
    return sum(module.pack() for module in model.modules() if isinstance(module, Packable))
