"""Where a training run stands: its position and its progress, the part of a checkpoint
that is the trainer's own (the model, optimizer, scheduler and random states are their
owners', saved through their ``state_dict``).

The :class:`~mpfp16.train.engine.Trainer` holds one :class:`TrainState` and is the only
one that changes it; :class:`~mpfp16.train.checkpointing.RunCheckpoints` saves the one it
is given and returns the one it loads, so that no other code writes the trainer's fields.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """The run's position and progress; a fresh run's by default.

    Attributes:
        step: optimizer steps taken, skipped ones included (the schedule's unit).
        epoch: epochs finished.
        samples_done: the position in the current epoch, in samples of its one order
            over all ranks, so that it means the same for any number of processes,
            batch and accumulation (:func:`mpfp16.train.resume.samples_done`).
        best_acc1: the best validation top-1 accuracy so far (percent), -1 before the
            first evaluation.
        best_epoch: the epoch (1-based) that reached ``best_acc1``, None before it.
        elapsed_before: seconds trained by the runs this one resumed, which its own
            time adds to.
    """

    step: int = 0
    epoch: int = 0
    samples_done: int = 0
    best_acc1: float = -1.0
    best_epoch: int | None = None
    elapsed_before: float = 0.0

    def batches_done(self, batch_size: int, world_size: int) -> int:
        """Each rank's micro-batches of ``batch_size`` in the current epoch: the position
        as checkpoints before ``samples_done`` recorded it."""
        return self.samples_done // (batch_size * world_size)
