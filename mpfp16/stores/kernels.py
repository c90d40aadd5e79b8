"""Single-pass optimizer updates over flat buffers, compiled with torch.compile: the
kernels of the fused backend (mpfp16/stores/fused.py). Importing this module
imports torch's compiler stack, so nothing imports it before a fused step needs it. On
AVX2 and AVX-512 CPUs under Linux, Adam and AdamW with round-to-nearest weights and the
overflow check without the norm take the C++ kernels of mpfp16/stores/native.cpp
instead, which compute the same bits.

One kernel per flat segment reads the 16-bit gradient, unscales (and clips) it in
fp32, updates the fp32 master and the optimizer state, and writes the rounded 16-bit
weight: the memory traffic of an fp32 optimizer step, with no fp32 gradient buffer.
With ``master_weights="remainder"`` the fp32 master is not read but rebuilt from the
bf16 weight and its int16 remainder, and written back as the two
(mpfp16/rounding.py): 2 bytes per parameter less each way.

**Exactness.** Each kernel performs, element by element, the same floating-point
operations with the same roundings as ``torch.optim``'s own SGD, Adam and AdamW
(single-tensor and foreach, which agree), so the result is bit-identical. That takes
care: an eager ``add(b, alpha=x)`` is one fused multiply-add, ``fma(b, x, a)``, while
inductor's CPU code compiles ``a + x * b`` with two roundings (it builds with
``-ffp-contract=off``). The helpers below spell out each eager kernel's formula, with
inductor's ``fma`` prim where eager uses one; on CPU they were checked element by
element against the eager ops (tests/test_fused.py). On CUDA, inductor's own
lowerings of ``add``, ``addcmul``, ``addcdiv`` and ``lerp`` follow the eager CUDA
kernels, so the CUDA branch uses those ops directly.

Scalars (lr, betas, the loss scale) are passed as fp32 0-dim tensors, rounded from
Python doubles exactly as eager rounds a Python scalar, so a learning-rate schedule
never triggers a recompilation.
"""

from __future__ import annotations

import logging
import types

import torch
import torch._dynamo
import torch._inductor.config
from torch._inductor import inductor_prims

from .. import inductor
from ..rounding import read_weights, scalar, write_state, write_weights

logger = logging.getLogger("mpfp16")

__all__ = ["sgd_update", "adam_update", "adam_moments", "adam_apply", "grad_stats", "compiled", "scalar"]


def _fma(a, b, c):
    return inductor_prims.fma(a, b, c)


def add_alpha(a, b, alpha):
    """``torch.add(a, b, alpha=alpha)``: fma(b, alpha, a) on CPU and CUDA."""
    return _fma(b, alpha, a)


def addcmul(a, b, c, value):
    """``torch.addcmul(a, b, c, value=value)``."""
    if a.device.type == "cuda":
        return torch.addcmul(a, b, c, value=value)
    return _fma(value * b, c, a)


def addcdiv(a, b, c, value):
    """``torch.addcdiv(a, b, c, value=value)``."""
    if a.device.type == "cuda":
        return torch.addcdiv(a, b, c, value=value)
    return a + (value * b) / c


def lerp(a, b, weight, low: bool | None = None):
    """``torch.lerp(a, b, weight)`` with a 0-dim weight. Eager CPU lerp takes one of
    two formulas by whether ``|weight| < 0.5``; ``low`` says which when the caller
    knows it (Adam's ``1 - beta1``), so that the kernel computes one, not both."""
    if a.device.type == "cuda":
        return torch.lerp(a, b, weight)
    diff = b - a
    if low is None:
        return torch.where(weight.abs() < 0.5, _fma(weight, diff, a), _fma(weight - 1, diff, b))
    return _fma(weight, diff, a) if low else _fma(weight - 1, diff, b)


def _unscaled(grad, inv_scale, clip_coef, maximize: bool):
    g = grad.float() * inv_scale * clip_coef
    return -g if maximize else g


def sgd_update(weights, grad, master, momentum_buf, noise, comp, inv_scale, clip_coef, lr, weight_decay, momentum,
               one_minus_dampening, buf_noise=None, *, has_master: bool, has_weight_decay: bool, has_momentum: bool,
               first_step: bool, nesterov: bool, maximize: bool, rounding: str) -> None:
    """torch.optim.SGD on one flat segment.

    ``weights`` is the model's buffer (16-bit or fp32); ``master`` the fp32 master or,
    without masters (``has_master=False``), unused: the fp32 value is the upcast weight,
    or with ``rounding="remainder"`` the master that the bf16 weight and its int16
    remainder (``comp``) hold exactly, split into them again after the update. A bf16
    ``momentum_buf`` is widened, and its new value stored rounded to nearest, or
    stochastically with ``buf_noise``; the update uses the fp32 value.
    """
    param = master if has_master else read_weights(weights, comp, rounding)
    g = _unscaled(grad, inv_scale, clip_coef, maximize)
    if has_weight_decay:
        g = add_alpha(g, param, weight_decay)
    if has_momentum:
        buf = g if first_step else add_alpha(momentum_buf.float() * momentum, g, one_minus_dampening)
        write_state(momentum_buf, buf, buf_noise)
        g = add_alpha(g, buf, momentum) if nesterov else buf
    new = add_alpha(param, g, -lr)
    if has_master:
        master.copy_(new)
    write_weights(weights, new, param, noise, comp, rounding)


def _adam_moments(g, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2, lerp_low: bool):
    """The new exp_avg and exp_avg_sq, as torch's Adam computes them (from 16-bit
    ones widened)."""
    return (lerp(exp_avg.float(), g, one_minus_beta1, lerp_low),
            addcmul(exp_avg_sq.float() * beta2, g, g, one_minus_beta2))


def _adam_new(param, m, v, bias_correction2_sqrt, eps, neg_step_size):
    """param - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps), rounded as torch's Adam."""
    return addcdiv(param, m, v.sqrt() / bias_correction2_sqrt + eps, neg_step_size)


def adam_update(weights, grad, master, exp_avg, exp_avg_sq, noise, comp, inv_scale, clip_coef, weight_decay,
                decay_factor, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size,
                m_noise=None, v_noise=None, *, has_master: bool, has_weight_decay: bool, decoupled: bool,
                maximize: bool, lerp_low: bool, rounding: str) -> None:
    """torch.optim.Adam / AdamW (amsgrad off) on one flat segment; the step scalars
    (bias corrections, step size) are computed by the caller in Python doubles, as
    torch's single-tensor Adam does. Without master weights and with Adam's coupled
    weight decay, the fused backend runs ``adam_moments`` and ``adam_apply`` instead
    (fp32 moments only). 16-bit moments are widened, the step computed from the fp32
    values, and the new moments stored rounded once (``m_noise``, ``v_noise``:
    stochastic rounding's noise, or None: to nearest)."""
    old = param = master if has_master else read_weights(weights, comp, rounding)
    g = _unscaled(grad, inv_scale, clip_coef, maximize)
    if has_weight_decay:
        if decoupled:
            param = param * decay_factor
        else:
            g = add_alpha(g, param, weight_decay)
    m, v = _adam_moments(g, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2, lerp_low)
    new = _adam_new(param, m, v, bias_correction2_sqrt, eps, neg_step_size)
    write_state(exp_avg, m, m_noise)
    write_state(exp_avg_sq, v, v_noise)
    if has_master:
        master.copy_(new)
    write_weights(weights, new, old, noise, comp, rounding)


def adam_moments(weights, grad, exp_avg, exp_avg_sq, inv_scale, clip_coef, weight_decay, one_minus_beta1, beta2,
                 one_minus_beta2, *, maximize: bool, lerp_low: bool) -> None:
    """The first of two passes of Adam with coupled weight decay over 16-bit weights
    without masters: the moments, from ``grad + weight_decay * weight``. In one pass
    the arithmetic waits on a load of the 16-bit weights that the same loop stores
    to, and the step runs 1.7x slower on one CPU thread (docs/BENCHMARKS.md, "Tried and not kept")."""
    g = add_alpha(_unscaled(grad, inv_scale, clip_coef, maximize), weights.float(), weight_decay)
    m, v = _adam_moments(g, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2, lerp_low)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


def adam_apply(weights, exp_avg, exp_avg_sq, noise, comp, bias_correction2_sqrt, eps, neg_step_size, *,
               rounding: str) -> None:
    """The second pass: the new 16-bit weights from the updated moments."""
    old = weights.float()
    write_weights(weights, _adam_new(old, exp_avg, exp_avg_sq, bias_correction2_sqrt, eps, neg_step_size), old, noise,
                  comp, rounding)


def grad_stats(grad, inv_scale, *, with_norm: bool):
    """[1.0 if any value is inf/NaN else 0.0, sum of squares of the unscaled values
    (0 when ``with_norm`` is False: half the work)]."""
    g = grad.float() * inv_scale
    found = (~torch.isfinite(g)).any().float()
    return torch.stack([found, (g * g).sum() if with_norm else torch.zeros_like(found)])


_COMPILED: dict = {}

# Every kernel is compiled from examples of this many elements, whatever the size it
# is first called on: inductor decides from the example's size whether a CPU loop runs
# on several threads (below 512 elements per thread it does not), and the compiled
# kernel, whose shapes are symbolic, keeps that decision for every later size. With
# one size class for every compile, inductor's on-disk cache, whose key holds the
# thread count but not the example's size, is correct for these kernels.
COMPILE_NUMEL = 1 << 20


def _signature(args) -> tuple:
    """What dynamo specializes a kernel on besides sizes: each argument's dtype and
    device, or that it is None."""
    return tuple((a.dtype, a.device.type) if isinstance(a, torch.Tensor) else None for a in args)


def _distinct(args) -> tuple:
    """``args`` with a tensor passed twice (a scalar 1.0 for both the inverse scale and
    the clip coefficient) replaced by a copy the second time: dynamo guards on
    aliasing, and a kernel compiled for one pattern would recompile for the other."""
    seen: set[int] = set()
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if id(a) in seen:
                a = a.clone()
            seen.add(id(a))
        out.append(a)
    return tuple(out)


def _compile_examples(args) -> list:
    """Scratch arguments like ``args``: each flat buffer replaced by zeros of
    ``COMPILE_NUMEL`` elements, each 0-dim scalar by a copy."""
    return [(a.new_zeros(COMPILE_NUMEL) if a.dim() == 1 else a.clone()) if isinstance(a, torch.Tensor) else a
            for a in args]




def compiled(fn, **static):
    """``fn`` compiled with ``torch.compile(dynamic=True)``, with the keyword flags in
    ``static`` fixed, made once per (fn, flags, argument dtypes and devices, thread
    count) and compiled on examples of ``COMPILE_NUMEL`` elements before its first
    real call.

    Each such combination gets a code object of its own. Dynamo keeps its compiled
    variants per code object, up to ``recompile_limit`` (8); past it, it runs the
    function eagerly, where inductor's ``fma`` prim is a multiply and an add with two
    roundings: no longer bit-exact. A code object per combination (fp16 or bf16
    weights, 16-bit or fp32 gradients after ``unscale_()``, CPU or CUDA) keeps every
    one compiled, and calls run with ``fail_on_recompile_limit_hit`` so that an eager
    fallback is an error, never a silent change of numerics. The thread count is part
    of the combination because a CPU kernel is generated for the thread count of its
    compile (``torch.set_num_threads`` later does not change it).

    ``emulate_precision_casts`` keeps every cast to 16 bits a real rounding (by
    default inductor may drop a cast down and back up, and stochastic rounding needs
    the nearest 16-bit value).
    """
    flags = tuple(sorted(static.items()))

    def call(*args):
        args = _distinct(args)
        key = (fn, flags, _signature(args), torch.get_num_threads())
        first = key not in _COMPILED
        if first:
            _COMPILED[key] = _compile_variant(fn, flags, len(_COMPILED))
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), \
                inductor.settings(emulate_precision_casts=True):
            if first:
                _COMPILED[key](*_compile_examples(args), **static)
            return _COMPILED[key](*args, **static)

    return call


def _compile_variant(fn, flags: tuple, serial: int):
    """``fn`` under a code object of its own (named for its flags), compiled."""
    name = fn.__name__ + "".join(f"__{k}_{v if isinstance(v, (str, type(None))) else int(v)}" for k, v in flags)
    name += f"__v{serial}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    variant = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    return torch.compile(variant, dynamic=True)
