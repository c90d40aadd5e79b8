"""The loss scalers of apex: the one ``FP16_Optimizer`` really uses (``apex.amp``'s),
and the two standalone classes ``apex.fp16_utils`` exported for hand-written loops.

Behaviour, as apex's code has it:

- :class:`AmpLossScaler` (``FP16_Optimizer``): dynamic from 2^16; an overflow halves
  the scale (never below ``min_loss_scale`` if one is given, and there is none by
  default); ``scale_window`` clean updates double it, up to ``max_loss_scale`` (2^24).
  ``scale_factor`` is accepted and ignored: it always halves and doubles. It is updated
  once per ``update_master_grads()``, that is, in ``backward()``. A static scale never
  changes and apex never checks it for overflow.
- :class:`DynamicLossScaler` (``fp16_utils``): from 2^32, divides by ``scale_factor``
  on overflow (not below 1), multiplies by it each time ``scale_window`` iterations
  have passed since the last overflow. apex finds an overflow from the fp32 sum of
  each gradient, which also flags finite values whose sum overflows; here it is
  found element by element, as every overflow check of mpfp16 finds it
  (mpfp16/stores/nonfinite.py). :class:`LossScaler` is a static scale that never
  reports an overflow.

Two things apex gets wrong are done right here, each with one warning: a static scale
is checked for overflow, so an overflowing step is skipped instead of writing inf
into every master (``FP16_Optimizer``); and a scale that keeps overflowing at its
lowest value raises :class:`mpfp16.LossScaleStuckError` instead of skipping forever.
"""

from __future__ import annotations

import logging
import math

import torch

from ...scaler import LossScaler as _MpLossScaler
from ...stores import nonfinite_flags
from ...scaler import LossScaleStuckError, check_loss_scale

__all__ = ["AmpLossScaler", "LossScaler", "DynamicLossScaler", "to_python_float"]

logger = logging.getLogger("mpfp16")

_FP32_TINY = 2.0**-126  # without a floor, a scale under this flushes every fp32 gradient


def to_python_float(t) -> float:
    """``t.item()`` (apex kept a fallback for tensors from before ``item()`` existed)."""
    return t.item() if hasattr(t, "item") else t[0]


class AmpLossScaler(_MpLossScaler):
    """``apex.amp.scaler.LossScaler`` as ``FP16_Optimizer`` drives it, under the
    interface FP16Optimizer reads (``scale``, ``update``, ``state_dict``).

    FP16Optimizer's own ``update()`` calls do nothing: the compat layer calls
    :meth:`update_scale` once per ``update_master_grads()``, as apex does. The scale
    is kept as the Python float apex keeps (not rounded to fp32), so a scale set by
    hand multiplies and divides exactly as apex's does.

    Args:
        loss_scale: ``"dynamic"`` or a number (a static scale).
        init_scale, scale_factor, scale_window, min_loss_scale, max_loss_scale: as
            apex's; ``scale_factor`` is ignored, as apex ignores it.
        stuck_after: consecutive overflows at the lowest scale (``min_loss_scale``, or
            2^-126 without one, or the static scale) that raise
            :class:`mpfp16.LossScaleStuckError`.
    """

    def __init__(self, loss_scale="dynamic", init_scale: float = 2.0**16, scale_factor: float = 2.0,
                 scale_window: int = 2000, min_loss_scale: float | None = None, max_loss_scale: float = 2.0**24,
                 *, stuck_after: int = 4) -> None:
        self.dynamic = loss_scale == "dynamic"
        value = float(init_scale if self.dynamic else loss_scale)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"a loss scale must be a positive finite number, got {value}")
        self._scale = value
        self.scale_window = int(scale_window)
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.unskipped = 0
        self.stuck_after = int(stuck_after)
        self.overflows_at_floor = 0

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"a loss scale must be a positive finite number, got {value}")
        self._scale = value

    @property
    def floor(self) -> float:
        if not self.dynamic:
            return self._scale
        return self.min_loss_scale if self.min_loss_scale else _FP32_TINY

    def update(self, found_inf: bool, step: int | None = None) -> None:
        """FP16Optimizer's per-step update: nothing (:meth:`update_scale` did it)."""

    def update_scale(self, overflow: bool) -> bool:
        """apex's ``update_scale()``: back off on an overflow, grow after
        ``scale_window`` clean updates. Returns whether the step must be skipped:
        apex skips only with a dynamic scale; here an overflow always skips.

        Raises:
            LossScaleStuckError: ``stuck_after`` overflows in a row at the floor.
        """
        at_floor = self._scale <= self.floor
        if overflow and self.dynamic:
            halved = self._scale / 2.0
            self._scale = max(self.min_loss_scale, halved) if self.min_loss_scale else halved
            self.unskipped = 0
        elif not overflow:
            self.unskipped += 1
        if self.dynamic and self.unskipped == self.scale_window:
            self._scale = min(self.max_loss_scale, self._scale * 2.0)
            self.unskipped = 0
        self.overflows_at_floor = self.overflows_at_floor + 1 if overflow and at_floor else 0
        if self.overflows_at_floor >= self.stuck_after:
            raise LossScaleStuckError(
                f"loss scale stuck at {self._scale:g}: the gradients held inf/NaN on {self.overflows_at_floor} "
                "consecutive steps at the lowest scale (apex would skip forever). Likely causes: NaN or inf in "
                "the data or the loss, a diverging learning rate, activations beyond the fp16 range.")
        return overflow

    def state_dict(self) -> dict:
        """Plain values: ``torch.load(weights_only=True)`` reads them."""
        return {"loss_scale": self._scale, "dynamic": self.dynamic, "unskipped": self.unskipped,
                "scale_window": self.scale_window, "min_loss_scale": self.min_loss_scale,
                "max_loss_scale": self.max_loss_scale, "overflows_at_floor": self.overflows_at_floor}

    def check_state_dict(self, state: dict) -> None:
        """Raise one line unless ``state`` (:meth:`state_dict`'s, or an apex scaler's)
        is one this scaler can load: the same kind of scale (dynamic or static), a
        scale that is a positive normal fp32 number, counters that are integers >= 0.
        :meth:`load_state_dict` and FP16Optimizer's own load call it first."""
        state = self._as_own(state)
        if bool(state["dynamic"]) != self.dynamic:
            raise ValueError(f"the state holds a {'dynamic' if state['dynamic'] else 'static'} loss scale and "
                             f"this optimizer uses a {'dynamic' if self.dynamic else 'static'} one")
        check_loss_scale(state["loss_scale"], "the loss scaler's loss_scale")
        for key in ("unskipped", "overflows_at_floor", "scale_window"):
            value = state.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"the loss scaler's {key} is {value!r}, and it must be an integer >= 0")

    @staticmethod
    def _as_own(state: dict) -> dict:
        """An apex scaler object's state (read by
        :func:`mpfp16.compat.apex.load_apex_checkpoint`) in this scaler's keys."""
        if not isinstance(state, dict):
            raise ValueError(f"loss scaler state_dict is a {type(state).__name__}, not a dict")
        kind = state.get("apex_class")
        if kind == "apex.amp.scaler.LossScaler":
            state = {"loss_scale": state["_loss_scale"], "dynamic": state["dynamic"],
                     "unskipped": state.get("_unskipped", 0), "scale_window": state.get("_scale_seq_len", 2000),
                     "min_loss_scale": state.get("_min_loss_scale"),
                     "max_loss_scale": state.get("_max_loss_scale", 2.0**24)}
        elif kind is not None:  # fp16_utils' own scalers: the scale carries over, the growth count restarts
            state = {"loss_scale": state["cur_scale"], "dynamic": "scale_window" in state, "unskipped": 0}
        missing = [k for k in ("loss_scale", "dynamic") if k not in state]
        if missing:
            raise ValueError(f"loss scaler state_dict is missing {', '.join(missing)}")
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`'s values, or those of an apex scaler object that
        :func:`mpfp16.compat.apex.load_apex_checkpoint` read from an apex checkpoint."""
        self.check_state_dict(state)
        state = self._as_own(state)
        self._scale = float(state["loss_scale"])
        self.unskipped = int(state.get("unskipped", 0))
        self.scale_window = int(state.get("scale_window", self.scale_window))
        self.min_loss_scale = state.get("min_loss_scale", self.min_loss_scale)
        self.max_loss_scale = state.get("max_loss_scale", self.max_loss_scale)
        self.overflows_at_floor = int(state.get("overflows_at_floor", 0))

    def __repr__(self) -> str:
        kind = f"dynamic, window {self.scale_window}" if self.dynamic else "static"
        return f"AmpLossScaler({self._scale:g}, {kind})"


class LossScaler:
    """``apex.fp16_utils.LossScaler``: a static scale that never reports an overflow."""

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    def has_overflow(self, params) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """``apex.fp16_utils.DynamicLossScaler`` (module docstring)."""

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        return bool(grads) and any(nonfinite_flags(grads))

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
