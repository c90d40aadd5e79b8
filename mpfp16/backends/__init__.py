"""Step backends: how the phases of :meth:`mpfp16.FP16Optimizer.step` run over the
flat groups (mpfp16/groups.py).

Each backend implements the same small interface:

``prepare()``
    make ready before the first step touches real data (the fused backend compiles
    its kernels here; what compiling can raise is
    ``mpfp16.backends.kernels.COMPILE_ERRORS``).
``unscale(inv_scale, materialize, with_norm) -> found_inf``
    phase "unscale and find inf": a float tensor whose first element is 1.0 when a
    gradient holds inf or NaN. ``materialize`` asks for unscaled fp32 gradients in
    the masters' ``.grad`` (the unfused backend always makes them; the fused one
    reads the 16-bit gradients directly unless asked, as ``unscale_()`` does).
``grad_norm() -> Tensor``
    the global 2-norm of the unscaled gradients, after ``unscale``.
``update(clip_coef, noise)``
    phase "update": the inner optimizer's arithmetic on the fp32 values, the
    gradients multiplied by ``clip_coef`` (a 0-dim tensor, or None).
``copy_back(noise)``
    phase "copy back": the new 16-bit weights, rounded as asked.
``invalidate()``
    the inner optimizer's state was replaced (``load_state_dict``).

``noise`` is, per flat group, uniform [0, 1) values for stochastic rounding or None.
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["inv_scale_tensor", "unscale_into_master_grads", "total_norm"]


def inv_scale_tensor(scale: float, device: torch.device) -> torch.Tensor:
    """1/scale as GradScaler computes it: the reciprocal in double, rounded to fp32;
    ``torch.full`` fills on the device, where ``torch.tensor`` would copy and wait."""
    return torch.full((), 1.0 / scale, dtype=torch.float32, device=device)


def unscale_into_master_grads(groups, scale: float) -> torch.Tensor:
    """fp32 master gradients = 16-bit gradients / scale, and whether any value is
    inf/NaN, in one pass per flat buffer (GradScaler's own kernel). Returns [flag]
    as an fp32 tensor on the first group's device (1.0: found)."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in groups:
        if g.half:
            g.prepare_master_grads()
            g.master_grads.copy_(g.grads)
        by_device[g.device].append(g.master_grads)
    found = []
    for device, grads in by_device.items():
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale_tensor(scale, device).view(1))
        found.append(found_inf)
    first = found[0]
    for other in found[1:]:
        first += other.to(first.device)
    return first


def total_norm(stepped: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the fp32 gradients of ``stepped`` as ``clip_grad_norm_`` computes
    it (per-tensor norms, then their norm), so that clipping matches it bit for bit."""
    return torch.nn.utils.get_total_norm([p.grad for p in stepped], 2.0)
