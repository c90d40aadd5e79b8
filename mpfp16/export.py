"""What a trained 16-bit model is exported as: its ``state_dict`` with either each
tensor as the model holds it, or the fp32 masters as an fp32 model.

    sd = export_state_dict(model, opt, "masters")   # every floating tensor fp32, the masters' values
    sd = export_state_dict(model, opt, "weights")   # model.state_dict(): 16-bit weights, fp32 norms

``"masters"`` is the trained values: an fp32 model loaded from it and converted again
by :func:`mpfp16.to_half` holds the same 16-bit weights (each is its master rounded to
nearest), and loaded into the 16-bit model it gives those weights again. ``"weights"``
is what the 16-bit model computes with, each tensor in its own dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .optimizer import FP16Optimizer

__all__ = ["EXPORTS", "export_state_dict", "check_export"]

EXPORTS = ("masters", "weights")


def check_export(what: str) -> str:
    """``what`` if it is one of :data:`EXPORTS`, else a one-line ValueError."""
    if what not in EXPORTS:
        raise ValueError(f"export={what!r}: choose 'masters' (the fp32 masters as an fp32 model) or 'weights' (each "
                         "tensor in the dtype the model holds it)")
    return what


def export_state_dict(model: nn.Module, optimizer: FP16Optimizer | None, what: str = "masters",
                      state_dict: dict | None = None) -> dict:
    """``model``'s state_dict as :data:`EXPORTS` names it (module docstring).

    Args:
        model: the 16-bit model ``optimizer`` steps (or the module holding it).
        optimizer: its FP16Optimizer; None before one exists (then ``"masters"``
            writes the weights widened to fp32, which are the values).
        what: ``"masters"`` or ``"weights"``.
        state_dict: ``model.state_dict()`` already taken (a framework's), with the
            same keys; None: taken here.
    """
    check_export(what)
    sd = model.state_dict() if state_dict is None else state_dict
    if what == "weights":
        return sd
    masters = {}
    if optimizer is not None:
        masters = {id(p): m for p, m in zip(optimizer.model_params(), optimizer.trained_values())}
    by_name = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    out = {}
    for key, value in sd.items():
        p = by_name.get(key)
        if p is not None and id(p) in masters:
            out[key] = masters[id(p)].detach().clone()
        elif torch.is_tensor(value) and value.is_floating_point():
            out[key] = value.detach().float()
        else:
            out[key] = value
    return out
