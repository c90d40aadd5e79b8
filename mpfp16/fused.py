"""Single-pass optimizer updates over flat buffers, compiled with torch.compile.

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

logger = logging.getLogger("mpfp16")

__all__ = ["sgd_update", "adam_update", "grad_stats", "compiled", "scalar"]


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


ROUNDINGS = ("nearest", "stochastic", "kahan")

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


def stochastic_round(x, noise, dtype):
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
    what this rounding loses (Kahan summation, as Zamirai et al. 2020 apply it to
    16-bit weights).
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


def compiled(fn, **static):
    """``fn`` compiled with ``torch.compile(dynamic=True)``, with the keyword flags in
    ``static`` fixed, made once per (fn, flags).

    Each flag combination gets a code object of its own. Dynamo keeps its compiled
    variants per code object, up to ``recompile_limit`` (8); past it, it silently
    runs the function eagerly, where inductor's ``fma`` prim is a multiply and an add
    with two roundings: no longer bit-exact. Separate code objects keep every
    combination compiled, and calls run with ``fail_on_recompile_limit_hit`` so that
    an eager fallback is an error, never a silent change of numerics.

    ``emulate_precision_casts`` keeps every cast to 16 bits a real rounding (by
    default inductor may drop a cast down and back up, and stochastic rounding needs
    the nearest 16-bit value). The on-disk caches of compiled graphs are off for
    these kernels: their keys
    ignore the example sizes from which inductor decided how many threads a CPU loop
    uses, so a kernel first compiled on a small tensor (a test) came back
    single-threaded for ResNet-50 and made its AdamW step 1.5x slower.
    """
    key = (fn, tuple(sorted(static.items())))
    if key not in _COMPILED:
        name = fn.__name__ + "".join(f"__{k}_{v if isinstance(v, str) else int(v)}" for k, v in key[1])
        code = fn.__code__.replace(co_name=name, co_qualname=name)
        variant = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        kernel = torch.compile(variant, dynamic=True)

        def call(*args, _kernel=kernel, _static=static):
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), \
                    torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False,
                                                 emulate_precision_casts=True), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                return _kernel(*args, **_static)

        _COMPILED[key] = call
    return _COMPILED[key]


# ----------------------------------------------------------------- the orchestration

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot take the fused path, or None if it can."""
    if type(optimizer) not in SUPPORTED:
        return f"{type(optimizer).__name__} is not SGD, Adam or AdamW"
    for group in optimizer.param_groups:
        if group.get("fused"):
            return "the inner optimizer was built with fused=True"
        if group.get("differentiable"):
            return "differentiable=True"
        if group.get("capturable"):
            return "capturable=True"
        if group.get("amsgrad"):
            return "amsgrad=True"
        for key in ("betas", "momentum", "weight_decay", "eps"):
            values = group.get(key, ())
            if any(torch.is_tensor(v) for v in (values if isinstance(values, tuple) else (values,))):
                return f"tensor-valued {key}"
    return None


def _value(x) -> float:
    return float(x) if torch.is_tensor(x) else x


class FusedUpdater:
    """Runs the step of an SGD/Adam/AdamW inner optimizer as fused kernels over the
    flat segments of FP16Optimizer's buffers, keeping the inner optimizer's ``state``
    in its usual per-parameter form (each entry a view of a flat state buffer), so
    that ``state_dict()`` is the same whichever path stepped."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups, rounding: str = "nearest") -> None:
        self.optimizer = optimizer
        self.groups = groups  # the _FlatGroup list
        self.rounding = rounding
        self.is_sgd = type(optimizer) is torch.optim.SGD
        self._flat_state: dict = {}  # (flat group index, state name) -> flat fp32 buffer
        self._steps: dict = {}  # (flat group index, segment index) -> Adam step counters
        self._adopted = False

    def invalidate(self) -> None:
        """The inner optimizer's state was replaced (load_state_dict): adopt it again."""
        self._adopted = False

    def _state_names(self, hyper: dict) -> tuple[str, ...]:
        if self.is_sgd:
            return ("momentum_buffer",) if hyper["momentum"] != 0 else ()
        return ("exp_avg", "exp_avg_sq")

    def _adopt(self) -> None:
        """Make every state tensor a view of a flat buffer, copying in what exists."""
        state = self.optimizer.state
        for gi, g in enumerate(self.groups):
            for si, segment in enumerate(g.segments):
                hyper = self.optimizer.param_groups[segment.group_index]
                for name in self._state_names(hyper):
                    key = (gi, name)
                    if key not in self._flat_state:
                        self._flat_state[key] = g.layout.empty(torch.float32, g.device)
                    views = g.layout.views(self._flat_state[key])
                    for i in segment.indices:
                        p, view = g.master_views[i], views[i]
                        existing = state[p].get(name)
                        if existing is not None and existing is not view:
                            view.copy_(existing)
                        if existing is not None or not self.is_sgd:
                            state[p][name] = view
                if not self.is_sgd:
                    # Adam's per-parameter step counters, as views of one tensor per
                    # segment, so that a step increments them all with one add.
                    steps = torch.zeros(len(segment.indices), dtype=torch.float32)
                    for k, i in enumerate(segment.indices):
                        existing = state[g.master_views[i]].get("step")
                        if existing is not None:
                            steps[k] = float(existing)
                        state[g.master_views[i]]["step"] = steps[k]
                    if steps.unique().numel() > 1:
                        raise RuntimeError("Adam step counters differ within a param group; the fused step "
                                           "needs them equal (use fused=False)")
                    self._steps[(gi, si)] = steps
        self._adopted = True

    def step(self, inv_scale: torch.Tensor, clip_coef: torch.Tensor, noise: list) -> None:
        """``noise``: per flat group, uniform [0, 1) values for stochastic rounding (or None)."""
        if not self._adopted:
            self._adopt()
        for gi, g in enumerate(self.groups):
            for si, segment in enumerate(g.segments):
                hyper = self.optimizer.param_groups[segment.group_index]
                if self.is_sgd:
                    self._sgd(gi, g, segment, hyper, inv_scale, clip_coef, noise[gi])
                else:
                    self._adam(gi, si, g, segment, hyper, inv_scale, clip_coef, noise[gi])

    def _rounding(self, g) -> str:
        return self.rounding if g.transient else "nearest"

    def _slices(self, gi, g, segment, names, noise):
        s = slice(segment.start, segment.end)
        master = g.master[s] if g.has_master else None
        extras = (noise[s] if noise is not None else None, g.comp[s] if g.comp is not None else None)
        return g.weights[s], g.grads[s], master, [self._flat_state[(gi, n)][s] for n in names], extras

    def _sgd(self, gi, g, segment, hyper, inv_scale, clip_coef, noise) -> None:
        dev = g.device
        momentum = hyper["momentum"]
        names = self._state_names(hyper)
        state = self.optimizer.state
        first = bool(names) and "momentum_buffer" not in state[g.master_views[segment.indices[0]]]
        weights, grad, master, bufs, (noise, comp) = self._slices(gi, g, segment, names, noise)
        compiled(sgd_update, **self._sgd_flags(hyper, master is not None, first, self._rounding(g)))(
            weights, grad, master, bufs[0] if bufs else None, noise, comp, inv_scale, clip_coef,
            scalar(_value(hyper["lr"]), dev), scalar(hyper["weight_decay"], dev), scalar(momentum, dev),
            scalar(1 - hyper["dampening"], dev))
        if first:
            views = g.layout.views(self._flat_state[(gi, "momentum_buffer")])
            for i in segment.indices:
                state[g.master_views[i]]["momentum_buffer"] = views[i]

    def _adam(self, gi, si, g, segment, hyper, inv_scale, clip_coef, noise) -> None:
        dev = g.device
        steps = self._steps[(gi, si)]
        steps += 1
        step = float(steps[0])
        lr, (beta1, beta2), wd, eps = _value(hyper["lr"]), hyper["betas"], hyper["weight_decay"], hyper["eps"]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        weights, grad, master, (exp_avg, exp_avg_sq), (noise, comp) = self._slices(
            gi, g, segment, ("exp_avg", "exp_avg_sq"), noise)
        compiled(adam_update, **self._adam_flags(hyper, master is not None, self._rounding(g)))(
            weights, grad, master, exp_avg, exp_avg_sq, noise, comp, inv_scale, clip_coef, scalar(wd, dev),
            scalar(1 - lr * wd, dev), scalar(1 - beta1, dev), scalar(beta2, dev), scalar(1 - beta2, dev),
            scalar(bias_correction2**0.5, dev), scalar(eps, dev), scalar(-step_size, dev))

    @staticmethod
    def _sgd_flags(hyper: dict, has_master: bool, first: bool, rounding: str) -> dict:
        return dict(has_master=has_master, has_weight_decay=hyper["weight_decay"] != 0,
                    has_momentum=hyper["momentum"] != 0, first_step=first, nesterov=bool(hyper["nesterov"]),
                    maximize=bool(hyper["maximize"]), rounding=rounding)

    @staticmethod
    def _adam_flags(hyper: dict, has_master: bool, rounding: str) -> dict:
        return dict(has_master=has_master, has_weight_decay=hyper["weight_decay"] != 0,
                    decoupled=bool(hyper.get("decoupled_weight_decay", False)), maximize=bool(hyper["maximize"]),
                    rounding=rounding)

    def warm_up(self, max_numel: int = 1 << 20) -> None:
        """Compile every kernel variant this optimizer will need, on scratch tensors,
        so that a compile failure shows before any real buffer is written.

        The scratch tensors have ``max_numel`` elements whatever the real sizes:
        inductor decides from the first example whether a CPU loop runs on several
        threads, and keeps that decision in its on-disk cache for every later size;
        a small first example would leave ResNet-50's step single-threaded."""
        numel = max_numel
        seen = set()  # a param group split into several segments needs its kernels once
        for g in self.groups:
            dev, dtype = g.device, g.dtype
            one = scalar(1.0, dev)
            for with_norm in (False, True):
                compiled(grad_stats, with_norm=with_norm)(torch.zeros(numel, dtype=dtype, device=dev), one)
            for segment in g.segments:
                hyper = self.optimizer.param_groups[segment.group_index]
                rounding = self._rounding(g)
                flags = (self._sgd_flags(hyper, g.has_master, False, rounding) if self.is_sgd
                         else self._adam_flags(hyper, g.has_master, rounding))
                if (dev, dtype, tuple(flags.items())) in seen:
                    continue
                seen.add((dev, dtype, tuple(flags.items())))
                weights = torch.zeros(numel, dtype=dtype, device=dev)
                grad = torch.zeros(numel, dtype=dtype, device=dev)
                master = torch.zeros(numel, device=dev) if g.has_master else None
                bufs = [torch.zeros(numel, device=dev) for _ in range(2)]
                noise = torch.zeros(numel, device=dev) if rounding == "stochastic" else None
                comp = torch.zeros(numel, dtype=dtype, device=dev) if rounding == "kahan" else None
                if self.is_sgd:
                    for first in (True, False):
                        compiled(sgd_update, **self._sgd_flags(hyper, master is not None, first, rounding))(
                            weights, grad, master, bufs[0], noise, comp, one, one, one, one, one, one)
                else:
                    compiled(adam_update, **self._adam_flags(hyper, master is not None, rounding))(
                        weights, grad, master, bufs[0], bufs[1], noise, comp, one, one, one, one, one, one, one,
                        one, one, one)
