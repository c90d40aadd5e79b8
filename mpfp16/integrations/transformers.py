"""mpfp16 in the Hugging Face ``transformers.Trainer``: :class:`MPFP16Trainer`.

    trainer = MPFP16Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                            mpfp16=MPFP16Options(dtype=torch.float16))
    trainer.train()                      # or train(resume_from_checkpoint=...)

The Trainer's own ``fp16=True`` is torch.amp: fp32 weights, autocast and a GradScaler.
transformers 5 removed the apex backend (``half_precision_backend``), so the Trainer has
no path left with 16-bit weights and fp32 master weights; this is one. The model's
weights and gradients are 16-bit (norm layers fp32, as :func:`mpfp16.to_half`
converts), the Trainer's optimizer steps fp32 masters inside an
:class:`mpfp16.FP16Optimizer`, the loss is scaled in backward, a step with inf/NaN
gradients is skipped on every rank, and ``max_grad_norm`` clips the unscaled fp32
gradients.

How, at each point where the Trainer reaches its Accelerator:

- ``training_step`` calls ``accelerator.backward(loss)``: here ``FP16Optimizer.backward``.
- The loop calls ``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)``
  before ``optimizer.step()``: here it sets the step's ``max_grad_norm``, and the step
  clips (bit for bit ``clip_grad_norm_`` over the masters after ``unscale_()``, without
  the fp32 gradients the fused step does not otherwise write).
- The loop steps the lr scheduler only if ``not accelerator.optimizer_step_was_skipped``:
  here that is ``not FP16Optimizer.step()``, so a skipped step leaves the schedule where
  it was, as transformers does with a GradScaler.
- ``accelerator.prepare`` wraps the optimizer in an ``AcceleratedOptimizer``: here in
  one whose ``step`` is ``FP16Optimizer.step``. It places the model on its device with
  ``model.to``: here it does not, since the model was converted there already and a
  copy would take the parameters out of the FP16Optimizer's flat buffers (under
  torchrun on CPUs the Accelerator's ``cpu:0`` copied every one). Under DDP the module
  it builds gets
  mpfp16's communication hook (:func:`mpfp16.distributed.attach`), and accumulating
  micro-batches run under its ``no_sync``, as the Trainer runs them.
- Checkpoints save ``optimizer.state_dict()``: here ``FP16Optimizer.state_dict()``, the
  masters, the inner optimizer's state and the scaler's.

Needs transformers and accelerate (``pip install 'mpfp16[transformers]'``); ``import
mpfp16`` never imports this module.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..convert import keep_inputs_of, to_half
from ..export import check_export, export_state_dict
from ..optimizer import FP16Optimizer
from ..parallel.ddp import attach
from ..parallel.handles import handle_of
from ..scaler import LossScaler
from .front_end import FrontEndOptions, show_unscaled_gradients, take_written_gradients

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import CallbackHandler
    from transformers.training_args import OptimizerNames
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("mpfp16.integrations.transformers needs transformers and accelerate: "
                      "pip install 'mpfp16[transformers]'") from exc

__all__ = ["MPFP16Trainer", "MPFP16Options"]

# Optimizers that update each parameter inside the backward pass (their step() does
# nothing), where FP16Optimizer steps the masters once, after it.
_IN_BACKWARD = (OptimizerNames.LOMO.value, OptimizerNames.ADALOMO.value)


class MPFP16Options(FrontEndOptions):
    """mpfp16's options for :class:`MPFP16Trainer`, checked when they are built, before
    any Trainer is: FP16Optimizer's own rules refuse a bad combination in one line.

    Args:
        dtype: the weights' and gradients' dtype, ``torch.float16`` or ``torch.bfloat16``.
        master_weights: ``True`` (fp32 masters), ``False`` (step the 16-bit weights
            directly) or ``"remainder"`` (bf16: the masters held as the weights and an
            int16 remainder each); :class:`mpfp16.FP16Optimizer`'s option.
        loss_scale: ``"dynamic"`` (for fp16; no scaling for bf16), a number (static),
            ``None``, or an :class:`mpfp16.LossScaler`, which each FP16Optimizer the
            Trainer builds starts from a copy of (``trainer.loss_scale`` is the
            scale now).
        rounding: ``"nearest"``, or without masters ``"stochastic"`` or ``"kahan"``.
        accumulate_dtype: ``None`` (the micro-batches of a step summed in the 16-bit
            ``.grad``) or ``torch.float32`` (summed in fp32; under DDP the step's one
            exchange carries the sum).
        fused: FP16Optimizer's ``fused`` (``None``: its default rule).
        rounding_seed: the seed of stochastic rounding.
        allreduce_dtype: under DDP, the dtype on the wire of mpfp16's hook (``None``:
            the gradients' own).
        state_dtype, state_dtypes, state_rounding: the optimizer states' dtypes and
            their rounding, :class:`mpfp16.FP16Optimizer`'s options (``None``: fp32).
        keep_fp32: more modules kept in fp32 (classes or names), as
            :func:`mpfp16.to_half` takes them; norm classes and the model's
            ``_keep_in_fp32_modules`` are kept without it.
        keep_inputs: keyword inputs of the model's ``forward`` left in their dtype,
            besides the Trainer's label names (``args.label_names``, by default the
            model's: ``labels``), which always are.
        export: what ``save_model`` and the checkpoints write as the model:
            ``"masters"`` (the fp32 masters, as an fp32 model) or ``"weights"`` (each
            tensor in the dtype the model holds it); either reloads with
            ``from_pretrained`` as an fp32 model, nothing rounded (docs/TRANSFORMERS.md).
    """

    def __init__(self, dtype: torch.dtype = torch.float16, master_weights: bool | str = True,
                 loss_scale: Any = "dynamic", rounding: str = "nearest", *, accumulate_dtype: torch.dtype | None = None,
                 fused: bool | None = None, rounding_seed: int = 0, allreduce_dtype: torch.dtype | None = None,
                 state_dtype: torch.dtype | None = None, state_dtypes: dict | None = None,
                 state_rounding: str = "nearest", keep_fp32=(), keep_inputs=(), export: str = "masters") -> None:
        super().__init__(dtype, master_weights, loss_scale, rounding, accumulate_dtype, fused, rounding_seed,
                         allreduce_dtype, state_dtype=state_dtype, state_dtypes=state_dtypes,
                         state_rounding=state_rounding, keep_fp32=keep_fp32, keep_inputs=keep_inputs)
        if not all(isinstance(name, str) for name in self.keep_inputs):
            raise TypeError(f"keep_inputs takes the names of forward's keyword arguments, not {keep_inputs!r}")
        self.export = check_export(export)

    def build(self, inner: torch.optim.Optimizer, model: torch.nn.Module, loss_scale=None) -> FP16Optimizer:
        """The FP16Optimizer over ``inner``, the torch optimizer the Trainer made (or was
        given) over ``model``'s parameters. A LossScaler given is where each
        FP16Optimizer starts: a Trainer builds one per model (model_init, hyperparameter
        search), and none must start from another's scale."""
        if loss_scale is None and isinstance(self.loss_scale, LossScaler):
            loss_scale = copy.deepcopy(self.loss_scale)
        return super().build(inner, model, loss_scale)

    def __repr__(self) -> str:
        return (f"MPFP16Options(dtype={self.dtype}, master_weights={self.master_weights!r}, "
                f"loss_scale={self.loss_scale!r}, rounding={self.rounding!r}, "
                f"accumulate_dtype={self.accumulate_dtype}, fused={self.fused!r}, "
                f"allreduce_dtype={self.allreduce_dtype}, state_dtype={self.state_dtype}, "
                f"state_dtypes={self.state_dtypes!r}, state_rounding={self.state_rounding!r}, "
                f"keep_fp32={self.keep_fp32!r}, keep_inputs={self.keep_inputs!r}, export={self.export!r})")


class _AcceleratedFP16Optimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper over an :class:`mpfp16.FP16Optimizer`.

    ``step`` is ``FP16Optimizer.step()``, on the step's last micro-batch only (as
    accelerate steps), with the clipping that ``accelerator.clip_grad_norm_`` asked for,
    and records whether it was skipped: ``accelerator.optimizer_step_was_skipped`` reads
    ``step_was_skipped``, which accelerate sets only for its own GradScaler.

    No device placement: accelerate would move ``state_dict()`` to its device and load
    it back, a round trip of every master (and the stochastic-rounding generator's state
    onto the GPU, where ``torch.Generator.set_state`` refuses it); the masters are made
    on the model's device already.
    """

    def __init__(self, optimizer: FP16Optimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._clip: tuple[float, torch.Tensor] | None = None  # (max norm, the norm's tensor) for the next step
        self._shown: torch.Tensor | None = None  # the norm show_gradients filled, NaN'd if the step is skipped

    def clip_next_step(self, max_norm: float) -> torch.Tensor:
        """Clip the next step's unscaled fp32 gradients to ``max_norm`` (``inf``: only
        measure their norm). Returns a 0-dim fp32 tensor that the step fills with the
        norm before clipping (NaN until then, and after a skipped step)."""
        norm = torch.full((), math.nan, dtype=torch.float32, device=self.optimizer.master_params()[0].device)
        self._clip = (max_norm, norm)
        return norm

    @torch.no_grad()
    def show_gradients(self) -> None:
        """Before the callbacks' ``on_pre_optimizer_step``: the gradients as the
        Trainer gives them there in fp32, unscaled and clipped. The step unscales now
        (the fp32 gradients in the masters' ``.grad``), the clipping asked for runs now
        (``torch.nn.utils.clip_grad_norm_`` over the masters, as the Trainer clips its
        fp32 model), and each 16-bit ``.grad`` is set to its fp32 gradient rounded, for
        a callback that reads ``model.parameters()``."""
        opt: FP16Optimizer = self.optimizer
        opt.unscale_()
        clip, self._clip = self._clip, None
        if clip is not None:
            grads = [m for m in opt.master_params() if m.grad is not None]
            clip[1].copy_(torch.nn.utils.clip_grad_norm_(grads, clip[0]))
            self._shown = clip[1]
        show_unscaled_gradients(opt)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FP16Optimizer.step() takes no closure: the Trainer's backward ran already")
        if not self.gradient_state.sync_gradients:
            return None
        opt: FP16Optimizer = self.optimizer
        clip, self._clip = self._clip, None
        base = opt.max_grad_norm, opt.track_grad_norm
        if clip is not None:
            opt.max_grad_norm = None if math.isinf(clip[0]) else clip[0]
            opt.track_grad_norm = True
        try:
            stepped = opt.step()
        finally:
            opt.max_grad_norm, opt.track_grad_norm = base
        if clip is not None and stepped:
            clip[1].fill_(opt.last_grad_norm)
        shown, self._shown = self._shown, None  # the norm show_gradients measured
        if shown is not None and not stepped:
            shown.fill_(math.nan)
        self._is_overflow = not stepped
        if stepped:
            # A scheduler built over the inner optimizer (optimizers=(opt, sched)) wraps its
            # step() and warns when it was never called; the fused step does not call it.
            opt.optimizer._opt_called = True
        return None


class _MPFP16Accelerator(Accelerator):
    """The Trainer's Accelerator with mpfp16's backward, clipping, optimizer wrapper and
    DDP hook. It adds methods and no state of its own beyond ``_mpfp16`` (the
    options): the Trainer builds its Accelerator inside
    ``create_accelerator_and_postprocess``, and :class:`MPFP16Trainer` switches that
    instance's class to this one right after."""

    _mpfp16: MPFP16Options

    def _fp16(self) -> _AcceleratedFP16Optimizer:
        found = [o for o in self._optimizers if isinstance(o, _AcceleratedFP16Optimizer)]
        if len(found) != 1:
            raise RuntimeError("MPFP16Trainer's accelerator has no FP16Optimizer prepared: backward and clipping run "
                               "inside trainer.train(), after the optimizer is set up" if not found else
                               f"MPFP16Trainer's accelerator has {len(found)} FP16Optimizers prepared; it steps one")
        return found[0]

    def prepare_optimizer(self, optimizer, device_placement=None):
        if isinstance(optimizer, _AcceleratedFP16Optimizer):  # a later train() of the same Trainer
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        if not isinstance(optimizer, FP16Optimizer):
            raise TypeError(f"MPFP16Trainer's accelerator prepares the FP16Optimizer the Trainer built, not "
                            f"{type(optimizer).__name__}")
        wrapped = _AcceleratedFP16Optimizer(optimizer)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        # No placement: the model was converted on its device, into flat buffers that the
        # FP16Optimizer holds, and accelerate's model.to(self.device) makes new tensors
        # wherever the devices differ even in spelling (under torchrun on CPUs the
        # Accelerator's device is cpu:0 and the parameters' cpu: every parameter was
        # copied out of its buffer). A model on another device is refused instead.
        _check_device(model, self.device)
        model = super().prepare_model(model, device_placement=False, evaluation_mode=evaluation_mode)
        if isinstance(model, DistributedDataParallel) and handle_of(model) is None:
            attach(model, allreduce_dtype=self._mpfp16.allreduce_dtype)
        return model

    def backward(self, loss, **kwargs):
        # accelerate divides by its own accumulation count (the Trainer sets it to 1 and
        # divides the loss itself).
        self._fp16().optimizer.backward(loss / self.gradient_accumulation_steps, **kwargs)

    def unscale_gradients(self, optimizer=None):
        self._fp16().optimizer.unscale_()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        wrapped = self._fp16()
        if norm_type != 2:
            raise ValueError(f"MPFP16Trainer clips the global 2-norm of the unscaled fp32 gradients, not the "
                             f"{norm_type}-norm")
        if not max_norm > 0:
            raise ValueError(f"max_grad_norm must be positive (or 0 for no clipping in TrainingArguments), "
                             f"got {max_norm}")
        _check_all_parameters(parameters, wrapped.optimizer, "clip_grad_norm_")
        return wrapped.clip_next_step(float(max_norm))

    def clip_grad_value_(self, parameters, clip_value):
        opt = self._fp16().optimizer
        _check_all_parameters(parameters, opt, "clip_grad_value_")
        opt.unscale_()
        torch.nn.utils.clip_grad_value_(opt.master_params(), clip_value)


class _MPFP16CallbackHandler(CallbackHandler):
    """The Trainer's callbacks, with what they read in ``on_pre_optimizer_step`` as the
    Trainer's fp32 run gives it: when a callback overrides that hook, the gradients
    are unscaled and clipped before it, and what it writes into them is stepped
    (:meth:`_AcceleratedFP16Optimizer.show_gradients`). With no such callback the
    step unscales and clips inside ``step()``, the fast path. :class:`MPFP16Trainer`
    switches its handler's class to this one."""

    _trainer: weakref.ref

    def on_pre_optimizer_step(self, args, state, control):
        wrapped = _prepared(self._trainer())
        hooked = wrapped is not None and any(
            type(cb).on_pre_optimizer_step is not TrainerCallback.on_pre_optimizer_step for cb in self.callbacks)
        if hooked:
            wrapped.show_gradients()
        control = super().on_pre_optimizer_step(args, state, control)
        if hooked:
            take_written_gradients(wrapped.optimizer)
        return control


def _prepared(trainer) -> _AcceleratedFP16Optimizer | None:
    opt = getattr(trainer, "optimizer", None)
    return opt if isinstance(opt, _AcceleratedFP16Optimizer) else None


def _check_own_checkpoint(checkpoint: str) -> None:
    """Refuse, in one line, a checkpoint that transformers' own Trainer saved (at another
    precision): its ``optimizer.pt`` is the torch optimizer's state over fp32 weights,
    with no masters and no scale, and its ``scaler.pt`` is torch.amp's."""
    path = os.path.join(checkpoint, "optimizer.pt")
    if not os.path.isfile(path):
        return
    # memory-mapped: only the record's small entries are read, not the masters and the
    # state, which the Trainer's own load reads next
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(saved, dict) and str(saved.get("format", "")).startswith("mpfp16.FP16Optimizer"):
        return
    amp = " and torch.amp's scaler.pt" if os.path.isfile(os.path.join(checkpoint, "scaler.pt")) else ""
    raise ValueError(f"{checkpoint} was saved by transformers' own Trainer (its optimizer.pt{amp} hold a torch optimizer's "
                     "state over fp32 weights, no masters and no loss scale), and MPFP16Trainer resumes only its own "
                     f"checkpoints: to go on from its weights, build the model with from_pretrained('{checkpoint}') and "
                     "train without resume_from_checkpoint (the optimizer starts again)")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` are one device: ``cpu`` is ``cpu:0`` (a CPU tensor's device has no index)."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _check_device(model: torch.nn.Module, device: torch.device) -> None:
    """Refuse a model whose parameters are not on the Accelerator's device: it was
    converted where it is (``place_model_on_device=False`` leaves it there), and moving
    it now would take its parameters out of the FP16Optimizer's flat buffers."""
    for name, p in model.named_parameters():
        if not _same_device(p.device, device):
            raise ValueError(f"MPFP16Trainer's model has {name} on {p.device}, not on the Trainer's device {device}: "
                             "it was converted into flat buffers where it is, and moving it would take its "
                             "parameters out of the FP16Optimizer's buffers; put the model on args.device before "
                             "giving it to the Trainer")


def _check_all_parameters(parameters, opt: FP16Optimizer, what: str) -> None:
    """Refuse clipping asked over a part of the optimizer's parameters: FP16Optimizer
    clips all of its gradients, so the rest would be clipped too, unasked."""
    given = {id(p) for p in parameters}
    missing = sum(1 for p in opt.model_params() if id(p) not in given)
    if missing:
        raise ValueError(f"accelerator.{what} over parameters that leave out {missing} of the FP16Optimizer's: it "
                         "clips the unscaled fp32 gradients of all of them; pass model.parameters()")


def _refuse_arguments(args, optimizers) -> None:
    """What ``TrainingArguments`` or ``optimizers=`` ask for that MPFP16Trainer cannot
    honour, in one line, before the Trainer builds anything."""
    if args is None:  # the Trainer's defaults ask for none of it
        return
    for flag, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        if getattr(args, flag):
            raise ValueError(f"TrainingArguments({flag}=True) is torch.amp (fp32 weights under autocast); "
                             f"MPFP16Trainer keeps 16-bit weights and fp32 masters itself: drop {flag}=True and "
                             f"pass mpfp16=MPFP16Options(dtype=torch.{dtype})")
    for flag in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, flag):
            raise ValueError(f"TrainingArguments({flag}=True) casts the whole model for evaluation, norm layers too, "
                             "out of the FP16Optimizer's buffers; MPFP16Trainer evaluates its 16-bit model as it is: "
                             f"drop {flag}=True")
    if args.deepspeed:
        raise ValueError("MPFP16Trainer does not run under DeepSpeed: DeepSpeed keeps fp32 master weights and a loss "
                         "scaler of its own (its fp16/bf16 config); drop deepspeed= to use MPFP16Trainer, or use "
                         "DeepSpeed with the plain Trainer")
    if args.fsdp:
        raise ValueError("MPFP16Trainer does not run under FSDP: FSDP shards the weights and keeps fp32 masters of its "
                         "own (its mixed-precision policy); drop fsdp= for DDP under torchrun, or for sharded fp32 "
                         "masters with mpfp16 use mpfp16.distributed.shard in your own loop")
    if args.parallelism_config is not None:
        raise ValueError("MPFP16Trainer does not take a parallelism_config (tensor, context or sequence parallelism "
                         "shard the weights or the work across ranks): it runs on one device or under DDP")
    optim = getattr(args.optim, "value", args.optim)  # an OptimizerNames member, or the string it was given as
    if optim in _IN_BACKWARD or "layerwise" in optim:
        raise ValueError(f"optim={optim!r} updates each parameter inside the backward pass; FP16Optimizer steps "
                         "the fp32 masters once, after it: choose another optim")
    if optim.startswith("schedule_free"):
        raise ValueError(f"optim={optim!r}: a schedule-free optimizer's train() and eval() swap the parameters "
                         "it holds (the fp32 masters), not the model's 16-bit weights, so evaluation would see the "
                         "wrong weights: choose another optim")
    if args.n_gpu > 1:
        raise ValueError(f"{args.n_gpu} GPUs in one process run nn.DataParallel, which copies the model at every "
                         "forward, outside the FP16Optimizer's buffers: launch one process per GPU with torchrun "
                         "(DDP)")
    inner = optimizers[0] if optimizers else None
    while isinstance(inner, AcceleratedOptimizer):
        inner = inner.optimizer
    if isinstance(inner, FP16Optimizer):
        raise ValueError("optimizers= holds an FP16Optimizer: give the Trainer the torch optimizer, and "
                         "MPFP16Trainer wraps it")


def _refuse_accelerator(accelerator: Accelerator) -> None:
    """What the Accelerator was configured for outside ``TrainingArguments`` (an
    ``accelerate launch`` config, ``ACCELERATE_*`` environment variables), in one line."""
    if accelerator.mixed_precision != "no":
        raise ValueError(f"the Accelerator runs mixed_precision={accelerator.mixed_precision!r} (an accelerate config "
                         "or ACCELERATE_MIXED_PRECISION): torch.amp on top of mpfp16's 16-bit weights; set it to 'no' "
                         "and choose the dtype with MPFP16Options")
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM,
                                        DistributedType.XLA):
        raise ValueError(f"MPFP16Trainer runs on one device or under DDP, not {accelerator.distributed_type.value} "
                         "(an accelerate config or ACCELERATE_* environment variables): it shards the weights, keeps "
                         "master weights of its own, or compiles the step for another device")


class MPFP16Trainer(Trainer):
    """A ``transformers.Trainer`` that trains 16-bit weights over fp32 masters with
    :class:`mpfp16.FP16Optimizer`. Every argument but ``mpfp16`` is the Trainer's own.

        trainer = MPFP16Trainer(model=model, args=args, train_dataset=ds,
                                mpfp16=MPFP16Options(dtype=torch.float16, loss_scale="dynamic"))

    - The model is converted as :func:`mpfp16.to_half` converts it (norm layers, the
      model's ``_keep_in_fp32_modules`` and ``keep_fp32`` stay fp32; the floating-point
      inputs of its ``forward`` are cast to 16 bits, except the labels and
      ``keep_inputs``, and its outputs to fp32), on ``args.device``, when the Trainer
      places it there (for a ``model_init``, at every new model), before the optimizer
      is built and before accelerate wraps it in DDP.
    - ``save_model`` and each checkpoint write the model as ``export`` says (the fp32
      masters by default), recorded as an fp32 model: ``from_pretrained`` rounds
      nothing. A callback's ``on_pre_optimizer_step`` reads the unscaled, clipped
      gradients, and what it writes there is stepped.
    - The Trainer's optimizer (``args.optim``, ``optimizer_cls_and_kwargs``, or the
      torch optimizer given in ``optimizers=``) becomes the inner optimizer of an
      FP16Optimizer; ``trainer.fp16_optimizer`` is that. The lr scheduler, the Trainer's
      or the one given, works on the inner optimizer's param groups, which the
      FP16Optimizer shares.
    - Backward is ``FP16Optimizer.backward``; the step is ``FP16Optimizer.step()``:
      unscale, check for inf/NaN on every rank, skip or clip, update, copy back. A
      skipped step counts in ``global_step`` and does not step the lr scheduler, as
      with the Trainer's ``fp16=True`` on a GPU (torch.amp's GradScaler).
      ``args.max_grad_norm`` clips the unscaled fp32 gradients inside the step; the
      ``grad_norm`` the Trainer logs is their norm before clipping (NaN for a skipped
      step). The training logs add ``loss_scale`` and ``skipped_steps``.
    - ``args.gradient_accumulation_steps`` sums the micro-batches (in 16 bits, or in fp32
      with ``accumulate_dtype=torch.float32``). Under DDP (torchrun) the DDP module that
      accelerate builds gets mpfp16's hook, and the accumulating micro-batches run under
      its ``no_sync``: one exchange per optimizer step.
    - Checkpoints hold ``FP16Optimizer.state_dict()`` (masters, inner state, scaler) in
      ``optimizer.pt`` beside the 16-bit weights; ``train(resume_from_checkpoint=...)``
      ends bit for bit where an uninterrupted run ends.

    Refused in one line: a checkpoint of transformers' own Trainer given to
    ``resume_from_checkpoint``; when the Trainer is built, ``fp16``/``bf16`` and their
    ``*_full_eval`` in ``TrainingArguments``, DeepSpeed, FSDP, a
    ``parallelism_config``, optimizers that step inside backward (LOMO, layer-wise) or
    swap their parameters (schedule-free), several GPUs in one process, an
    FP16Optimizer given in ``optimizers=``, and an Accelerator configured for mixed
    precision, DeepSpeed, FSDP, Megatron-LM or XLA by an accelerate config. Options
    that contradict each other are refused when :class:`MPFP16Options` is built.
    """

    def __init__(self, *args, mpfp16: MPFP16Options | None = None, **kwargs) -> None:
        if mpfp16 is None:
            mpfp16 = MPFP16Options()
        if not isinstance(mpfp16, MPFP16Options):
            raise TypeError(f"mpfp16= takes an MPFP16Options, not {type(mpfp16).__name__}")
        bound = inspect.signature(Trainer.__init__).bind(self, *args, **kwargs)
        _refuse_arguments(bound.arguments.get("args"), bound.arguments.get("optimizers"))
        self._mpfp16 = mpfp16
        self._converted: weakref.WeakSet = weakref.WeakSet()
        super().__init__(*args, **kwargs)
        self._convert(self.model)  # one the Trainer did not place (place_model_on_device=False)
        if self.model is not None:
            keep_inputs_of(self.model, self._kept_inputs())  # the label names are set after the model was placed
        self.callback_handler.__class__ = _MPFP16CallbackHandler
        self.callback_handler._trainer = weakref.ref(self)

    # ------------------------------------------------------------------ set-up

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        _refuse_accelerator(self.accelerator)
        self.accelerator.__class__ = _MPFP16Accelerator
        self.accelerator._mpfp16 = self._mpfp16

    def _move_model_to_device(self, model, device) -> None:
        super()._move_model_to_device(model, device)
        self._convert(model)  # on its device: into flat buffers there, not before the move

    def _convert(self, model) -> None:
        if model is None or model in self._converted:
            return
        if isinstance(model, DistributedDataParallel):
            raise TypeError("MPFP16Trainer got a DistributedDataParallel module: give it the model, and accelerate "
                            "wraps it under torchrun")
        to_half(model, self._mpfp16.dtype, keep_fp32=self._mpfp16.keep_fp32, keep_inputs=self._kept_inputs())
        self._converted.add(model)

    def _kept_inputs(self) -> tuple[str, ...]:
        """The keyword inputs the model's input hook leaves in their dtype: the label
        names (known once the Trainer's ``__init__`` set them) and the user's."""
        return tuple(getattr(self, "label_names", None) or ("labels",)) + self._mpfp16.keep_inputs

    def create_optimizer(self, model=None):
        self._convert(self.model if model is None else model)
        if self.fp16_optimizer is not None:  # made by an earlier train() of this Trainer
            return self.optimizer
        inner = super().create_optimizer(model)
        self.optimizer = self._mpfp16.build(inner, self.model if model is None else model)
        return self.optimizer

    # ------------------------------------------------------------------ resume

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        _check_own_checkpoint(resume_from_checkpoint)  # before any of it is loaded
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    # ------------------------------------------------------------------ export

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """``save_model`` and each checkpoint's model: the state_dict as ``export``
        says (:func:`mpfp16.export.export_state_dict`), recorded as an fp32 model, so
        that ``from_pretrained`` rounds nothing (it would build the model in the
        dtype the config records: float16 rounds the fp32 norm layers)."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if self.args.should_save:
            state_dict = export_state_dict(model, self.fp16_optimizer, self._mpfp16.export, state_dict)
        super()._save(output_dir, state_dict=state_dict)
        config = os.path.join(output_dir if output_dir is not None else self.args.output_dir, "config.json")
        if self.args.should_save and os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                saved = json.load(f)
            if saved.get("dtype") != "float32":
                saved["dtype"] = "float32"
                with open(config, "w", encoding="utf-8") as f:
                    json.dump(saved, f, indent=2, sort_keys=True)
                    f.write("\n")

    # ------------------------------------------------------------------ reports

    @property
    def fp16_optimizer(self) -> FP16Optimizer | None:
        """The FP16Optimizer this Trainer steps (None before ``train()`` sets it up)."""
        opt = self.optimizer
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        return opt if isinstance(opt, FP16Optimizer) else None

    @property
    def loss_scale(self) -> float | None:
        opt = self.fp16_optimizer
        return opt.loss_scale if opt is not None else None

    @property
    def skipped_steps(self) -> int:
        opt = self.fp16_optimizer
        return opt.skipped_steps if opt is not None else 0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        opt = self.fp16_optimizer
        if opt is not None and "loss" in logs:  # a training log line
            logs = {**logs, "loss_scale": float(opt.loss_scale), "skipped_steps": opt.skipped_steps}
        super().log(logs, start_time)
