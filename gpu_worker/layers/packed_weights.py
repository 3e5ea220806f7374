"""Linear weights packed once after loading, on CPU, for a faster matrix product.

- Panels of 16 output features for pagedserve's own kernel (csrc/ops.h, ``linear_packed``),
  on CPUs with AVX2 or AVX-512: float32 always, bfloat16 / float16 where oneDNN has no packed
  path. MKL behind float32 ``F.linear`` packs the weight inside every call (one more pass
  over every weight per decode step), and its few-row kernels are slow: a decode step's
  products ran 1.8-2.5x faster from 1 to 64 rows on the embedded model's shapes
  (docs/BENCHMARKS.md); 16-bit ``F.linear`` on a CPU without AVX-512 BF16 / FP16 was slower
  still. Sums run in another order than MKL's / oneDNN's, so results differ from ``F.linear``
  in the last bits (greedy tokens still match HF's in the parity tests), and each row's
  result is the same whatever else is in the batch.
- bfloat16 / float16 where oneDNN packs them (AVX-512 BF16 / FP16, AMX): oneDNN's blocked
  layout. ``F.linear`` there reorders the plain ``[out, in]`` weight into that layout inside
  every call; packing once measured 1.2-1.5x faster at 8 to 200 rows on the embedded model's
  layer shapes (30 layers, 2 threads), with the same results.

``PAGEDSERVE_CPU_LINEAR=torch`` (read when a model is packed) keeps every plain weight on
``F.linear``; ``packed``, the default, packs where a packed path exists. GPUs never pack. A
packed layer keeps the packed form as ``weight`` (a plain attribute, no longer a parameter),
so the plain copy's memory is returned.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import _C_cpu
from pagedserve.gpu_worker.model_config import check_quantization_name

if TYPE_CHECKING:
    from pagedserve.gpu_worker.lora import LoRALayer

CPU_LINEAR_ENV = "PAGEDSERVE_CPU_LINEAR"
CPU_LINEAR_CHOICES = ("packed", "torch")

# The row count oneDNN tunes the blocked layout for. Decode batches (8-256 rows) run
# equally fast with any hint measured; prefill chunks of max_num_batched_tokens (2048 by
# default) ran 1.3x faster packed for 2048 rows than for 32 or 256.
PACKING_ROWS_HINT = 2048
ONEDNN_DTYPES = (torch.bfloat16, torch.float16)
PANEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The ISA variants of _C_cpu whose kernel beats torch's (the generic one would not).
PANEL_ISAS = ("avx2", "avx512")
PANEL_WIDTH = _C_cpu.LINEAR_PANEL_WIDTH


def cpu_linear_mode() -> str:
    """``PAGEDSERVE_CPU_LINEAR``: ``packed`` (default) or ``torch``."""
    mode = os.environ.get(CPU_LINEAR_ENV, "packed").strip().lower() or "packed"
    if mode not in CPU_LINEAR_CHOICES:
        raise ValueError(
            f"{CPU_LINEAR_ENV}={os.environ[CPU_LINEAR_ENV]!r} is not one of "
            f"{', '.join(CPU_LINEAR_CHOICES)}"
        )
    return mode


def _panels(matrix: torch.Tensor) -> torch.Tensor:
    """[out, in] -> csrc/ops.h's panels ``[ceil(out / 16), in, 16]``, zero past ``out``."""
    out_features, in_features = matrix.shape
    num_panels = -(-out_features // PANEL_WIDTH)
    padded = matrix.new_zeros(num_panels * PANEL_WIDTH, in_features)
    padded[:out_features] = matrix
    return padded.view(num_panels, PANEL_WIDTH, in_features).transpose(1, 2).contiguous()


class PanelWeight:
    """An ``[out, in]`` matrix (float32, bfloat16 or float16) in csrc/ops.h's panel layout:
    ``panels [ceil(out / 16), in, 16]``, ``W[n][k] == panels[n // 16, k, n % 16]``, zero past
    ``out``. ``shape``, ``dtype`` and ``device`` are the plain matrix's, as code reading a
    layer's weight expects."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.panels = _panels(weight.detach())
        self.shape = weight.shape
        self.dtype = weight.dtype
        self.device = weight.device
        self._dtype_code = _DTYPE_CODES[weight.dtype]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` for ``x [..., in]`` -> ``[..., out]``, all in this matrix's dtype."""
        rows, out = self._rows_and_out(x, bias)
        _C_cpu.linear_packed(
            out.data_ptr(),
            out.shape[1],
            rows.data_ptr(),
            rows.stride(0),
            self.panels.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            rows.shape[0],
            rows.shape[1],
            out.shape[1],
            self._dtype_code,
        )
        return out.view(*x.shape[:-1], out.shape[1])

    def _rows_and_out(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` checked and seen as rows with unit feature stride, and the output's rows."""
        out_features, in_features = self.shape
        if x.dtype != self.dtype or x.device.type != "cpu" or x.shape[-1] != in_features:
            raise ValueError(
                f"x of a packed {self.dtype} [{out_features}, {in_features}] layer must be a "
                f"{self.dtype} CPU tensor [..., {in_features}], got {x.dtype} {x.device.type} "
                f"{tuple(x.shape)}"
            )
        if bias is not None and (
            bias.dtype != self.dtype or bias.shape != (out_features,) or not bias.is_contiguous()
        ):
            raise ValueError(
                f"bias of a packed {self.dtype} [{out_features}, {in_features}] layer must be a "
                f"contiguous {self.dtype} [{out_features}], got {bias.dtype} {tuple(bias.shape)}"
            )
        rows = x.reshape(-1, in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return rows, torch.empty(rows.shape[0], out_features, dtype=self.dtype)


class Int8PanelWeight(PanelWeight):
    """An ``[out, in]`` matrix quantized to int8 for csrc/ops.h's ``linear_packed_int8``
    (weight-only quantization): per output feature ``n``, ``scales[n] = max|W[n]| / 127`` and
    ``W[n][k] ~ round(W[n][k] / scales[n]) * scales[n]``, the int8 values in panels. ``dtype``
    is the plain matrix's: that of x, bias and out (the product sums in float32).
    ``largest``: each row's max |w| when the matrix is a shard of wider rows (the whole row's,
    so every shard of a row shares its scale); by default this matrix's."""

    def __init__(self, weight: torch.Tensor, largest: torch.Tensor | None = None) -> None:
        plain = weight.detach().float()
        if largest is None:
            largest = plain.abs().amax(dim=1)
        # A row of zeros quantizes to zeros whatever its scale.
        self.scales = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
        quantized = torch.round(plain / self.scales[:, None]).clamp_(-127, 127).to(torch.int8)
        self.panels = _panels(quantized)
        self.shape = weight.shape
        self.dtype = weight.dtype
        self.device = weight.device
        self._dtype_code = _DTYPE_CODES[weight.dtype]

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out, in]`` matrix this one stands for."""
        out_features, in_features = self.shape
        values = self.panels.transpose(1, 2).reshape(-1, in_features)[:out_features]
        return values.float() * self.scales[:, None]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` over the quantized ``W``, for ``x [..., in]`` -> ``[..., out]``."""
        rows, out = self._rows_and_out(x, bias)
        _C_cpu.linear_packed_int8(
            out.data_ptr(),
            out.shape[1],
            rows.data_ptr(),
            rows.stride(0),
            self.panels.data_ptr(),
            self.scales.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            rows.shape[0],
            rows.shape[1],
            out.shape[1],
            self._dtype_code,
        )
        return out.view(*x.shape[:-1], out.shape[1])


def packing_available(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or cpu_linear_mode() != "packed":
        return False
    return _packs_for_onednn(weight.dtype) or _packs_in_panels(weight.dtype)


def _packs_for_onednn(dtype: torch.dtype) -> bool:
    return dtype in ONEDNN_DTYPES and _onednn_packs(dtype)


def _packs_in_panels(dtype: torch.dtype) -> bool:
    return dtype in PANEL_DTYPES and _C_cpu.isa() in PANEL_ISAS


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` on this CPU: it refuses where the ISA lacks the dtype's
    instructions (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, float16 AVX512-FP16 or
    AVX-NE-CONVERT, e.g. on AVX2-only CPUs), and those CPUs use the panels. Asked by
    packing a small matrix once: torch's own check, whatever its version requires."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    weight = torch.ones(16, 16, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS_HINT)
        packed_linear(torch.ones(1, 16, dtype=dtype), packed, None)
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor | PanelWeight:
    """[out, in] plain -> the same matrix packed (where ``packing_available``): oneDNN's
    layout (an mkldnn tensor) where oneDNN packs the dtype, else panels."""
    if _packs_for_onednn(weight.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous(), PACKING_ROWS_HINT
        )
    return PanelWeight(weight)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor | PanelWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    if isinstance(packed, PanelWeight):
        return packed.linear(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@runtime_checkable
class Packable(Protocol):
    def pack(self, quantization: str | None = None) -> bool:
        """Packs this layer's matrix if this device and dtype have a packed path (quantized
        as ``quantization`` says, see ``PackableLinear.pack``); True if it did."""


class PackableLinear(nn.Module):
    """A layer computing ``x W^T + b`` with ``self.weight`` and ``self.bias``, which can
    swap its weight for the packed form once loading is over."""

    weight: torch.Tensor | PanelWeight
    bias: torch.Tensor | None
    weight_packed: bool = False
    # False where quantizing would cost accuracy for little memory (a MoE router).
    quantizable: bool = True
    # LoRA adapters' products on this layer (gpu_worker/lora.py), added to its output.
    lora: LoRALayer | None = None

    def pack(self, quantization: str | None = None) -> bool:
        """Packs ``weight`` when this device and dtype have a packed path; True if so.
        ``quantization="int8"`` quantizes a quantizable layer's weight to int8 panels
        (``Int8PanelWeight``, on any CPU), whatever ``PAGEDSERVE_CPU_LINEAR`` says."""
        if self.weight_packed:
            return False
        check_quantization_name(quantization, self.weight.device.type)
        if quantization == "int8" and self.quantizable:
            packed = Int8PanelWeight(self.weight, self.row_largest())
        elif packing_available(self.weight):
            packed = pack_weight(self.weight)
        else:
            return False
        del self.weight  # the parameter; the packed tensor replaces it
        self.weight = packed
        self.weight_packed = True
        return True

    def row_largest(self) -> torch.Tensor:
        """Each output feature's max |w| over its whole row (this layer holds whole rows;
        a layer holding a slice of each row overrides it)."""
        return self.weight.detach().float().abs().amax(dim=1)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_packed:
            y = packed_linear(x, self.weight, bias)
        else:
            y = F.linear(x, self.weight, bias)
        if self.lora is not None:
            self.lora.add(x, y)
        return y


def pack_linear_weights(model: nn.Module, quantization: str | None = None) -> int:
    """Packs every layer of ``model`` that can be packed (quantized as ``quantization``
    says); returns how many it packed."""
    return sum(
        module.pack(quantization) for module in model.modules() if isinstance(module, Packable)
    )
