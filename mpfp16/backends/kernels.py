"""Single-pass optimizer updates over flat buffers, compiled with torch.compile: the
kernels of the fused backend (mpfp16/backends/fused.py). Importing this module
imports torch's compiler stack, so nothing imports it before a fused step needs it.

One kernel per flat segment reads the 16-bit gradient, unscales (and clips) it in
fp32, updates the fp32 master and the optimizer state, and writes the rounded 16-bit
weight: the memory traffic of an fp32 optimizer step, with no fp32 gradient buffer.

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
import subprocess
import types

import torch
import torch._dynamo
import torch._dynamo.exc
import torch._functorch.config
import torch._inductor.config
import torch._inductor.exc
from torch._inductor import inductor_prims

from ..rounding import write_weights

logger = logging.getLogger("mpfp16")

__all__ = ["sgd_update", "adam_update", "grad_stats", "compiled", "scalar", "COMPILE_ERRORS"]


def scalar(value: float, device: torch.device) -> torch.Tensor:
    """A Python double as eager kernels see it: rounded to fp32. ``torch.full`` fills
    on the device, where ``torch.tensor`` would copy from the host and wait."""
    return torch.full((), value, dtype=torch.float32, device=device)


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


def lerp(a, b, weight):
    """``torch.lerp(a, b, weight)`` with a 0-dim weight."""
    if a.device.type == "cuda":
        return torch.lerp(a, b, weight)
    diff = b - a
    return torch.where(weight.abs() < 0.5, _fma(weight, diff, a), _fma(weight - 1, diff, b))


# What compiling a kernel can raise: dynamo's and inductor's own errors (a missing or
# broken C++ compiler arrives as InductorError), a compiler that cannot be run, and
# the recompile limit. Anything else is a bug and propagates.
COMPILE_ERRORS = (
    torch._dynamo.exc.TorchDynamoException,
    torch._dynamo.exc.FailOnRecompileLimitHit,
    torch._dynamo.exc.TritonUnavailableError,
    torch._inductor.exc.InvalidCxxCompiler,
    torch._inductor.exc.CppCompileError,
    torch._inductor.exc.OperatorIssue,
    subprocess.CalledProcessError,
    OSError,
)


def _unscaled(grad, inv_scale, clip_coef, maximize: bool):
    g = grad.float() * inv_scale * clip_coef
    return -g if maximize else g


def sgd_update(weights, grad, master, momentum_buf, noise, comp, inv_scale, clip_coef, lr, weight_decay, momentum,
               one_minus_dampening, *, has_master: bool, has_weight_decay: bool, has_momentum: bool,
               first_step: bool, nesterov: bool, maximize: bool, rounding: str) -> None:
    """torch.optim.SGD on one flat segment.

    ``weights`` is the model's buffer (16-bit or fp32); ``master`` the fp32 master or,
    without masters (``has_master=False``), unused: the fp32 value is the upcast weight.
    """
    param = master if has_master else weights.float()
    g = _unscaled(grad, inv_scale, clip_coef, maximize)
    if has_weight_decay:
        g = add_alpha(g, param, weight_decay)
    if has_momentum:
        buf = g if first_step else add_alpha(momentum_buf * momentum, g, one_minus_dampening)
        momentum_buf.copy_(buf)
        g = add_alpha(g, buf, momentum) if nesterov else buf
    new = add_alpha(param, g, -lr)
    if has_master:
        master.copy_(new)
    write_weights(weights, new, param, noise, comp, rounding)


def adam_update(weights, grad, master, exp_avg, exp_avg_sq, noise, comp, inv_scale, clip_coef, weight_decay,
                decay_factor, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size, *,
                has_master: bool, has_weight_decay: bool, decoupled: bool, maximize: bool, rounding: str) -> None:
    """torch.optim.Adam / AdamW (amsgrad off) on one flat segment; the step scalars
    (bias corrections, step size) are computed by the caller in Python doubles, as
    torch's single-tensor Adam does."""
    old = param = master if has_master else weights.float()
    g = _unscaled(grad, inv_scale, clip_coef, maximize)
    if has_weight_decay:
        if decoupled:
            param = param * decay_factor
        else:
            g = add_alpha(g, param, weight_decay)
    m = lerp(exp_avg, g, one_minus_beta1)
    v = addcmul(exp_avg_sq * beta2, g, g, one_minus_beta2)
    denom = v.sqrt() / bias_correction2_sqrt + eps
    new = addcdiv(param, m, denom, neg_step_size)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if has_master:
        master.copy_(new)
    write_weights(weights, new, old, noise, comp, rounding)


def grad_stats(grad, inv_scale, *, with_norm: bool):
    """[1.0 if any value is inf/NaN else 0.0, sum of squares of the unscaled values
    (0 when ``with_norm`` is False: half the work)]."""
    g = grad.float() * inv_scale
    found = (~torch.isfinite(g)).any().float()
    return torch.stack([found, (g * g).sum() if with_norm else torch.zeros_like(found)])


_COMPILED: dict = {}


def _signature(args) -> tuple:
    """What dynamo specializes a kernel on besides sizes: each argument's dtype and
    device, or that it is None."""
    return tuple((a.dtype, a.device.type) if isinstance(a, torch.Tensor) else None for a in args)


def compiled(fn, **static):
    """``fn`` compiled with ``torch.compile(dynamic=True)``, with the keyword flags in
    ``static`` fixed, made once per (fn, flags, argument dtypes and devices).

    Each such combination gets a code object of its own. Dynamo keeps its compiled
    variants per code object, up to ``recompile_limit`` (8); past it, it runs the
    function eagerly, where inductor's ``fma`` prim is a multiply and an add with two
    roundings: no longer bit-exact. A code object per combination (fp16 or bf16
    weights, 16-bit or fp32 gradients after ``unscale_()``, CPU or CUDA) keeps every
    one compiled, and calls run with ``fail_on_recompile_limit_hit`` so that an eager
    fallback is an error, never a silent change of numerics.

    ``emulate_precision_casts`` keeps every cast to 16 bits a real rounding (by
    default inductor may drop a cast down and back up, and stochastic rounding needs
    the nearest 16-bit value). The on-disk caches of compiled graphs are off for
    these kernels: their keys ignore the example sizes from which inductor decided
    how many threads a CPU loop uses, so a kernel first compiled on a small tensor (a
    test) came back single-threaded for ResNet-50 and made its AdamW step 1.5x slower.
    """
    flags = tuple(sorted(static.items()))

    def call(*args):
        key = (fn, flags, _signature(args))
        if key not in _COMPILED:
            _COMPILED[key] = _compile_variant(fn, flags, len(_COMPILED))
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), \
                torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False,
                                             emulate_precision_casts=True), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            return _COMPILED[key](*args, **static)

    return call


def _compile_variant(fn, flags: tuple, serial: int):
    """``fn`` under a code object of its own (named for its flags), compiled."""
    name = fn.__name__ + "".join(f"__{k}_{v if isinstance(v, str) else int(v)}" for k, v in flags) + f"__v{serial}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    variant = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    return torch.compile(variant, dynamic=True)
