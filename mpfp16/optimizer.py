"""FP16Optimizer: fp32 master weights, loss scaling and one clean optimizer step.

The wrapper takes any ``torch.optim`` optimizer built over a 16-bit model's
parameters. Where the parameters live is a *store* (mpfp16/stores/), chosen from the
parameters and made ready by :func:`mpfp16.stores.build_store`: flat buffers (those
:func:`mpfp16.to_half` made, adopted as they are, so the wrapper may be built before or
after DDP), fused or not; per-tensor, for 16-bit parameters that can no longer move (a
``.half()`` model already held by DDP); or FSDP2's shards, for a model made by
:func:`mpfp16.distributed.shard`. The masters replace the model's parameters in the
inner optimizer's ``param_groups``; fp32 parameters (normalization layers) are stepped
directly. This class conducts; each other job has a module of its own: the options
(mpfp16/options.py), the step's state and the order of calls (mpfp16/step_state.py),
overflow reports (mpfp16/overflow.py), the state_dict's form (mpfp16/state_format.py).

:meth:`FP16Optimizer.step` is written once, as two public phases, as Megatron-LM's
mixed-precision optimizer is:

:meth:`~FP16Optimizer.prepare_grads` (returns whether the gradients are finite)
    1. check ready: a backward pass reached the parameters, through ``backward()``;
    2. unscale and find inf: fp32 gradients = 16-bit gradients / scale, and whether
       any is inf/NaN (done already if the user called ``unscale_()``);
    3. agree across ranks: the flag is max-reduced, then read: the step's one host
       sync; an overflow names its parameters in :attr:`~FP16Optimizer.last_overflow`;

then :meth:`~FP16Optimizer.skip_step` (the scale backs off, nothing changes), or
:meth:`~FP16Optimizer.step_with_ready_grads`:
    4. clip (the global norm);
    5. update: the inner optimizer's arithmetic on the fp32 masters;
    6. copy back: the new 16-bit weights;
    7. update the scale.

The step in the order users write it::

    opt.zero_grad()
    opt.backward(loss)                  # (loss.float() * loss_scale).backward()
    opt.unscale_()                      # optional: unscaled fp32 grads in opt.master_params()
    torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)
    opt.step()                          # False when skipped (inf/NaN gradients)

The flat store runs phases 2, 5 and 6 unfused (the inner optimizer's own ``step()``)
or, for SGD, Adam and AdamW, fused (one kernel per flat segment that does 5 and 6 in
one pass, and reads the 16-bit gradients directly in 2).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .options import check_options, constructor_state, held_params, make_scaler, master_mode, state_dtypes_of
from .overflow import OVERFLOW_REPORTED, describe_overflow, gather_report, with_culprits
from .parallel import accumulation
from .parallel.ranks import any_rank, get_world_size, is_main_process
from .scaler import LossScaler, LossScaleStuckError, loss_gradient_dtype, largest_scale
from .errors import dtype_name
from .state_format import (STATE_FORMAT, check_state_dict, keyed_by_index, keyed_by_parameter, state_dtypes_changed,
                           upgrade_state_dict)
from .step_state import Phase, StepGuard, check_groups, check_inner_hooks, group_params
from .stores import ParamStore, StoreOptions, build_store, store_type

__all__ = ["FP16Optimizer"]

logger = logging.getLogger("mpfp16")

# Below it any 16-bit loss's own gradient fits, and backward need not read the loss's dtype.
_FP16_LARGEST_SCALE = largest_scale(torch.float16)


class FP16Optimizer(torch.optim.Optimizer):
    """Mixed-precision wrapper around a ``torch.optim`` optimizer (the step in the
    order users write it: the module docstring).

    Args:
        optimizer: any ``torch.optim.Optimizer`` built over the model's parameters
            (fp16, bf16 or fp32), after :func:`mpfp16.to_half` (or
            :func:`mpfp16.flatten_parameters`) and before or after wrapping the model
            in DDP; or over a model sharded by :func:`mpfp16.distributed.shard`. It
            stays reachable as ``.optimizer``.
        loss_scale: ``"dynamic"`` (a :class:`DynamicLossScaler`; for a model that
            computes in no fp16, bf16 or fp32, it means no scaling), a float (a static
            scale), ``None`` (no scaling; non-finite gradients still skip the step),
            or a :class:`LossScaler` instance.
        master_weights: keep fp32 masters of the 16-bit parameters. ``False`` steps
            the 16-bit weights directly: the update is computed in fp32 inside
            ``step()`` and rounded to the parameter's dtype (``rounding``).
            ``"remainder"`` (bf16 only): the fp32 masters kept exactly, as the bf16
            weights and an int16 remainder each, 2 bytes where an fp32 master takes 4
            (docs/REMAINDER.md); ``master_weights`` is then True and ``master_mode``
            ``"remainder"`` (else ``"fp32"`` or ``"none"``).
        max_grad_norm: clip the global 2-norm of the unscaled fp32 gradients.
        model: if given, every parameter of ``optimizer`` must belong to it, and the
            state_dict names them. Required for a sharded model.
        track_grad_norm: compute ``last_grad_norm`` even when not clipping.
        process_group: under torch.distributed, the ranks that must agree on skipping
            a step (default: all): the overflow flag is max-reduced over them. A
            sharded model reduces it over the group it is sharded over.
        reduce_overflow: set False when this rank steps alone while others run (a
            single-process baseline inside a distributed job). Refused when sharded.
        fused: run the step of an SGD, Adam or AdamW inner optimizer as one kernel
            per flat buffer segment (mpfp16/stores/fused.py), with no fp32 gradient
            buffer. ``None`` (default): when supported and either the model has at
            least 1M parameters or the inner optimizer was built with ``fused=True``
            or ``foreach=True`` (one log line says why where it cannot be taken);
            ``True``: always, or an error; ``False``: never. A compile that fails on
            any rank makes ``fused=True`` raise on every rank, and ``None`` put every
            rank on the unfused step with one warning (docs/API.md, the fused step).
        rounding: without master weights, how a new weight is rounded to 16 bits:
            ``"nearest"``, ``"stochastic"`` (unbiased; seeded by ``rounding_seed``,
            its generator's state in the state_dict) or ``"kahan"`` (a 16-bit
            compensation carries each rounding's error on; 2 bytes per parameter).
        accumulate_dtype: how the gradients of a step's micro-batches are summed:
            ``None`` (default) in the model's 16-bit ``.grad``, as apex does;
            ``torch.float32``: each :meth:`backward` adds the 16-bit gradients into
            fp32 buffers and zeroes them, and the step unscales the fp32 sum (4 bytes
            per 16-bit parameter). Under :func:`mpfp16.distributed.wrap` the step's one
            exchange carries the sum; a step whose sum no exchange carried while this
            rank steps with others (a stock DDP) raises, and so do gradients computed
            outside :meth:`backward` (docs/ACCUMULATION.md). Refused for a sharded model.
        state_dtype, state_dtypes, state_rounding: keep the inner optimizer's states
            (SGD, Adam, AdamW) in bf16 between steps, all (``state_dtype``) or by name
            (``state_dtypes={"exp_avg": torch.bfloat16}``); each step computes in fp32
            and rounds the new states once, ``"nearest"`` or ``"stochastic"``
            (``rounding_seed``'s generator). fp16 is refused (docs/MEMORY.md).

    Every parameter the inner optimizer holds belongs to the store, frozen or not, and
    is stepped in a step where it requires grad (a layer unfrozen later is stepped
    through its master from then on). Flat gradients are persistent: ``zero_grad()``
    zeroes them in place whatever ``set_to_none`` says.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        loss_scale: str | float | LossScaler | None = "dynamic",
        master_weights: bool | str = True,
        max_grad_norm: float | None = None,
        *,
        model: torch.nn.Module | None = None,
        track_grad_norm: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduce_overflow: bool = True,
        fused: bool | None = None,
        rounding: str = "nearest",
        rounding_seed: int = 0,
        accumulate_dtype: torch.dtype | None = None,
        state_dtype: torch.dtype | None = None,
        state_dtypes: dict[str, torch.dtype] | None = None,
        state_rounding: str = "nearest",
    ) -> None:
        if isinstance(optimizer, FP16Optimizer):
            raise TypeError("the optimizer is already an FP16Optimizer; wrap the inner optimizer once")
        params = held_params(optimizer, model, track_grad_norm=track_grad_norm, rounding_seed=rounding_seed)
        if constructor_state(optimizer):  # Adagrad's, over the 16-bit parameters: made again over the masters
            optimizer.state.clear()
        self.optimizer = optimizer
        kind = store_type(params)
        check_options(master_weights=master_weights, rounding=rounding, max_grad_norm=max_grad_norm, fused=fused,
                      reduce_overflow=reduce_overflow, accumulate_dtype=accumulate_dtype,
                      dtypes={p.dtype for p in params}, store=kind)
        self.state_dtypes = state_dtypes_of(optimizer, state_dtype, state_dtypes, state_rounding,
                                            store=kind)  # the states kept in 16 bits, by name
        self.state_rounding = state_rounding
        self.rounding = rounding
        self.master_weights = bool(master_weights)  # "remainder" keeps masters too (held otherwise): True
        self.master_mode = master_mode(master_weights)
        self.max_grad_norm = max_grad_norm
        self.track_grad_norm = track_grad_norm
        self.reduce_overflow = reduce_overflow
        self.accumulate_dtype = accumulate_dtype
        self.skipped_steps = 0
        self._told_loss_limit = False  # _fit_scale_to's line, logged once
        self.iteration = 0  # optimizer steps attempted, skipped ones included
        self._last_grad_norm: torch.Tensor | None = None
        self._last_overflow: list[dict] = []
        names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
        self._names = [names.get(id(p)) for p in params] if model is not None else None
        self._keys = (list(self._names) if self._names is not None and None not in self._names
                      else [str(i) for i in range(len(params))])  # the state_dict's keys
        self._shapes = [list(p.shape) for p in params]
        self._labels = [name if name is not None else f"param {i} {shape}"  # last_overflow's names
                        for i, (name, shape) in enumerate(zip(self._names or [None] * len(params), self._shapes))]
        self.store: ParamStore = build_store(optimizer, params, StoreOptions(
            master_weights="remainder" if self.master_mode == "remainder" else self.master_weights,
            rounding=rounding, accumulate=accumulate_dtype is not None, fused=fused, state_dtypes=self.state_dtypes,
            state_rounding=state_rounding, model=model, process_group=process_group,
            reduce_overflow=reduce_overflow, labels=tuple(self._labels)))
        # The ranks that agree on a skip: those the store reduces its norm over, if it
        # reduces one (a sharded model's mesh), else the caller's group.
        self.process_group = self.store.group if self.store.group is not None else process_group
        self.scaler = make_scaler(loss_scale, self.store.compute_dtype)
        self._rounding_rng = torch.Generator(device=self.store.device)
        self._rounding_rng.manual_seed(rounding_seed)

        # Replace each 16-bit parameter by its master in the inner optimizer.
        to_master = {id(p): m for p, m in zip(self.store.params, self.store.stepped)}
        for group in optimizer.param_groups:  # in place: LBFGS keeps a reference to its group's list
            group["params"][:] = [to_master.get(id(p), p) for p in group["params"]]
        self._dtypes = self.store.dtypes

        # torch.optim.Optimizer's own set-up (hooks, the step patch schedulers rely on),
        # over the inner optimizer's groups; then share its param_groups and state, so
        # that a scheduler that changes lr changes what is stepped.
        self._constructing = True
        # The base gets copies of the group dicts, so that the inner groups' own params lists stay.
        super().__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self._constructing = False
        self._share_inner_state()
        self._guard = StepGuard(self.store.params, self.store.hooks_gradients)
        if self.store.accumulates:  # the DDP hooks find the sums by parameter, and tell the guard they carried them
            accumulation.register(self.store.sums, self._guard)

    def _share_inner_state(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults
        self._held_groups = group_params(self.param_groups)  # what the store holds, group by group

    def _check_groups(self) -> None:
        check_groups(self.optimizer.param_groups, self.param_groups, self._held_groups)

    # ------------------------------------------------------------ Optimizer surface

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters the inner optimizer holds, in its order (:meth:`master_params`')."""
        return list(self.store.params)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the inner optimizer steps, in its order: the masters of the
        16-bit parameters, the fp32 parameters themselves (a sharded model's shards);
        after :meth:`unscale_` their ``.grad`` holds the unscaled fp32 gradients.
        Without persistent masters they hold values only inside ``step()``."""
        return list(self.store.stepped)

    def trained_values(self) -> list[torch.Tensor]:
        """Each of :meth:`model_params`' trained value in fp32, in its order: the fp32
        master (rebuilt exactly from a remainder), the parameter itself where it is
        fp32, and without masters the 16-bit weight, widened (exact). Tensors the
        optimizer holds or new ones: copy them before changing them.

        Raises:
            ValueError: the store is sharded (each rank holds a shard of the masters:
                mpfp16.checkpoint saves them).
        """
        if self.store.kind == "sharded":
            raise ValueError("the masters are sharded across ranks: save them with mpfp16.checkpoint, which "
                             "writes each rank's shard")
        return [m if m is not None else p.detach().float()
                for p, m in zip(self.store.params, (e["master"] for e in self.store.state_out()))]

    def param_names(self) -> list[str | None] | None:
        """The names (in ``model``) of :meth:`model_params`, when ``model=`` was given."""
        return None if self._names is None else list(self._names)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def fused(self) -> bool:
        """Whether steps run the fused kernels (False after a fallback)."""
        return self.store.fused

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global 2-norm of the unscaled gradients, before clipping (None
        when neither clipping nor tracking, and after a skipped step)."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    @property
    def last_overflow(self) -> list[dict]:
        """After a skipped step, the parameters whose gradient held inf or NaN: the
        first :data:`~mpfp16.overflow.OVERFLOW_REPORTED` in parameter order, one dict
        of plain values each (``name``, ``kind``, ``count``, ``ranks``: what they mean
        is :mod:`mpfp16.overflow`'s), gathered over the ranks that skipped together.
        ``[]`` before any step and after a clean one; a clean step costs nothing."""
        return self._last_overflow

    def add_param_group(self, param_group: dict) -> None:
        if self._constructing:  # torch.optim.Optimizer.__init__ registers the inner groups
            return super().add_param_group(param_group)
        raise NotImplementedError("FP16Optimizer cannot add parameter groups after construction: build the inner "
                                  "optimizer with all of its groups, then wrap it")

    def __repr__(self) -> str:
        masters = self.master_weights if self.master_mode != "remainder" else "remainder"
        return (f"FP16Optimizer(master_weights={masters!r}, scaler={self.scaler!r}, max_grad_norm="
                f"{self.max_grad_norm}, store={self.store.kind}, fused={self.fused},\n  {self.optimizer!r})")

    # ------------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Run ``(loss.float() * loss_scale).backward(**kwargs)``; with
        ``accumulate_dtype=torch.float32``, then add the 16-bit gradients into the fp32
        sums and zero them."""
        scale = self.scaler.scale
        if scale > _FP16_LARGEST_SCALE and not (self._guard.state.started and self._guard.state.scale is not None):
            scale = self._fit_scale_to(loss)  # the step's first backward: its scale is the step's
        scaled_loss = loss.float() if scale == 1.0 else loss.float() * scale
        first = self._guard.begin_backward(scale, loss, sums=self.accumulate_dtype is not None)
        try:
            scaled_loss.backward(**kwargs)
        finally:
            self._guard.end_backward()
        if self.accumulate_dtype is not None:
            self.store.accumulate(first)

    @classmethod
    def backward_together(cls, optimizers: list[FP16Optimizer], loss: torch.Tensor, **kwargs) -> None:
        """One backward pass of ``loss`` for several FP16Optimizers over different
        parameters that share one loss scaler (a GAN's generator and discriminator:
        the generator's loss flows through both models), as torch.amp's recipe for
        several optimizers shares one GradScaler: the loss is scaled once, by the
        first's :meth:`backward`, and each of the others takes the gradients that
        reach its parameters as its own backward's, at the scale its step unscales by.

        Raises:
            ValueError: the optimizers do not share one scaler (one line).
        """
        lead, rest = optimizers[0], list(optimizers[1:])
        if any(opt.scaler is not lead.scaler for opt in rest):
            raise ValueError("backward_together needs FP16Optimizers that share one loss scaler (loss_scale=the same "
                             "LossScaler): the loss is scaled once")
        firsts = [opt._guard.begin_backward(opt.scaler.scale, loss, sums=opt.accumulate_dtype is not None)
                  for opt in rest]
        try:
            lead.backward(loss, **kwargs)
        finally:
            for opt in rest:
                opt._guard.end_backward()
        for opt, first in zip(rest, firsts):
            opt._guard.state.scale = lead._guard.state.scale  # the lead may have fitted the shared scale first
            if opt.accumulate_dtype is not None:
                opt.store.accumulate(first)

    def _fit_scale_to(self, loss: torch.Tensor) -> float:
        """The scale for a step whose loss is 16-bit: at most the largest its dtype
        holds (:func:`mpfp16.scaler.loss_gradient_dtype`; 32768 for fp16), since the
        loss's own gradient is the scale and would be inf at every step. A dynamic
        scaler backs off to it once, logging it, and takes the step instead of
        skipping it; a static scale above it is refused."""
        dtype = loss_gradient_dtype(loss)
        limit = largest_scale(dtype)
        if self.scaler.scale <= limit:
            return self.scaler.scale
        before = self.scaler.scale
        if not self.scaler.fit_under(limit):
            if not self.scaler.dynamic:
                raise ValueError(f"the loss is {dtype_name(dtype)} and the static loss scale {before:g} is "
                                 f"above the largest its gradient holds ({limit:g}): every step would overflow; use a "
                                 f"scale of at most {limit:g}, or 'dynamic'")
            return self.scaler.scale  # min_scale is above the limit: the step overflows and is skipped
        if is_main_process() and not self._told_loss_limit:
            logger.info("mpfp16: the loss is computed in 16 bits, so its own gradient is the loss scale: the scale "
                        "backs off from %g to %g, the largest that fits, instead of skipping a step", before,
                        self.scaler.scale)
            self._told_loss_limit = True
        return self.scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient and start a new step: flat ones in place, one fill per
        buffer, whatever ``set_to_none`` says; per tensor, as it says; shards dropped."""
        self.store.zero(set_to_none)
        self._guard.new_step()

    @torch.no_grad()
    def unscale_(self) -> None:
        """Unscale now, so that the gradients can be read or clipped before ``step()``,
        as ``GradScaler.unscale_`` does: ``opt.master_params()`` then hold the unscaled
        fp32 gradients in their ``.grad``, and ``step()`` does not unscale again. A
        second call in a step does nothing. With the fused step it writes the fp32
        gradients that the fused step otherwise never makes (4 bytes per parameter).

        Raises:
            RuntimeError: a backward pass ran since the ``unscale_()`` of this step
                (the gradients are unscaled in place: they cannot be unscaled again).
        """
        self._check_groups()
        if self._guard.state.phase is Phase.UNSCALED:
            self._guard.check_unscaled()
            return
        self._guard.unscaled(self._unscale(materialize=True))

    def _check(self, materialize: bool) -> None:
        """Phase 1: the store's check (every parameter in place, the inner optimizer's
        state one it can step, the fused kernels this step needs built, agreed across
        ranks), then the order of calls (a backward reached the parameters, through
        ``backward()``)."""
        present = self.store.check(fp32_grads=materialize, with_norm=self._wants_norm, group=self.process_group,
                                   agree=self.reduce_overflow)
        self._guard.check_ready(
            present=present, no_gradient=self.store.no_gradient, scale=self.scaler.scale,
            accumulates=self.accumulate_dtype is not None,
            needs_carry=self.store.accumulates and self.reduce_overflow and get_world_size(self.process_group) > 1)

    def _unscale(self, materialize: bool):
        """Phases 1 and 2: check, then unscale; what the store found (``Checked``)."""
        self._check(materialize)
        return self.store.unscale(self._scale_of(self._guard.state), materialize=materialize,
                                  with_norm=self._wants_norm and not materialize)

    def _scale_of(self, state) -> float:
        """The scale of the step's gradients: its last ``backward()``'s (mpfp16.compat.apex
        may change the scale between backward and step, as apex does), or the scale now."""
        return state.scale if state.scale is not None else self.scaler.scale

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        """The copy-back phase alone, for code that steps the inner optimizer itself (a
        closure-driven LBFGS, mpfp16.compat.apex): the fp32 masters into the model."""
        self.store.copy_back()

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """The step (module docstring): :meth:`prepare_grads`, then
        :meth:`step_with_ready_grads` or :meth:`skip_step`. Returns False if skipped.

        Raises:
            LossScaleStuckError: the gradients kept overflowing at the lowest scale.
            RuntimeError: a call in a wrong order (mpfp16/step_state.py), one line.
        """
        if closure is not None:
            raise ValueError("FP16Optimizer.step() takes no closure: call backward() then step()")
        if not self.prepare_grads():
            self.skip_step()
            return False
        self.step_with_ready_grads()
        return True

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Phases 1-3: check that the step may read its gradients, unscale them (unless
        :meth:`unscale_` did), and agree across ranks whether any is inf/NaN; on an
        overflow, :attr:`last_overflow` names the parameters. Returns whether the
        gradients are finite, the same on every rank; then call
        :meth:`step_with_ready_grads` or :meth:`skip_step`."""
        self._check_groups()
        check_inner_hooks(self.optimizer, self.store.fused)
        state = self._guard.state
        if state.phase is Phase.UNSCALED:
            self._guard.check_unscaled()
            self._check(materialize=state.checked.materialized)  # the state may have changed since unscale_()
        else:
            self._guard.unscaled(self._unscale(materialize=False), in_step=True)
        found_inf = state.checked.found_inf
        # The flag is max-reduced over the group and read: the step's one host sync.
        # After DDP's allreduce the gradients already agree; this makes the decision
        # agree whatever happened to them since.
        overflow = any_rank(found_inf, group=self.process_group) if self.reduce_overflow else bool(found_inf[0].item())
        self._guard.agreed(not overflow)
        if overflow:
            self.report_overflow(before_unscale=False)
        elif self._last_overflow:
            self._last_overflow = []
        return not overflow

    def _ready_state(self, finite: bool):
        state = self._guard.state
        if state.finite is not finite:
            raise RuntimeError(f"{'step_with_ready_grads' if finite else 'skip_step'}() needs prepare_grads() first, "
                               f"and {'finite' if finite else 'non-finite'} gradients")
        self.iteration += 1
        return self._guard.finish()

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Phases 4-7, after :meth:`prepare_grads` found the gradients finite: clip,
        step the masters, copy them into the model, and let the scale grow."""
        state = self._ready_state(finite=True)
        clip_coef = self._clip(state.checked)
        self.store.update(state.checked, self._scale_of(state), clip_coef, self._rounding_rng)
        self.store.copy_back()
        self.scaler.update(False, step=self.iteration)

    @torch.no_grad()
    def skip_step(self) -> None:
        """After :meth:`prepare_grads` found an inf/NaN gradient: nothing is stepped,
        the gradients are zeroed and the scale backs off (one log line, on rank 0);
        ``LossScaleStuckError`` (naming the last culprits) if it can back off no more."""
        self._ready_state(finite=False)
        self.skipped_steps += 1
        self._last_grad_norm = None
        self.zero_grad()
        old_scale = self.scaler.scale
        try:
            self.scaler.update(True, step=self.iteration)
        except LossScaleStuckError as exc:
            raise with_culprits(exc, self._last_overflow) from None
        if is_main_process():
            found = describe_overflow(self._last_overflow)
            logger.info("step %d skipped: inf/NaN in the gradients%s; loss scale %g -> %g (%d skipped so far)",
                        self.iteration, f": {found}" if found else "", old_scale, self.scaler.scale,
                        self.skipped_steps)

    def report_overflow(self, before_unscale: bool = True) -> list[dict]:
        """Fill :attr:`last_overflow` from the gradients as they are now (with
        ``before_unscale``, as an unscale would read them: mpfp16.compat.apex finds an
        overflow before it unscales, as apex does) and return it. A collective where
        ranks agree on skipping: call it on every rank, once they agreed."""
        state = self._guard.state
        local = self.store.overflow(state.checked, OVERFLOW_REPORTED, before_unscale=before_unscale)
        self._last_overflow = gather_report(local, self._labels, loss_finite=state.loss_finite,
                                            shards_gradients=self.store.shards_gradients, group=self.process_group,
                                            reduce=self.reduce_overflow)
        return self._last_overflow

    @property
    def _wants_norm(self) -> bool:
        return self.max_grad_norm is not None or self.track_grad_norm

    def _clip(self, checked) -> torch.Tensor | None:
        """The factor the gradients are multiplied by, as ``clip_grad_norm_`` computes
        it from the global norm of the unscaled gradients (None: no clipping). No host
        synchronization."""
        if not self._wants_norm:
            self._last_grad_norm = None
            return None
        self._last_grad_norm = self.store.norm(checked)
        if self.max_grad_norm is None:
            return None
        return torch.clamp(self.max_grad_norm / (self._last_grad_norm + 1e-6), max=1.0)

    def memory_bytes_per_param(self) -> dict[str, float]:
        """Bytes held between steps per parameter the optimizer holds, by kind of
        buffer (``model_weights``, ``model_grads``, ``master_weights``,
        ``master_grads``, ``optimizer_state``, ``compensation``, ``master_remainder``,
        ``total``), from the storages actually allocated: fp16 with masters and
        SGD-momentum reads 2 + 2 + 4 + 4 + 4 = 16 unfused, 12 fused (no fp32
        gradients), 8 without masters (docs/API.md, memory per parameter)."""
        return self.store.memory()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """One form for every store, keyed by parameter (mpfp16/state_format.py): each
        parameter's fp32 master and inner state, the scaler's state and the counters,
        all plain containers of tensors and numbers: ``torch.load(path,
        weights_only=True)`` reads it. A sharded model's tensors are DTensors
        (:mod:`mpfp16.checkpoint` saves them as a DCP folder)."""
        self._check_groups()
        params, inner = keyed_by_parameter(self._keys, self._shapes, self._dtypes, self.store.state_out(),
                                           self.optimizer.state_dict())
        return {
            "format": STATE_FORMAT,
            "store": self.store.kind,
            "inner_optimizer": type(self.optimizer).__name__,
            "params": params,
            "optimizer": inner,
            "master_weights": self.master_weights,
            "master_mode": self.master_mode,
            "compute_dtype": dtype_name(self.store.compute_dtype),
            "scaler": self.scaler.state_dict(),
            "scaler_type": type(self.scaler).__name__,
            "skipped_steps": self.skipped_steps,
            "iteration": self.iteration,
            "rounding": self.rounding,
            "rounding_rng": self._rounding_rng.get_state(),
            "state_dtypes": {name: dtype_name(d) for name, d in self.state_dtypes.items()},  # fp32 ones left out
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned, from any store (flat, per-tensor or
        sharded: the tensors are taken whole or sharded as this store holds them), of
        this version or an earlier one. Load the model's state first: without saved
        masters (``master_weights=False``) the 16-bit weights are the values. With
        saved masters the model's weights are set from them, so the two always agree.

        Raises:
            ValueError: one line, before anything is changed, when the state_dict
                does not fit this optimizer.
        """
        state_dict = upgrade_state_dict(state_dict)
        check_state_dict(state_dict, keys=self._keys, names=self._names, shapes=self._shapes, dtypes=self._dtypes,
                         compute_dtype=dtype_name(self.store.compute_dtype), inner=self.optimizer,
                         has_half=self.store.has_half, master_weights=self.master_weights,
                         master_mode=self.master_mode, rounding=self.rounding, scaler_type=type(self.scaler).__name__)
        entries = list(state_dict["params"].values())  # in this optimizer's order (checked)
        legacy = {k: state_dict[k] for k in ("kahan_compensation",) if k in state_dict}
        self.scaler.check_state_dict(state_dict["scaler"])  # before anything is loaded

        def load_inner(like) -> None:
            self.optimizer.load_state_dict(keyed_by_index(state_dict, self._shapes, like))
            self._share_inner_state()  # the inner optimizer made new param_groups and state

        self.store.state_in(entries, legacy, load_inner)  # refuses what does not fit before it loads
        self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.iteration = int(state_dict["iteration"])
        if state_dict.get("rounding_rng") is not None:
            self._rounding_rng.set_state(state_dict["rounding_rng"].cpu())
        changed = state_dtypes_changed(state_dict, self.state_dtypes)
        if changed and is_main_process():
            logger.info("FP16Optimizer: %s", changed)
