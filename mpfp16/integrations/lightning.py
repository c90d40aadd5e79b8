"""mpfp16 as a PyTorch Lightning precision plugin, for the ``Trainer`` and for ``Fabric``.

    trainer = lightning.Trainer(plugins=[MPFP16Precision(dtype=torch.float16)], ...)
    trainer.fit(model)                                  # your LightningModule, unchanged

    fabric = lightning.Fabric(plugins=[MPFP16FabricPrecision(dtype=torch.float16)], ...)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(loss); optimizer.step()

Either gives the model mpfp16's semantics: 16-bit weights and gradients (norm layers
fp32, as :func:`mpfp16.to_half` converts), each of the user's optimizers stepped over
fp32 master weights by its own :class:`mpfp16.FP16Optimizer`, the loss scaled in
backward, a step with inf/NaN gradients skipped on every rank, and clipping applied to
the unscaled fp32 gradients. Lightning's own ``"16-mixed"`` keeps fp32 weights and runs
under autocast; its ``"16-true"`` keeps fp16 weights only, with no master copy and no
loss scale (docs/LIGHTNING.md measures what that loses).

Needs the ``lightning`` package (``pip install 'mpfp16[lightning]'``); ``import
mpfp16`` never imports this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..export import check_export, export_state_dict
from ..optimizer import FP16Optimizer
from ..options import make_scaler
from ..parallel.ranks import is_main_process
from ..parallel.ddp import attach
from ..parallel.handles import handle_of
from .front_end import FrontEndOptions, show_unscaled_gradients, take_written_gradients, written

try:
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.fabric.utilities.device_dtype_mixin import _update_properties
    from lightning.fabric.wrappers import _FabricOptimizer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy,
                                              SingleDeviceXLAStrategy, XLAStrategy)
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning_utilities import apply_to_collection
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("mpfp16.integrations.lightning needs Lightning: pip install 'mpfp16[lightning]'") from exc

__all__ = ["MPFP16Precision", "MPFP16FabricPrecision", "LossScaleMonitor"]

logger = logging.getLogger("mpfp16")

_DTYPES = {torch.float16: "16-true", torch.bfloat16: "bf16-true"}  # Lightning's name for 16-bit weights


class _Options(FrontEndOptions):
    """The options both plugins take, checked when the plugin is built (before any
    trainer runs), and the FP16Optimizer they make from them."""

    def build(self, inner: torch.optim.Optimizer, model: torch.nn.Module | None, loss_scale=None) -> FP16Optimizer:
        if isinstance(inner, FP16Optimizer):
            raise ValueError("the optimizer is already an FP16Optimizer: give Lightning the torch optimizer, and the "
                             "plugin wraps it")
        return super().build(inner, model, loss_scale)

    def scaler(self):
        """The one loss scaler that every FP16Optimizer of a run shares (as torch.amp's
        recipe for several optimizers shares one GradScaler): the ``loss_scale``
        option's, a new one for each run unless the option is a scaler itself."""
        return make_scaler(self.loss_scale, self.dtype)

    def repr_args(self) -> str:
        return (f"dtype={self.dtype}, master_weights={self.master_weights!r}, loss_scale={self.loss_scale!r}, "
                f"rounding={self.rounding!r}")


class _Shared:
    """What both plugins share: the FP16Optimizers they made (one per torch optimizer,
    all on one loss scaler), their scale and skipped steps, the slots of their
    parameters, and what the model exports."""

    optimizers: list[FP16Optimizer]
    _options: _Options
    _export: str
    _slots: dict

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._options.repr_args()}, export={self._export!r})"

    @property
    def optimizer(self) -> FP16Optimizer | None:
        """The FP16Optimizer (the first, where the model has several optimizers)."""
        return self.optimizers[0] if self.optimizers else None

    @property
    def loss_scale(self) -> float | None:
        return self.optimizer.loss_scale if self.optimizer is not None else None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/NaN gradients, over every optimizer."""
        return sum(opt.skipped_steps for opt in self.optimizers)

    def _built(self, opts: list[FP16Optimizer]) -> None:
        """Remember where each parameter of ``opts`` lives now, so that a callback that
        replaces a parameter's tensor (``param.data = ...``) can be put back."""
        for opt in opts:
            self._slots[id(opt)] = [p.data for p in opt.model_params()]

    def _keep_writes(self) -> None:
        """Before the next forward pass: what was written into the weights since the
        last step becomes the masters' value (:func:`_return_replaced`, then
        :func:`_adopt_written_weights`), for every optimizer."""
        for opt in self.optimizers:
            _return_replaced(opt, self._slots.get(id(opt), ()))
            _adopt_written_weights(opt)

    def _targets(self, loss: torch.Tensor) -> list[FP16Optimizer]:
        """The FP16Optimizers a backward of ``loss`` gives gradients to: the one there
        is; with several, those whose parameters the loss's graph reaches."""
        if len(self.optimizers) <= 1:
            return list(self.optimizers)
        reached = _reached_parameters(loss)
        hit = [opt for opt in self.optimizers if any(id(p) in reached for p in opt.model_params())]
        return hit or self.optimizers[:1]

    def _watch_for_export(self, module: torch.nn.Module) -> None:
        """With ``export="masters"``, ``module.state_dict()`` (a Lightning checkpoint's
        ``state_dict``, ``fabric.save``) gives the fp32 masters (:class:`_ExportHook`);
        the hook of a plugin that converted the module before (an earlier Trainer's) goes."""
        hooks = module._state_dict_hooks
        mine = False
        for key, hook in list(hooks.items()):
            if isinstance(hook, _ExportHook):
                if hook.serves(self) and self._export == "masters":
                    mine = True
                else:
                    del hooks[key]
        if self._export == "masters" and not mine:
            module.register_state_dict_post_hook(_ExportHook(self, module))

    def export_state_dict(self, module: torch.nn.Module | None = None) -> dict:
        """The state_dict of ``module`` (the converted model, or any module inside it,
        such as a PEFT model's ``save_pretrained(..., state_dict=...)`` needs) as
        ``export=`` says: ``"masters"``, every floating-point tensor fp32 and each
        16-bit parameter its fp32 master; ``"weights"``, each tensor as the model holds
        it. A weight written since the last step (an average copied in at the end of
        ``fit``, pruning made permanent) counts with its written value, as the next
        step would adopt it."""
        if module is None:
            module = self._converted()
        with _ExportHook.paused():
            state = module.state_dict()
        return self._exported(module, state) if self._export == "masters" else state

    def _exported(self, module: torch.nn.Module, state: dict) -> dict:
        out = state
        for opt in self.optimizers or [None]:
            out = export_state_dict(module, opt, "masters", state_dict=out)
        values = {}
        for opt in self.optimizers:
            values.update(_written_values(opt))
        if values:
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) in values and name in out:
                    out[name] = values[id(p)]
        return out

    def _converted(self) -> torch.nn.Module:
        raise NotImplementedError


class _ExportHook:
    """``state_dict`` post-hook of the converted module (``export="masters"``): the
    module's state_dict as :meth:`_Shared.export_state_dict` gives it. A copy of the
    module (``deepcopy``, pickling) gets an inert hook: its parameters are not the ones
    the optimizers hold. ``state_dict(keep_vars=True)`` (the parameters themselves) is
    left as it is."""

    _paused = 0

    def __init__(self, plugin, module: torch.nn.Module) -> None:
        self._plugin = weakref.ref(plugin)
        self._module = weakref.ref(module)

    @classmethod
    @contextlib.contextmanager
    def paused(cls):
        cls._paused += 1
        try:
            yield
        finally:
            cls._paused -= 1

    def serves(self, plugin) -> bool:
        return self._plugin is not None and self._plugin() is plugin

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        plugin = self._plugin() if self._plugin is not None else None
        if plugin is None or self._paused or module is not self._module() or plugin._export != "masters":
            return
        keys = [k for k in state_dict if k.startswith(prefix)]
        if any(isinstance(state_dict[k], torch.nn.Parameter) for k in keys):  # keep_vars=True
            return
        out = plugin._exported(module, {k[len(prefix):]: state_dict[k] for k in keys})
        for key, value in out.items():
            state_dict[prefix + key] = value

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _plugin=None, _module=None)


def _cast_floating(data: Any, dtype: torch.dtype, keep=()) -> Any:
    """Every floating-point tensor in ``data`` (a batch: tensors in any nesting of
    collections, dataclasses included) cast to ``dtype``; integer tensors (labels, token
    ids) and other objects as they are. Lightning's ``"16-true"`` plugins cast a batch
    the same way (``HalfPrecision.convert_input``). What ``keep`` names at the batch's
    top level stays as it is: a dict's key, a namedtuple's or dataclass's field (a
    name), or a tuple's or list's position (an int): a regression target, rounded to
    16 bits, is no longer the target."""
    def cast(value):
        return apply_to_collection(value, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    names = {k for k in keep if isinstance(k, str)}
    positions = {k for k in keep if isinstance(k, int)}
    if isinstance(data, dict) and names:
        return type(data)((k, v if k in names else cast(v)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields") and names:
        return type(data)(*(v if f in names else cast(v) for f, v in zip(data._fields, data)))
    if isinstance(data, (tuple, list)) and positions:
        return type(data)(v if i in positions else cast(v) for i, v in enumerate(data))
    if dataclasses.is_dataclass(data) and not isinstance(data, type) and names:
        return dataclasses.replace(data, **{f.name: cast(getattr(data, f.name)) for f in dataclasses.fields(data)
                                            if f.name not in names and f.init})
    return cast(data)


def _set_dtype(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """``LightningModule.dtype`` (and ``.dtype`` of any of Lightning's modules inside):
    the 16-bit dtype of the converted weights, as ``"16-true"``'s conversion sets it,
    so that a step's ``torch.randn(..., dtype=self.dtype)`` meets the weights' dtype."""
    _update_properties(module, dtype=dtype)


@torch.no_grad()
def _return_replaced(opt: FP16Optimizer, slots) -> None:
    """Put back in its place every parameter whose tensor a callback replaced
    (``param.data = new``, as Lightning's ``ModelPruning`` does when it resets the
    parameters to their initial values, and torch's pruning when it makes pruning
    permanent), which takes it out of the FP16Optimizer's buffer. The new value is
    written into the parameter's place (rounded to its dtype) and, with fp32 masters,
    into its master exactly: the value the callback gave, as fp32 training keeps it."""
    fp32_masters = opt.master_mode == "fp32"
    masters = None
    for i, (p, slot) in enumerate(zip(opt.model_params(), slots)):
        if p.data_ptr() == slot.data_ptr() and p.dtype == slot.dtype and p.shape == slot.shape:
            continue
        new = p.data
        if new.shape != slot.shape:
            raise RuntimeError(f"a parameter of shape {list(slot.shape)} was replaced by a tensor of shape "
                               f"{list(new.shape)}: an FP16Optimizer's parameters keep their shapes")
        slot.copy_(new)
        if fp32_masters and slot.dtype != torch.float32:
            masters = opt.master_params() if masters is None else masters
            masters[i].copy_(new)
        p.data = slot  # back in place (a .data write leaves the version counter, so the master stays as set)


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
    for weight, master, mask in _written(opt):
        torch.where(mask, weight.to(master.dtype), master, out=master)


def _written(opt: FP16Optimizer):
    """(weight, master, mask) for each 16-bit weight with an fp32 master some of whose
    elements are not their master's rounding (written since the last step)."""
    if opt.master_mode != "fp32":
        return
    for weight, master in zip(opt.model_params(), opt.master_params()):
        if weight is master or weight.dtype == master.dtype or weight.shape != master.shape:
            continue
        mask = written(weight, master)
        if bool(mask.any()):
            yield weight, master, mask


def _written_values(opt: FP16Optimizer) -> dict:
    """id(weight) -> its value as the next step would adopt it (fp32), for the weights
    written since the last step; the masters are left as they are."""
    return {id(w): torch.where(mask, w.detach().to(m.dtype), m) for w, m, mask in _written(opt)}


def _reached_parameters(loss: torch.Tensor) -> set[int]:
    """id() of every leaf tensor that a backward of ``loss`` gives a gradient: the
    variables of the ``AccumulateGrad`` nodes of its graph."""
    out: set[int] = set()
    seen: set = set()
    stack = [getattr(loss, "grad_fn", None)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            out.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return out


def _hooks_read_gradients(model, trainer) -> bool:
    """Whether the LightningModule or a callback has an ``on_before_optimizer_step``
    (the hook where Lightning shows the gradients), so that the step unscales them
    before it, as ``"16-mixed"`` does."""
    return is_overridden("on_before_optimizer_step", model) or any(
        is_overridden("on_before_optimizer_step", cb) for cb in trainer.callbacks)


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


class _ToggleModelParameters:
    """``LightningModule.toggle_optimizer`` / ``untoggle_optimizer`` under the plugin
    (manual optimization): Lightning's rule, applied to the model's parameters. An
    FP16Optimizer's ``param_groups`` hold its fp32 masters, whose ``requires_grad``
    Lightning's own toggle would set, leaving the model's parameters as they were."""

    def __init__(self, plugin: MPFP16Precision, module, untoggle: bool) -> None:
        self._plugin, self._module, self._untoggle = weakref.ref(plugin), weakref.ref(module), untoggle

    def __call__(self, optimizer) -> None:
        plugin = self._plugin() if self._plugin is not None else None
        module = self._module() if self._module is not None else None
        if plugin is None or module is None:
            raise RuntimeError("toggle_optimizer of a copy of a LightningModule made while MPFP16Precision trained it: "
                               "toggle the LightningModule the Trainer trains")
        opt = plugin._fp16(optimizer)
        if self._untoggle:
            state = getattr(module, "_mpfp16_requires_grad", {})
            for other in plugin.optimizers:
                if other is not opt:
                    for p in other.model_params():
                        if id(p) in state:
                            p.requires_grad_(state[id(p)])
            module._mpfp16_requires_grad = {}
            return
        state = {}
        for other in plugin.optimizers:
            for p in other.model_params():
                if id(p) not in state:
                    state[id(p)] = p.requires_grad
                    p.requires_grad_(False)
        for p in opt.model_params():
            p.requires_grad_(state[id(p)])
        module._mpfp16_requires_grad = state

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _plugin=None, _module=None)


class MPFP16Precision(_Shared, Precision):
    """A precision plugin for the Lightning ``Trainer``: fp16 (or bf16) weights and
    gradients, each ``configure_optimizers`` optimizer stepped over fp32 masters by an
    :class:`mpfp16.FP16Optimizer` of its own.

        Trainer(plugins=[MPFP16Precision(dtype=torch.float16, master_weights=True,
                                         loss_scale="dynamic", rounding="nearest")])

    - The model is converted as :func:`mpfp16.to_half` converts it (norm layers and the
      modules ``keep_fp32`` names stay fp32; inputs of its ``forward`` are cast to 16
      bits and outputs back to fp32), on the strategy's device, before Lightning wraps
      it in DDP; ``LightningModule.dtype`` is then the 16-bit dtype. Every batch's
      floating-point tensors are cast to 16 bits before its step, as ``"16-true"``
      casts them (:meth:`convert_input`): a step that calls a submodule gets 16-bit
      outputs from it; compute the loss in fp32 (``logits.float()``).
    - Backward scales the loss; the step unscales, skips on inf/NaN (on every rank),
      clips, steps and copies back, as ``FP16Optimizer.step()`` does. A skipped step
      counts as an optimizer step for ``global_step`` and the lr schedulers, as with
      ``"16-mixed"`` (torch.amp). ``last_step_skipped``, ``skipped_steps`` and
      ``loss_scale`` say what happened; :class:`LossScaleMonitor` logs the last two.
      A step with no backward (a ``training_step`` that returns None, the batch-norm
      epoch of ``StochasticWeightAveraging``) is not taken and leaves the scale alone.
    - Manual optimization (``automatic_optimization = False``) with one or several
      optimizers: each is its own FP16Optimizer, all on one loss scaler;
      ``self.manual_backward(loss)`` scales the loss once and gives its gradients to
      the optimizers whose parameters it reaches; ``toggle_optimizer`` freezes the
      model's parameters of the other optimizers.
    - A hook ``on_before_optimizer_step`` (of the LightningModule or a callback) sees
      the unscaled gradients in the model's ``.grad``, as under ``"16-mixed"``;
      clipping follows it.
    - A write into the 16-bit weights by the hooks of an epoch's start or end or of a
      validation run (a callback's pruning, an average copied in), or a parameter's
      tensor replaced there (``param.data = ...``), becomes the masters' value before
      the next training step, as fp32 training keeps it (once after such hooks ran, not
      at every step); an EMA swapped in and back changes nothing. A write in the hooks
      around each batch is undone by the next step, as in mpfp16's own loop
      (docs/LIGHTNING.md).
    - ``gradient_clip_val`` clips the unscaled fp32 gradients: by norm inside the step
      (bit for bit ``clip_grad_norm_`` after ``unscale_()``), by value after
      ``unscale_()``.
    - Under ``strategy="ddp"``, mpfp16's hook averages the 16-bit gradients
      (``allreduce_dtype`` sets the wire), once per optimizer step with
      ``accumulate_grad_batches``; ``accumulate_dtype=torch.float32`` sums the
      micro-batches in fp32 and the exchange carries the sum.
    - Checkpoints: the ``state_dict`` is the fp32 masters with ``export="masters"``
      (the default: ``load_from_checkpoint`` gives an fp32 model with the trained
      values), the 16-bit weights with ``export="weights"``; the optimizer state is
      ``FP16Optimizer.state_dict()``: masters, the inner optimizer's state and the
      scaler's. ``trainer.fit(ckpt_path=...)`` resumes from it bit for bit, mid-epoch
      too where the training loader is one Lightning can resume.

    Refused when ``fit`` sets up, before the first batch, in one line: a strategy other
    than one device or DDP (FSDP and DeepSpeed shard or hold their own master weights),
    LBFGS, a DDP communication hook of the user's.

    Args: ``dtype`` (torch.float16 or torch.bfloat16), ``master_weights``,
    ``loss_scale``, ``rounding``, ``accumulate_dtype``, ``fused``, ``rounding_seed``,
    ``state_dtype``, ``state_dtypes``, ``state_rounding``: as
    :class:`mpfp16.FP16Optimizer` takes them; ``allreduce_dtype``: as
    :func:`mpfp16.distributed.wrap` takes it; ``keep_fp32``: as :func:`mpfp16.to_half`
    takes it (names as the LightningModule's ``named_modules()`` gives them);
    ``keep_inputs``: what a batch keeps in its dtype (a dict's keys or a namedtuple's
    fields by name, a tuple's positions by int; default a dict batch's ``labels``), and
    the keyword inputs of ``forward`` of those names;
    ``export``: ``"masters"`` or ``"weights"``, what the model's ``state_dict`` holds.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, master_weights: bool | str = True,
                 loss_scale: Any = "dynamic", rounding: str = "nearest", *, accumulate_dtype: torch.dtype | None = None,
                 fused: bool | None = None, rounding_seed: int = 0, allreduce_dtype: torch.dtype | None = None,
                 state_dtype: torch.dtype | None = None, state_dtypes: dict | None = None,
                 state_rounding: str = "nearest", keep_fp32=(), keep_inputs=("labels",),
                 export: str = "masters") -> None:
        self._options = _Options(dtype, master_weights, loss_scale, rounding, accumulate_dtype, fused, rounding_seed,
                                 allreduce_dtype, state_dtype=state_dtype, state_dtypes=state_dtypes,
                                 state_rounding=state_rounding, keep_fp32=keep_fp32, keep_inputs=keep_inputs)
        self._export = check_export(export)
        self.precision = _DTYPES[dtype]
        self.optimizers: list[FP16Optimizer] = []  # made when fit() sets up, one per configure_optimizers optimizer
        self.last_step_skipped = False
        self._slots: dict = {}
        self._module_ref = None  # the converted LightningModule
        self._step_max_norm: float | None = None  # gradient clipping by norm asked for in this step
        self._no_backward = False  # while this step had no backward: nothing to unscale or step
        self._shown: FP16Optimizer | None = None  # unscaled for on_before_optimizer_step: its writes are stepped
        self._hooks_seen: tuple | None = None  # _hooks_ran at the last training step that kept written weights

    # -------------------------------------------------------------- set-up

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:  # Lightning's strategy converts the LightningModule it trains
            _refuse_trainer(trainer, module)
            module.to(trainer.strategy.root_device)  # into flat buffers on the device, not before the move
        self._options.convert(module)
        _set_dtype(module, self._options.dtype)
        self._module_ref = weakref.ref(module)
        self._watch_for_export(module)
        return module

    def _converted(self) -> torch.nn.Module:
        module = self._module_ref() if self._module_ref is not None else None
        if module is None:
            raise RuntimeError("MPFP16Precision has converted no model yet: export_state_dict(module) needs one")
        return module

    def convert_input(self, data: Any) -> Any:
        """The batch's floating-point tensors cast to the model's 16-bit dtype, as
        Lightning's ``"16-true"`` casts them, before every training, validation, test
        and prediction step: a step that calls a submodule (``self.net(x)``) gives it
        the 16-bit input that ``self(x)`` would. That submodule's outputs are 16-bit;
        only the converted LightningModule's own ``forward`` casts its outputs to fp32."""
        return _cast_floating(data, self._options.dtype, self._options.keep_inputs)

    def connect(self, model, optimizers: list, lr_schedulers: list):
        if not optimizers or optimizers == self.optimizers:  # evaluation; or after this plugin's own fit
            return model, optimizers, lr_schedulers
        if len(optimizers) == 1 and isinstance(optimizers[0], _MockOptimizer):
            raise ValueError("configure_optimizers returned no optimizer; MPFP16Precision steps the ones it returns")
        module = model.module if isinstance(model, DistributedDataParallel) else model
        if isinstance(model, DistributedDataParallel):
            attach(model, allreduce_dtype=self._options.allreduce_dtype)
        scaler = self._options.scaler()
        self.optimizers = [self._options.build(opt, module, loss_scale=scaler) for opt in optimizers]
        self._slots = {}
        self._built(self.optimizers)
        self._hooks_seen = None
        if not module.automatic_optimization:
            module.toggle_optimizer = _ToggleModelParameters(self, module, untoggle=False)
            module.untoggle_optimizer = _ToggleModelParameters(self, module, untoggle=True)
        return model, list(self.optimizers), lr_schedulers

    def teardown(self) -> None:
        """At the end of ``fit``: a parameter whose tensor was replaced since the last
        training step (``ModelPruning`` makes pruning permanent so, in ``on_train_end``)
        is put back in its place, so that the model stays converted; the toggles go."""
        for opt in self.optimizers:
            _return_replaced(opt, self._slots.get(id(opt), ()))
        module = self._module_ref() if self._module_ref is not None else None
        if module is not None:
            for name in ("toggle_optimizer", "untoggle_optimizer"):
                if isinstance(module.__dict__.get(name), _ToggleModelParameters):
                    del module.__dict__[name]
        super().teardown()

    def _fp16(self, optimizer) -> FP16Optimizer:
        opt = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer holds it
        if not isinstance(opt, FP16Optimizer) or not any(opt is mine for mine in self.optimizers):
            raise RuntimeError("MPFP16Precision was asked to step an optimizer it did not set up")
        return opt

    # -------------------------------------------------------------- the step

    @contextlib.contextmanager
    def train_step_context(self):
        """Around each ``training_step``: first, at the first one after hooks that may
        write the weights ran (:func:`_hooks_ran`), what they wrote becomes the
        masters' value, so that the forward pass and the step use it."""
        module = self._module_ref() if self._module_ref is not None else None
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and self.optimizers:
            ran = _hooks_ran(trainer)
            if ran != self._hooks_seen:  # the first step, or hooks that may write weights ran since the last
                self._keep_writes()
                self._hooks_seen = ran
        with self.forward_context():
            yield

    def backward(self, tensor: torch.Tensor, model, optimizer, *args, **kwargs) -> None:
        if not self.optimizers:
            raise RuntimeError("MPFP16Precision: backward before fit() set up the optimizer")
        if args:
            raise ValueError("FP16Optimizer.backward() takes keyword arguments only (retain_graph=...)")
        FP16Optimizer.backward_together(self._targets(tensor), tensor, **kwargs)  # manual optimization passes no optimizer

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        opt = self._fp16(optimizer)
        if kwargs:
            raise ValueError(f"FP16Optimizer.step() takes no arguments; got {', '.join(sorted(kwargs))}")
        closure_result = closure()  # training_step and backward (and zero_grad on the first micro-batch)
        trainer = model.trainer
        # no backward ran: a training_step that returned None, or SWA's batch-norm epoch (forward passes only)
        no_backward = model.automatic_optimization and (
            closure_result is None or bool(getattr(trainer.fit_loop, "_skip_backward", False)))
        if not no_backward and _hooks_read_gradients(model, trainer):
            opt.unscale_()  # the hook sees the unscaled gradients, as under "16-mixed"
            show_unscaled_gradients(opt)
            self._shown = opt  # what the hook writes there is stepped (_take_written)
        self._no_backward = no_backward
        try:
            self._after_closure(model, optimizer)  # on_before_optimizer_step, then the clipping
            self._take_written()
        finally:
            self._no_backward, self._shown = False, None
        max_norm, self._step_max_norm = self._step_max_norm, None
        if no_backward:
            self.last_step_skipped = True  # no step, no scale change (as torch.amp's "16-mixed" skips its scaler)
            return closure_result
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
        if self._no_backward:  # no backward ran: no gradients to clip, and no step follows
            return
        self._take_written()  # the hook ran: its writes first, then the clipping
        opt.unscale_()
        torch.nn.utils.clip_grad_value_(opt.master_params(), clip_val)

    def _take_written(self) -> None:
        """After ``on_before_optimizer_step`` saw the unscaled 16-bit gradients: what it
        wrote into them becomes the fp32 gradients the step reads (once)."""
        if self._shown is not None:
            take_written_gradients(self._shown)
            self._shown = None

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


class MPFP16FabricPrecision(_Shared, FabricPrecision):
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
    :meth:`adopt_written_weights` after the write. Fabric shows a precision plugin the optimizers
    only when they step, so the plugin wraps them at the first ``fabric.backward()``: it
    finds every optimizer that ``fabric.setup`` (or ``setup_optimizers``) returned over
    the parameters of the models it converted, wraps each torch optimizer inside them in
    an :class:`mpfp16.FP16Optimizer` of its own (all on one loss scaler), and points the
    Fabric optimizer at it. From then on ``optimizer.zero_grad()``, ``optimizer.step()``,
    ``fabric.clip_gradients`` (pass ``error_if_nonfinite=False``, as with
    ``"16-mixed"``: a step whose gradients overflowed is skipped, not an error),
    ``optimizer.state_dict()`` and ``fabric.save`` / ``fabric.load`` reach the
    FP16Optimizer: masters, inner state and scaler. With several models and optimizers
    (a GAN), ``fabric.backward(loss)`` scales the loss once by the shared scale and gives
    its gradients to the optimizers whose parameters it reaches.
    A ``fabric.load`` before the first backward (a resume) wraps the optimizers first:
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
                 state_dtypes: dict | None = None, state_rounding: str = "nearest", keep_fp32=(),
                 keep_inputs=("labels",), export: str = "masters") -> None:
        self._options = _Options(dtype, master_weights, loss_scale, rounding, accumulate_dtype, fused, rounding_seed,
                                 None, state_dtype=state_dtype, state_dtypes=state_dtypes,
                                 state_rounding=state_rounding, keep_fp32=keep_fp32, keep_inputs=keep_inputs)
        self._export = check_export(export)
        self.precision = _DTYPES[dtype]
        self.optimizers: list[FP16Optimizer] = []  # made at the first fabric.backward()
        self._slots: dict = {}
        self._scaler = None  # the loss scaler the FP16Optimizers share, made with the first of them
        self._modules: list[weakref.ref] = []
        self._unseen = False  # a model was converted since the optimizers were looked for
        self._ddp_hooked = False  # accumulate_dtype: mpfp16's hook attached to Fabric's DDP module, if any
        self._arrived: dict = {}  # id(inner) -> an FP16Optimizer state being loaded through the inner optimizer
        self._load_hooked = weakref.WeakSet()  # the torch optimizers given the load hooks
        self.last_step_skipped = False

    def adopt_written_weights(self) -> None:
        """Make what the loop wrote into the 16-bit weights since the last step the fp32
        masters' value (pruning, an average copied in, a ``load_state_dict``, a
        parameter's tensor replaced by ``param.data = ...``), which the next step would
        otherwise overwrite from the masters; a pass over every weight and master, for
        the loop to call after such a write (a write swapped back before the step needs
        none)."""
        self._keep_writes()

    def convert_input(self, data: Any) -> Any:
        """The floating-point tensors passed to a module that ``fabric.setup`` returned,
        cast to the model's 16-bit dtype, as Lightning's ``"16-true"`` casts them. A
        step method that Fabric sends through the module's ``forward`` (a
        LightningModule's ``training_step`` under DDP) gets its batch cast too; one
        called on it directly on one device does not, as under ``"16-true"``: the loop
        casts that batch with this method (docs/LIGHTNING.md)."""
        return _cast_floating(data, self._options.dtype, self._options.keep_inputs)

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
        self._options.convert(module)
        _set_dtype(module, self._options.dtype)
        self._modules = [ref for ref in self._modules if ref() is not None and ref() is not module]
        self._modules.append(weakref.ref(module))
        self._unseen = True
        self._watch_for_export(module)
        # fabric.setup(model, optimizer): the optimizer exists already. A checkpoint load
        # into it (fabric.load, before any backward) wraps it first, then loads.
        owner = self._owner()
        for inner in _optimizers(lambda cls: issubclass(cls, torch.optim.Optimizer) and not issubclass(
                cls, FP16Optimizer), owner):
            if inner not in self._load_hooked:
                inner.register_load_state_dict_pre_hook(self._load_into_wrapper)
                inner.register_load_state_dict_post_hook(self._load_wrapper_after_inner)
                self._load_hooked.add(inner)
        return module

    def _converted(self) -> torch.nn.Module:
        modules = [m for m in (ref() for ref in self._modules) if m is not None]
        if len(modules) != 1:
            raise RuntimeError(f"MPFP16FabricPrecision converted {len(modules)} models: name the one to export, "
                               "export_state_dict(model)")
        return modules[0]

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
        self._arrived.pop(id(inner), None)  # what a load that failed half-way left
        if not (isinstance(state_dict, dict) and "master_weights" in state_dict and "optimizer" in state_dict):
            return None  # the inner optimizer's own state
        self._wrap_found_optimizers()
        if not any(opt.optimizer is inner for opt in self.optimizers):
            return None
        self._arrived[id(inner)] = state_dict
        return state_dict["optimizer"]

    def _load_wrapper_after_inner(self, inner) -> None:
        """The inner optimizer's load_state_dict post-hook: the FP16Optimizer state
        that :meth:`_load_into_wrapper` saw arrive, loaded by the FP16Optimizer (which
        loads the inner optimizer's part again, into the same masters, and takes its
        new groups)."""
        state_dict = self._arrived.pop(id(inner), None)
        if state_dict is not None:
            next(opt for opt in self.optimizers if opt.optimizer is inner).load_state_dict(state_dict)

    def _wrap_found_optimizers(self) -> None:
        """Every optimizer Fabric set up over the converted models' parameters, wrapped
        (each torch optimizer once, in an FP16Optimizer of its own, on the shared loss
        scaler); looked for again only after another model was converted."""
        if self.optimizers and not self._unseen:
            return
        owner = self._owner()
        if not owner:
            raise RuntimeError("MPFP16FabricPrecision: fabric.backward() before fabric.setup(model, ...)")
        found = {}  # id(inner) -> (inner, [fabric optimizers])
        for wrapper in _optimizers(lambda cls: issubclass(cls, _FabricOptimizer), owner,
                                   inner_of=lambda obj: obj.__dict__.get("_optimizer")):
            inner = wrapper.__dict__["_optimizer"]
            if isinstance(inner, FP16Optimizer):  # wrapped already (its fp32 parameters are its own masters)
                continue
            found.setdefault(id(inner), (inner, []))[1].append(wrapper)
        if not found and not self.optimizers:
            raise RuntimeError("MPFP16FabricPrecision steps the optimizers over the models it converted; no "
                               "optimizer set up with fabric.setup(model, optimizer) or fabric.setup_optimizers "
                               "holds their parameters")
        if self._scaler is None:
            self._scaler = self._options.scaler()
        # in the order the models were set up, and their parameters within each
        position = {pid: i for i, pid in enumerate(owner)}
        made = []
        for inner, wrappers in sorted(found.values(), key=lambda entry: min(
                position.get(id(p), len(position)) for g in entry[0].param_groups for p in g["params"])):
            modules = {id(owner[id(p)]): owner[id(p)] for g in inner.param_groups for p in g["params"]
                       if id(p) in owner}
            opt = self._options.build(inner, next(iter(modules.values())) if len(modules) == 1 else None,
                                      loss_scale=self._scaler)
            made.append(opt)
            for wrapper in wrappers:
                wrapper._optimizer = opt
                # Fabric's optimizer imitates the torch optimizer's class, so its zero_grad is
                # torch's over param_groups (the masters): the 16-bit gradients need this one.
                wrapper.zero_grad = opt.zero_grad
        self.optimizers = self.optimizers + made
        self._built(made)
        self._unseen = False

    def backward(self, tensor: torch.Tensor, model, *args, **kwargs) -> None:
        self._wrap_found_optimizers()
        if self._options.accumulate_dtype is not None and not self._ddp_hooked:
            self._attach_to_ddp()
        if args:
            raise ValueError("FP16Optimizer.backward() takes keyword arguments only (retain_graph=...)")
        FP16Optimizer.backward_together(self._targets(tensor), tensor, **kwargs)

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
        if not any(optimizer is opt for opt in self.optimizers):
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
