"""Convert a model to 16-bit weights, keeping normalization layers in fp32.

Normalization layers keep fp32 parameters and running statistics: their statistics
are sums over many values, and fp16's 10-bit mantissa loses them. PyTorch's
batch_norm, layer_norm and group_norm kernels accept a 16-bit input with fp32
weights on both CPU and CUDA and return the input's dtype, so nothing else changes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import flat_buffers

__all__ = ["NORM_TYPES", "HALF_DTYPES", "to_half", "to_float", "model_dtype", "cast_floating", "CastInputs", "outputs_to_fp32",
           "keeps_fp32"]

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
    again. A class at module level, not a closure, so that a converted model pickles."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        dtype = self.dtype if self.dtype is not None else model_dtype(module)
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)


def outputs_to_fp32(module, args, output):
    """A forward hook that casts a module's floating-point outputs to fp32."""
    return cast_floating(output, torch.float32)


def _target_dtype(module: nn.Module, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if keeps_fp32(module) else dtype


def to_half(model: nn.Module, dtype: torch.dtype = torch.float16, cast_io: bool = True) -> nn.Module:
    """Convert ``model`` in place to 16-bit parameters and buffers, except normalization layers,
    and place its parameters in flat buffers (:func:`mpfp16.flatten_parameters`).

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

    Returns:
        ``model``.
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"to_half converts to torch.float16 or torch.bfloat16, not {dtype}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("to_half got a DistributedDataParallel module: convert the model first, then wrap it "
                        "(casting parameters that DDP holds would silently stop its gradient averaging)")
    changing = [p for module in model.modules() for p in module.parameters(recurse=False)
                if p.is_floating_point() and p.dtype != _target_dtype(module, dtype)]
    flat_buffers.check_movable(changing)

    def cast_to(target):
        return lambda t: t.to(target) if t.is_floating_point() else t

    for module in model.modules():
        module._apply(cast_to(_target_dtype(module, dtype)), recurse=False)
    flat_buffers.flatten_parameters(model)

    if cast_io and not any(isinstance(hook, CastInputs) for hook in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(CastInputs(), with_kwargs=True)  # follows the model's dtype
        model.register_forward_hook(outputs_to_fp32)
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
    for hooks, extra in ((model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs),
                         (model._forward_hooks, model._forward_hooks_with_kwargs)):
        for key, hook in list(hooks.items()):
            if isinstance(hook, CastInputs) or hook is outputs_to_fp32:
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
