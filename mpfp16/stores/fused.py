"""The fused step of the flat store: SGD, Adam and AdamW as one kernel per flat
segment that reads the gradient, updates the fp32 master and the optimizer state and
writes the 16-bit weight, with no fp32 gradient buffer. The kernels are compiled with
torch.compile (mpfp16/stores/kernels.py), except on AVX2 and AVX-512 Linux CPUs for Adam
and AdamW with round-to-nearest weights and for the overflow check that does not sum
the squares: those are C++ on at::vec, built at first use (mpfp16/stores/native.py),
the same results bit for bit, about level with torch's fused AdamW.

A segment is a run of parameters of one param group that are stepped this step (they
require grad) and whose optimizer state is at the same point (SGD: a momentum buffer
or none yet; Adam: the same step count), so that one kernel call steps them all. A
parameter frozen mid-run is left out, and one unfrozen later is stepped from its own
state: the segments are made again whenever the set of parameters that require grad
changes.

The kernels are compiled in :meth:`FusedStep.prepare`, on scratch tensors, before
the first step writes anything; this module itself imports no compiler, so
``import mpfp16`` stays light, and inductor is imported only by a step that uses one of
its kernels.
"""

from __future__ import annotations

import torch

from . import native
from .interface import unscale_and_check
from .segments import runs

__all__ = ["FusedStep", "SUPPORTED", "unsupported_reason", "fast_path_flag"]

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def fast_path_flag(optimizer: torch.optim.Optimizer) -> str | None:
    """``"fused=True"`` or ``"foreach=True"`` if the inner optimizer was built asking for
    torch's fast step: FP16Optimizer takes that as asking for its own fused step."""
    for flag in ("fused", "foreach"):
        if any(group.get(flag) for group in optimizer.param_groups):
            return f"{flag}=True"
    return None


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot take the fused path, or None if it can. The inner
    optimizer's own ``fused``/``foreach`` flags are no reason: the fused kernels do
    the arithmetic of torch's foreach and for-loop steps, and without them (a compile
    that fails) the inner optimizer's own step, fused or not, runs over the masters."""
    if type(optimizer) not in SUPPORTED:
        return f"{type(optimizer).__name__} is not SGD, Adam or AdamW"
    for group in optimizer.param_groups:
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


class FusedStep:
    """Runs the step of an SGD/Adam/AdamW inner optimizer as fused kernels over the
    segments of the flat store's buffers (module docstring), keeping the inner
    optimizer's ``state`` in its usual per-parameter form (each entry a view of a flat
    state buffer), so that ``state_dict()`` is the same whichever step ran.

    The kernels read the 16-bit gradients and unscale them on the fly, or, after
    ``unscale(..., materialize=True)`` (what ``FP16Optimizer.unscale_()`` asks for),
    the unscaled fp32 gradients that it wrote into the masters' ``.grad``. What one
    step found (the scale, whether the gradients were materialized, their sum of
    squares) is in the step's state (:class:`mpfp16.step_state.StepState`), which each
    phase is handed. The groups are reached through their kernel methods
    (:meth:`mpfp16.stores.groups.ParamGroup.kernel_buffers`, ``check_grads``,
    ``kernel_rounding``, ``ready_fp32_grads``).

    With ``state_dtypes`` (mpfp16/stores/state_dtypes.py) the flat state buffers of
    those states are 16-bit: the kernels widen them, compute in fp32, and store the new
    states rounded once (``state_rounding``: to nearest, or stochastically with noise
    drawn each step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, groups, stepped, rounding: str = "nearest",
                 state_dtypes: dict | None = None, state_rounding: str = "nearest") -> None:
        self.optimizer = optimizer
        self.groups = groups  # the ParamGroups, every one flat
        self.stepped = stepped
        self.rounding = rounding
        self.state_dtypes, self.state_rounding = dict(state_dtypes or {}), state_rounding
        self.is_sgd = type(optimizer) is torch.optim.SGD
        self._flat_state: dict = {}  # (flat group index, state name) -> flat state buffer, in its state's dtype
        self._segments: dict = {}  # flat group index -> the segments stepped (module docstring)
        self._steps: dict = {}  # (flat group index, segment index) -> Adam step counters
        self._adopted_for = None  # the requires_grad pattern the segments were made for

    # ------------------------------------------------------------------ the phases

    def unscale(self, state, scale: float, materialize: bool, with_norm: bool) -> torch.Tensor:
        """[found_inf]; without ``materialize``, read straight from the 16-bit
        gradient buffers (and their sum of squares when ``with_norm``, kept in
        ``state.grad_sumsq``)."""
        if materialize:
            for g in self.groups:
                g.ready_fp32_grads()
            return unscale_and_check([t for g in self.groups for t in g.fp32_grads()], scale)
        device = self.groups[0].device
        stats = torch.zeros(2, dtype=torch.float32, device=device)
        for g in self.groups:
            grads = g.check_grads(materialized=False)
            if self._native_check(grads, with_norm):
                stats[0] += float(native.nonfinite(grads, 1.0 / scale))
            else:
                from . import kernels

                kernel = kernels.compiled(kernels.grad_stats, with_norm=with_norm)
                stats += kernel(grads, kernels.scalar(1.0 / scale, g.device)).to(device)
        state.grad_sumsq = stats[1]
        return stats[:1]

    @staticmethod
    def _native_check(grads: torch.Tensor, with_norm: bool) -> bool:
        """Whether native.nonfinite checks these gradients: on CPU, without the norm (the
        norm's sum keeps inductor's order of summation)."""
        return not with_norm and native.handles(grads.device, grads.dtype, grads.dtype, "nearest")

    def _native_adam(self, g, grad_dtype: torch.dtype) -> bool:
        """Whether native.adam_update steps this group's segments: its states rounded to
        nearest, in the dtypes it steps."""
        moments = tuple(self.state_dtypes.get(name, torch.float32) for name in ("exp_avg", "exp_avg_sq"))
        return (not self.is_sgd and native.handles(g.device, g.dtype, grad_dtype, g.kernel_rounding(self.rounding))
                and (moments == (torch.float32, torch.float32) or (
                    self.state_rounding == "nearest" and native.handles_states(*moments))))

    @staticmethod
    def grad_norm(state) -> torch.Tensor:
        """From the flat sum of squares the check found, which can differ from
        clip_grad_norm_'s per-tensor norms in the last bits (the flat store computes it
        from the fp32 gradients as the unfused step does after ``unscale_()``)."""
        return state.grad_sumsq.sqrt()

    def invalidate(self) -> None:
        """The inner optimizer's state was replaced (load_state_dict): adopt it again."""
        self._adopted_for = None

    def _state_names(self, hyper: dict) -> tuple[str, ...]:
        if self.is_sgd:
            return ("momentum_buffer",) if hyper["momentum"] != 0 else ()
        return ("exp_avg", "exp_avg_sq")

    def _state_key(self, master: torch.Tensor, hyper: dict):
        """What a segment's parameters must share besides their param group: SGD,
        whether the momentum buffer exists; Adam, the step count."""
        state = self.optimizer.state.get(master, {})
        if self.is_sgd:
            return "momentum_buffer" in state
        return float(state.get("step", 0.0))

    def _adopt(self, pattern: tuple) -> None:
        """Make the segments for the parameters that require grad now, and every state
        tensor of theirs a view of a flat buffer, copying in what exists."""
        state = self.optimizer.state
        groups = self.optimizer.param_groups
        self._segments.clear()
        self._steps.clear()
        for gi, g in enumerate(self.groups):
            param_group = [segment.group_index for segment in g.segments for _ in segment.indices]
            keys = [(pg, p.requires_grad, self._state_key(m, groups[pg]) if p.requires_grad else None)
                    for pg, p, m in zip(param_group, g.params, g.master_views)]
            segments = [s for s in runs(keys, g.layout) if s.key[1]]  # the parameters stepped
            self._segments[gi] = segments
            for si, segment in enumerate(segments):
                hyper = groups[segment.group_index]
                for name in self._state_names(hyper):
                    key = (gi, name)
                    if key not in self._flat_state:
                        self._flat_state[key] = g.layout.empty(self.state_dtypes.get(name, torch.float32), g.device)
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
                    # segment (all equal: the segment's key), so that a step
                    # increments them all with one add.
                    steps = torch.full((len(segment.indices),), float(segment.key[2]), dtype=torch.float32)
                    for k, i in enumerate(segment.indices):
                        state[g.master_views[i]]["step"] = steps[k]
                    self._steps[(gi, si)] = steps
        self._adopted_for = pattern

    def update(self, state, scale: float, clip_coef: torch.Tensor | None, noise: list,
               rng: torch.Generator | None = None) -> None:
        """One kernel per segment: update, and write the new 16-bit weights (``scale``:
        that of the step's gradients, unless ``state`` says they were unscaled); with
        stochastically rounded 16-bit states, their noise drawn from ``rng``."""
        pattern = tuple(p.requires_grad for g in self.groups for p in g.params)
        if self._adopted_for != pattern:
            self._adopt(pattern)
        inv_scale = 1.0 if state.materialized else 1.0 / scale
        self._state_noise, self._state_rng = {}, rng  # noise drawn as the kernels ask for it (_noise_of)
        for gi, g in enumerate(self.groups):
            for si, segment in enumerate(self._segments[gi]):
                hyper = self.optimizer.param_groups[segment.group_index]
                if self.is_sgd:
                    self._sgd(gi, g, segment, hyper, inv_scale, clip_coef, noise[gi], state.materialized)
                else:
                    self._adam(gi, si, g, segment, hyper, inv_scale, clip_coef, noise[gi], state.materialized)

    def _slices(self, gi, g, segment, names, noise, materialized):
        s = segment.range
        b = g.kernel_buffers(s, materialized)
        extras = (noise[s] if noise is not None else None, b.comp)
        return b.weights, b.grad, b.master, [self._flat_state[(gi, n)][s] for n in names], extras

    def _noise_of(self, gi, segment, names) -> list:
        """The stochastic rounding noise of each of ``names``' 16-bit states over
        ``segment`` (None where a state is rounded to nearest or fp32). A group's noise
        for a state is drawn, over the whole group, when a kernel first steps that state
        in this step: none for a state no kernel steps (``max_exp_avg_sq``, which the
        fused step never keeps; SGD's momentum at ``momentum=0``)."""
        if self.state_rounding != "stochastic":
            return [None] * len(names)
        out = []
        for n in names:
            if n not in self.state_dtypes:
                out.append(None)
                continue
            if (gi, n) not in self._state_noise:
                g = self.groups[gi]
                self._state_noise[(gi, n)] = torch.rand(g.layout.total, generator=self._state_rng, device=g.device)
            out.append(self._state_noise[(gi, n)][segment.range])
        return out

    def _sgd(self, gi, g, segment, hyper, inv_scale, clip_coef, noise, materialized) -> None:
        from .kernels import compiled, scalar, sgd_update

        dev = g.device
        momentum = hyper["momentum"]
        names = self._state_names(hyper)
        state = self.optimizer.state
        first = bool(names) and "momentum_buffer" not in state[g.master_views[segment.indices[0]]]
        weights, grad, master, bufs, (noise, comp) = self._slices(gi, g, segment, names, noise, materialized)
        buf_noise = self._noise_of(gi, segment, names)[0] if names else None
        compiled(sgd_update, **self._sgd_flags(hyper, master is not None, first, g.kernel_rounding(self.rounding)))(
            weights, grad, master, bufs[0] if bufs else None, noise, comp, scalar(inv_scale, dev),
            scalar(1.0, dev) if clip_coef is None else clip_coef, scalar(_value(hyper["lr"]), dev),
            scalar(hyper["weight_decay"], dev), scalar(momentum, dev), scalar(1 - hyper["dampening"], dev), buf_noise)
        if first:
            views = g.layout.views(self._flat_state[(gi, "momentum_buffer")])
            for i in segment.indices:
                state[g.master_views[i]]["momentum_buffer"] = views[i]

    def _adam(self, gi, si, g, segment, hyper, inv_scale, clip_coef, noise, materialized) -> None:
        steps = self._steps[(gi, si)]
        steps += 1
        step = float(steps[0])
        lr, (beta1, beta2), wd, eps = _value(hyper["lr"]), hyper["betas"], hyper["weight_decay"], hyper["eps"]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        weights, grad, master, (exp_avg, exp_avg_sq), (noise, comp) = self._slices(
            gi, g, segment, ("exp_avg", "exp_avg_sq"), noise, materialized)
        flags = self._adam_flags(hyper, master is not None, g.kernel_rounding(self.rounding))
        # The step's scalars in Python doubles, in the order of the kernels' arguments:
        # the weight decay's two, the moments' three, the new parameter's three.
        scalars = dict(weight_decay=wd, decay_factor=1 - lr * wd, one_minus_beta1=1 - beta1, beta2=beta2,
                       one_minus_beta2=1 - beta2, bias_correction2_sqrt=bias_correction2**0.5, eps=eps,
                       neg_step_size=-step_size)
        m_noise, v_noise = self._noise_of(gi, segment, ("exp_avg", "exp_avg_sq"))
        if self._native_adam(g, grad.dtype):
            native.adam_update(weights, grad, master, exp_avg, exp_avg_sq, inv_scale=inv_scale,
                               clip_coef=1.0 if clip_coef is None else float(clip_coef), **scalars,
                               **{k: v for k, v in flags.items() if k not in ("has_master", "rounding")})
            return
        from .kernels import adam_apply, adam_moments, adam_update, compiled, scalar

        dev = g.device
        inv_scale, clip_coef = scalar(inv_scale, dev), scalar(1.0, dev) if clip_coef is None else clip_coef
        wd_t, decay, *rest = (scalar(v, dev) for v in scalars.values())
        moments, new = rest[:3], rest[3:]
        if self._two_passes(g, hyper, self.state_dtypes):
            compiled(adam_moments, maximize=flags["maximize"], lerp_low=flags["lerp_low"])(
                weights, grad, exp_avg, exp_avg_sq, inv_scale, clip_coef, wd_t, *moments)
            compiled(adam_apply, rounding=flags["rounding"])(weights, exp_avg, exp_avg_sq, noise, comp, *new)
            return
        compiled(adam_update, **flags)(weights, grad, master, exp_avg, exp_avg_sq, noise, comp, inv_scale, clip_coef,
                                       wd_t, decay, *moments, *new, m_noise, v_noise)

    @staticmethod
    def _two_passes(g, hyper: dict, state_dtypes: dict) -> bool:
        """Adam with coupled weight decay over 16-bit weights without masters, on CPU
        with inductor's kernels (stochastic or Kahan rounding; round-to-nearest takes
        the native kernel, one pass): two passes (``kernels.adam_moments``) run faster
        than one there. Not with remainders: the weight decay is of the exact master,
        which only the one-pass kernel rebuilds; nor with 16-bit moments, whose second
        pass would read them rounded where the step reads the fp32 values."""
        return (not state_dtypes and not g.has_master and g.half and g.device.type == "cpu"
                and hyper["weight_decay"] != 0
                and not hyper.get("decoupled_weight_decay", False) and g.remainder is None)

    @staticmethod
    def _sgd_flags(hyper: dict, has_master: bool, first: bool, rounding: str) -> dict:
        return dict(has_master=has_master, has_weight_decay=hyper["weight_decay"] != 0,
                    has_momentum=hyper["momentum"] != 0, first_step=first, nesterov=bool(hyper["nesterov"]),
                    maximize=bool(hyper["maximize"]), rounding=rounding)

    @staticmethod
    def _adam_flags(hyper: dict, has_master: bool, rounding: str) -> dict:
        return dict(has_master=has_master, has_weight_decay=hyper["weight_decay"] != 0,
                    decoupled=bool(hyper.get("decoupled_weight_decay", False)), maximize=bool(hyper["maximize"]),
                    lerp_low=abs(1 - hyper["betas"][0]) < 0.5, rounding=rounding)

    def prepare(self, fp32_grads: bool = False, with_norm: bool = False) -> None:
        """Compile every kernel variant the next step needs, on scratch tensors, so
        that a compile failure shows before any real buffer is written: with
        ``fp32_grads``, also the variants that read the fp32 gradients ``unscale_()``
        makes; with ``with_norm``, also the overflow check that sums the squares for
        the norm (FP16Optimizer prepares again when a later step first needs either).
        The scratch sizes do not matter: ``kernels.compiled`` compiles every kernel on
        examples of one size. The native kernels are one library, built (or loaded
        from disk) by the first variant that needs it."""
        numel = 64
        seen = set()  # a param group split into several segments needs its kernels once
        for g in self.groups:
            dev, dtype = g.device, g.dtype
            # The dtypes of the gradients the kernels read: 16-bit, or the fp32 sum or the
            # fp32 gradients unscale_() makes.
            grad_dtypes = (dtype,) if not g.half else (torch.float32,) if g.accumulating else (
                (dtype, torch.float32) if fp32_grads else (dtype,))
            for norm in (False, True) if with_norm else (False,):
                for grad_dtype in grad_dtypes:
                    grads = torch.zeros(numel, dtype=grad_dtype, device=dev)
                    if self._native_check(grads, norm):
                        native.load()
                    else:
                        from .kernels import compiled, grad_stats, scalar

                        compiled(grad_stats, with_norm=norm)(grads, scalar(1.0, dev))
            for segment in g.segments:
                hyper = self.optimizer.param_groups[segment.group_index]
                rounding = g.kernel_rounding(self.rounding)
                flags = (self._sgd_flags(hyper, g.has_master, False, rounding) if self.is_sgd
                         else self._adam_flags(hyper, g.has_master, rounding))
                if (dev, dtype, tuple(flags.items())) in seen:
                    continue
                seen.add((dev, dtype, tuple(flags.items())))
                for grad_dtype in grad_dtypes:
                    if self._native_adam(g, grad_dtype):
                        native.load()
                    else:
                        self._prepare_compiled(g, hyper, flags, grad_dtype, numel)

    def _prepare_compiled(self, g, hyper: dict, flags: dict, grad_dtype: torch.dtype, numel: int) -> None:
        """Compile the inductor kernels of one segment's step, on scratch tensors."""
        from .kernels import adam_apply, adam_moments, adam_update, compiled, scalar, sgd_update

        dev, dtype, rounding = g.device, g.dtype, flags["rounding"]
        one = scalar(1.0, dev)
        weights = torch.zeros(numel, dtype=dtype, device=dev)
        master = torch.zeros(numel, device=dev) if g.has_master else None
        names = ("momentum_buffer",) if self.is_sgd else ("exp_avg", "exp_avg_sq")
        bufs = [torch.zeros(numel, dtype=self.state_dtypes.get(n, torch.float32), device=dev) for n in names]
        state_noise = [torch.zeros(numel, device=dev) if self.state_rounding == "stochastic" and n in self.state_dtypes
                       else None for n in names]
        noise = torch.zeros(numel, device=dev) if rounding == "stochastic" else None
        comp = (torch.zeros(numel, dtype=dtype, device=dev) if rounding == "kahan" else
                torch.zeros(numel, dtype=torch.int16, device=dev) if rounding == "remainder" else None)
        grad = torch.zeros(numel, dtype=grad_dtype, device=dev)
        if self.is_sgd:
            for first in (True, False):
                compiled(sgd_update, **self._sgd_flags(hyper, master is not None, first, rounding))(
                    weights, grad, master, bufs[0], noise, comp, one, one, one, one, one, one, state_noise[0])
        elif self._two_passes(g, hyper, self.state_dtypes):
            compiled(adam_moments, maximize=flags["maximize"], lerp_low=flags["lerp_low"])(
                weights, grad, bufs[0], bufs[1], one, one, one, one, one, one)
            compiled(adam_apply, rounding=rounding)(weights, bufs[0], bufs[1], noise, comp, one, one, one)
        else:
            compiled(adam_update, **flags)(weights, grad, master, bufs[0], bufs[1], noise, comp, one, one, one, one,
                                           one, one, one, one, one, one, *state_noise)
