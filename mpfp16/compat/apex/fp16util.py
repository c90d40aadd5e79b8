"""apex's ``fp16_utils`` helpers for converting a model and for hand-written master
weight loops, with apex's behaviour.

``network_to_half`` and ``FP16Model`` also place the model's parameters in mpfp16's
flat buffers (:func:`mpfp16.flatten_parameters`), which changes no value or name; it
lets ``FP16_Optimizer`` be built before or after ``DistributedDataParallel``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ...flat_buffers import flatten_parameters
from .loss_scaler import to_python_float

__all__ = ["tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network", "FP16Model",
           "prep_param_lists", "model_grads_to_master_grads", "master_params_to_model_params", "to_python_float",
           "clip_grad_norm"]

clip_grad_norm = torch.nn.utils.clip_grad_norm_


class tofp16(nn.Module):  # noqa: N801 - apex's name
    """A module whose forward is ``input.half()``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - apex's signature
        return input.half()


def _affine_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 - apex's name
    """Turn every BatchNorm with ``affine=True`` back to fp32 (its parameters and
    running statistics); non-affine BatchNorm and other norm layers stay as they are."""
    if _affine_batchnorm(module):
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``nn.Sequential(tofp16(), BN_convert_float(network.half()))``: fp16 inputs and
    outputs, affine BatchNorm in fp32. Parameter names gain a ``1.`` prefix, as with
    apex; the outputs are fp16 (cast them, or the loss, to fp32 yourself)."""
    return flatten_parameters(nn.Sequential(tofp16(), BN_convert_float(network.half())))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Convert a module's own floating-point parameters (and their gradients) and
    buffers to ``dtype``."""
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)  # the same Parameter object, as apex keeps it
                if param.grad is not None and param.grad.is_floating_point():
                    param.grad = param.grad.to(dtype)
        for buf in module.buffers(recurse=False):
            if buf.is_floating_point():
                buf.data = buf.data.to(dtype)  # the same buffer object, as apex keeps it


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Convert every module but affine BatchNorm to ``dtype``; RNN weights are
    re-flattened for cuDNN afterwards."""
    for module in network.modules():
        if _affine_batchnorm(module):
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """The network in fp16 (affine BatchNorm kept fp32); inputs are cast to fp16."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)
        flatten_parameters(self)

    def forward(self, *inputs):
        return self.network(*(t.half() for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False):
    """``(model_params, master_params)``: the trainable parameters, and fp32 copies of
    them that require grad; with ``flat_master``, one flat fp32 copy (all parameters
    must then have one dtype), whose ``.grad`` is allocated."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if len({p.dtype for p in model_params}) > 1:
            raise TypeError("prep_param_lists(flat_master=True) needs parameters of one dtype; this model mixes "
                            f"{sorted({str(p.dtype) for p in model_params})}: use flat_master=False")
        master = nn.Parameter(_flatten_dense_tensors([p.detach() for p in model_params]).float())
        master.grad = torch.empty_like(master)
        return model_params, [master]
    masters = [p.detach().clone().float().requires_grad_() for p in model_params]
    return model_params, masters


@torch.no_grad()
def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the model's gradients into the masters' (a master whose model parameter has
    no gradient gets none)."""
    if flat_master:
        master_params[0].grad.copy_(_flatten_dense_tensors([p.grad for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


@torch.no_grad()
def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the masters' values into the model's parameters."""
    if flat_master:
        masters = _unflatten_dense_tensors(master_params[0], model_params)
    else:
        masters = master_params
    for model, master in zip(model_params, masters):
        model.copy_(master)
