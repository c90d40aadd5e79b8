"""Learning-rate schedules as a pure function of the optimizer step.

A schedule that is a function of the step alone resumes exactly: the step is in the
checkpoint, and nothing else is. It is driven through
``torch.optim.lr_scheduler.LambdaLR`` on the FP16Optimizer itself.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_multiplier"]

SCHEDULES = ("step", "cosine", "onecycle", "linear")


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, kind: str) -> float:
    """The factor applied to the base learning rate at optimizer step ``step`` (0-based).

    - warm-up: linear from 1/warmup_steps to 1 over the first ``warmup_steps`` steps;
    - ``step``: 1, then 0.1 from half of the remaining steps, 0.01 from three quarters;
    - ``cosine``: half a cosine from 1 down to 0;
    - ``linear``: a straight line from 1 down to 0;
    - ``onecycle``: the triangle of Smith's one-cycle policy (as in Page's DAWNBench
      ResNet): up over the warm-up, which defaults to 30% of the run when
      ``warmup_steps`` is 0, then linearly down to 0.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    total_steps = max(1, total_steps)
    if kind == "onecycle" and warmup_steps == 0:
        warmup_steps = max(1, round(0.3 * total_steps))
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "step":
        return 1.0 if t < 0.5 else 0.1 if t < 0.75 else 0.01
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    return 1.0 - t
