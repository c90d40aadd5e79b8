"""mpfp16 as a PyTorch Lightning precision plugin, for the ``Trainer`` and for ``Fabric``.

    trainer = lightning.Trainer(plugins=[MPFP16Precision(dtype=torch.float16)], ...)
    trainer.fit(model)                                  # your LightningModule, unchanged

    fabric = lightning.Fabric(plugins=[MPFP16FabricPrecision(dtype=torch.float16)], ...)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(loss); optimizer.step()

Either gives the model mpfp16's semantics: 16-bit weights and gradients (norm layers
fp32, as :func:`mpfp16.to_half` converts), the user's optimizer stepped over fp32
master weights by :class:`mpfp16.FP16Optimizer`, the loss scaled in backward, a
step with inf/NaN gradients skipped on every rank, and clipping applied to the
unscaled fp32 gradients. Lightning's own ``"16-mixed"`` keeps fp32 weights and runs
under autocast; its ``"16-true"`` keeps fp16 weights only, with no master copy and
no loss scale (docs/LIGHTNING.md measures what that loses).

Needs the ``lightning`` package (``pip install 'mpfp16[lightning]'``); ``import
mpfp16`` never imports this module.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..convert import to_half
from ..optimizer import FP16Optimizer
from ..parallel.ranks import is_main_process
from ..parallel.ddp import attach
from ..parallel.handles import handle_of
from .front_end import FrontEndOptions

try:
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy,
                                              SingleDeviceXLAStrategy, XLAStrategy)
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning_utilities import apply_to_collection
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("mpfp16.integrations.lightning needs Lightning: pip install 'mpfp16[lightning]'") from exc

__all__ = ["MPFP16Precision", "MPFP16FabricPrecision", "LossScaleMonitor"]

logger = logging.getLogger("mpfp16")

_DTYPES = {torch.float16: "16-true", torch.bfloat16: "bf16-true"}  # Lightning's name for 16-bit weights


class _Options(FrontEndOptions):
    """The options both plugins take, checked when the plugin is built (before any
    trainer runs), and the FP16Optimizer they make from them."""

    def build(self, inner: torch.optim.Optimizer, model: torch.nn.Module, loss_scale=None) -> FP16Optimizer:
        if isinstance(inner, FP16Optimizer):
            raise ValueError("the optimizer is already an FP16Optimizer: give Lightning the torch optimizer, and the "
                             "plugin wraps it")
        return super().build(inner, model, loss_scale)

    def repr_args(self) -> str:
        return (f"dtype={self.dtype}, master_weights={self.master_weights!r}, loss_scale={self.loss_scale!r}, "
                f"rounding={self.rounding!r}")


class _Reports:
    """What both plugins say about the run: the FP16Optimizer they made, its scale and
    its skipped steps."""

    optimizer: FP16Optimizer | None
    _options: _Options

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._options.repr_args()})"

    @property
    def loss_scale(self) -> float | None:
        return self.optimizer.loss_scale if self.optimizer is not None else None

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps if self.optimizer is not None else 0


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in ``data`` (a batch: tensors in any nesting of
    collections, dataclasses included) cast to ``dtype``; integer tensors (labels, token
    ids) and other objects as they are. Lightning's ``"16-true"`` plugins cast a batch
    the same way (``HalfPrecision.convert_input``)."""
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


@torch.no_grad()
def _adopt_written_weights(opt: FP16Optimizer) -> None:
    """Make a write into the 16-bit weights the masters' value, as fp32 training keeps
    a write into its weights.

    With fp32 masters every 16-bit weight is its master rounded to nearest (the copy
    back, a load, the construction all leave it so), and the step overwrites the
    weights from the masters: a write that is not swapped back before the next step (a
    callback's pruning, an average copied in, a ``load_state_dict``) would be undone by
    it. Each element whose 16-bit bits are not its master's rounding takes the written
    value as its master. A write swapped back (an EMA during validation) leaves nothing
    to adopt. Without masters the 16-bit weights are the values, and a write needs no
    adopting; with ``master_weights="remainder"`` the bf16 weight is the master's upper
    half, and a write is kept with the old remainder below it (less than one bf16 step).

    It reads every weight and master, a pass as long as the step's (longer on a CPU,
    whose eager fp32-to-16-bit conversion is slow): the Trainer's plugin runs it where
    Lightning runs the hooks that write weights, not at every step."""
    if opt.master_mode != "fp32":
        return
    for weight, master in zip(opt.model_params(), opt.master_params()):
        if weight is master or weight.dtype == master.dtype:  # an fp32 parameter is its own master
            continue
        written = master.to(weight.dtype).view(torch.int16) != weight.view(torch.int16)
        if bool(written.any()):
            torch.where(written, weight.to(master.dtype), master, out=master)


def _hooks_ran(trainer) -> tuple:
    """Where the Trainer stands in the runs of the hooks that write weights between
    steps: the epoch (``on_train_epoch_start``/``end``, ``ModelPruning``'s epoch ends),
    and the validation batches run so far (the validation hooks, where weight
    averaging swaps); a step after either changed follows such hooks."""
    return trainer.current_epoch, trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.started


def _scheduler_sees_step(opt: FP16Optimizer) -> None:
    """torch's lr schedulers wrap the inner optimizer's ``step`` (configure_optimizers
    built them over it) and warn when it was never called; the fused step does not call
    it, and a skipped step of FP16Optimizer still is an optimizer step to Lightning,
    as a skipped step of torch.amp's GradScaler is."""
    opt.optimizer._opt_called = True


class MPFP16Precision(_Reports, Precision):
    """A precision plugin for the Lightning ``Trainer``: fp16 (or bf16) weights and
    gradients, the ``configure_optimizers`` optimizer stepped over fp32 masters by
    :class:`mpfp16.FP16Optimizer`.

        Trainer(plugins=[MPFP16Precision(dtype=torch.float16, master_weights=True,
                                         loss_scale="dynamic", rounding="nearest")])

    - The model is converted as :func:`mpfp16.to_half` converts it (norm layers stay
      fp32; inputs of its ``forward`` are cast to 16 bits and outputs back to fp32),
      on the strategy's device, before Lightning wraps it in DDP. Every batch's
      floating-point tensors are cast to 16 bits before its step, as ``"16-true"``
      casts them (:meth:`convert_input`): a step that calls a submodule gets 16-bit
      outputs from it; compute the loss in fp32 (``logits.float()``).
    - Backward scales the loss; the step unscales, skips on inf/NaN (on every rank),
      clips, steps and copies back, as ``FP16Optimizer.step()`` does. A skipped step
      counts as an optimizer step for ``global_step`` and the lr schedulers, as with
      ``"16-mixed"`` (torch.amp). ``last_step_skipped``, ``skipped_steps`` and
      ``loss_scale`` say what happened; :class:`LossScaleMonitor` logs the last two.
      A ``training_step`` that returns None takes no step and leaves the scale alone.
    - A write into the 16-bit weights by the hooks of an epoch's start or end or of a
      validation run (a callback's pruning, an average copied in) becomes the masters'
      value before the next step, as fp32 training keeps it
      (:func:`_adopt_written_weights`, once after such hooks ran, not at every step);
      an EMA swapped in and back changes nothing. A write in the hooks around each
      batch is undone by the next step, as in mpfp16's own loop (docs/LIGHTNING.md).
    - ``gradient_clip_val`` clips the unscaled fp32 gradients: by norm inside the step
      (bit for bit ``clip_grad_norm_`` after ``unscale_()``), by value after
      ``unscale_()``.
    - Under ``strategy="ddp"``, mpfp16's hook averages the 16-bit gradients
      (``allreduce_dtype`` sets the wire), once per optimizer step with
      ``accumulate_grad_batches``; ``accumulate_dtype=torch.float32`` sums the
      micro-batches in fp32 and the exchange carries the sum.
    - The checkpoint's optimizer state is ``FP16Optimizer.state_dict()``: masters, the
      inner optimizer's state and the scaler's; ``trainer.fit(ckpt_path=...)`` resumes
      from it, bit for bit, mid-epoch too where the training loader is one Lightning
      can resume (``state_dict``/``load_state_dict``; docs/LIGHTNING.md).

    Refused when ``fit`` sets up, before the first batch, in one line: a strategy other
    than one device or DDP (FSDP and DeepSpeed shard or hold their own master weights),
    manual optimization, more than one optimizer, LBFGS, a DDP communication hook of
    the user's.

    Args: ``dtype`` (torch.float16 or torch.bfloat16), ``master_weights``,
    ``loss_scale``, ``rounding``, ``accumulate_dtype``, ``fused``, ``rounding_seed``,
    ``state_dtype``, ``state_dtypes``, ``state_rounding``: as
    :class:`mpfp16.FP16Optimizer` takes them; ``allreduce_dtype``: as
    :func:`mpfp16.distributed.wrap` takes it.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, master_weights: bool | str = True,
                 loss_scale: Any = "dynamic", rounding: str = "nearest", *, accumulate_dtype: torch.dtype | None = None,
                 fused: bool | None = None, rounding_seed: int = 0, allreduce_dtype: torch.dtype | None = None,
                 state_dtype: torch.dtype | None = None, state_dtypes: dict | None = None,
                 state_rounding: str = "nearest") -> None:
        self._options = _Options(dtype, master_weights, loss_scale, rounding, accumulate_dtype, fused, rounding_seed,
                                 allreduce_dtype, state_dtype=state_dtype, state_dtypes=state_dtypes,
                                 state_rounding=state_rounding)
        self.precision = _DTYPES[dtype]
        self.optimizer: FP16Optimizer | None = None  # made when fit() sets up
        self.last_step_skipped = False
        self._step_max_norm: float | None = None  # gradient clipping by norm asked for in this step
        self._no_backward = False  # while this step's training_step returned None: nothing to unscale or step
        self._hooks_seen: tuple | None = None  # _hooks_ran at the last step that adopted written weights

    # -------------------------------------------------------------- set-up

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:  # Lightning's strategy converts the LightningModule it trains
            _refuse_trainer(trainer, module)
            module.to(trainer.strategy.root_device)  # into flat buffers on the device, not before the move
        return to_half(module, self._options.dtype)

    def convert_input(self, data: Any) -> Any:
        """The batch's floating-point tensors cast to the model's 16-bit dtype, as
        Lightning's ``"16-true"`` casts them, before every training, validation, test
        and prediction step: a step that calls a submodule (``self.net(x)``) gives it
        the 16-bit input that ``self(x)`` would. That submodule's outputs are 16-bit;
        only the converted LightningModule's own ``forward`` casts its outputs to fp32."""
        return _cast_floating(data, self._options.dtype)

    def connect(self, model, optimizers: list, lr_schedulers: list):
        if not optimizers or optimizers == [self.optimizer]:  # evaluation; or after this plugin's own fit
            return model, optimizers, lr_schedulers
        if len(optimizers) == 1 and isinstance(optimizers[0], _MockOptimizer):
            raise ValueError("configure_optimizers returned no optimizer; MPFP16Precision steps the one it returns")
        if len(optimizers) != 1:
            raise ValueError(f"MPFP16Precision steps one optimizer; configure_optimizers returned {len(optimizers)}")
        module = model.module if isinstance(model, DistributedDataParallel) else model
        if isinstance(model, DistributedDataParallel):
            attach(model, allreduce_dtype=self._options.allreduce_dtype)
        self.optimizer = self._options.build(optimizers[0], module)
        return model, [self.optimizer], lr_schedulers

    def _fp16(self, optimizer) -> FP16Optimizer:
        opt = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer holds it
        if not isinstance(opt, FP16Optimizer) or opt is not self.optimizer:
            raise RuntimeError("MPFP16Precision was asked to step an optimizer it did not set up")
        return opt

    # -------------------------------------------------------------- the step

    def backward(self, tensor: torch.Tensor, model, optimizer, *args, **kwargs) -> None:
        if self.optimizer is None:
            raise RuntimeError("MPFP16Precision: backward before fit() set up the optimizer")
        self.optimizer.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        opt = self._fp16(optimizer)
        if kwargs:
            raise ValueError(f"FP16Optimizer.step() takes no arguments; got {', '.join(sorted(kwargs))}")
        closure_result = closure()  # training_step and backward (and zero_grad on the first micro-batch)
        self._no_backward = closure_result is None and model.automatic_optimization  # training_step returned None
        try:
            self._after_closure(model, optimizer)  # on_before_optimizer_step, then the clipping
        finally:
            self._no_backward = False
        max_norm, self._step_max_norm = self._step_max_norm, None
        if closure_result is None and model.automatic_optimization:  # training_step returned None: no backward
            self.last_step_skipped = True  # no step, no scale change (as torch.amp's "16-mixed" skips its scaler)
            return None
        ran = _hooks_ran(model.trainer)
        if ran != self._hooks_seen:  # the first step, or hooks that may write weights ran since the last
            _adopt_written_weights(opt)
            self._hooks_seen = ran
        base = opt.max_grad_norm
        opt.max_grad_norm = max_norm if max_norm is not None else base
        try:
            stepped = opt.step()
        finally:
            opt.max_grad_norm = base
        self.last_step_skipped = not stepped
        _scheduler_sees_step(opt)
        return closure_result

    def clip_gradients(self, optimizer, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if not clip_val or clip_val <= 0:
            return
        opt = self._fp16(optimizer)
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self._step_max_norm = float(clip_val)  # inside the step, on the unscaled fp32 gradients
            return
        if self._no_backward:  # training_step returned None: no gradients to clip, and no step follows
            return
        opt.unscale_()
        torch.nn.utils.clip_grad_value_(opt.master_params(), clip_val)

    def main_params(self, optimizer):
        return self._fp16(optimizer).master_params()

    def unscale_gradients(self, optimizer) -> None:
        self._fp16(optimizer).unscale_()


def _refuse_trainer(trainer, module) -> None:
    """What the Trainer asks for that MPFP16Precision cannot honour, in one line."""
    strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or isinstance(
            strategy, (DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy)):
        raise ValueError(f"MPFP16Precision runs on one device or under strategy='ddp', not {type(strategy).__name__}: "
                         "FSDP and DeepSpeed shard the weights or keep master weights of their own (for sharded fp32 "
                         "masters use mpfp16.distributed.shard in your own loop)")
    if getattr(strategy, "_ddp_comm_hook", None) is not None:  # DDPStrategy(ddp_comm_hook=...)
        raise ValueError("MPFP16Precision averages the gradients with mpfp16's own DDP hook; a ddp_comm_hook given "
                         "to DDPStrategy cannot run beside it: leave it unset (allreduce_dtype= sets the wire)")
    if not module.automatic_optimization and trainer.training:
        raise ValueError("MPFP16Precision needs automatic optimization: with automatic_optimization = False, "
                         "self.optimizers() wraps the FP16Optimizer in a LightningOptimizer, whose zero_grad and "
                         "step calls do not reach it as a whole")


class MPFP16FabricPrecision(_Reports, FabricPrecision):
    """A precision plugin for Lightning ``Fabric``, with the options and the semantics
    of :class:`MPFP16Precision`.

        fabric = Fabric(plugins=[MPFP16FabricPrecision(dtype=torch.float16)])
        model, optimizer = fabric.setup(model, optimizer)
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(loss_fn(model(x), y))
            optimizer.step()                     # skipped on inf/NaN gradients

    ``fabric.setup`` converts the model; the floating-point arguments of a call to the
    module it returned are cast to 16 bits and its outputs to fp32, as
    :meth:`convert_input` and :meth:`convert_output` say. The next step overwrites the
    16-bit weights from the masters: a loop that writes the weights and keeps them calls
    :meth:`adopt_written_weights` after the write. Fabric shows a precision plugin the optimizer
    only when it steps, so the plugin wraps it at the first ``fabric.backward()``: it
    finds the optimizer that ``fabric.setup`` (or ``setup_optimizers``) returned over
    this model's parameters, wraps the torch optimizer inside it in an
    :class:`mpfp16.FP16Optimizer`, and points the Fabric optimizer at that. From then
    on ``optimizer.zero_grad()``, ``optimizer.step()``, ``fabric.clip_gradients``
    (pass ``error_if_nonfinite=False``, as with ``"16-mixed"``: a step whose gradients
    overflowed is skipped, not an error), ``optimizer.state_dict()`` and ``fabric.save``
    / ``fabric.load`` reach the FP16Optimizer: masters, inner state and scaler.
    A ``fabric.load`` before the first backward (a resume) wraps the optimizer first:
    ``fabric.setup(model, optimizer)`` gave the optimizer a hook that sees an
    FP16Optimizer state arrive. (An optimizer made after ``fabric.setup_module`` has no
    such hook: resume it after one ``fabric.backward``.)

    Under ``strategy="ddp"`` Fabric's own DistributedDataParallel averages the 16-bit
    gradients with DDP's default hook; ``fabric.no_backward_sync`` skips the exchange
    while accumulating, so each optimizer step sends one. With
    ``accumulate_dtype=torch.float32`` the plugin gives that DDP module mpfp16's hook
    at the first ``fabric.backward()``, and the one exchange carries the fp32 sum of
    the micro-batches, as under the Trainer plugin. On a GPU, build the
    model under ``fabric.init_module()`` or move it to ``fabric.device`` before
    ``fabric.setup``: Fabric moves it after converting it, out of mpfp16's flat buffers.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, master_weights: bool | str = True,
                 loss_scale: Any = "dynamic", rounding: str = "nearest", *, accumulate_dtype: torch.dtype | None = None,
                 fused: bool | None = None, rounding_seed: int = 0, state_dtype: torch.dtype | None = None,
                 state_dtypes: dict | None = None, state_rounding: str = "nearest") -> None:
        self._options = _Options(dtype, master_weights, loss_scale, rounding, accumulate_dtype, fused, rounding_seed,
                                 None, state_dtype=state_dtype, state_dtypes=state_dtypes,
                                 state_rounding=state_rounding)
        self.precision = _DTYPES[dtype]
        self.optimizer: FP16Optimizer | None = None  # made at the first fabric.backward()
        self._modules: list[weakref.ref] = []
        self._ddp_hooked = False  # accumulate_dtype: mpfp16's hook attached to Fabric's DDP module, if any
        self._arrived: dict | None = None  # an FP16Optimizer state being loaded through the inner optimizer
        self.last_step_skipped = False

    def adopt_written_weights(self) -> None:
        """Make what the loop wrote into the 16-bit weights since the last step the fp32
        masters' value (pruning, an average copied in, a ``load_state_dict``), which the
        next step would otherwise overwrite from the masters; a pass over every weight
        and master, for the loop to call after such a write (a write swapped back before
        the step needs none)."""
        if self.optimizer is not None:
            _adopt_written_weights(self.optimizer)

    def convert_input(self, data: Any) -> Any:
        """The floating-point tensors passed to a module that ``fabric.setup`` returned,
        cast to the model's 16-bit dtype, as Lightning's ``"16-true"`` casts them. A
        step method that Fabric sends through the module's ``forward`` (a
        LightningModule's ``training_step`` under DDP) gets its batch cast too; one
        called on it directly on one device does not, as under ``"16-true"``: the loop
        casts that batch with this method (docs/LIGHTNING.md)."""
        return _cast_floating(data, self._options.dtype)

    def convert_output(self, data: Any) -> Any:
        """The floating-point tensors that module returns, cast to fp32 (as
        :func:`mpfp16.to_half`'s hooks cast the converted model's outputs): the loss of
        a ``training_step`` called through it is fp32."""
        return _cast_floating(data, torch.float32)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if torch.cuda.is_available() and any(p.device.type == "cpu" for p in module.parameters()) and (
                is_main_process()):
            logger.warning("MPFP16FabricPrecision: the model is on the CPU; Fabric moves it to its device after "
                           "converting it, out of mpfp16's flat buffers. Build it under fabric.init_module() or "
                           "move it to fabric.device before fabric.setup")
        to_half(module, self._options.dtype)
        self._modules = [ref for ref in self._modules if ref() is not None and ref() is not module]
        self._modules.append(weakref.ref(module))
        # fabric.setup(model, optimizer): the optimizer exists already. A checkpoint load
        # into it (fabric.load, before any backward) wraps it first, then loads.
        owner = self._owner()
        for inner in _optimizers(lambda cls: issubclass(cls, torch.optim.Optimizer) and not issubclass(
                cls, FP16Optimizer), owner):
            inner.register_load_state_dict_pre_hook(self._load_into_wrapper)
            inner.register_load_state_dict_post_hook(self._load_wrapper_after_inner)
        return module

    def _owner(self) -> dict:
        """id(parameter) -> the converted module that holds it."""
        modules = [m for m in (ref() for ref in self._modules) if m is not None]
        return {id(p): m for m in modules for p in m.parameters()}

    def _load_into_wrapper(self, inner, state_dict):
        """The inner optimizer's load_state_dict pre-hook: an FP16Optimizer state
        (``fabric.load`` before the first backward) arrives at the torch optimizer,
        which this wraps now. The torch optimizer loads its own part (it cannot be
        stopped from loading something), and the post-hook
        (:meth:`_load_wrapper_after_inner`) then loads the whole state into the
        FP16Optimizer. That order matters: a torch optimizer's load makes new
        ``param_groups``, and only the FP16Optimizer's own load, last, leaves it on the
        groups its inner optimizer and the lr schedulers use (loaded first, it would be
        left on the groups of before the load)."""
        self._arrived = None  # what a load that failed half-way left
        if not (isinstance(state_dict, dict) and "master_weights" in state_dict and "optimizer" in state_dict):
            return None  # the inner optimizer's own state
        if self.optimizer is None:
            self.optimizer = self._wrap_found_optimizer()
        if self.optimizer.optimizer is not inner:
            return None
        self._arrived = state_dict
        return state_dict["optimizer"]

    def _load_wrapper_after_inner(self, inner) -> None:
        """The inner optimizer's load_state_dict post-hook: the FP16Optimizer state
        that :meth:`_load_into_wrapper` saw arrive, loaded by the FP16Optimizer (which
        loads the inner optimizer's part again, into the same masters, and takes its
        new groups)."""
        state_dict, self._arrived = self._arrived, None
        if state_dict is not None:
            self.optimizer.load_state_dict(state_dict)

    def _wrap_found_optimizer(self) -> FP16Optimizer:
        """The optimizer Fabric set up over the converted model's parameters, wrapped."""
        owner = self._owner()
        if not owner:
            raise RuntimeError("MPFP16FabricPrecision: fabric.backward() before fabric.setup(model, ...)")
        found = {}  # id(inner) -> (inner, [fabric optimizers])
        for wrapper in _optimizers(lambda cls: issubclass(cls, _FabricOptimizer), owner,
                                   inner_of=lambda obj: obj.__dict__.get("_optimizer")):
            inner = wrapper.__dict__["_optimizer"]
            found.setdefault(id(inner), (inner, []))[1].append(wrapper)
        if len(found) != 1:
            what = "no optimizer" if not found else f"{len(found)} optimizers"
            raise RuntimeError(f"MPFP16FabricPrecision steps one optimizer over the model it converted; {what} set "
                               "up with fabric.setup(model, optimizer) or fabric.setup_optimizers hold its parameters")
        (inner, wrappers), = found.values()
        model = next(owner[id(p)] for group in inner.param_groups for p in group["params"] if id(p) in owner)
        opt = self._options.build(inner, model)
        for wrapper in wrappers:
            wrapper._optimizer = opt
            # Fabric's optimizer imitates the torch optimizer's class, so its zero_grad is
            # torch's over param_groups (the masters): the 16-bit gradients need this one.
            wrapper.zero_grad = opt.zero_grad
        return opt

    def backward(self, tensor: torch.Tensor, model, *args, **kwargs) -> None:
        if self.optimizer is None:
            self.optimizer = self._wrap_found_optimizer()
        if self._options.accumulate_dtype is not None and not self._ddp_hooked:
            self._attach_to_ddp()
        self.optimizer.backward(tensor, *args, **kwargs)

    def _attach_to_ddp(self) -> None:
        """With ``accumulate_dtype=torch.float32``, before the first backward pass: give
        the DistributedDataParallel module that Fabric's DDP strategy built around the
        converted model mpfp16's hook (:func:`mpfp16.distributed.attach`, the gradients'
        own dtype on the wire). The step's one exchange must carry the fp32 sum of its
        micro-batches; DDP's default hook sends only the last micro-batch's 16-bit
        gradient. Every rank attaches at its first backward. A DDP module with a hook
        of its own is refused by ``attach``, in one line; one that already has mpfp16's
        is left as it is. Fabric hands a precision plugin neither module, so the DDP
        module is found among the interpreter's objects, as the optimizer is."""
        modules = {id(m) for m in (ref() for ref in self._modules) if m is not None}
        for obj in gc.get_objects():
            if (issubclass(type(obj), DistributedDataParallel) and id(obj.module) in modules
                    and handle_of(obj) is None):
                attach(obj)
        self._ddp_hooked = True

    def _fp16(self, optimizer) -> FP16Optimizer:
        if issubclass(type(optimizer), _FabricOptimizer):
            optimizer = optimizer.optimizer
        if self.optimizer is None or optimizer is not self.optimizer:
            raise RuntimeError("MPFP16FabricPrecision: this optimizer was not wrapped; run fabric.backward(loss) "
                               "before optimizer.step(), fabric.clip_gradients or a checkpoint load")
        return optimizer

    def optimizer_step(self, optimizer, **kwargs):
        opt = self._fp16(optimizer)
        if kwargs:
            raise ValueError(f"FP16Optimizer.step() takes no arguments; got {', '.join(sorted(kwargs))}")
        stepped = opt.step()
        self.last_step_skipped = not stepped
        _scheduler_sees_step(opt)
        return stepped

    def main_params(self, optimizer):
        return self._fp16(optimizer).master_params()

    def unscale_gradients(self, optimizer) -> None:
        self._fp16(optimizer).unscale_()


def _optimizers(kind, owner: dict, inner_of=lambda obj: obj) -> list:
    """The live objects whose type passes ``kind(type)`` and whose optimizer
    (``inner_of(obj)``) holds a parameter of ``owner``: Fabric hands a precision plugin
    neither the optimizers nor its wrappers of them, so they are found among the
    interpreter's objects. Only ``type(obj)`` is read before the match: an attribute
    read could run anything (a dead weak proxy raises)."""
    out = []
    for obj in gc.get_objects():
        if not kind(type(obj)):
            continue
        inner = inner_of(obj)
        if isinstance(inner, torch.optim.Optimizer) and any(
                id(p) in owner for group in inner.param_groups for p in group["params"]):
            out.append(obj)
    return out


class LossScaleMonitor(Callback):
    """Logs ``loss_scale`` and ``skipped_steps`` (``self.log``, on step) after every
    optimizer step of a Trainer that runs :class:`MPFP16Precision`."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, MPFP16Precision):
            raise ValueError("LossScaleMonitor logs MPFP16Precision's loss scale; this Trainer runs "
                             f"{type(plugin).__name__}")
        if plugin.optimizer is not None:
            pl_module.log_dict({"loss_scale": float(plugin.loss_scale), "skipped_steps": float(plugin.skipped_steps)},
                               on_step=True, on_epoch=False)
