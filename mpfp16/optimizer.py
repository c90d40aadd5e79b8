"""FP16Optimizer: fp32 master weights, loss scaling and one clean optimizer step.

The wrapper takes any ``torch.optim`` optimizer built over a 16-bit model's
parameters. The parameters live in flat buffers, one per (device, dtype): those that
:func:`mpfp16.to_half` made (adopted as they are, so the wrapper may be built before
or after DDP), or, for parameters that are not in one, buffers it makes (mpfp16/flat.py
refuses to move parameters that DDP already holds). Their gradients are views of a
flat buffer of the same layout, and the fp32 masters of the 16-bit parameters live in
one too (mpfp16/groups.py); the masters replace the model's parameters in the inner
optimizer's ``param_groups``. fp32 parameters (normalization layers) are stepped
directly.

:meth:`FP16Optimizer.step` runs the project's step, in this order, each phase a
method below:

1. check ready: a backward pass reached the parameters, through ``backward()``;
2. unscale and find inf: fp32 gradients = 16-bit gradients / scale, and whether any
   is inf/NaN (done already if the user called ``unscale_()``);
3. agree across ranks: the flag is max-reduced, then read: the step's one host sync;
4. skip (scale backs off, nothing changes) or clip (the global norm);
5. update: the inner optimizer's arithmetic on the fp32 masters;
6. copy back: the new 16-bit weights;
7. update the scale.

Phases 2, 5 and 6 run on one of two interchangeable backends (mpfp16/backends/): the
unfused one (the inner optimizer's own ``step()``), or, for SGD, Adam and AdamW, the
fused one (one compiled kernel per flat segment that does 5 and 6 in one pass, and
reads the 16-bit gradients directly in 2).
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook

from . import flat
from .backends import fused as fused_backend
from .backends.unfused import UnfusedBackend
from .convert import HALF_DTYPES
from .distributed import get_world_size, is_main_process
from .errors import FusedStepUnavailable, one_line
from .groups import FlatGroup, is_master
from .rounding import ROUNDINGS
from .scaler import DynamicLossScaler, LossScaler

__all__ = ["FP16Optimizer"]

logger = logging.getLogger("mpfp16")

_SUPPORTED_DTYPES = HALF_DTYPES + (torch.float32,)
FUSED_MIN_NUMEL = 1 << 20  # below this, fused=None keeps the unfused step (no compile time)
_STATE_FORMAT = "mpfp16.FP16Optimizer/1"


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _holds_sharded(optimizer) -> bool:
    from .sharding import is_sharded

    params = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
    return any(is_sharded(p) for p in params)


class FP16Optimizer(torch.optim.Optimizer):
    """Mixed-precision wrapper around a ``torch.optim`` optimizer.

    The step in the order users write it::

        opt.zero_grad()
        opt.backward(loss)                  # (loss.float() * loss_scale).backward()
        opt.unscale_()                      # optional: unscaled fp32 grads in opt.master_params()
        torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)
        opt.step()                          # False when skipped (inf/NaN gradients)

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
            kernel per flat buffer segment (mpfp16/backends/fused.py), with no fp32 gradient
            buffer: bit-identical for SGD; for Adam the parameters differ in the last
            bits where torch's CPU sqrt is not correctly rounded.
            ``None`` (default): when supported and either the model has at least 1M
            parameters (compiling takes seconds) or the inner optimizer was built
            with ``fused=True`` or ``foreach=True`` (asking for the fast step; where
            it cannot be taken, one log line says why, and the inner optimizer's own
            step runs over the masters); ``True``: always (an error if the inner
            optimizer is not supported); ``False``: never. The kernels compile
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

    def __new__(cls, optimizer=None, *args, **kwargs):
        # A model sharded by mpfp16.distributed.shard() gets the sharded step (mpfp16/sharded_optimizer.py).
        if cls is FP16Optimizer and _holds_sharded(optimizer):
            from .sharded_optimizer import ShardedFP16Optimizer

            cls = ShardedFP16Optimizer
        return super().__new__(cls)

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
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
        if rounding != "nearest" and master_weights:
            raise ValueError(f"rounding={rounding!r} applies to 16-bit weights stepped directly: "
                             "pass master_weights=False")
        self.optimizer = optimizer
        self.rounding = rounding
        self.master_weights = bool(master_weights)
        self.max_grad_norm = max_grad_norm
        self.track_grad_norm = bool(track_grad_norm)
        self.process_group = process_group
        self.reduce_overflow = reduce_overflow
        self.skipped_steps = 0
        self.iteration = 0  # optimizer steps attempted, skipped ones included
        self._last_grad_norm: torch.Tensor | None = None

        params = self._trainable_params(model)
        reason = fused_backend.unsupported_reason(optimizer)
        if fused and reason:
            raise ValueError(f"fused=True is not possible: {reason}")
        self._groups = self._build_groups(params)
        self.scaler = self._make_scaler(loss_scale, params)
        self._rounding_rng = torch.Generator(device=self._groups[0].device)
        self._rounding_rng.manual_seed(rounding_seed)

        # Replace each 16-bit parameter by its master in the inner optimizer.
        to_master = {id(p): m for g in self._groups for p, m in zip(g.params, g.master_views)}
        for group in optimizer.param_groups:  # in place: LBFGS keeps a reference to its group's list
            group["params"][:] = [to_master.get(id(p), p) for p in group["params"]]
        self._model_params = params  # inner param order
        self._stepped = [to_master[id(p)] for p in params]
        self._shapes = [list(p.shape) for p in params]
        self._dtypes = [str(p.dtype).replace("torch.", "") for p in params]

        numel = sum(g.layout.numel for g in self._groups)
        asked = fused_backend.fast_path_flag(optimizer)  # the inner optimizer's fused=True / foreach=True
        use_fused = fused if fused is not None else (reason is None and (numel >= FUSED_MIN_NUMEL or asked is not None))
        if asked and not use_fused and is_main_process():
            self._explain_no_fused_step(asked, reason)
        backend = fused_backend.FusedBackend if use_fused else UnfusedBackend
        self._backend = backend(optimizer, self._groups, self._stepped, rounding)
        self._fused_requested = fused is True
        self._prepared = False  # the backend's prepare() ran

        # torch.optim.Optimizer's own set-up (hooks, the step patch schedulers rely on),
        # over the inner optimizer's groups; then share its param_groups and state, so
        # that a scheduler that changes lr changes what is stepped.
        self._constructing = True
        # The base gets copies of the group dicts, so that the inner groups' own params lists stay.
        super().__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self._constructing = False
        self._share_inner_state()

        # The misuse guard: which backward passes reached the parameters, and whether
        # they ran inside backward(). A flag, not a count: nested graph tasks
        # (reentrant activation checkpointing) fire the hook more than once per pass.
        self._in_backward = False
        self._grads_arrived = False
        self._grads_outside_backward = False
        self._grads_after_unscale = False
        self._unscaled: torch.Tensor | None = None  # found_inf, once unscale_() ran in this step
        self._backward_scale: float | None = None
        ref = weakref.ref(self)

        def on_backward(_grad):
            opt = ref()
            if opt is not None:
                opt._grads_arrived = True
                opt._grads_outside_backward |= not opt._in_backward
                opt._grads_after_unscale |= opt._unscaled is not None

        self._grad_hook = register_multi_grad_hook(params, on_backward, mode="any")

    def _share_inner_state(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    # ----------------------------------------------------------------- construction

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
            if is_master(p):
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

    def _build_groups(self, params: list[torch.Tensor]) -> list[FlatGroup]:
        group_of = {id(p): gi for gi, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        return [FlatGroup(ps, self.master_weights, group_of, kahan=self.rounding == "kahan")
                for ps in flat.trainable_by_key(params).values()]

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

    def model_params(self) -> list[torch.Tensor]:
        """The model's trainable parameters, in the inner optimizer's order (that of
        :meth:`master_params` and of the state_dict's indices)."""
        return list(self._model_params)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the inner optimizer steps, in its parameter order: the
        masters of the 16-bit parameters and the fp32 parameters themselves. After
        :meth:`unscale_` their ``.grad`` holds the unscaled fp32 gradients. Without
        master weights the masters of 16-bit parameters hold values only inside
        ``step()``; their gradients are there after ``unscale_()``."""
        return list(self._stepped)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def fused(self) -> bool:
        """Whether steps run the fused kernels (False after a fallback)."""
        return self._backend.name == "fused"

    @property
    def last_grad_norm(self) -> float | None:
        """Global 2-norm of the unscaled gradients of the last step, before clipping;
        None when neither clipping nor tracking, and after a skipped step."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    def add_param_group(self, param_group: dict) -> None:
        if self._constructing:  # torch.optim.Optimizer.__init__ registers the inner groups
            return super().add_param_group(param_group)
        raise NotImplementedError(
            "FP16Optimizer cannot add parameter groups after construction: build the inner "
            "optimizer with all of its groups, then wrap it"
        )

    def __repr__(self) -> str:
        return (
            f"FP16Optimizer(master_weights={self.master_weights}, scaler={self.scaler!r}, "
            f"max_grad_norm={self.max_grad_norm}, backend={self._backend.name},\n  {self.optimizer!r})"
        )

    # ------------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Run ``(loss.float() * loss_scale).backward(**kwargs)``."""
        scale = self.scaler.scale
        scaled_loss = loss.float() if scale == 1.0 else loss.float() * scale
        self._backward_scale = scale  # what the gradients are unscaled by, should the scale change before
        self._in_backward = True
        try:
            scaled_loss.backward(**kwargs)
        finally:
            self._in_backward = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient in place, one fill per flat buffer, and start a new step.

        ``set_to_none`` is accepted for compatibility; the gradients are views into
        persistent buffers and are zeroed rather than dropped.
        """
        for g in self._groups:
            g.grads.zero_()
        self._new_step()

    def _new_step(self) -> None:
        self._grads_arrived = self._grads_outside_backward = self._grads_after_unscale = False
        self._unscaled = None
        self._backward_scale = None

    @property
    def _grads_scale(self) -> float:
        """The scale the current gradients were computed with: that of the last
        backward() (a wrapper such as mpfp16.compat.apex may change the scale between
        backward and step, as apex does), or the scale now."""
        return self._backward_scale if self._backward_scale is not None else self.scaler.scale

    @torch.no_grad()
    def unscale_(self) -> None:
        """Unscale now, so that the gradients can be read or clipped before ``step()``.

        Afterwards ``opt.master_params()`` hold the unscaled fp32 gradients in their
        ``.grad``: ``torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)`` (or any
        clipping of your own) works, and ``step()`` does not unscale again. Calling it
        twice in a step does nothing the second time, as ``GradScaler.unscale_`` is
        meant to be called once. With the fused backend it writes the fp32 gradients
        the fused step otherwise never materializes (4 bytes per parameter more).

        Raises:
            RuntimeError: a backward pass ran since the last ``unscale_()`` of this
                step (fp32 gradients are unscaled in place, so they cannot be
                unscaled again; so does ``step()`` then).
        """
        if self._unscaled is not None:
            self._refuse_grads_after_unscale()
            return
        self._check_ready()
        self._prepare_backend(fp32_grads=True)
        self._unscaled = self._backend.unscale(self._grads_scale, materialize=True, with_norm=False)
        self._grads_after_unscale = False

    def _refuse_grads_after_unscale(self) -> None:
        if self._grads_after_unscale:
            raise RuntimeError("a backward pass ran after unscale_() in this step, so the gradients are no longer "
                               "unscaled: call unscale_() after the last backward, just before step()")

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        """The copy-back phase alone: round the fp32 masters into the 16-bit model now.
        ``step()`` does it; code that steps the inner optimizer itself (a closure-driven
        LBFGS, mpfp16.compat.apex) calls this between its steps. Without master weights
        there is nothing to copy."""
        for g in self._groups:
            if g.has_master:
                g.weights.copy_(g.master)

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """The step, phase by phase (module docstring). Returns False if it was skipped.

        Raises:
            LossScaleStuckError: the gradients kept overflowing at the lowest scale.
            RuntimeError: no backward pass reached the parameters since the last step,
                the gradients were not produced by :meth:`backward` while the loss
                scale is not 1, or a gradient arrived after :meth:`unscale_`.
        """
        if closure is not None:
            raise ValueError("FP16Optimizer.step() takes no closure: call backward() then step()")
        found_inf = self._unscaled
        if found_inf is None:
            self._check_ready()
            self._prepare_backend(fp32_grads=False)
            found_inf = self._backend.unscale(self._grads_scale, materialize=False, with_norm=self._wants_norm)
        else:
            self._refuse_grads_after_unscale()
        overflow = self._agree_on_overflow(found_inf)
        self.iteration += 1
        self._new_step()
        if overflow:
            self._skip()
            return False
        clip_coef = self._clip()
        noise = self._noise()
        self._backend.update(clip_coef, noise)
        self._backend.copy_back(noise)
        self.scaler.update(False, step=self.iteration)
        return True

    # Phase 1: check ready.

    def _check_ready(self) -> None:
        for g in self._groups:
            g.check_params()
        if not self._grads_arrived:
            raise RuntimeError(
                "step() was called but no backward pass reached the parameters since the "
                "last step(): call opt.backward(loss) first"
            )
        if self.scaler.scale != 1.0 and self._grads_outside_backward:
            raise RuntimeError(
                f"gradients were computed outside opt.backward() while the loss scale is "
                f"{self.scaler.scale:g}; they would be unscaled wrongly. Call opt.backward(loss)"
            )

    def _explain_no_fused_step(self, asked: str, reason: str | None) -> None:
        """One line for an inner optimizer built with fused=True or foreach=True whose
        step is not mpfp16's fused one: its own step then runs over the fp32 masters."""
        name = type(self.optimizer).__name__
        if reason is None:  # FP16Optimizer(fused=False)
            logger.info("%s(%s) under FP16Optimizer(fused=False): torch's own %s step runs over the fp32 "
                        "masters, not mpfp16's fused step", name, asked, asked.split("=")[0])
        else:
            logger.warning("%s(%s): mpfp16's fused step cannot take it (%s); torch's own %s step runs over the "
                           "fp32 masters", name, asked, reason, asked.split("=")[0])

    def _prepare_backend(self, fp32_grads: bool) -> None:
        """Before the first step: let the backend compile what it needs, and make every
        rank take the same path. The fp32-gradient kernels of ``unscale_()`` are made
        here if the first step calls it, otherwise at their first use.

        A compile can fail on one rank only (a node without a working compiler, a full
        disk), so the outcome is gathered across the process group. If any rank
        failed, ``fused=True`` raises on every rank, naming the ranks and the reason;
        the default (``fused=None``) moves every rank to the unfused backend, with one
        warning. Errors other than compile errors are not caught."""
        if self._prepared:
            return
        self._prepared = True
        if self._backend.name != "fused":
            return
        from .backends.kernels import COMPILE_ERRORS

        error = None
        try:
            self._backend.prepare(fp32_grads=fp32_grads)
        except COMPILE_ERRORS as exc:
            error = f"{type(exc).__name__}: {one_line(exc)}"
        failures = self._gather_failures(error)
        if not failures:
            return
        where = ", ".join(f"rank {rank}" for rank in failures)
        reason = next(iter(failures.values()))
        if self._fused_requested:
            raise FusedStepUnavailable(f"fused=True cannot be honoured: compiling the fused step failed on {where} "
                                       f"({reason})")
        if is_main_process():
            logger.warning("fused optimizer step unavailable: compiling failed on %s (%s); every rank uses the "
                           "unfused step", where, reason)
        self._backend = UnfusedBackend(self.optimizer, self._groups, self._stepped, self.rounding)

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

    # Phase 2 is the backend's unscale(); phase 3: agree across ranks.

    @property
    def _wants_norm(self) -> bool:
        return self.max_grad_norm is not None or self.track_grad_norm

    def _agree_on_overflow(self, found_inf: torch.Tensor) -> bool:
        """Max-reduce the inf/NaN flag over the process group and read it: the step's
        one host synchronization. After DDP's allreduce the gradients already agree;
        this makes the decision agree whatever happened to them since."""
        if self.reduce_overflow and get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(found_inf[0].item())

    # Phase 4: skip, or clip.

    def _skip(self) -> None:
        """An inf/NaN gradient. Nothing is stepped; the scale backs off."""
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

    def _clip(self) -> torch.Tensor | None:
        """The factor the gradients are multiplied by, as ``clip_grad_norm_`` computes
        it from the global norm of the unscaled gradients (None: no clipping). No host
        synchronization."""
        if not self._wants_norm:
            self._last_grad_norm = None
            return None
        self._last_grad_norm = self._backend.grad_norm()
        if self.max_grad_norm is None:
            return None
        return torch.clamp(self.max_grad_norm / (self._last_grad_norm + 1e-6), max=1.0)

    def _noise(self) -> list[torch.Tensor | None]:
        """Uniform [0, 1) values for stochastic rounding, one per 16-bit weight, from the
        optimizer's own seeded generator (the same on every rank)."""
        return [torch.rand(g.layout.total, generator=self._rounding_rng, device=g.device)
                if self.rounding == "stochastic" and g.half else None for g in self._groups]

    # Phases 5 and 6 are the backend's update() and copy_back(); 7 is the scaler's.

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
        nbytes = storage_bytes
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

    def state_dict(self) -> dict:
        """Masters, inner optimizer state and scaler state, all plain containers of
        tensors and numbers: ``torch.load(path, weights_only=True)`` reads it."""
        persistent = {id(m) for g in self._groups if g.has_master for m in g.master_views}
        return {
            "format": _STATE_FORMAT,
            "optimizer": self.optimizer.state_dict(),
            "master_weights": self.master_weights,
            "master_params": [m if id(m) in persistent else None for m in self._stepped],
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

    def _check_state_dict(self, state_dict: dict) -> None:
        """Raise one line where ``state_dict`` was made by an optimizer of another
        shape: other parameters, dtypes, masters, rounding or scaler."""
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
        for i, (saved, mine) in enumerate(zip(state_dict.get("param_dtypes", self._dtypes), self._dtypes)):
            if saved != mine:
                raise ValueError(f"optimizer state_dict does not match the model: parameter {i} is {saved} in the "
                                 f"state_dict and {mine} here")
        saved_masters = state_dict.get("master_weights")
        if saved_masters is None:  # written before the flag was saved: masters of 16-bit parameters tell
            saved_masters = any(m is not None for m, dtype in zip(state_dict["master_params"], self._dtypes)
                                if dtype != "float32")
        if any(g.half for g in self._groups) and bool(saved_masters) != self.master_weights:
            raise ValueError(f"the state_dict was saved with master_weights={bool(saved_masters)} and this "
                             f"optimizer has master_weights={self.master_weights}")
        if state_dict.get("rounding", "nearest") != self.rounding:
            raise ValueError(f"the state_dict was saved with rounding={state_dict.get('rounding', 'nearest')!r} "
                             f"and this optimizer uses rounding={self.rounding!r}")
        saved_comp = state_dict.get("kahan_compensation", [None] * len(self._groups))
        for i, (g, comp) in enumerate(zip(self._groups, saved_comp)):
            if g.comp is not None and (comp is None or comp.shape != g.comp.shape):
                found = "none" if comp is None else f"{comp.numel()} elements"
                raise ValueError(f"Kahan compensation buffer {i} has {found} in the state_dict and "
                                 f"{g.comp.numel()} here")
        saved_scaler = state_dict["scaler_type"]
        if saved_scaler != type(self.scaler).__name__:
            raise ValueError(
                f"the state_dict holds a {saved_scaler} state but this optimizer uses a "
                f"{type(self.scaler).__name__}: use the same loss_scale setting"
            )

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned. Load the model's state first: without
        saved masters (a checkpoint taken with ``master_weights=False``) the masters are
        rebuilt from the model's weights. With saved masters the model's 16-bit weights
        are set from them, so the two always agree.

        Raises:
            ValueError: one line, before anything is changed, when the state_dict
                does not fit this optimizer.
        """
        self._check_state_dict(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._share_inner_state()  # the inner optimizer made new param_groups and state
        self._backend.invalidate()
        self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.iteration = int(state_dict["iteration"])
        if "rounding_rng" in state_dict:
            self._rounding_rng.set_state(state_dict["rounding_rng"].cpu())
        saved_masters = state_dict["master_params"]
        position = {id(m): i for i, m in enumerate(self._stepped)}
        with torch.no_grad():
            for g, comp in zip(self._groups, state_dict.get("kahan_compensation", [])):
                if g.comp is not None:
                    g.comp.copy_(comp)
            for g in self._groups:
                if not g.has_master:
                    continue
                for p, m in zip(g.params, g.master_views):
                    saved = saved_masters[position[id(m)]]
                    m.copy_(p if saved is None else saved)
                g.weights.copy_(g.master)
            for g in self._groups:  # the model was loaded first: its weights are not stale
                g.mark_synced()
