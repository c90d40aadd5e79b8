"""The fused step of the flat store: SGD, Adam and AdamW as one kernel per flat
segment that reads the gradient, updates the fp32 master and the optimizer state and
writes the 16-bit weight, with no fp32 gradient buffer. The kernels are compiled with
torch.compile (mpfp16/stores/kernels.py), except on AVX2 and AVX-512 Linux CPUs for Adam
and AdamW with round-to-nearest weights and for the overflow check that does not sum
the squares: those are C++ on at::vec, built at first use (mpfp16/stores/native.py),
the same results bit for bit, about level with torch's fused AdamW.

The kernels step the inner optimizer's own state tensors, which are views of flat
buffers (mpfp16/stores/flat_state.py): ``optimizer.state`` is the state's one owner, and
whatever a user does to it between steps, the next step honours. Every group's
hyper-parameters are read at every step; one that the kernels cannot step (a checkpoint
that turns ``amsgrad`` on, say) is found before anything moves (:func:`unsupported_reason`).

A segment is a run of parameters of one param group that are stepped this step (they
require grad) and whose optimizer state is at the same point (SGD: a momentum buffer
or none yet; Adam: the same step count), so that one kernel call steps them all.

The kernels a step needs are built by the store's check (``LocalStore.check``, from the
builds :meth:`FusedStep.variants` names), on scratch tensors, before the step writes
anything; a variant that a changed hyper-parameter needs first (momentum turned on,
say) is built then, before that step writes anything. This module itself imports no
compiler, so ``import mpfp16`` stays light, and inductor is imported only by a step that
uses one of its kernels.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..parallel.ranks import is_main_process
from ..rounding import scalar
from . import native
from .flat_state import FlatState
from .interface import Checked
from .nonfinite import check_flat, flat_check_is_native, prepare_flat_check, unscale_and_check
from .state_rules import has_own_step, known_base, state_problem

__all__ = ["FusedStep", "unsupported_reason", "fast_path_flag", "choose_fused", "FUSED_MIN_NUMEL"]

logger = logging.getLogger("mpfp16")

FUSED_MIN_NUMEL = 1 << 20  # below this, fused=None keeps the unfused step (no compile time)


def fast_path_flag(optimizer: torch.optim.Optimizer) -> str | None:
    """``"fused=True"`` or ``"foreach=True"`` if the inner optimizer was built asking for
    torch's fast step: FP16Optimizer takes that as asking for its own fused step."""
    for flag in ("fused", "foreach"):
        if any(group.get(flag) for group in optimizer.param_groups):
            return f"{flag}=True"
    return None


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the fused kernels cannot step ``optimizer`` as its param groups are now, or
    None if they can. Asked when the optimizer is built and before every fused step.
    The inner optimizer's own ``fused``/``foreach`` flags are no reason: the fused
    kernels do the arithmetic of torch's foreach and for-loop steps."""
    if known_base(optimizer) is None:
        name = type(optimizer).__name__
        return f"{name} has a step() of its own" if has_own_step(optimizer) else f"{name} is not SGD, Adam or AdamW"
    for i, group in enumerate(optimizer.param_groups):
        where = f" in param group {i}" if len(optimizer.param_groups) > 1 else ""
        for flag in ("differentiable", "capturable", "amsgrad"):
            if group.get(flag):
                return f"{flag}=True{where}"
        for key in ("lr", "betas", "momentum", "weight_decay", "eps", "dampening"):
            values = group.get(key, ())
            if any(torch.is_tensor(v) and key != "lr" for v in (values if isinstance(values, tuple) else (values,))):
                return f"tensor-valued {key}{where}"
    return None


def choose_fused(optimizer: torch.optim.Optimizer, numel: int, fused: bool | None, store_reason: str | None) -> bool:
    """Whether a store whose fused step is possible unless ``store_reason`` says why not
    takes it, for FP16Optimizer's ``fused`` (True: the fused step or a one-line error;
    None: when supported and either ``numel`` >= :data:`FUSED_MIN_NUMEL` or the inner
    optimizer asked for torch's fast step; False: never), with one log line where it is
    not what was asked for.

    Raises:
        ValueError: ``fused=True`` where the optimizer or the store cannot take it.
    """
    optimizer_reason = unsupported_reason(optimizer)
    reason = optimizer_reason or store_reason
    if fused and reason:
        raise ValueError(f"fused=True is not possible: {reason}")
    asked = fast_path_flag(optimizer)  # the inner optimizer's fused=True / foreach=True
    big = numel >= FUSED_MIN_NUMEL
    use = fused if fused is not None else (reason is None and (big or asked is not None))
    # Said where the fused step was asked for (the inner optimizer's flag), or where its
    # size would have chosen it and the optimizer is what stands in the way (a store that
    # cannot take it says so in its own line); fused=False asks for nothing.
    if not use and is_main_process() and (asked or (fused is None and big and optimizer_reason is not None)):
        _explain_no_fused_step(optimizer, asked, optimizer_reason, store_reason, numel)
    return bool(use)


def _explain_no_fused_step(optimizer, asked: str | None, optimizer_reason: str | None, store_reason: str | None,
                           numel: int) -> None:
    """One line for an inner optimizer built with fused=True or foreach=True whose
    step is not mpfp16's fused one: its own step then runs over the fp32 masters; and,
    with ``asked`` None, for one that FP16Optimizer(fused=None) would have given the
    fused step for its size but cannot take (torchao's low-bit optimizers, RMSprop,
    amsgrad=True): its own step runs, an INFO line, since nothing was asked for."""
    name = type(optimizer).__name__
    if asked is None:
        logger.info("%s over %d parameters: mpfp16's fused step cannot take it (%s); %s's own step runs", name,
                    numel, optimizer_reason, name)
        return
    own = f"torch's own {asked.split('=')[0]} step runs over the fp32 masters"
    if optimizer_reason is not None:
        logger.warning("%s(%s): mpfp16's fused step cannot take it (%s); %s", name, asked, optimizer_reason, own)
    elif store_reason is not None:
        logger.info("%s(%s): %s (mpfp16's fused step: %s)", name, asked, own, store_reason)
    else:  # FP16Optimizer(fused=False)
        logger.info("%s(%s) under FP16Optimizer(fused=False): %s, not mpfp16's fused step", name, asked, own)


def _value(x) -> float:
    return float(x) if torch.is_tensor(x) else x


class FusedStep:
    """Runs the step of an SGD/Adam/AdamW inner optimizer as fused kernels over the
    segments of the flat store's buffers (module docstring), on the inner optimizer's
    own state tensors (:class:`mpfp16.stores.flat_state.FlatState`).

    The kernels read the 16-bit gradients and unscale them on the fly, or, after
    ``unscale(..., materialize=True)`` (what ``FP16Optimizer.unscale_()`` asks for),
    the unscaled fp32 gradients that it wrote into the masters' ``.grad``. With
    ``state_dtypes`` (mpfp16/stores/state_dtypes.py) the flat state buffers of those
    states are 16-bit: the kernels widen them, compute in fp32, and store the new
    states rounded once (``state_rounding``: to nearest, or stochastically with noise
    drawn each step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, groups, rounding: str = "nearest",
                 state_dtypes: dict | None = None, state_rounding: str = "nearest") -> None:
        self.optimizer = optimizer
        self.groups = groups  # the ParamGroups, every one flat
        self.rounding = rounding
        self.state_dtypes, self.state_rounding = dict(state_dtypes or {}), state_rounding
        self.is_sgd = known_base(optimizer) is torch.optim.SGD
        self.state = FlatState(optimizer, groups, self.state_dtypes, self.is_sgd)

    # ------------------------------------------------------------------ before anything moves

    def problem(self, stepped: list[torch.Tensor], params: list[torch.Tensor], labels: list[str]) -> str | None:
        """Why the next step cannot step the state as it is now (one line), or None:
        nothing to say while the state is what the kernels made it."""
        if self.state.holds():
            return None
        return state_problem(self.optimizer, stepped, params, labels)

    def reload(self, stepped: list[torch.Tensor], params: list[torch.Tensor], labels: list[str]) -> None:
        """After the inner optimizer loaded a state_dict: adopt it now, so that 16-bit
        states are held in 16 bits from the load on (one that cannot be stepped is left
        for the next step's check to refuse)."""
        if state_problem(self.optimizer, stepped, params, labels) is None:
            self.state.adopt(fresh_states=False)

    # ------------------------------------------------------------------ the phases

    def unscale(self, scale: float, materialize: bool, with_norm: bool) -> Checked:
        """[found_inf]; without ``materialize``, read straight from the 16-bit
        gradient buffers (and their sum of squares when ``with_norm``)."""
        if materialize:
            for g in self.groups:
                g.ready_fp32_grads()
            found = unscale_and_check([t for g in self.groups for t in g.fp32_grads()], scale)
            return Checked(found, materialized=True)
        device = self.groups[0].device
        stats = torch.zeros(2, dtype=torch.float32, device=device)
        for g in self.groups:
            stats += check_flat(g.check_grads(materialized=False), scale, with_norm).to(device)
        return Checked(stats[:1], materialized=False, grad_sumsq=stats[1] if with_norm else None)

    @staticmethod
    def norm(checked: Checked) -> torch.Tensor:
        """From the flat sum of squares the check found: summed in another order than
        clip_grad_norm_'s per-tensor norms, so it can differ from theirs in the last
        bits (docs/API.md, clipping; after ``unscale_()`` the store computes it as
        clip_grad_norm_ does, from the fp32 gradients)."""
        return checked.grad_sumsq.sqrt()

    def _native_adam(self, g, grad_dtype: torch.dtype) -> bool:
        """Whether native.adam_update steps this group's segments: its states rounded to
        nearest, in the dtypes it steps."""
        moments = tuple(self.state_dtypes.get(name, torch.float32) for name in ("exp_avg", "exp_avg_sq"))
        return (not self.is_sgd and native.handles(g.device, g.dtype, grad_dtype, g.kernel_rounding(self.rounding))
                and (moments == (torch.float32, torch.float32) or (
                    self.state_rounding == "nearest" and native.handles_states(*moments))))

    def update(self, checked: Checked, scale: float, clip_coef: torch.Tensor | None, noise: list,
               rng: torch.Generator | None = None) -> None:
        """One kernel per segment: update, and write the new 16-bit weights (``scale``:
        that of the step's gradients, unless ``checked`` says they were unscaled); with
        stochastically rounded 16-bit states, their noise drawn from ``rng``."""
        if not self.state.holds():
            self.state.adopt()
        inv_scale = 1.0 if checked.materialized else 1.0 / scale
        self._state_noise, self._state_rng = {}, rng  # noise drawn as the kernels ask for it (_noise_of)
        steps = {} if self.is_sgd else self.state.count_steps()
        first = False
        for gi, g in enumerate(self.groups):
            for si, segment in enumerate(self.state.segments[gi]):
                hyper = self.optimizer.param_groups[segment.group_index]
                if self.is_sgd:
                    first |= self._sgd(gi, g, segment, hyper, inv_scale, clip_coef, noise[gi], checked.materialized)
                else:
                    self._adam(gi, g, segment, hyper, steps[(gi, si)], inv_scale, clip_coef, noise[gi],
                               checked.materialized)
        if first:
            self.state.forget()  # the momentum buffers made this step are the state: adopt them next step

    def _slices(self, gi, g, segment, names, noise, materialized):
        s = segment.range
        b = g.kernel_buffers(s, materialized)
        extras = (noise[s] if noise is not None else None, b.comp)
        return b.weights, b.grad, b.master, [self.state.buffers[(gi, n)][s] for n in names], extras

    def _noise_of(self, gi, segment, names) -> list:
        """The stochastic rounding noise of each of ``names``' 16-bit states over
        ``segment`` (None where a state is rounded to nearest or fp32). A group's noise
        for a state is drawn, over the whole group, when a kernel first steps that state
        in this step: none for a state no kernel steps (SGD's momentum at ``momentum=0``)."""
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

    def _sgd(self, gi, g, segment, hyper, inv_scale, clip_coef, noise, materialized) -> bool:
        """One SGD segment; returns whether it made the segment's momentum buffers."""
        from .kernels import compiled, sgd_update

        dev = g.device
        names = self.state.names(hyper)
        first = bool(names) and not segment.key[2]
        weights, grad, master, bufs, (noise, comp) = self._slices(gi, g, segment, names, noise, materialized)
        buf_noise = self._noise_of(gi, segment, names)[0] if names else None
        compiled(sgd_update, **self._sgd_flags(hyper, master is not None, first, g.kernel_rounding(self.rounding)))(
            weights, grad, master, bufs[0] if bufs else None, noise, comp, scalar(inv_scale, dev),
            scalar(1.0, dev) if clip_coef is None else clip_coef, scalar(_value(hyper["lr"]), dev),
            scalar(hyper["weight_decay"], dev), scalar(hyper["momentum"], dev), scalar(1 - hyper["dampening"], dev),
            buf_noise)
        if first:
            state = self.optimizer.state
            for i in segment.indices:
                state[g.master_views[i]]["momentum_buffer"] = self.state._view(gi, "momentum_buffer", i)
        return first

    def _adam(self, gi, g, segment, hyper, step, inv_scale, clip_coef, noise, materialized) -> None:
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
        from .kernels import adam_apply, adam_moments, adam_update, compiled

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

    # ------------------------------------------------------------------ the kernels' build

    def variants(self, fp32_grads: bool, with_norm: bool) -> dict:
        """The kernels the next step needs, ``{key: build}`` (``build()`` compiles or
        loads one on scratch tensors): the overflow check for each gradient dtype it
        reads (with ``with_norm``, also the variant that sums the squares for the
        norm), and each param group's update as its hyper-parameters are now; with
        ``fp32_grads``, also the variants that read the fp32 gradients ``unscale_()``
        makes. A key names what the kernel depends on, so that a step needs a build only
        where a key is new (a hyper-parameter changed, or a step first clips)."""
        out = {}
        for g in self.groups:
            dev, dtype = g.device, g.dtype
            # The dtypes of the gradients the kernels read: 16-bit, or the fp32 sum or the
            # fp32 gradients unscale_() makes.
            grad_dtypes = (dtype,) if not g.half else (torch.float32,) if g.accumulating else (
                (dtype, torch.float32) if fp32_grads else (dtype,))
            for norm in (False, True) if with_norm else (False,):
                for grad_dtype in grad_dtypes:
                    native_check = flat_check_is_native(dev, grad_dtype, norm)
                    out[("check", dev, grad_dtype, norm, native_check)] = functools.partial(
                        prepare_flat_check, dev, grad_dtype, norm)
            rounding = g.kernel_rounding(self.rounding)
            for segment in g.segments:
                hyper = self.optimizer.param_groups[segment.group_index]
                flags = (self._sgd_flags(hyper, g.has_master, False, rounding) if self.is_sgd
                         else self._adam_flags(hyper, g.has_master, rounding))
                for grad_dtype in grad_dtypes:
                    if self._native_adam(g, grad_dtype):
                        out[("native",)] = native.load
                        continue
                    key = ("update", dev, dtype, grad_dtype, tuple(flags.items()),
                           self._two_passes(g, hyper, self.state_dtypes))
                    out[key] = functools.partial(self._prepare_compiled, g, hyper, flags, grad_dtype)
        return out

    def _prepare_compiled(self, g, hyper: dict, flags: dict, grad_dtype: torch.dtype, numel: int = 64) -> None:
        """Compile the inductor kernels of one segment's step, on scratch tensors (the
        scratch size does not matter: ``kernels.compiled`` compiles every kernel on
        examples of one size)."""
        from .kernels import adam_apply, adam_moments, adam_update, compiled, sgd_update

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
