"""Checks every op wrapper makes before it calls a kernel (``ops.py``, ``fused_ops.py``):
devices, dtypes, strides and index vectors, each failure a ``TypeError`` or ``ValueError``
naming the argument, the value and what is allowed."""

from __future__ import annotations

import torch


class _DeviceOf:
    """Stands for a tensor in _check_same_device: its device and whether it is a CUDA one."""

    __slots__ = ("device", "is_cuda", "is_cpu")

    def __init__(self, device: torch.device, is_cuda: bool) -> None:
        self.device, self.is_cuda, self.is_cpu = device, is_cuda, not is_cuda


def _check_device(name: str, tensor: object) -> None:
    if isinstance(tensor, torch.Tensor) and (tensor.is_cpu or tensor.is_cuda):
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    raise ValueError(f"{name} is on {tensor.device}; only CPU and CUDA tensors are supported")


def _check_same_device(
    reference_name: str, reference: torch.Tensor | _DeviceOf, *named: tuple[str, torch.Tensor]
) -> None:
    """Every named tensor is on ``reference``'s device (on the CPU: cheap flag reads only)."""
    if reference.is_cpu:
        if all(tensor.is_cpu for _, tensor in named):
            return
    else:
        device = reference.device
        if all(tensor.device == device for _, tensor in named):
            return
    for name, tensor in named:
        if tensor.device != reference.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {reference_name} is on {reference.device}; "
                "every tensor of an op must be on one device"
            )


def _check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(dtype) for dtype in allowed)
        raise TypeError(f"{name} has dtype {tensor.dtype}; supported: {names}")


def _check_inner_strides(name: str, tensor: torch.Tensor, layout: str) -> None:
    """All dims but the first must be contiguous (size-1 dims may have any stride)."""
    shape, strides = tensor.shape, tensor.stride()
    expected = 1
    for dim in reversed(range(1, len(shape))):
        if shape[dim] != 1 and strides[dim] != expected:
            contiguous = ", ".join(layout.strip("[]").split(", ")[1:])
            raise ValueError(
                f"{name} {layout} must have contiguous {contiguous}; got shape "
                f"{tuple(shape)} with strides {strides}"
            )
        expected *= shape[dim]


def _check_index_vector(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, length: int, length_name: str
) -> None:
    _check_device(name, tensor)
    if tensor.dtype != dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected {dtype}")
    if tensor.dim() != 1 or tensor.shape[0] != length:
        raise ValueError(
            f"{name} must have shape [{length_name}] = [{length}], got {tuple(tensor.shape)}"
        )
    if length > 1 and tensor.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {tensor.stride()}")


def _check_same_length(name: str, tensor: torch.Tensor, other: str, length: int) -> None:
    if tensor.shape[0] != length:
        raise ValueError(f"{name} has {tensor.shape[0]} tokens but {other} has {length}")
