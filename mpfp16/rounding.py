"""How a new fp32 weight becomes a 16-bit one when there are no master weights.

``nearest`` rounds to the nearest 16-bit value: an update smaller than half a 16-bit
ulp of the weight is lost (Micikevicius et al. 2018, section 3.1). ``stochastic``
rounds up or down at random in proportion to the distance, so the expected result is
exact. ``kahan`` keeps what each rounding lost in a 16-bit compensation buffer and
adds it to the next update (Zamirai et al. 2020).

These are plain torch operations: the unfused step runs them eagerly, and the fused
kernels (mpfp16/stores/kernels.py) trace the same functions, so both round alike.
"""

from __future__ import annotations

import torch

__all__ = ["ROUNDINGS", "stochastic_round", "write_weights"]

ROUNDINGS = ("nearest", "stochastic", "kahan")


def stochastic_round(x: torch.Tensor, noise: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 ``x`` to ``dtype`` (fp16 or bf16) up or down at random, with
    probability proportional to the distance, so that E[result] = x: unbiased.

    ``noise`` is uniform in [0, 1). The two candidates are the nearest 16-bit value
    and its neighbour on the other side of ``x``, found by stepping its bit pattern
    by one (16-bit floats are ordered like their bit patterns within a sign), which
    also handles subnormals. Values that are exact, inf or NaN pass through.
    """
    r = x.to(dtype)
    rf = r.float()
    away = x.abs() > rf.abs()
    bits = r.view(torch.int16)
    other = torch.where(away, bits + 1, bits - 1).view(dtype).float()
    lo, hi = torch.minimum(rf, other), torch.maximum(rf, other)
    up = noise < (x - lo) / (hi - lo)
    return torch.where((x != rf) & torch.isfinite(rf), torch.where(up, hi, lo), rf).to(dtype)


def write_weights(weights, new, old, noise, comp, rounding: str) -> None:
    """Store the fp32 result ``new`` into the 16-bit ``weights`` (whose value before
    the step is ``old``, in fp32) with the given rounding.

    ``kahan``: the 16-bit compensation buffer ``comp`` holds what the last rounding
    lost; it is added back into this step's update before rounding, and replaced by
    what this rounding loses.
    """
    if rounding == "stochastic":
        weights.copy_(stochastic_round(new, noise, weights.dtype))
    elif rounding == "kahan":
        update = (new - old) - comp.float()
        rounded = (old + update).to(weights.dtype)
        comp.copy_(((rounded.float() - old) - update).to(comp.dtype))
        weights.copy_(rounded)
    else:
        weights.copy_(new)
