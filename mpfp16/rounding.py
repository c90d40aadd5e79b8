"""How a new fp32 weight becomes a 16-bit one when there are no master weights.

``nearest`` rounds to the nearest 16-bit value: an update smaller than half a 16-bit
ulp of the weight is lost (Micikevicius et al. 2018, section 3.1). ``stochastic``
rounds up or down at random in proportion to the distance, so the expected result is
exact. ``kahan`` keeps what each rounding lost in a 16-bit compensation buffer and
adds it to the next update (Zamirai et al. 2020).

``remainder`` (``FP16Optimizer(master_weights="remainder")``, bf16 only) is not a
user's choice of rounding but how bf16 weights and their 16-bit remainders hold an
fp32 master exactly: :func:`split_remainder` and :func:`join_remainder`
(docs/REMAINDER.md). A bf16 value is the upper half of an fp32 bit pattern (the same
sign and 8-bit exponent, 7 of the 23 mantissa bits), so the fp32 master is the bf16
weight's bits and 16 more, provided the weight is chosen so that those 16 bits are
what is left over. Rounding to nearest, ties to even cannot be made exact that way:
an even bf16 value is the rounding of 65537 fp32 patterns (both ties, half an ulp
below and above, round to it), one more than 16 bits tell apart. Rounding ties away
from zero (Megatron-LM's ``store_param_remainders``) gives each bf16 value exactly
65536 patterns: the weight is the rounding to nearest of the master, ties away from
zero, and the master is rebuilt bit for bit.

These are plain torch operations: the unfused step runs them eagerly, and the fused
kernels (mpfp16/stores/kernels.py) trace the same functions, so both round alike.
"""

from __future__ import annotations

import torch

__all__ = ["ROUNDINGS", "scalar", "stochastic_round", "write_state", "write_weights", "read_weights", "split_remainder",
           "join_remainder",
           "REMAINDER_TIE"]

ROUNDINGS = ("nearest", "stochastic", "kahan")
REMAINDER_TIE = -0x8000  # the remainder of an fp32 value exactly halfway between two bf16 values
_QUIET_NAN = 0x7FC0  # the bf16 weight of a NaN master


def scalar(value: float, device: torch.device) -> torch.Tensor:
    """A Python double as eager kernels see it: rounded to fp32, a 0-dim tensor on
    ``device``. ``torch.full`` fills on the device, where ``torch.tensor`` would copy
    from the host and wait. The fused kernels take their scalars (lr, betas, 1/scale)
    from here, so that a schedule never recompiles them."""
    return torch.full((), value, dtype=torch.float32, device=device)


def split_remainder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` as (bf16 weight, int16 remainder) such that
    :func:`join_remainder` gives ``x`` back bit for bit (NaN: a NaN).

    On the bit pattern ``u`` (int32): the remainder ``lo`` is its lower 16 bits read as
    a signed int16, and the weight ``hi`` its upper 16 bits, plus one where ``lo`` is
    negative (the lower half is 0x8000 or more), so that ``u = hi * 2**16 + lo``. In
    magnitude (floats are sign-magnitude, and so is this arithmetic on their bits,
    for either sign) that rounds to nearest with ties away from zero: the weight is
    torch's rounding to nearest-even but where ``x`` lies exactly halfway between two
    bf16 values (``lo == REMAINDER_TIE``) and the even one is the one nearer zero. A
    carry out of the mantissa is a step into the next binade, and from the largest
    finite bf16 to infinity, as rounding does. A NaN has no such pair for every
    payload (``hi`` would wrap to a zero, or stay an infinity): its weight is the
    quiet NaN 0x7FC0 and its remainder 0, so that it stays a NaN (its payload is lost).

    Integer operations only (no rounding to bf16, whose branches cost more in the
    fused kernel's loop, which runs scalar: inductor's CPU code does not vectorize
    int16).
    """
    u = x.view(torch.int32)
    lo = ((u & 0xFFFF) ^ 0x8000) - 0x8000  # the lower half, sign-extended, with no overflow
    nan = x != x
    hi = torch.where(nan, _QUIET_NAN, (u >> 16) + (lo < 0).to(torch.int32))  # >>: arithmetic, the upper half signed
    return hi.to(torch.int16).view(torch.bfloat16), torch.where(nan, 0, lo).to(torch.int16)


def join_remainder(weights: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 value of bf16 ``weights`` and their int16 ``remainder``
    (:func:`split_remainder`): the bits ``weight * 2**16 + remainder`` in int32, read
    as fp32. With ``out`` (fp32, the same shape), written there with in-place ops and
    no temporary (the unfused step); the same integers either way."""
    if out is None:
        return (weights.view(torch.int16).to(torch.int32) * 0x10000 + remainder).view(torch.float32)
    bits = out.view(torch.int32)
    bits.copy_(weights.view(torch.int16))
    bits.mul_(0x10000).add_(remainder)
    return out


def read_weights(weights: torch.Tensor, comp: torch.Tensor | None, rounding: str) -> torch.Tensor:
    """The fp32 value a step without fp32 master buffers starts from: the upcast
    16-bit weights, or under ``remainder`` (``comp`` the int16 remainders) the exact
    master they hold."""
    if rounding == "remainder":
        return join_remainder(weights, comp)
    return weights.float()


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


def write_state(buf: torch.Tensor, new: torch.Tensor, noise: torch.Tensor | None) -> None:
    """Store the fp32 result ``new`` into an optimizer state ``buf``: as it is (fp32),
    rounded to nearest (even), or with ``noise`` stochastically (:func:`stochastic_round`)."""
    if noise is not None and buf.dtype != torch.float32:
        buf.copy_(stochastic_round(new, noise, buf.dtype))
    else:
        buf.copy_(new)


def write_weights(weights, new, old, noise, comp, rounding: str) -> None:
    """Store the fp32 result ``new`` into the 16-bit ``weights`` (whose value before
    the step is ``old``, in fp32) with the given rounding.

    ``kahan``: the 16-bit compensation buffer ``comp`` holds what the last rounding
    lost; it is added back into this step's update before rounding, and replaced by
    what this rounding loses. ``remainder``: ``comp`` is the int16 remainder buffer,
    and the pair holds ``new`` exactly (:func:`split_remainder`).
    """
    if rounding == "remainder":
        rounded, remainder = split_remainder(new)
        weights.copy_(rounded)
        comp.copy_(remainder)
    elif rounding == "stochastic":
        weights.copy_(stochastic_round(new, noise, weights.dtype))
    elif rounding == "kahan":
        update = (new - old) - comp.float()
        rounded = (old + update).to(weights.dtype)
        comp.copy_(((rounded.float() - old) - update).to(comp.dtype))
        weights.copy_(rounded)
    else:
        weights.copy_(new)
