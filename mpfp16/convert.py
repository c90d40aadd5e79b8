"""Convert a model to 16-bit weights, keeping normalization layers in fp32.

Normalization layers keep fp32 parameters and running statistics: their statistics
are sums over many values, and fp16's 10-bit mantissa loses them. PyTorch's
batch_norm, layer_norm, group_norm and rms_norm kernels accept a 16-bit input with fp32
weights on both CPU and CUDA and return the input's dtype, so nothing else changes.

Other modules kept in fp32 compute in fp32 and hand the 16-bit layers after them
16-bit outputs (:class:`FP32Island`): the norm classes that libraries write themselves (transformers'
``LlamaRMSNorm`` and ``T5LayerNorm``, timm's ``LayerNorm2d``: any class whose name ends
in ``RMSNorm``, ``RmsNorm``, ``LayerNorm``, ``GroupNorm``, ``BatchNorm`` or
``InstanceNorm``, with an optional dimension suffix, and no parameters in
submodules), a transformers model's ``_keep_in_fp32_modules``, and the modules a user
names in ``keep_fp32``. Rotary-embedding modules (a class name holding
``RotaryEmbedding``, no parameters) keep their ``inv_freq`` buffer in fp32, as
transformers' own 16-bit loading keeps it; they cast their outputs themselves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn as nn

from . import flat_buffers

__all__ = ["NORM_TYPES", "HALF_DTYPES", "to_half", "to_float", "model_dtype", "cast_floating", "CastInputs", "outputs_to_fp32",
           "keeps_fp32", "fp32_modules", "FP32Island", "keep_inputs_of"]

HALF_DTYPES = (torch.float16, torch.bfloat16)

# _BatchNorm covers BatchNorm1d/2d/3d, SyncBatchNorm and the lazy variants;
# _InstanceNorm covers InstanceNorm1d/2d/3d, affine or not.
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def keeps_fp32(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters and buffers stay fp32 in a 16-bit model: the
    one policy of :func:`to_half` and of :func:`mpfp16.distributed.shard` (which keeps
    such layers as fp32 units). True for normalization layers (module docstring).
    """
    return isinstance(module, NORM_TYPES)


# Norm classes that libraries define themselves (transformers' LlamaRMSNorm, T5LayerNorm,
# Qwen2RMSNorm; timm's LayerNorm2d, RmsNorm), matched by their class's name.
_NORM_NAME = re.compile(r"(RMS|Rms|Layer|Group|Batch|Instance)Norm(\d+d)?$")
_ROTARY_NAME = re.compile(r"RotaryEmbedding")


def _component_match(name: str, wanted: str) -> bool:
    """transformers' rule for ``_keep_in_fp32_modules``: ``wanted`` is the module's full
    dotted name, or one or more whole components of it (``"wo"`` matches
    ``encoder.block.0.layer.1.DenseReluDense.wo``)."""
    return name == wanted or f".{wanted}." in f".{name}."


def fp32_modules(model: nn.Module, keep_fp32: Iterable = ()) -> dict[nn.Module, bool]:
    """The modules of ``model`` whose whole subtree stays fp32 in a 16-bit model, each
    mapped to whether it needs :class:`FP32Island`'s casts (True) or computes in the
    16-bit input's dtype itself (torch's norm classes, rotary embeddings: False).

    Args:
        keep_fp32: module classes (``isinstance``) or names (a module's dotted name, or
            whole components of it, as transformers matches ``_keep_in_fp32_modules``).

    Raises:
        ValueError: a name that no module of ``model`` matches, or an entry that is
            neither a class nor a string (one line).
    """
    if isinstance(keep_fp32, (str, type)):
        keep_fp32 = (keep_fp32,)
    types, names = [], []
    for entry in keep_fp32 or ():
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            types.append(entry)
        elif isinstance(entry, str) and entry:
            names.append(entry)
        else:
            raise ValueError(f"keep_fp32 takes module classes and module names, not {entry!r}")
    named = list(model.named_modules())
    for wanted in names:
        if not any(_component_match(name, wanted) for name, _ in named if name):
            raise ValueError(f"keep_fp32 names {wanted!r}, which no module of the {type(model).__name__} is called "
                             "(give a dotted name from model.named_modules(), or a part of one)")
    # transformers' own list, on each PreTrainedModel in the tree, relative to it
    hf = []
    for prefix, module in named:
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            for wanted in getattr(module, attr, None) or ():  # PreTrainedModel.post_init sets it on the instance
                hf.append((f"{prefix}." if prefix else "", wanted))
    kept: dict[nn.Module, bool] = {}
    inside: set[int] = set()  # modules under a kept one: kept with it
    for name, module in named:
        if id(module) in inside:
            continue
        if keeps_fp32(module):
            kept[module] = False
        elif (any(isinstance(module, t) for t in types)
              or any(name and _component_match(name, wanted) for wanted in names)
              or any(name.startswith(prefix) and _component_match(name[len(prefix):], wanted) for prefix, wanted in hf)
              or (_NORM_NAME.search(type(module).__name__) and _own_parameters_only(module))):
            kept[module] = True
        elif _ROTARY_NAME.search(type(module).__name__) and not any(True for _ in module.parameters()):
            kept[module] = False
        else:
            continue
        inside.update(id(m) for m in module.modules())
    return kept


def _own_parameters_only(module: nn.Module) -> bool:
    """No submodule of ``module`` holds a parameter: a norm, not a block named for one."""
    return not any(True for child in module.children() for _ in child.parameters())


class FP32Island:
    """The hooks of a module kept in fp32 inside a 16-bit model: its floating-point
    inputs are cast to fp32 before its forward, and its floating-point outputs to the
    model's 16-bit ``dtype`` after it, so that the 16-bit layers after it get what a
    16-bit module would give them (a model that widens a value on its way into the
    module, as T5 does into its ``wo``, gets it back in 16 bits). ``pre`` and
    ``post`` are the two hooks; a class at module level, so that a converted model
    pickles."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def pre(self, module, args, kwargs):
        return cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)

    def post(self, module, args, kwargs, output):
        return cast_floating(output, self.dtype)


def _island_of(module: nn.Module) -> FP32Island | None:
    for hook in module._forward_pre_hooks.values():
        if isinstance(getattr(hook, "__self__", None), FP32Island):
            return hook.__self__
    return None


def cast_floating(obj, dtype: torch.dtype):
    """Cast every floating-point tensor inside ``obj`` (tensors, tuples, lists, dicts)
    to ``dtype``; integer tensors (labels, token ids) and other objects pass through."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(cast_floating(o, dtype) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, cast_floating(v, dtype)) for k, v in obj.items())
    return obj


class CastInputs:
    """A forward pre-hook that casts a module's floating-point inputs to ``dtype``, or,
    when ``dtype`` is None, to whatever dtype the module computes in now
    (:func:`model_dtype`): after ``model.float()`` a converted model takes fp32 inputs
    again. Keyword arguments named in ``keep`` (labels, targets: what the model does
    not compute on) keep their dtype. A class at module level, not a closure, so that a
    converted model pickles."""

    def __init__(self, dtype: torch.dtype | None = None, keep: Iterable[str] = ()) -> None:
        self.dtype = dtype
        self.keep = frozenset(keep)

    def __call__(self, module, args, kwargs):
        dtype = self.dtype if self.dtype is not None else model_dtype(module)
        return cast_floating(args, dtype), {k: v if k in self.keep else cast_floating(v, dtype)
                                            for k, v in kwargs.items()}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("keep", frozenset())  # pickled before ``keep`` existed


def keep_inputs_of(model: nn.Module, names: Iterable[str]) -> None:
    """Make the keyword inputs ``names`` of a model that :func:`to_half` converted keep
    their dtype (its input hook casts the rest); for a front end that learns the
    names of the labels after converting (the transformers Trainer)."""
    for hook in model._forward_pre_hooks.values():
        if isinstance(hook, CastInputs):
            hook.keep = frozenset(names)


def outputs_to_fp32(module, args, output):
    """A forward hook that casts a module's floating-point outputs to fp32."""
    return cast_floating(output, torch.float32)


def to_half(model: nn.Module, dtype: torch.dtype = torch.float16, cast_io: bool = True,
            keep_fp32: Iterable = (), keep_inputs: Iterable[str] = ()) -> nn.Module:
    """Convert ``model`` in place to 16-bit parameters and buffers, except the modules
    kept in fp32 (normalization layers, and the rest the module docstring lists), and
    place its parameters in flat buffers (:func:`mpfp16.flatten_parameters`).

    Call it after moving the model to its device and before wrapping it in
    DistributedDataParallel: then FP16Optimizer, built before or after DDP, adopts the
    flat buffers and moves no parameter. Converting a model that DDP already holds
    raises an error instead of silently detaching DDP's gradient hooks.

    Args:
        model: the model; converted in place (the Parameter objects stay the same, so an
            optimizer built over them earlier still holds them).
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        cast_io: install hooks on ``model`` that cast floating-point inputs to the
            model's 16-bit dtype (whatever it is at each forward: ``model.float()``
            later makes them fp32) and floating-point outputs to fp32, so that
            ``loss_fn(model(x_fp32), y)`` computes the loss in fp32. Calling
            ``to_half`` again does not add them twice; :func:`to_float` removes them.
        keep_fp32: more modules to keep in fp32, whole: module classes, or module
            names as ``model.named_modules()`` gives them (or whole components of
            them, as transformers matches ``_keep_in_fp32_modules``). Each computes
            in fp32 and returns its outputs in ``dtype`` (:class:`FP32Island`).
        keep_inputs: keyword arguments of ``forward`` that the input hook leaves in
            their dtype (``"labels"``: a regression target is not rounded to 16 bits).

    Returns:
        ``model``.
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"to_half converts to torch.float16 or torch.bfloat16, not {dtype}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("to_half got a DistributedDataParallel module: convert the model first, then wrap it "
                        "(casting parameters that DDP holds would silently stop its gradient averaging)")
    kept = fp32_modules(model, keep_fp32)
    fp32 = {id(m) for root in kept for m in root.modules()}

    def target(module):
        return torch.float32 if id(module) in fp32 else dtype

    changing = [p for module in model.modules() for p in module.parameters(recurse=False)
                if p.is_floating_point() and p.dtype != target(module)]
    flat_buffers.check_movable(changing)

    def cast_to(target):
        return lambda t: t.to(target) if t.is_floating_point() else t

    for module in model.modules():
        module._apply(cast_to(target(module)), recurse=False)
    for module, casts in kept.items():
        island = _island_of(module)
        if island is not None:
            island.dtype = dtype
        elif casts:
            island = FP32Island(dtype)
            module.register_forward_pre_hook(island.pre, with_kwargs=True)
            module.register_forward_hook(island.post, with_kwargs=True)
    flat_buffers.flatten_parameters(model)

    if cast_io and not any(isinstance(hook, CastInputs) for hook in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(CastInputs(keep=keep_inputs), with_kwargs=True)  # follows the model's dtype
        model.register_forward_hook(outputs_to_fp32)
    elif keep_inputs:
        keep_inputs_of(model, keep_inputs)
    return model


def to_float(model: nn.Module) -> nn.Module:
    """Undo :func:`to_half`: every floating-point parameter and buffer back to fp32, the
    cast hooks removed, and the parameters in flat buffers (as
    :func:`mpfp16.flatten_parameters` places them). Like ``to_half``, it refuses a model
    whose 16-bit parameters DDP already holds. Returns ``model``."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("to_float got a DistributedDataParallel module: convert the model, then wrap it")
    flat_buffers.check_movable([p for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32])
    model.float()
    for module in model.modules():
        for hooks, extra in ((module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
                             (module._forward_hooks, module._forward_hooks_with_kwargs)):
            for key, hook in list(hooks.items()):
                if (isinstance(hook, CastInputs) or hook is outputs_to_fp32
                        or isinstance(getattr(hook, "__self__", None), FP32Island)):
                    del hooks[key]
                    extra.pop(key, None)
    flat_buffers.flatten_parameters(model)
    return model


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype inputs should have: the first 16-bit parameter's, else fp32."""
    for p in model.parameters():
        if p.dtype in HALF_DTYPES:
            return p.dtype
    return torch.float32
