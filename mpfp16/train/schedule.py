"""Learning-rate schedules as a pure function of the optimizer step.

A schedule that is a function of the step alone resumes exactly: the step is in the
checkpoint, and nothing else is. It is driven through
``torch.optim.lr_scheduler.LambdaLR`` on the FP16Optimizer itself.

Two families:

- this trainer's own (:data:`OWN_SCHEDULES`, ``--lr-schedule``), per optimizer step,
  with a linear warm-up from ``1/warmup_steps`` (:func:`lr_multiplier`);
- torchvision's reference recipe's (:data:`TORCHVISION_SCHEDULES`, ``--lr-scheduler``,
  references/classification/train.py): ``StepLR``, ``CosineAnnealingLR`` and
  ``ExponentialLR`` after a ``LinearLR`` or ``ConstantLR`` warm-up, chained by
  ``SequentialLR``. torchvision steps its scheduler once per epoch, so the lr is
  constant through each epoch and changes at its end; :func:`torchvision_multiplier`
  is that, as a function of the step (its epoch is ``step // steps_per_epoch``), so that
  a recipe pasted from torchvision trains at torchvision's learning rates, and a run
  stopped inside an epoch resumes at the same one.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "OWN_SCHEDULES", "TORCHVISION_SCHEDULES", "WARMUP_METHODS", "lr_multiplier",
           "torchvision_multiplier", "torchvision_epoch_multiplier"]

OWN_SCHEDULES = ("step", "cosine", "onecycle", "linear")
TORCHVISION_SCHEDULES = ("steplr", "cosineannealinglr", "exponentiallr")  # torchvision's --lr-scheduler
SCHEDULES = OWN_SCHEDULES + TORCHVISION_SCHEDULES
WARMUP_METHODS = ("linear", "constant")  # torchvision's --lr-warmup-method


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
    if kind not in OWN_SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}; choose one of {', '.join(OWN_SCHEDULES)}")
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


def torchvision_epoch_multiplier(epoch: int, *, kind: str, epochs: int, warmup_epochs: int = 0,
                                 warmup_method: str = "linear", warmup_decay: float = 0.01, step_size: int = 30,
                                 gamma: float = 0.1, min_ratio: float = 0.0) -> float:
    """The factor on the base lr through epoch ``epoch`` (0-based) of torchvision's
    reference schedule, as its train.py builds it:

    - the warm-up, over the first ``warmup_epochs`` epochs: ``LinearLR(start_factor=
      warmup_decay, total_iters=warmup_epochs)`` (``warmup_decay`` rising linearly to 1)
      or ``ConstantLR(factor=warmup_decay, total_iters=warmup_epochs)``;
    - then, counting epochs from the warm-up's end (``SequentialLR``'s milestone):
      ``steplr`` ``gamma ** (e // step_size)``; ``exponentiallr`` ``gamma ** e``;
      ``cosineannealinglr`` from 1 down to ``min_ratio`` (``eta_min / lr``) over
      ``T_max = epochs - warmup_epochs`` epochs.
    """
    if kind not in TORCHVISION_SCHEDULES:
        raise ValueError(f"unknown torchvision lr scheduler {kind!r}; choose one of {', '.join(TORCHVISION_SCHEDULES)}")
    if warmup_method not in WARMUP_METHODS:
        raise ValueError(f"unknown lr warm-up method {warmup_method!r}; choose one of {', '.join(WARMUP_METHODS)}")
    if epoch < warmup_epochs:
        if warmup_method == "constant":
            return warmup_decay
        return warmup_decay + (1.0 - warmup_decay) * epoch / warmup_epochs
    e = epoch - warmup_epochs
    if kind == "steplr":
        return gamma ** (e // step_size)
    if kind == "exponentiallr":
        return gamma ** e
    t_max = epochs - warmup_epochs
    return min_ratio + (1.0 - min_ratio) * (1.0 + math.cos(math.pi * e / t_max)) / 2


def torchvision_multiplier(step: int, steps_per_epoch: int, **schedule) -> float:
    """:func:`torchvision_epoch_multiplier` at optimizer step ``step`` (0-based): the
    lr of the step's epoch, as torchvision steps its scheduler once per epoch."""
    return torchvision_epoch_multiplier(step // max(1, steps_per_epoch), **schedule)
