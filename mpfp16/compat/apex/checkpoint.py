"""Reading checkpoints written by apex, whose ``FP16_Optimizer.state_dict()`` pickles
its loss-scaler object, without unpickling anything else.

The file is read by torch's ``weights_only`` unpickler with three extra names allowed:
apex's scaler classes (``apex.amp.scaler.LossScaler``, and ``fp16_utils``'
``LossScaler`` and ``DynamicLossScaler``), built as inert stand-ins that only hold
their attributes. Each is then replaced by a dict of its plain attributes, with
``"apex_class"`` naming the class, which ``FP16_Optimizer.load_state_dict`` reads.
Any other pickled object is refused, never executed, in one line.
"""

from __future__ import annotations

import torch

from ...serialization import load_weights_only

__all__ = ["load_apex_checkpoint", "APEX_SCALER_CLASSES"]

APEX_SCALER_CLASSES = ("apex.amp.scaler.LossScaler", "apex.fp16_utils.loss_scaler.LossScaler",
                       "apex.fp16_utils.loss_scaler.DynamicLossScaler")


def _stand_in(full_name: str) -> type:
    module, _, name = full_name.rpartition(".")
    return type(name, (), {"__module__": module, "__qualname__": name, "apex_class": full_name})


_STAND_INS = tuple(_stand_in(name) for name in APEX_SCALER_CLASSES)


def _plain(obj):
    """The loaded object with every scaler stand-in replaced by a dict of its plain
    attributes (tensors, such as apex's overflow buffer, are dropped)."""
    if isinstance(obj, _STAND_INS):
        state = {k: v for k, v in vars(obj).items() if not isinstance(v, torch.Tensor)}
        return {"apex_class": obj.apex_class, **state}
    if isinstance(obj, dict):
        return type(obj)((k, _plain(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def load_apex_checkpoint(path: str, map_location="cpu") -> dict:
    """Read a ``torch.save`` checkpoint written with apex's ``FP16_Optimizer``.

    Returns:
        The checkpoint, its loss scalers as plain dicts: pass its optimizer part to
        ``FP16_Optimizer.load_state_dict``.

    Raises:
        mpfp16.errors.CheckpointError: one line, for a file that is missing, corrupt,
            or holds any pickled object other than apex's loss scalers.
    """
    return _plain(load_weights_only(path, map_location, allowed=_STAND_INS,
                                    refusal_hint="an apex checkpoint may hold only tensors, plain values and "
                                                 "apex's loss scalers"))
