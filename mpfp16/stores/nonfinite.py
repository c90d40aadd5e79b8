"""Finding inf and NaN in gradients: the one overflow detector every store, the fused
step and mpfp16.compat.apex use.

Three questions, one answer each:

:func:`unscale_and_check`
    per tensor (a store's fp32 gradients): ``grads *= 1/scale`` in place and whether
    any value is inf/NaN, in one pass (GradScaler's own kernel), one flag per device.
:func:`check_flat`
    one flat 16-bit gradient buffer, read without writing anything (the fused step):
    whether ``grad * (1/scale)`` holds inf/NaN and, when the norm is wanted, its sum of
    squares. On AVX2 and AVX-512 CPUs under Linux, without the norm, that is the C++
    kernel (mpfp16/stores/native.py); elsewhere, and with the norm, inductor's
    (mpfp16/stores/kernels.py).
:func:`any_nonfinite`, :func:`nonfinite_flags`, :func:`find_nonfinite`
    whether any of some tensors holds inf/NaN (read without unscaling: apex's order,
    mpfp16.compat.apex), which do, and how many of each: the scan behind
    ``FP16Optimizer.last_overflow``, run once a step is known to overflow.

Each reads every element once and synchronizes with the host at most once per device.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..rounding import scalar
from . import native

__all__ = ["unscale_and_check", "check_flat", "flat_check_is_native", "any_nonfinite", "nonfinite_flags",
           "find_nonfinite",
           "inv_scale", "prepare_flat_check"]


def inv_scale(scale: float, device: torch.device) -> torch.Tensor:
    """1/scale as GradScaler computes it: the reciprocal in double, rounded to fp32."""
    return scalar(1.0 / scale, device)


def _by_device(items, tensor_of) -> dict:
    """``items`` by the device of ``tensor_of(item)``, each list in the given order."""
    by_device: dict[torch.device, list] = defaultdict(list)
    for item in items:
        by_device[tensor_of(item).device].append(item)
    return by_device


def unscale_and_check(grads: list[torch.Tensor], scale: float) -> torch.Tensor:
    """``grads *= 1/scale`` in place, and whether any value is inf/NaN, in one pass per
    tensor (GradScaler's own kernel). Returns [flag] as an fp32 tensor on the first
    tensor's device (1.0: found)."""
    found = []
    for device, tensors in _by_device(grads, lambda t: t).items():
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale(scale, device).view(1))
        found.append(found_inf)
    if not found:
        return torch.zeros(1, dtype=torch.float32)
    first = found[0]
    for other in found[1:]:
        first += other.to(first.device)
    return first


def flat_check_is_native(device: torch.device, dtype: torch.dtype, with_norm: bool) -> bool:
    """Whether :func:`check_flat` reads gradients of ``dtype`` on ``device`` with the
    C++ kernel: on CPU, without the norm (the norm's sum keeps inductor's order of
    summation)."""
    return not with_norm and native.handles(device, dtype, dtype, "nearest")


def check_flat(grad: torch.Tensor, scale: float, with_norm: bool) -> torch.Tensor:
    """``[1.0 if grad * (1/scale) holds inf/NaN else 0.0, its sum of squares (0 without
    with_norm)]``, fp32 on ``grad``'s device, reading ``grad`` once and writing nothing."""
    if flat_check_is_native(grad.device, grad.dtype, with_norm):
        found = float(native.nonfinite(grad, 1.0 / scale))
        return torch.tensor([found, 0.0], dtype=torch.float32, device=grad.device)
    from . import kernels

    return kernels.compiled(kernels.grad_stats, with_norm=with_norm)(grad, inv_scale(scale, grad.device))


def prepare_flat_check(device: torch.device, dtype: torch.dtype, with_norm: bool) -> None:
    """Build (or compile) the kernel :func:`check_flat` takes for gradients of ``dtype``
    on ``device``, on scratch values, so that a failure shows before a step writes
    anything."""
    if flat_check_is_native(device, dtype, with_norm):
        native.load()
    else:
        check_flat(torch.zeros(64, dtype=dtype, device=device), 1.0, with_norm)


def _ends(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor (each non-empty, all on one device), its minimum and maximum in fp32:
    NaN, -inf or inf where it holds any, read in one pass with no temporary (unlike
    ``abs().max()``)."""
    return torch.stack([torch.stack(torch.aminmax(t)).float() for t in tensors])


def any_nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[1.0] where any of ``tensors`` holds inf or NaN, else [0.0]: fp32 on the first
    tensor's device, with no host read (the caller reduces it across ranks and reads it
    once)."""
    found = torch.zeros(1, dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
    for device, items in _by_device([t for t in tensors if t.numel()], lambda t: t).items():
        found += (~torch.isfinite(_ends(items)).all()).float().to(found.device)
    return found


def nonfinite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Per tensor, whether it holds inf or NaN: one read of each and one host read per
    device. Empty tensors hold none."""
    flags = [False] * len(tensors)
    items = [(i, t) for i, t in enumerate(tensors) if t.numel()]
    for device_items in _by_device(items, lambda item: item[1]).values():
        ends = _ends([t for _, t in device_items])
        for (i, _), bad in zip(device_items, (~torch.isfinite(ends).all(dim=1)).tolist()):
            flags[i] = bad
    return flags


def find_nonfinite(pairs, limit: int) -> list[tuple[int, int, int]]:
    """``(index, NaN count, inf count)`` for the ``limit`` smallest indices of ``pairs``
    (``(index, gradient tensor)``; None or empty tensors are passed over) whose tensor
    holds NaN or inf, in increasing index order. Meant for a step already found to
    overflow: :func:`nonfinite_flags` finds which hold non-finite values; only those
    reported are then counted, with one more host read per device."""
    items = sorted(((i, t) for i, t in pairs if t is not None and t.numel()), key=lambda item: item[0])
    flagged = [item for item, bad in zip(items, nonfinite_flags([t for _, t in items])) if bad][:limit]
    found = []
    for device_items in _by_device(flagged, lambda item: item[1]).values():
        counts = torch.stack([torch.stack([torch.count_nonzero(t.isnan()), torch.count_nonzero(t.isinf())])
                              for _, t in device_items]).tolist()
        found += [(i, nans, infs) for (i, _), (nans, infs) in zip(device_items, counts)]
    return sorted(found)
