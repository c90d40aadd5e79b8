"""``--model-ema``: an exponential moving average of the model, kept in fp32 from the
fp32 masters, with the semantics of torchvision's reference recipe
(references/classification/train.py and its ``utils.ExponentialMovingAverage``).

torchvision's EMA is ``torch.optim.swa_utils.AveragedModel(model, device, ema_avg,
use_buffers=True)`` with ``ema_avg(avg, p, n) = decay * avg + (1 - decay) * p``: every
parameter and every buffer of the model (BatchNorm's running statistics included) is
averaged, the first update copies, and the update runs every ``--model-ema-steps``
optimizer steps of an epoch (``if i % model_ema_steps == 0``, ``i`` the step's index in
its epoch), with ``decay = 1 - min(1, (1 - model_ema_decay) * adjust)``,
``adjust = world_size * batch_size * model_ema_steps / epochs``. During the warm-up
epochs (``epoch < lr_warmup_epochs``) each update is followed by
``n_averaged.fill_(0)``, so that the next one copies again: the average follows the
model until the warm-up ends.

What differs here, and why:

- **The average of a parameter is taken from its fp32 master**
  (:meth:`mpfp16.FP16Optimizer.trained_values`: the master of a 16-bit parameter, an
  fp32 parameter itself), and held in fp32. torchvision's average is a copy of the
  model in its dtype: of a 16-bit model, a 16-bit average of the 16-bit weights. At
  decay 0.99998 an update moves the average by 2e-5 of its distance to the weight,
  far below half an ulp of a 16-bit value, and is lost (Micikevicius et al. 2018,
  section 3.1, applied to the average; ``python -m mpfp16.experiments ema`` measures
  it). Without masters (``--no-master-weights``) the values are the 16-bit weights,
  widened (exact), and the average is still fp32.
- **Buffers** are averaged as torchvision averages them (``use_buffers=True``), from
  the model's own buffers (BatchNorm's statistics are fp32 already); an integer buffer
  (``num_batches_tracked``) takes torchvision's arithmetic too, truncated by its
  ``copy_``. Under DDP each rank's statistics move with its own batch, so rank 0's
  are broadcast first (as DDP does at the next forward): every rank keeps the same
  average, as it keeps the same masters.
- **Skipped steps**: the counter ``i`` counts the optimizer steps of the epoch that
  trained. A skipped step (inf/NaN in the gradients) changed no weight: it is neither
  averaged in nor counted, so the average is the one torchvision would compute over
  the sequence of weights the run went through, with the skipped steps, which moved
  nothing, left out (as a run without them would not see them). The updates still
  fall every ``--model-ema-steps`` trained steps of each epoch, its first included.
- **Accumulation**: ``adjust`` uses the samples of one optimizer step,
  ``world_size * batch_size * accum_steps``; with ``--accum-steps 1`` it is
  torchvision's formula.
- **Evaluation** runs the average itself: :attr:`ModelEMA.module` is an fp32 copy of
  the model whose parameters and buffers *are* the average (no rounding, and no
  memory beyond the average's own 4 bytes per parameter); its forward is fp32.
  torchvision evaluates its copy in the model's dtype; rounding the fp32 average to
  16 bits for a 16-bit forward would add one rounding of every weight, and on a GPU
  the fp32 forward costs about one more evaluation pass per epoch.

Its state (the average, ``n_averaged``, the position of the counter, the best EMA
accuracy) is saved in ``last.pt`` and ``best.pt`` and resumed bit for bit.
"""

from __future__ import annotations

import copy
import numbers

import torch
import torch.nn as nn

from ..convert import to_float
from ..errors import UserError

__all__ = ["ModelEMA", "ema_decay", "average_", "check_options", "is_state", "STATE_KEYS"]

# What ModelEMA.state_dict() holds besides the average ("module").
STATE_KEYS = ("n_averaged", "epoch", "epoch_steps", "updates")


def ema_decay(world_size: int, batch_size: int, accum_steps: int, model_ema_steps: int, epochs: int,
              model_ema_decay: float) -> float:
    """The decay of one update, as torchvision adjusts ``--model-ema-decay``:
    ``alpha = min(1, (1 - model_ema_decay) * world_size * batch_size * steps / epochs)``,
    the batch being the samples of one optimizer step on a process (``batch_size *
    accum_steps``), and ``decay = 1 - alpha``."""
    adjust = world_size * batch_size * accum_steps * model_ema_steps / epochs
    alpha = 1.0 - model_ema_decay
    alpha = min(1.0, alpha * adjust)
    return 1.0 - alpha


def check_options(cfg) -> None:
    """Refuse what ``--model-ema`` cannot go with, before any data is loaded.

    Raises:
        UserError: one line.
    """
    if not cfg.model_ema:
        return
    if cfg.shard:
        raise UserError("--model-ema keeps an fp32 average of the whole masters, and --shard splits them across "
                        "the ranks: drop one of them")
    if not 0.0 <= cfg.model_ema_decay <= 1.0:
        raise UserError(f"--model-ema-decay is {cfg.model_ema_decay:g}; it must be in [0, 1]")
    if cfg.model_ema_steps < 1:
        raise UserError(f"--model-ema-steps is {cfg.model_ema_steps}; it must be at least 1")


@torch.no_grad()
def average_(averages: list[torch.Tensor], values: list[torch.Tensor], decay: float) -> None:
    """``avg = decay * avg + (1 - decay) * value`` for each pair, in place: torchvision's
    ``ema_avg``, op for op (two products rounded in the averages' dtype, then their sum),
    so that on tensors of one dtype it gives torchvision's bits. The products are made
    out of place: torch's in-place ``_foreach_mul_`` of a 16-bit tensor by a Python
    float rounds otherwise than ``decay * tensor`` does (torch 2.14, CPU)."""
    if not averages:
        return
    sums = torch._foreach_mul(averages, decay)
    torch._foreach_add_(sums, torch._foreach_mul(values, 1.0 - decay))
    torch._foreach_copy_(averages, sums)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_state(value) -> bool:
    """Whether ``value`` has the form of :meth:`ModelEMA.state_dict` (for the checkpoint's
    field checks, before anything is loaded)."""
    if not isinstance(value, dict) or not isinstance(value.get("module"), dict):
        return False
    if not all(torch.is_tensor(t) for t in value["module"].values()):
        return False
    if not all(_count(value.get(key)) for key in STATE_KEYS):
        return False
    best = value.get("best_acc1", -1.0)
    return (isinstance(best, numbers.Real) and not isinstance(best, bool)
            and (value.get("best_epoch") is None or _count(value.get("best_epoch"))))


def _fp32_copy(model: nn.Module) -> nn.Module:
    """An fp32 copy of ``model`` (a converted one: its cast hooks removed, its
    parameters in a flat buffer), for evaluation only."""
    module = copy.deepcopy(model)
    for p in module.parameters():
        p.grad = None
    to_float(module)
    module.requires_grad_(False)
    module.eval()
    return module


class ModelEMA:
    """The average of one model (module docstring).

    Args:
        model: the model (not a DDP wrapper), as the optimizer steps it.
        opt: its :class:`mpfp16.FP16Optimizer`; the values averaged are its
            :meth:`~mpfp16.FP16Optimizer.trained_values`.
        decay: the decay of one update (:func:`ema_decay`).
        every: ``--model-ema-steps``: trained optimizer steps of an epoch between updates.
        warmup_epochs: the epochs during which the average is reset to the model at
            each update (``epoch < warmup_epochs``).
        sync_buffers: called before each update, on every rank (under DDP: give
            every rank rank 0's buffers).
    """

    def __init__(self, model: nn.Module, opt, *, decay: float, every: int, warmup_epochs: float = 0.0,
                 sync_buffers=None) -> None:
        self.model, self.opt = model, opt
        self.decay, self.every, self.warmup_epochs = float(decay), int(every), float(warmup_epochs or 0.0)
        self.sync_buffers = sync_buffers
        self.module = _fp32_copy(model)
        names = {id(p): name for name, p in model.named_parameters()}
        own = dict(self.module.named_parameters())
        stepped = opt.model_params()
        self._averaged = [own[names[id(p)]] for p in stepped]  # aligned with opt.trained_values()
        in_opt = {id(p) for p in stepped}
        self._frozen = [(own[name], p) for name, p in model.named_parameters() if id(p) not in in_opt]
        own_buffers = dict(self.module.named_buffers())
        pairs = [(own_buffers[name], b) for name, b in model.named_buffers()]
        self._float_buffers = [(e, b) for e, b in pairs if e.is_floating_point()]
        self._other_buffers = [(e, b) for e, b in pairs if not e.is_floating_point()]
        self.n_averaged = 0  # AveragedModel's: 0 means the next update copies
        self.epoch, self.epoch_steps = 0, 0  # the epoch the counter counts in, and its trained steps so far
        self.updates = 0
        self.best_acc1, self.best_epoch = -1.0, None  # the best EMA acc1 of an epoch's end, and its epoch

    # ------------------------------------------------------------------ updating

    def after_step(self, epoch: int, stepped: bool) -> bool:
        """Count one optimizer step of ``epoch`` (0-based) that trained (``stepped``) or
        was skipped, and update the average where torchvision would:
        ``if i % model_ema_steps == 0``, ``i`` the index of the trained step in its
        epoch; during the warm-up, reset it after. Every rank calls it. Returns whether
        it updated."""
        if not stepped:
            return False
        if epoch != self.epoch:
            self.epoch, self.epoch_steps = epoch, 0
        due = self.epoch_steps % self.every == 0
        self.epoch_steps += 1
        if due:
            if self.sync_buffers is not None:
                self.sync_buffers()
            self.update()
            if epoch < self.warmup_epochs:  # torchvision: keep copying the weights during the warm-up
                self.n_averaged = 0
        return due

    @torch.no_grad()
    def update(self) -> None:
        """One update of the average from the masters and the model's buffers
        (AveragedModel.update_parameters with use_buffers=True)."""
        averages = self._averaged + [e for e, _ in self._frozen] + [e for e, _ in self._float_buffers]
        values = (list(self.opt.trained_values()) + [p.detach().float() for _, p in self._frozen]
                  + [b.detach().float() for _, b in self._float_buffers])
        if self.n_averaged == 0:
            torch._foreach_copy_(averages, values)
            for e, b in self._other_buffers:
                e.copy_(b)
        else:
            average_(averages, values, self.decay)
            for e, b in self._other_buffers:  # torchvision's arithmetic on an integer buffer, truncated by copy_
                e.copy_(self.decay * e + (1 - self.decay) * b)
        self.n_averaged += 1
        self.updates += 1

    def record(self, acc1: float, epoch: int) -> bool:
        """An epoch's end evaluation of the average (acc1, epoch 1-based): whether it is
        the best so far (kept in the state)."""
        if acc1 > self.best_acc1:
            self.best_acc1, self.best_epoch = acc1, epoch
            return True
        return False

    # ------------------------------------------------------------------ saving

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "n_averaged": self.n_averaged, "epoch": self.epoch,
                "epoch_steps": self.epoch_steps, "updates": self.updates, "decay": self.decay, "every": self.every,
                "best_acc1": self.best_acc1, "best_epoch": self.best_epoch}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` (of the same model).

        Raises:
            ValueError: it does not have that form, or its average does not fit this
                model (one line).
        """
        if not is_state(state):
            raise ValueError("its EMA state is not one that --model-ema writes")
        mine = self.module.state_dict()
        saved = state["module"]
        if saved.keys() != mine.keys():
            missing = [k for k in mine if k not in saved]
            raise ValueError(f"its EMA does not fit this model ({len(missing)} of its tensors missing"
                             + (f", first {missing[0]})" if missing else ", and others unknown here)"))
        for key, value in saved.items():
            if value.shape != mine[key].shape:
                raise ValueError(f"its EMA does not fit this model: {key} is {list(value.shape)} there and "
                                 f"{list(mine[key].shape)} here")
        for key, value in saved.items():
            mine[key].copy_(value)
        self.n_averaged, self.epoch = int(state["n_averaged"]), int(state["epoch"])
        self.epoch_steps, self.updates = int(state["epoch_steps"]), int(state["updates"])
        self.best_acc1 = float(state.get("best_acc1", -1.0))
        self.best_epoch = state.get("best_epoch")
