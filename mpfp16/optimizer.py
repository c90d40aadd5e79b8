"""FP16Optimizer: fp32 master weights, loss scaling and one clean optimizer step.

The wrapper takes any ``torch.optim`` optimizer built over a 16-bit model's
parameters. The parameters live in flat buffers, one per (device, dtype): those that
:func:`mpfp16.to_half` made (adopted as they are, so the wrapper may be built before
or after DDP), or, for parameters that are not in one, buffers it makes (mpfp16/flat.py
refuses to move parameters that DDP already holds). Their gradients become views of a
flat buffer of the same layout. It keeps an fp32 master copy of every 16-bit
parameter in a flat buffer of that layout too, and puts the masters into the inner
optimizer's ``param_groups`` in place of the model's parameters. fp32 parameters
(normalization layers) are stepped directly.

The step runs in one fixed order (the project's DESIGN):

1. ``_unscale_grads``: copy the 16-bit gradients into the fp32 master gradients,
   multiply by 1/scale and look for inf/NaN, one pass per flat buffer;
2. on overflow: skip, back the scale off, count it, zero the gradients;
3. ``_clip_grads``: clip the global norm of the unscaled fp32 gradients;
4. the inner optimizer steps the masters;
5. ``_copy_masters_to_model``: one copy per flat buffer;
6. the scaler counts a clean step (and may grow the scale).

For SGD, Adam and AdamW, the fused path (mpfp16/fused.py) does the same in two
compiled passes: ``_grad_stats`` (phase 1's check, read from the 16-bit gradients)
and one kernel per flat segment for phases 3 to 5. Either way, reading the overflow
flag is the step's only host synchronization.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook

from . import flat
from . import fused as fused_mod
from .convert import HALF_DTYPES
from .distributed import get_world_size, is_main_process
from .errors import FusedStepUnavailable
from .scaler import DynamicLossScaler, LossScaler

__all__ = ["FP16Optimizer"]

logger = logging.getLogger("mpfp16")

_SUPPORTED_DTYPES = HALF_DTYPES + (torch.float32,)
FUSED_MIN_NUMEL = 1 << 20  # below this, fused=None keeps the unfused step (no compile time)
_STATE_FORMAT = "mpfp16.FP16Optimizer/1"


@dataclass(frozen=True)
class _Segment:
    """The parameters of one param group inside a flat buffer: a contiguous range."""

    group_index: int
    start: int
    end: int
    indices: tuple[int, ...]


class _FlatGroup:
    """The trainable parameters of one (device, dtype), held in flat buffers.

    ``weights`` and ``grads`` are the model's own storage: every parameter and its
    ``.grad`` is a view into them. For a 16-bit group, ``master`` and
    ``master_grads`` are fp32 buffers of the same layout; for an fp32 group they are
    ``weights`` and ``grads`` themselves. ``master_views`` are what the inner
    optimizer steps. ``segments`` cut the buffers by param group.

    ``master_grads`` of a 16-bit group gets memory only when the unfused path first
    needs it (the fused path reads the 16-bit gradients directly); without master
    weights, ``master`` and ``master_grads`` have memory only inside that path's step.
    """

    def __init__(self, params: list[torch.Tensor], master_weights: bool, group_of: dict[int, int],
                 kahan: bool = False) -> None:
        # The buffer to_half() made for exactly these parameters moves nothing; any other
        # placement is refused if DDP already holds them (flat.check_movable).
        placed = flat.place(params)
        self.params = params = placed.params
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.half = self.dtype in HALF_DTYPES
        self.layout = placed.layout
        self.weights = placed.data
        self.grads = self.layout.empty(self.dtype, self.device)
        self.grad_views = self.layout.views(self.grads)
        with torch.no_grad():
            for p, g in zip(params, self.grad_views):
                if p.grad is not None:
                    g.copy_(p.grad)
                p.grad = g  # unlike moving the parameter, harmless under DDP
        self.data_ptrs = [p.data_ptr() for p in params]
        # The optimizer writes the weights through the flat buffer, which leaves each
        # parameter's own version counter alone; a write through the parameter itself
        # (DDP's initial broadcast from rank 0, model.load_state_dict, an in-place init)
        # bumps it, and the next step re-reads that weight's master (check_params).
        self.mark_synced()
        self.grad_ptrs = [g.data_ptr() for g in self.grad_views]
        self.segments = self._segments([group_of[id(p)] for p in params])
        # Kahan rounding's 16-bit compensation: what the last rounding lost, per weight.
        self.comp = self.layout.empty(self.dtype, self.device) if kahan and self.dtype in HALF_DTYPES else None

        # Without master weights the fp32 buffers exist only inside step().
        self.transient = self.half and not master_weights
        if not self.half:
            self.master, self.master_grads = self.weights, self.grads
            self.master_views = params
            return
        self.master = self.weights.float()
        self.master_grads = self.layout.empty(torch.float32, self.device)
        self.master_views = self.layout.views(self.master)
        for m, g in zip(self.master_views, self.layout.views(self.master_grads)):
            m.grad = g
            m._mpfp16_master = True
        flat.release(self.master_grads)
        if self.transient:
            flat.release(self.master)

    def _segments(self, group_indices: list[int]) -> list[_Segment]:
        """Consecutive runs of parameters of the same param group. The buffer is in
        model order, so a param group can make several runs (weights and biases in
        groups with and without weight decay, say)."""
        segments, first, offsets = [], 0, self.layout.offsets
        for i in range(1, len(group_indices) + 1):
            if i == len(group_indices) or group_indices[i] != group_indices[first]:
                end = offsets[i] if i < len(group_indices) else self.layout.total
                segments.append(_Segment(group_indices[first], offsets[first], end, tuple(range(first, i))))
                first = i
        return segments

    @property
    def has_master(self) -> bool:
        """A 16-bit group with persistent fp32 masters."""
        return self.half and not self.transient

    def prepare_master_grads(self) -> None:
        if self.half:
            flat.restore(self.master_grads)

    def mark_synced(self) -> None:
        """The masters and the weights agree now: remember each weight's version."""
        self.versions = [p._version for p in self.params]

    def check_params(self) -> None:
        """Raise if a parameter or its gradient left the flat buffers; re-read the
        master (and reset the Kahan compensation) of a weight written from outside
        since the last step; re-attach gradients that were replaced
        (``model.zero_grad()`` sets them to None, and the next backward then makes a
        fresh tensor)."""
        for i, (p, g, ptr, grad_ptr) in enumerate(zip(self.params, self.grad_views, self.data_ptrs,
                                                      self.grad_ptrs)):
            if p.data_ptr() != ptr or g.data_ptr() != grad_ptr:
                raise RuntimeError(
                    f"a {self.dtype} parameter of shape {list(p.shape)} no longer lives in the "
                    "FP16Optimizer's flat buffer: the model was converted or moved (.half(), "
                    ".to()) after the optimizer was built. Convert and move the model first."
                )
            if p._version != self.versions[i]:
                self.versions[i] = p._version
                if self.has_master:
                    self.master_views[i].copy_(p)
                if self.comp is not None:
                    self.layout.views(self.comp)[i].zero_()
            if p.grad is g:
                continue
            if p.grad is None:
                g.zero_()
            else:
                g.copy_(p.grad)
            p.grad = g

    def master_from_weights(self) -> None:
        if self.half:
            flat.restore(self.master)
            self.master.copy_(self.weights)

    def release(self) -> None:
        """Free the fp32 buffers of a group without master weights."""
        if self.transient:
            flat.release(self.master)
            flat.release(self.master_grads)


class FP16Optimizer(torch.optim.Optimizer):
    """Mixed-precision wrapper around a ``torch.optim`` optimizer.

    Args:
        optimizer: any ``torch.optim.Optimizer`` built over the model's parameters
            (fp16, bf16 or fp32), after :func:`mpfp16.to_half` (or
            :func:`mpfp16.flatten_parameters`) and before or after wrapping the model
            in DDP. It stays reachable as ``.optimizer``.
        loss_scale: ``"dynamic"`` (a :class:`DynamicLossScaler`; for a model with no
            fp16 parameter, bf16 or fp32, it means no scaling), a float (a static
            scale), ``None`` (no scaling; non-finite gradients still skip the step),
            or a :class:`LossScaler` instance.
        master_weights: keep fp32 masters of the 16-bit parameters. ``False`` steps
            the 16-bit weights directly: the update is computed in fp32 inside
            ``step()`` and the new weight is rounded to the parameter's dtype, and no
            fp32 copy of the weights exists between steps.
        max_grad_norm: clip the global 2-norm of the unscaled fp32 gradients.
        model: if given, every parameter of ``optimizer`` must belong to it.
        track_grad_norm: compute ``last_grad_norm`` even when not clipping.
        process_group: under torch.distributed, the ranks that must agree on skipping
            a step (default: all). The overflow flag is max-reduced across them, so
            every rank skips together even when only one rank's gradients overflowed
            outside the data-parallel allreduce.
        reduce_overflow: set False when this rank steps alone while others run
            (a single-process baseline inside a distributed job); also an attribute.
        fused: run the step of an SGD, Adam or AdamW inner optimizer as one compiled
            kernel per flat buffer segment (mpfp16/fused.py), with no fp32 gradient
            buffer: bit-identical for SGD; for Adam the parameters differ in the last
            bits where torch's CPU sqrt is not correctly rounded.
            ``None`` (default): when supported and the model has at least 1M
            parameters (compiling takes seconds); ``True``: always (an error if the
            inner optimizer is not supported); ``False``: never. The kernels compile
            at the first step; if that fails on any rank, ``fused=True`` raises on
            every rank, and ``None`` puts every rank on the unfused step with one
            warning, so the ranks never take different paths.
        rounding: how a new weight is rounded to 16 bits without master weights:
            ``"nearest"`` (updates under half an ulp vanish), ``"stochastic"``
            (unbiased: up or down at random, in proportion to the distance; seeded by
            ``rounding_seed``, its generator state is in the state_dict) or
            ``"kahan"`` (a 16-bit compensation buffer carries each rounding's error
            into the next update; 2 more bytes per parameter). With master weights
            only ``"nearest"`` applies.

    Gradients live in persistent flat buffers, so ``zero_grad()`` zeroes them in place
    (one fill per buffer) whatever ``set_to_none`` says, and a parameter that got no
    gradient in a step is stepped with a zero gradient, as torch does after
    ``zero_grad(set_to_none=False)``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        loss_scale: str | float | LossScaler | None = "dynamic",
        master_weights: bool = True,
        max_grad_norm: float | None = None,
        *,
        model: torch.nn.Module | None = None,
        track_grad_norm: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduce_overflow: bool = True,
        fused: bool | None = None,
        rounding: str = "nearest",
        rounding_seed: int = 0,
    ) -> None:
        if isinstance(optimizer, FP16Optimizer):
            raise TypeError("the optimizer is already an FP16Optimizer; wrap the inner optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16Optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if rounding not in fused_mod.ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(fused_mod.ROUNDINGS)}, got {rounding!r}")
        if rounding != "nearest" and master_weights:
            raise ValueError(f"rounding={rounding!r} applies to 16-bit weights stepped directly: "
                             "pass master_weights=False")
        self.rounding = rounding
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.master_weights = bool(master_weights)
        self.max_grad_norm = max_grad_norm
        self.track_grad_norm = bool(track_grad_norm)
        self.process_group = process_group
        self.reduce_overflow = reduce_overflow
        self.skipped_steps = 0
        self.iteration = 0  # optimizer steps attempted, skipped ones included
        self._last_grad_norm: torch.Tensor | None = None
        self._init_hooks()

        params = self._trainable_params(model)
        reason = fused_mod.unsupported_reason(optimizer)
        if fused and reason:
            raise ValueError(f"fused=True is not possible: {reason}")
        self._groups = self._build_groups(params)
        self.scaler = self._make_scaler(loss_scale, params)
        numel = sum(g.layout.numel for g in self._groups)
        use_fused = fused if fused is not None else (reason is None and numel >= FUSED_MIN_NUMEL)
        self._fused = fused_mod.FusedUpdater(optimizer, self._groups, rounding) if use_fused else None
        self._fused_checked = False
        self._fused_requested = fused is True
        self._rounding_rng = torch.Generator(device=self._groups[0].device)
        self._rounding_rng.manual_seed(rounding_seed)

        # Replace each 16-bit parameter by its master in the inner optimizer.
        to_master = {id(p): m for g in self._groups for p, m in zip(g.params, g.master_views)}
        for group in optimizer.param_groups:
            group["params"] = [to_master.get(id(p), p) for p in group["params"]]
        self._model_params = params  # inner param order
        self._stepped = [to_master[id(p)] for p in params]
        self._shapes = [list(p.shape) for p in params]
        self._dtypes = [str(p.dtype).replace("torch.", "") for p in params]

        # Count backward passes that reach the parameters, to refuse a step with no
        # gradient and gradients that were not scaled by backward().
        self._backward_passes = 0
        self._scaled_passes = 0
        ref = weakref.ref(self)

        def on_backward(_grad):
            opt = ref()
            if opt is not None:
                opt._backward_passes += 1

        self._grad_hook = register_multi_grad_hook(params, on_backward, mode="any")

    # ----------------------------------------------------------------- construction

    def _init_hooks(self) -> None:
        # What torch.optim.Optimizer.__init__ sets up, minus the param_groups it owns:
        # here those belong to the inner optimizer.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    def _trainable_params(self, model: torch.nn.Module | None) -> list[torch.Tensor]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if getattr(self.optimizer, "state", None) and any(self.optimizer.state.values()):
            raise ValueError(
                "the optimizer already has state: wrap it before its first step, and load "
                "checkpoints through FP16Optimizer.load_state_dict"
            )
        if model is not None:
            owned = {id(p) for p in model.parameters()}
            foreign = [p for p in params if id(p) not in owned]
            if foreign:
                raise ValueError(
                    f"{len(foreign)} of the optimizer's parameters are not parameters of the "
                    f"model (the first has shape {list(foreign[0].shape)}): build the optimizer "
                    "over model.parameters()"
                )
        for i, p in enumerate(params):
            if getattr(p, "_mpfp16_master", False):
                raise ValueError("the optimizer holds the masters of another FP16Optimizer")
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(
                    f"parameter {i} (shape {list(p.shape)}) is {p.dtype}; FP16Optimizer "
                    "handles float16, bfloat16 and float32 parameters"
                )
            if not p.is_leaf:
                raise ValueError(f"parameter {i} (shape {list(p.shape)}) is not a leaf tensor")
        # Frozen parameters never get a gradient: the inner optimizer keeps them as they are.
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("the optimizer has no parameter that requires grad")
        return params

    def _build_groups(self, params: list[torch.Tensor]) -> list[_FlatGroup]:
        group_of = {id(p): gi for gi, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            by_key[(p.device, p.dtype)].append(p)
        return [_FlatGroup(ps, self.master_weights, group_of, kahan=self.rounding == "kahan")
                for ps in by_key.values()]

    @staticmethod
    def _make_scaler(loss_scale, params) -> LossScaler:
        if isinstance(loss_scale, LossScaler):
            return loss_scale
        if loss_scale is None:
            return LossScaler(1.0)
        if isinstance(loss_scale, str):
            if loss_scale != "dynamic":
                raise ValueError(f"loss_scale must be 'dynamic', a number, None or a LossScaler; got {loss_scale!r}")
            # Only fp16 needs scaling: bf16 and fp32 have fp32's exponent range.
            has_fp16 = any(p.dtype == torch.float16 for p in params)
            return DynamicLossScaler() if has_fp16 else LossScaler(1.0)
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            return LossScaler(float(loss_scale))
        raise TypeError(f"loss_scale must be 'dynamic', a number, None or a LossScaler; got {type(loss_scale).__name__}")

    # ------------------------------------------------------------ Optimizer surface

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param_groups (holding the masters), so that schedulers
        that change ``lr`` change what is stepped."""
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def model_params(self) -> list[torch.Tensor]:
        """The model's trainable parameters, in the inner optimizer's order (that of
        :meth:`master_params` and of the state_dict's indices)."""
        return list(self._model_params)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the inner optimizer steps, in its parameter order: the
        masters of the 16-bit parameters and the fp32 parameters themselves. Without
        master weights the masters of 16-bit parameters hold values only inside
        ``step()``."""
        return list(self._stepped)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def fused(self) -> bool:
        """Whether steps run the fused kernels (False after a fallback)."""
        return self._fused is not None

    @property
    def last_grad_norm(self) -> float | None:
        """Global 2-norm of the unscaled gradients of the last step that was not
        skipped, before clipping; None when neither clipping nor tracking."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "FP16Optimizer cannot add parameter groups after construction: build the inner "
            "optimizer with all of its groups, then wrap it"
        )

    def __repr__(self) -> str:
        return (
            f"FP16Optimizer(master_weights={self.master_weights}, scaler={self.scaler!r}, "
            f"max_grad_norm={self.max_grad_norm},\n  {self.optimizer!r})"
        )

    # ------------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Run ``(loss.float() * loss_scale).backward(**kwargs)``."""
        self._scaled_passes += 1
        scale = self.scaler.scale
        scaled_loss = loss.float() if scale == 1.0 else loss.float() * scale
        scaled_loss.backward(**kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient in place, one fill per flat buffer.

        ``set_to_none`` is accepted for compatibility; the gradients are views into
        persistent buffers and are zeroed rather than dropped.
        """
        for g in self._groups:
            g.grads.zero_()
        self._backward_passes = 0
        self._scaled_passes = 0

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Unscale, check, clip, step and copy back. Returns False if the step was skipped.

        Raises:
            LossScaleStuckError: the gradients kept overflowing at the lowest scale.
            RuntimeError: no backward pass reached the parameters since the last step,
                or the gradients were not produced by :meth:`backward` while the loss
                scale is not 1.
        """
        if closure is not None:
            raise ValueError("FP16Optimizer.step() takes no closure: call backward() then step()")
        self._check_ready()
        fused = self._fused is not None and self._fused_ready()
        stats = self._grad_stats() if fused else self._unscale_grads()
        if self.reduce_overflow and get_world_size() > 1:
            # After DDP's allreduce the gradients already agree; this one-float reduction
            # makes the decision agree whatever happened to them since.
            dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX, group=self.process_group)
        overflow = bool(stats[0].item())  # the one host synchronization of the step
        self.iteration += 1
        self._backward_passes = 0
        self._scaled_passes = 0
        if overflow:
            self._skip()
            return False
        if fused:
            self._fused.step(self._inv_scale(self._groups[0].device), self._clip_coef_from(stats[1]), self._noise())
        else:
            self._clip_grads()
            for g in self._groups:
                if g.transient:
                    g.master_from_weights()
            self.optimizer.step()
            self._copy_masters_to_model()
        self.scaler.update(False, step=self.iteration)
        return True

    # The fused path (mpfp16/fused.py): one compiled kernel per flat segment.

    def _fused_ready(self) -> bool:
        """Compile the kernels on scratch tensors before the first fused step touches
        real data, and make every rank take the same path.

        A compile can fail on one rank only (a node without a working compiler, a full
        disk), so the outcome is gathered across the process group. If any rank
        failed, ``fused=True`` raises on every rank, naming the ranks and the reason;
        the default (``fused=None``) moves every rank to the unfused step, with one
        warning. Errors other than compile errors are not caught."""
        if self._fused_checked:
            return True
        self._fused_checked = True
        error = None
        try:
            self._fused.warm_up()
        except fused_mod.COMPILE_ERRORS as exc:
            lines = str(exc).strip().splitlines()
            error = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        failures = self._gather_failures(error)
        if not failures:
            return True
        where = ", ".join(f"rank {rank}" for rank in failures)
        reason = next(iter(failures.values()))
        if self._fused_requested:
            raise FusedStepUnavailable(f"fused=True cannot be honoured: compiling the fused step failed on {where} "
                                       f"({reason})")
        if is_main_process():
            logger.warning("fused optimizer step unavailable: compiling failed on %s (%s); every rank uses the "
                           "unfused step", where, reason)
        self._fused = None
        return False

    def _gather_failures(self, error: str | None) -> dict[int, str]:
        """{rank: error} of the ranks whose compile failed, the same on every rank: one
        small all_gather, and the messages only when something failed."""
        if not (self.reduce_overflow and get_world_size() > 1):
            return {0: error} if error is not None else {}
        group = self.process_group
        flag = torch.tensor([error is not None], dtype=torch.int32, device=self._groups[0].device)
        flags = [torch.empty_like(flag) for _ in range(dist.get_world_size(group))]
        dist.all_gather(flags, flag, group=group)
        if not any(bool(f.item()) for f in flags):
            return {}
        errors = [None] * len(flags)
        dist.all_gather_object(errors, error, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(errors))
        return {rank: e for rank, e in zip(ranks, errors) if e is not None}

    def _noise(self) -> list[torch.Tensor | None]:
        """Uniform [0, 1) values for stochastic rounding, one per 16-bit weight, from the
        optimizer's own seeded generator (the same on every rank)."""
        return [torch.rand(g.layout.total, generator=self._rounding_rng, device=g.device)
                if self.rounding == "stochastic" and g.half else None for g in self._groups]

    def _inv_scale(self, device: torch.device) -> torch.Tensor:
        # As GradScaler: the reciprocal in double, then rounded to fp32.
        return torch.full((), 1.0 / self.scaler.scale, dtype=torch.float32, device=device)

    def _grad_stats(self) -> torch.Tensor:
        """Phase 1, fused: [any inf/NaN, sum of squares of the unscaled gradients],
        read straight from the 16-bit gradient buffers."""
        device = self._groups[0].device
        inv = self._inv_scale(device)
        with_norm = self.max_grad_norm is not None or self.track_grad_norm
        kernel = fused_mod.compiled(fused_mod.grad_stats, with_norm=with_norm)
        total = torch.zeros(2, dtype=torch.float32, device=device)
        for g in self._groups:
            total += kernel(g.grads, inv.to(g.device)).to(device)
        return total

    def _clip_coef_from(self, sumsq: torch.Tensor) -> torch.Tensor:
        """The clip coefficient as clip_grad_norm_ computes it, from the flat sum of
        squares. The norm can differ from clip_grad_norm_'s (per-tensor norms, then their
        norm) in its last bits, so clipped steps match the unfused path to fp32
        rounding, not bit for bit; unclipped steps multiply by exactly 1."""
        if self.max_grad_norm is None and not self.track_grad_norm:
            self._last_grad_norm = None
            return torch.ones((), dtype=torch.float32, device=sumsq.device)
        self._last_grad_norm = sumsq.sqrt()
        if self.max_grad_norm is None:
            return torch.ones((), dtype=torch.float32, device=sumsq.device)
        return torch.clamp(self.max_grad_norm / (self._last_grad_norm + 1e-6), max=1.0)

    # The unfused path: the inner optimizer steps per-tensor master views.

    def _check_ready(self) -> None:
        for g in self._groups:
            g.check_params()
        if self._backward_passes == 0:
            raise RuntimeError(
                "step() was called but no backward pass reached the parameters since the "
                "last step(): call opt.backward(loss) first"
            )
        if self.scaler.scale != 1.0 and self._backward_passes > self._scaled_passes:
            raise RuntimeError(
                f"gradients were computed outside opt.backward() while the loss scale is "
                f"{self.scaler.scale:g}; they would be unscaled wrongly. Call opt.backward(loss)"
            )

    def _unscale_grads(self) -> torch.Tensor:
        """Phase 1, unfused: fp32 master gradients = 16-bit gradients / scale, and
        whether any value is inf/NaN. Returns [flag] as a float tensor (1.0 = found)."""
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for g in self._groups:
            if g.half:
                g.prepare_master_grads()
                g.master_grads.copy_(g.grads)
            by_device[g.device].append(g.master_grads)
        found = []
        for device, grads in by_device.items():
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self._inv_scale(device).view(1))
            found.append(found_inf)
        first = found[0]
        for other in found[1:]:
            first += other.to(first.device)
        return first

    def _skip(self) -> None:
        """Phase 2: an inf/NaN gradient. Nothing is stepped; the scale backs off."""
        self.skipped_steps += 1
        self._last_grad_norm = None
        self.zero_grad()
        for g in self._groups:
            g.release()
        old_scale = self.scaler.scale
        self.scaler.update(True, step=self.iteration)
        if is_main_process():
            logger.info(
                "step %d skipped: inf/NaN in the gradients; loss scale %g -> %g (%d skipped so far)",
                self.iteration, old_scale, self.scaler.scale, self.skipped_steps,
            )

    def _clip_grads(self) -> None:
        """Phase 3: the global norm of the unscaled fp32 gradients, computed as
        ``torch.nn.utils.clip_grad_norm_`` does (per-tensor norms, then their norm),
        so that the result matches it bit for bit. No host synchronization."""
        if self.max_grad_norm is None and not self.track_grad_norm:
            self._last_grad_norm = None
            return
        grads = [p.grad for p in self._stepped]
        self._last_grad_norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self._stepped, self.max_grad_norm, self._last_grad_norm)

    def _copy_masters_to_model(self) -> None:
        """Phase 5: round the fp32 masters into the 16-bit model, one copy per buffer
        (without master weights, with the chosen rounding)."""
        for g, noise in zip(self._groups, self._noise()):
            if not g.half:
                continue
            if g.transient:
                fused_mod.write_weights(g.weights, g.master, g.weights.float(), noise, g.comp, self.rounding)
            else:
                g.weights.copy_(g.master)
            g.release()

    # ------------------------------------------------------------------ memory

    def memory_bytes_per_param(self) -> dict[str, float]:
        """Bytes held between steps per trainable parameter, by kind of buffer.

        Keys: ``model_weights``, ``model_grads``, ``master_weights``,
        ``master_grads``, ``optimizer_state``, ``compensation`` (Kahan rounding) and
        ``total``. Measured from the
        storages actually allocated (flat-buffer alignment gaps included), so for a
        large model fp16 with masters and SGD-momentum reads 2 + 2 + 4 + 4 + 4 = 16
        with ``fused=False`` (2 + 2 + 4 + 0 + 4 = 12 fused: no fp32 gradients), and
        without masters 2 + 2 + 0 + 0 + 4 = 8.
        """
        numel = sum(g.layout.numel for g in self._groups)

        def nbytes(tensors) -> int:
            seen, total = set(), 0
            for t in tensors:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        halves = [g for g in self._groups if g.half]
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        report = {
            "model_weights": nbytes(g.weights for g in self._groups) / numel,
            "model_grads": nbytes(g.grads for g in self._groups) / numel,
            "master_weights": nbytes(g.master for g in halves) / numel,
            "master_grads": nbytes(g.master_grads for g in halves) / numel,
            "optimizer_state": nbytes(state) / numel,
            "compensation": nbytes(g.comp for g in halves if g.comp is not None) / numel,
        }
        report["total"] = sum(report.values())
        return report

    # ------------------------------------------------------------------ state

    def _is_master(self, t: torch.Tensor) -> bool:
        return self.master_weights and getattr(t, "_mpfp16_master", False)

    def state_dict(self) -> dict:
        """Masters, inner optimizer state and scaler state, all plain containers of
        tensors and numbers: ``torch.load(path, weights_only=True)`` reads it."""
        masters = [m if self._is_master(m) else None for m in self._stepped]
        return {
            "format": _STATE_FORMAT,
            "optimizer": self.optimizer.state_dict(),
            "master_params": masters,
            "param_shapes": self._shapes,
            "param_dtypes": self._dtypes,
            "scaler": self.scaler.state_dict(),
            "scaler_type": type(self.scaler).__name__,
            "skipped_steps": self.skipped_steps,
            "iteration": self.iteration,
            "rounding": self.rounding,
            "rounding_rng": self._rounding_rng.get_state(),
            "kahan_compensation": [g.comp for g in self._groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned. Load the model's state first: without
        saved masters (a checkpoint taken with ``master_weights=False``) the masters are
        rebuilt from the model's weights. With saved masters the model's 16-bit weights
        are set from them, so the two always agree."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _STATE_FORMAT:
            raise ValueError("not an FP16Optimizer state_dict (no 'format': 'mpfp16.FP16Optimizer/1' entry)")
        shapes = [list(s) for s in state_dict["param_shapes"]]
        if len(shapes) != len(self._shapes):
            raise ValueError(
                f"optimizer state_dict is for {len(shapes)} parameters, this optimizer has {len(self._shapes)}"
            )
        for i, (saved, mine) in enumerate(zip(shapes, self._shapes)):
            if saved != mine:
                raise ValueError(
                    f"optimizer state_dict does not match the model: parameter {i} has shape "
                    f"{saved} in the state_dict and {mine} here"
                )
        saved_scaler = state_dict["scaler_type"]
        if saved_scaler != type(self.scaler).__name__:
            raise ValueError(
                f"the state_dict holds a {saved_scaler} state but this optimizer uses a "
                f"{type(self.scaler).__name__}: use the same loss_scale setting"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self._fused is not None:
            self._fused.invalidate()
        self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.iteration = int(state_dict["iteration"])
        if "rounding_rng" in state_dict:
            self._rounding_rng.set_state(state_dict["rounding_rng"].cpu())
        for g, comp in zip(self._groups, state_dict.get("kahan_compensation", [])):
            if g.comp is not None and comp is not None and comp.shape == g.comp.shape:
                g.comp.copy_(comp)
        saved_masters = state_dict["master_params"]
        position = {id(m): i for i, m in enumerate(self._stepped)}
        with torch.no_grad():
            for g in self._groups:
                if not (g.half and self.master_weights):
                    continue
                for p, m in zip(g.params, g.master_views):
                    saved = saved_masters[position[id(m)]]
                    m.copy_(p if saved is None else saved)
                g.weights.copy_(g.master)
            for g in self._groups:  # the model was loaded first: its weights are not stale
                g.mark_synced()
