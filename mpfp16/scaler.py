"""Loss scaling: a static scale and a dynamic one that follows torch.amp.GradScaler.

The scalers are host-side state machines: the optimizer tells them, once per step,
whether the gradients held an inf or NaN (``update(found_inf)``), and reads
``scale`` before the next backward. The scale is an fp32 value, and each update
multiplies it by a double factor and rounds the product to fp32, exactly as
GradScaler's update kernel does, so that the two produce the same sequence of
scales bit for bit (:func:`_f32`).

A run whose gradients overflow even at the smallest scale allowed can only skip
steps forever. Both scalers count such steps and raise :class:`LossScaleStuckError`
after ``stuck_after`` of them in a row, instead of skipping in silence.
"""

from __future__ import annotations

import math
import struct

import torch

__all__ = ["LossScaler", "DynamicLossScaler", "LossScaleStuckError", "check_loss_scale", "loss_gradient_dtype",
           "largest_scale"]

# The smallest normal fp32 value: the floor used to decide that a scale with no
# configured minimum can fall no further in any useful way.
_FP32_TINY = 2.0**-126


_FP32_MAX = 3.4028234663852886e38


def check_loss_scale(value, name: str = "loss_scale", say=None) -> float:
    """``value`` as the fp32 scale it becomes, or a one-line ValueError: a loss scale
    must round to a normal, finite fp32 number (2^-126 to 3.4e38). Outside that range
    it becomes 0, a subnormal (whose reciprocal is inf) or inf, and every step would
    be skipped or unscaled to inf. ``say(name, value)`` words the option as the
    caller spells it (default ``name=value``)."""
    words = say(name, value) if say is not None else f"{name}={value!r}"
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{words}: a loss scale must be a number") from None
    if not (math.isfinite(scale) and _FP32_TINY <= scale <= _FP32_MAX):
        raise ValueError(f"{words}: a loss scale must be a positive normal fp32 number, from {_FP32_TINY:.4g} to "
                         f"{_FP32_MAX:.4g}")
    return _f32(scale)


def _shown(value) -> str:
    """A state's value in an error line: short, and its type when it is not a number."""
    if isinstance(value, (int, float, str, bool, type(None))):
        text = repr(value)
    else:
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _f32(x: float) -> float:
    """Round a Python float (a double) to the nearest fp32 value, as a C++
    ``static_cast<float>`` of a double does in GradScaler's update kernel."""
    return struct.unpack("f", struct.pack("f", x))[0]


class LossScaleStuckError(RuntimeError):
    """Raised when gradients keep overflowing although the scale cannot go lower.

    The scaler knows no parameters: raised through an FP16Optimizer, the one line
    ends with those whose gradient held inf/NaN at the last step (and the ranks whose
    loss was not finite), and ``.overflow`` is that step's ``last_overflow``."""


class LossScaler:
    """A static loss scale. Steps whose gradients hold inf/NaN are still skipped.

    ``LossScaler(1.0)`` is what ``loss_scale=None`` means: no scaling at all (bf16,
    fp32), but a non-finite gradient still skips the step, and ``stuck_after``
    such steps in a row raise :class:`LossScaleStuckError`.

    Args:
        scale: the constant loss scale (a positive, finite number).
        stuck_after: how many consecutive overflowing steps at the lowest scale
            raise :class:`LossScaleStuckError`. For a static scaler every step is at
            its lowest scale.
    """

    dynamic = False

    def __init__(self, scale: float = 1.0, *, stuck_after: int = 4) -> None:
        self._scale = check_loss_scale(scale, "scale")
        if int(stuck_after) < 1:
            raise ValueError(f"stuck_after must be at least 1, got {stuck_after}")
        self.stuck_after = int(stuck_after)
        self.overflows_at_floor = 0  # consecutive overflowing steps taken at the floor

    @property
    def scale(self) -> float:
        """The current loss scale, a Python float that is exactly representable in fp32."""
        return self._scale

    @property
    def floor(self) -> float:
        """The lowest scale this scaler can reach."""
        return self._scale

    def update(self, found_inf: bool, step: int | None = None) -> None:
        """Record one optimizer step. ``found_inf`` means the step was skipped.

        Raises:
            LossScaleStuckError: after ``stuck_after`` consecutive overflows at the floor.
        """
        if not found_inf:
            self.overflows_at_floor = 0
            self._grow()
            return
        at_floor = self._scale <= self.floor
        self._back_off()
        self.overflows_at_floor = self.overflows_at_floor + 1 if at_floor else 0
        if self.overflows_at_floor >= self.stuck_after:
            where = f" at optimizer step {step}" if step is not None else ""
            raise LossScaleStuckError(
                f"loss scale stuck at {self._scale:g}: the gradients held inf/NaN on "
                f"{self.overflows_at_floor} consecutive steps at the lowest scale{where}. "
                "Likely causes: NaN or inf in the input data or the loss, a learning rate "
                "that makes training diverge, or activations that overflow the 16-bit range."
            )

    def _grow(self) -> None:
        pass

    def _back_off(self) -> None:
        pass

    def fit_under(self, limit: float) -> bool:
        """Lower the scale to at most ``limit`` before a step's first backward, when the
        loss itself is 16-bit and the scale would overflow its gradient for sure
        (:func:`loss_gradient_dtype`). Returns whether the scale now
        fits; a static scale cannot move (False)."""
        return self._scale <= limit

    def state_dict(self) -> dict:
        """Plain numbers only, so that ``torch.load(weights_only=True)`` reads it."""
        return {
            "scale": self._scale,
            "overflows_at_floor": self.overflows_at_floor,
        }

    def check_state_dict(self, state: dict) -> None:
        """Raise one line unless ``state`` is a state this scaler can be in: every key
        of :meth:`state_dict`, a scale that is a normal finite fp32 number within this
        scaler's range (a static one: any), and counters that are integers (not bools)
        within their bounds: ``overflows_at_floor`` from 0 to ``stuck_after``, the count
        that :class:`LossScaleStuckError` leaves. A checkpoint written before its fields
        had checksums is checked by these rules alone (a flipped bit had resumed a scale
        of 2**32 above ``max_scale`` 2**24). :meth:`load_state_dict` calls it first.

        Raises:
            ValueError: naming the field, what it holds and what it must be.
        """
        if not isinstance(state, dict):
            raise ValueError(f"loss scaler state_dict is a {type(state).__name__}, not a dict")
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"loss scaler state_dict is missing {', '.join(missing)}")
        scale = state["scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"the loss scaler's scale is {_shown(scale)}, not a number")
        low, high = self._range()
        try:
            exact = math.isfinite(scale) and _f32(float(scale)) == scale
        except OverflowError:  # an int beyond any float
            exact = False
        if not (exact and low <= scale <= high):
            raise ValueError(f"the loss scaler's scale is {_shown(scale)}, and it must be a normal fp32 "
                             f"number {self._range_words()}")
        self._check_counter(state, "overflows_at_floor", self.stuck_after, f"stuck_after {self.stuck_after}")

    def _range(self) -> tuple[float, float]:
        """The scales this scaler can hold: a static one, any normal finite fp32."""
        return _FP32_TINY, _FP32_MAX

    def _range_words(self) -> str:
        return f"from {_FP32_TINY:.4g} to {_FP32_MAX:.4g}"

    @staticmethod
    def _check_counter(state: dict, name: str, high: int, why: str) -> None:
        """``state[name]`` must be an integer from 0 to ``high`` (``why`` says which setting bounds it)."""
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise ValueError(f"the loss scaler's {name} is {_shown(value)}, and it must be an integer from "
                             f"0 to {high} ({why})")

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` returned, once :meth:`check_state_dict` found
        it a state this scaler can be in; nothing changes when it raises."""
        self.check_state_dict(state)
        self._scale = _f32(float(state["scale"]))
        self.overflows_at_floor = int(state["overflows_at_floor"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self._scale:g})"


class DynamicLossScaler(LossScaler):
    """A loss scale that backs off on overflow and grows after a run of clean steps.

    With ``hysteresis=1``, ``min_scale=None`` and ``max_scale=None`` the sequence of
    scales and skipped steps is identical to ``torch.amp.GradScaler`` with the same
    ``init_scale``, ``growth_factor``, ``backoff_factor`` and ``growth_interval``:
    an overflow multiplies the scale by ``backoff_factor`` and resets the count of
    clean steps; ``growth_interval`` clean steps in a row multiply it by
    ``growth_factor`` (unless that would give inf) and reset the count.

    Hysteresis follows Megatron-LM's ``DynamicGradScaler``: the scaler tolerates
    ``hysteresis - 1`` overflows before it backs off. Each overflow spends one unit
    of the budget (and still skips its step, and still resets the clean-step count);
    once the budget is spent every further overflow backs off, until the next growth
    refills it. DeepSpeed's variant refills the budget on every clean step instead.

    Args:
        init_scale: the first scale.
        growth_factor: multiplier applied after ``growth_interval`` clean steps.
        backoff_factor: multiplier applied on overflow.
        growth_interval: clean steps in a row before growing.
        hysteresis: overflows absorbed (minus one) before backing off; 1 = none.
        min_scale: the floor (None: no floor, as GradScaler). Without a floor the
            scale may fall to the smallest normal fp32 value before a run is
            declared stuck.
        max_scale: the ceiling (None: no ceiling, as GradScaler).
        stuck_after: consecutive overflows at the floor that raise
            :class:`LossScaleStuckError`.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = 1.0,
        max_scale: float | None = 2.0**24,
        *,
        stuck_after: int = 4,
    ) -> None:
        super().__init__(init_scale, stuck_after=stuck_after)
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) < 1:
            raise ValueError(f"growth_interval must be at least 1, got {growth_interval}")
        if int(hysteresis) < 1:
            raise ValueError(f"hysteresis must be at least 1, got {hysteresis}")
        if min_scale is not None:
            check_loss_scale(min_scale, "min_scale")
        if max_scale is not None:
            check_loss_scale(max_scale, "max_scale")
        if min_scale is not None and max_scale is not None and max_scale < min_scale:
            raise ValueError(f"max_scale ({max_scale}) is below min_scale ({min_scale})")
        # The factors stay doubles: GradScaler's kernel multiplies its fp32 scale by a
        # double factor and rounds the product to fp32.
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = None if min_scale is None else _f32(float(min_scale))
        self.max_scale = None if max_scale is None else _f32(float(max_scale))
        if self.min_scale is not None and self._scale < self.min_scale:
            raise ValueError(f"init_scale ({init_scale}) is below min_scale ({min_scale})")
        if self.max_scale is not None and self._scale > self.max_scale:
            raise ValueError(f"init_scale ({init_scale}) is above max_scale ({max_scale})")
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @property
    def floor(self) -> float:
        return _FP32_TINY if self.min_scale is None else self.min_scale

    def update(self, found_inf: bool, step: int | None = None) -> None:
        if found_inf:
            self.growth_tracker = 0
        super().update(found_inf, step)

    def _back_off(self) -> None:
        self.hysteresis_tracker -= 1
        if self.hysteresis_tracker > 0:
            return
        new_scale = _f32(self._scale * self.backoff_factor)
        if self.min_scale is not None:
            new_scale = max(new_scale, self.min_scale)
        self._scale = new_scale

    def fit_under(self, limit: float) -> bool:
        """Back off (``backoff_factor``, hysteresis aside: the gradient is sure to
        overflow, not found to) until the scale is at most ``limit``, down to
        ``min_scale``; the growth count starts again, as after a back-off. The step
        that would have been skipped at the higher scale is taken at this one."""
        moved = False
        while self._scale > limit:
            new_scale = _f32(self._scale * self.backoff_factor)
            if self.min_scale is not None and new_scale < self.min_scale:
                break
            self._scale, moved = new_scale, True
        if moved:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
        return self._scale <= limit

    def _grow(self) -> None:
        self.growth_tracker += 1
        if self.growth_tracker < self.growth_interval:
            return
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis
        new_scale = _f32(self._scale * self.growth_factor)
        if self.max_scale is not None:
            new_scale = min(new_scale, self.max_scale)
        if math.isfinite(new_scale):
            self._scale = new_scale

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(growth_tracker=self.growth_tracker, hysteresis_tracker=self.hysteresis_tracker)
        return state

    def check_state_dict(self, state: dict) -> None:
        """:meth:`LossScaler.check_state_dict`, with this scaler's range
        (``min_scale`` to ``max_scale``) and its trackers: ``growth_tracker`` from 0
        to ``growth_interval - 1`` (it is reset on reaching it), ``hysteresis_tracker``
        at most ``hysteresis``. The hysteresis tracker has no floor: each overflow
        takes one off, below 0 once the budget is spent (every value <= 0 acts alike,
        until a growth refills it), so a state of many overflows holds a negative one."""
        super().check_state_dict(state)
        self._check_counter(state, "growth_tracker", self.growth_interval - 1,
                            f"below growth_interval {self.growth_interval}")
        tracker = state["hysteresis_tracker"]
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker > self.hysteresis:
            raise ValueError(f"the loss scaler's hysteresis_tracker is {_shown(tracker)}, and it must be an "
                             f"integer of at most {self.hysteresis} (hysteresis)")

    def _range(self) -> tuple[float, float]:
        return self.floor, _FP32_MAX if self.max_scale is None else self.max_scale

    def _range_words(self) -> str:
        low, high = self._range()
        low_words = f"{low!r} (min_scale)" if self.min_scale is not None else f"{low:.4g}"
        high_words = f"{high!r} (max_scale)" if self.max_scale is not None else f"{high:.4g}"
        return f"from {low_words} to {high_words}"

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)  # checks the whole state first
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale}, max_scale={self.max_scale})"
        )


_WALKED = 32  # autograd nodes followed back from the loss, at most


def loss_gradient_dtype(loss: torch.Tensor) -> torch.dtype:
    """The narrowest floating dtype the loss's own gradient passes through before it
    reaches the model: read back from ``loss`` along the autograd nodes with one input
    whose gradient is one element (casts, a division by the accumulation count, the
    loss's own reduction), up to the first that is not: the gradient of the loss
    itself, before it spreads over the model's outputs.

    The gradient of ``(loss.float() * scale)`` with respect to the loss is ``scale``;
    where the loss was computed in fp16 (a model's head that returns its loss, cast to
    fp32 by :func:`mpfp16.to_half`'s output hook or by ``backward``), that gradient is
    rounded to fp16 before anything else runs, and a scale above 65504 is inf there: a
    sure overflow at every step (:func:`largest_scale`)."""
    smallest = loss.dtype
    node = loss.grad_fn
    for _ in range(_WALKED):
        if node is None:
            break
        metas = getattr(node, "_input_metadata", ())  # the gradient this node receives
        if len(metas) != 1 or math.prod(getattr(metas[0], "shape", (0,))) != 1:
            break  # past the loss itself: a gradient of many elements is the model's, not the loss's
        dtype = getattr(metas[0], "dtype", None)
        if dtype is not None and dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(smallest).max:
            smallest = dtype
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            break
        node = inputs[0]
    return smallest


def largest_scale(dtype: torch.dtype) -> float:
    """The largest power of two ``dtype`` holds: the largest loss scale a loss of that
    dtype can take without its own gradient overflowing (32768 for fp16)."""
    return 2.0 ** math.floor(math.log2(torch.finfo(dtype).max))
