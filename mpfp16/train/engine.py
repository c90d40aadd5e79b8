"""The train/eval loop shared by both scripts: it conducts the parts that build the run
(:mod:`.build`), claim its folder (:mod:`.rundir`), save and resume it
(:mod:`.checkpointing`), evaluate it (:mod:`.evaluation`) and log it (:mod:`.metrics`).

One optimizer step is ``accum_steps`` micro-batches; the allreduce runs only on the
last of them. ``step`` counts optimizer steps, skipped ones included; ``--max-steps``,
``--save-every`` and the learning-rate schedule are in those units. The position in the
epoch, ``samples_done``, counts samples of the epoch's one order over all ranks, so that
it means the same for any number of processes, batch and accumulation; an epoch resumed
with another of these ends where an uninterrupted epoch of its shape ends, with a
shorter last step where its full steps stop before that (:func:`.resume.epoch_rest`).

An epoch's train loss is the mean over its steps that trained: a skipped step (inf/NaN
in the gradients) trained nothing, and its loss (NaN, when a batch held NaN) is counted
apart, as the number of the epoch's skipped steps (a resumed epoch's: over the steps
since the resume). A logged record's ``loss`` is so too, over its steps; where every
one of them was skipped, their own loss. The evaluation at an epoch's end
competes for ``best.pt``; the one at a stop in mid-epoch (``--max-steps``) does not,
since an uninterrupted run makes no evaluation there (it is logged, and until the
first epoch ends ``best.pt`` is the checkpoint of the stop, so that a run stopped
before then has one). With ``--model-ema`` the fp32 average of the masters
(:mod:`.ema`) is updated after the steps that trained and evaluated beside the model.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

from .. import __version__
from .. import distributed as mdist
from . import build, rundir
from . import resume as decide
from . import augment
from . import data as data_mod
from .checkpointing import RunCheckpoints
from .ema import ModelEMA, check_options as check_ema_options, ema_decay
from .config import TrainConfig
from .evaluation import evaluate
from .metrics import MetricsWriter
from .preemption import StopSignals, Stopped
from .state import TrainState

__all__ = ["Trainer", "train"]

logger = logging.getLogger("mpfp16")


def _fmt_time(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _read_only(name: str) -> property:
    """The trainer's ``state.<name>``, for code that reads where the run is (a test, a
    patched step); only the trainer writes its state."""
    return property(lambda self: getattr(self.state, name), doc=f"``state.{name}`` (read-only)")


class Trainer:
    """Everything one training run holds. ``fit()`` runs it. Its position and progress
    are :attr:`state`, which only the trainer's own methods change: the checkpoint code
    saves the one it is given and returns the one it loads."""

    def __init__(self, cfg: TrainConfig, info: mdist.DistInfo, signals: StopSignals | None = None) -> None:
        self.cfg, self.info = cfg, info
        self.device = info.device
        self.main = info.is_main_process
        self.signals = signals
        torch.manual_seed(cfg.seed)
        build.check_model_fits(cfg)  # before loading data, which can take long
        check_ema_options(cfg)
        self.metrics_path = cfg.metrics or os.path.join(cfg.checkpoint_dir, "metrics.jsonl")
        self.lock = rundir.claim(cfg, self.metrics_path)  # before any data is loaded or any kernel compiled
        try:
            self._build(cfg, info)
        except BaseException:
            self.release()
            raise

    def _build(self, cfg: TrainConfig, info: mdist.DistInfo) -> None:
        # A CPU group for the stop flag, so that agreeing on it never waits on a GPU stream.
        self.control_group = dist.new_group(backend="gloo") if info.backend == "nccl" else None
        self.data = build.data(cfg, info)
        self.model = build.model(cfg, self.data.spec.num_classes, info)
        self.opt = build.optimizer(cfg, self.model, info.world_size)
        self.ddp = build.wrap(cfg, self.model, info)
        self.samples_per_step = cfg.batch_size * cfg.accum_steps * info.world_size
        schedule = build.schedule(cfg, self.opt, len(self.data.train_sampler))
        self.sched, self.steps_per_epoch = schedule.scheduler, schedule.steps_per_epoch
        self.total_steps, self.epochs_shown = schedule.total_steps, schedule.epochs_shown
        self.max_steps = schedule.max_steps
        self.replica_checks, self.replica_check_s, self._checked_at = 0, 0.0, None
        self.last_skip = None  # (step, opt.last_overflow) of the last skipped step since the last train record
        self.last_stepped = True  # whether the last train_step trained (False: skipped)
        self.ema = self._build_ema(cfg, info) if cfg.model_ema else None
        self.checkpoints = RunCheckpoints(cfg, info, self.model, self.ddp, self.opt, self.sched,
                                          run_facts=self.run_facts(), training_images=len(self.data.spec.train),
                                          ema=self.ema)
        self.state: TrainState = self.checkpoints.resume()  # what it loaded, or a fresh run's
        if cfg.evaluate and not self.checkpoints.ema_resumed:
            self.ema = None  # no average in the checkpoint to evaluate (said when it was read)
        self.metrics = MetricsWriter(self.metrics_path, self.main, cfg.tensorboard, truncate=cfg.overwrite)

    def _build_ema(self, cfg: TrainConfig, info: mdist.DistInfo) -> ModelEMA:
        decay = ema_decay(info.world_size, cfg.batch_size, cfg.accum_steps, cfg.model_ema_steps, cfg.epochs,
                          cfg.model_ema_decay)
        sync = (lambda: mdist.broadcast_buffers(self.model)) if info.distributed else None
        logger.info("model EMA: fp32, of the fp32 masters, every %d trained steps of an epoch, decay %.8g per update "
                    "(--model-ema-decay %g adjusted as torchvision does)%s", cfg.model_ema_steps, decay,
                    cfg.model_ema_decay, f", reset to the model in the {cfg.warmup_epochs:g} warm-up epochs"
                    if cfg.warmup_epochs else "")
        return ModelEMA(self.model, self.opt, decay=decay, every=cfg.model_ema_steps,
                        warmup_epochs=cfg.warmup_epochs or 0.0, sync_buffers=sync)

    step = _read_only("step")
    epoch = _read_only("epoch")
    best_acc1 = _read_only("best_acc1")

    @property
    def batches_done(self) -> int:
        """Each rank's micro-batches of the current epoch, of this run's ``-b`` (read-only)."""
        return self.state.batches_done(self.cfg.batch_size, self.info.world_size)

    def epoch_rest(self) -> decide.EpochRest:
        """How the rest of the epoch is trained from ``samples_done`` on: full steps, and
        after a resume with another shape a shorter last one (resume.epoch_rest)."""
        return decide.epoch_rest(self.state.samples_done, dataset_size=self.data.train_sampler.epoch_size,
                                 world_size=self.info.world_size, batch_size=self.cfg.batch_size,
                                 accum_steps=self.cfg.accum_steps)

    def steps_left_in_epoch(self) -> int:
        return self.epoch_rest().steps

    def _over(self) -> bool:
        """Whether the run has ended: at --epochs, or at --max-steps before it
        (build.schedule). Counted in epochs, not steps, so that a run resumed with
        another global batch (--allow-changed-config) ends at --epochs too."""
        if self.max_steps is not None and self.state.step >= self.max_steps:
            return True
        last_epoch_done = self.state.epoch + 1 == self.cfg.epochs and self.steps_left_in_epoch() == 0
        return self.state.epoch >= self.cfg.epochs or last_epoch_done

    def release(self) -> None:
        """Let go of the run directory's lock (the OS does it too when the process ends)."""
        if self.lock is not None:
            self.lock.release()

    def run_facts(self) -> dict:
        """What the run's meaning depends on besides its flags."""
        return {"processes": self.info.world_size, "training images": len(self.data.spec.train)}

    def check_replicas(self) -> None:
        """Compare weights, masters and optimizer state across ranks (every
        ``--check-replicas`` steps, before each checkpoint, at the end). BatchNorm
        statistics are rank 0's first, as DDP makes them at the next forward."""
        if not (self.info.world_size > 1 and self.cfg.check_replicas) or self._checked_at == self.state.step:
            return
        started = time.perf_counter()
        mdist.broadcast_buffers(self.model)
        mdist.check_replicas(self.model, self.opt, context=f" at step {self.state.step}")
        if self.ema is not None:
            mdist.check_replicas(self.ema.module, context=f" (the model EMA) at step {self.state.step}")
        self._checked_at = self.state.step
        self.replica_checks += 1
        self.replica_check_s += time.perf_counter() - started

    def save(self, best: bool = False) -> None:
        """Write DIR/last (and DIR/best) in the run's format: every rank takes part."""
        self.metrics.check()  # a metrics write that failed on rank 0 (a full disk) stops every rank here
        self.check_replicas()  # never save a state the ranks do not share
        self.checkpoints.save(self.state, self.elapsed(), best)

    def evaluate(self) -> dict:
        spare_size = build.image_size(self.cfg, self.state.epoch)
        return evaluate(self.model, self.data, self.cfg, self.info, self._prepare, spare_size)

    def evaluate_ema(self) -> dict:
        """The model EMA's evaluation (its fp32 copy, :mod:`.ema`), its keys prefixed
        ``ema_``; empty without ``--model-ema``."""
        if self.ema is None:
            return {}
        spare_size = build.image_size(self.cfg, self.state.epoch)
        result = evaluate(self.ema.module, self.data, self.cfg, self.info, self._prepare, spare_size)
        self.ema.module.eval()
        return {f"ema_{key}": value for key, value in result.items() if key != "val_samples"}

    # ------------------------------------------------------------------ the loop

    def elapsed(self) -> float:
        return self.state.elapsed_before + time.perf_counter() - self.started

    def fit(self) -> dict:
        cfg = self.cfg
        self.started = time.perf_counter()
        if self.main:
            self.metrics.write({"type": "config", **cfg.as_dict(), "world_size": self.info.world_size,
                                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps})
        if cfg.evaluate:
            result = {**self.evaluate(), **self.evaluate_ema()}
            logger.info("evaluation: loss %.4f, acc1 %.2f%%, acc5 %.2f%% on %d images%s", result["val_loss"],
                        result["val_acc1"], result["val_acc5"], result["val_samples"], _ema_words(result))
            self.metrics.write({"type": "eval", "step": self.state.step, "epoch": self.state.epoch, **result})
            self.metrics.close()
            return result
        logger.info("training %d steps (%d per epoch) of %d samples; checkpoints in %s, metrics in %s",
                    self.total_steps, self.steps_per_epoch, self.samples_per_step, cfg.checkpoint_dir,
                    self.metrics_path)
        self._stop_if_asked(save=False)  # a signal during start-up: nothing trained yet
        while not self._over():
            self.train_epoch()
        return self.finish()

    def _stop_if_asked(self, save: bool = True) -> None:
        """If any rank got SIGTERM or SIGINT, every rank saves (after the step in
        progress, which has finished) and the run ends with :class:`Stopped`."""
        signum = self.signals.agreed(self.control_group) if self.signals is not None else None
        if signum is None:
            return
        name = signal.Signals(signum).name
        if save and self.checkpoints.saved_at != self.state.step:
            self.save()
        if self.main:
            self.metrics.write({"type": "stopped", "reason": name, "step": self.state.step,
                                "epoch": self.state.epoch, "time": self.elapsed()})
        self.metrics.close()
        saved = f"saved {self.checkpoints.last_path}; continue with --resume auto" if save else "nothing to save"
        raise Stopped(signum, f"stopped by {name} at step {self.state.step}: {saved}", announce=self.main)

    def _loader(self, epoch: int, rest: decide.EpochRest):
        """The micro-batches of the rest of ``epoch``: ``rest``'s full steps', then those of
        its shorter last step."""
        cfg, spec = self.cfg, self.data.spec
        if spec.make_transforms is not None and spec.train.transform is not None:
            spec.train.transform, spec.val.transform = spec.make_transforms(build.image_size(cfg, epoch))
        self.data.train_sampler.set_epoch(epoch, self.state.samples_done)
        sizes = [cfg.batch_size] * (rest.full_steps * cfg.accum_steps) + list(rest.last_step)
        return data_mod.make_loader(spec.train, self.data.train_sampler, cfg.batch_size, cfg.workers,
                                    self.device.type == "cuda", drop_last=True, batch_sizes=sizes)

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True).float().sub_(self.data.mean).div_(self.data.std)
        if self.cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images

    def train_epoch(self) -> None:
        cfg = self.cfg
        epoch = self.state.epoch
        rest = self.epoch_rest()
        note = decide.describe_rest(rest, epoch=epoch, samples_done=self.state.samples_done,
                                    dataset_size=self.data.train_sampler.epoch_size, world_size=self.info.world_size)
        if note and self.main:  # a resume with another shape: once, on rank 0
            (logger.warning if note[0] == "warning" else logger.info)("%s", note[1])
        steps_left = rest.steps if self.max_steps is None else min(rest.steps, self.max_steps - self.state.step)
        show = self.main and cfg.progress and sys.stderr.isatty()
        bar = tqdm(total=self.steps_per_epoch, initial=max(0, self.steps_per_epoch - rest.steps), disable=not show,
                   desc=f"epoch {epoch + 1}/{self.epochs_shown}", dynamic_ncols=True, leave=False)
        self.model.train()
        epoch_start, epoch_losses = time.perf_counter(), _Losses(self.device)
        window_start, window_losses = time.perf_counter(), _Losses(self.device)
        epoch_samples = window_samples = 0
        batches = iter(self._loader(epoch, rest))
        try:
            for i in range(steps_left):
                shorter = i == rest.full_steps  # the shorter last step of a resume with another shape
                loss = self.train_step(batches, rest.last_step) if shorter else self.train_step(batches)
                step_samples = sum(rest.last_step) * self.info.world_size if shorter else self.samples_per_step
                self.state.step += 1
                self.state.samples_done += step_samples
                comm = mdist.comm_stats(self.ddp)
                comm = comm.pop_step() if comm is not None else {"allreduce_calls": 0, "allreduce_bytes": 0}
                if self.ema is not None:
                    self.ema.after_step(epoch, self.last_stepped)
                window_losses.add(loss, self.last_stepped)
                window_samples += step_samples
                epoch_losses.add(loss, self.last_stepped)
                epoch_samples += step_samples
                bar.update(1)
                last = self._over()
                if self.state.step % cfg.print_freq == 0 or last:
                    mean_loss = self._mean_across_ranks(window_losses.mean())
                    rate = window_samples / (time.perf_counter() - window_start)
                    self._log_step(mean_loss, rate, comm)
                    self.metrics.check()  # a metrics write that failed on the main process stops every rank now
                    bar.set_postfix(loss=f"{mean_loss:.4f}", scale=f"{self.opt.loss_scale:g}", img_s=f"{rate:.0f}")
                    window_start, window_samples, window_losses = time.perf_counter(), 0, _Losses(self.device)
                if cfg.save_every and self.state.step % cfg.save_every == 0 and not last:
                    self.save()
                elif cfg.check_replicas and self.state.step % cfg.check_replicas == 0:
                    self.check_replicas()
                if not last:
                    self._stop_if_asked()
        finally:
            bar.close()
        train_loss = self._mean_across_ranks(epoch_losses.mean())
        ended = self.steps_left_in_epoch() == 0  # else a stop in mid-epoch (--max-steps)
        if ended:
            self.state.epoch, self.state.samples_done = epoch + 1, 0
        self._end_epoch(epoch, train_loss, epoch_losses, time.perf_counter() - epoch_start, epoch_samples, ended)

    def train_step(self, batches, shorter: tuple[int, ...] | None = None) -> torch.Tensor:
        """One optimizer step over ``accum_steps`` micro-batches, or, for the shorter last
        step of an epoch resumed with another shape, over micro-batches of the sizes
        ``shorter`` (each one's loss weighted by its share of the step, so that the
        gradient is the mean over the step's samples, as in any step). The labels are
        class indices, or class probabilities ([N, classes], floating: mixup's and
        cutmix's soft targets), which the loss takes in fp32. Returns the mean loss (a
        tensor on the device: no host sync here); :attr:`last_stepped` says whether the
        step trained or was skipped."""
        cfg = self.cfg
        self.opt.zero_grad()
        self._snapshot_buffers()
        total = torch.zeros((), device=self.device)
        micro_batches = cfg.accum_steps if shorter is None else len(shorter)
        earlier = 0  # this rank's samples in the step's earlier micro-batches
        for micro in range(micro_batches):
            images, labels = next(batches)
            images, labels = self._prepare(images), labels.to(self.device, non_blocking=True)
            if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0:
                index = augment.batch_index(self.state.samples_done, earlier=earlier,
                                            world_size=self.info.world_size, rank=self.info.rank)
                images, labels = augment.mix_batch(images, labels, epoch=self.state.epoch, index=index,
                                                   seed=cfg.seed, mixup_alpha=cfg.mixup_alpha,
                                                   cutmix_alpha=cfg.cutmix_alpha,
                                                   num_classes=self.data.spec.num_classes)
            earlier += len(labels)
            labels = _targets(labels)
            # Only the last micro-batch's backward allreduces: the others accumulate
            # locally under no_sync, so the wire carries one allreduce per step.
            with mdist.sync_gradients(self.ddp, micro == micro_batches - 1):
                loss = nn.functional.cross_entropy(self.ddp(images).float(), labels,
                                                   label_smoothing=cfg.label_smoothing)
                if shorter is not None:
                    loss = loss * (len(labels) / sum(shorter))
                self.opt.backward(loss / cfg.accum_steps if shorter is None else loss)
            total += loss.detach()
        self.last_stepped = bool(self.opt.step())
        if not self.last_stepped:
            self._restore_buffers()
            self.last_skip = (self.state.step + 1, self.opt.last_overflow)  # the step this one is counted as
        self.sched.step()
        return total / cfg.accum_steps if shorter is None else total

    def _snapshot_buffers(self) -> None:
        """Keep the model's buffers (BatchNorm statistics) as they were before this
        step's forward passes: a batch that makes the step skip (NaN in the data, say)
        must not leave NaN in the running statistics either."""
        buffers = list(self.model.buffers())
        if not hasattr(self, "_buffer_copies"):
            self._buffer_copies = [b.detach().clone() for b in buffers]
        elif buffers:
            torch._foreach_copy_(self._buffer_copies, buffers)

    @torch.no_grad()
    def _restore_buffers(self) -> None:
        buffers = list(self.model.buffers())
        if buffers:
            torch._foreach_copy_(buffers, self._buffer_copies)

    def _mean_across_ranks(self, value: torch.Tensor) -> float:
        if self.info.distributed:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.info.world_size
        return float(value)

    def _log_step(self, loss: float, rate: float, comm: dict) -> None:
        skip, self.last_skip = self.last_skip, None
        if not self.main:
            return
        self.metrics.write({
            "type": "train", "step": self.state.step, "epoch": self.state.epoch, "loss": loss,
            "loss_scale": self.opt.loss_scale, "skipped_steps": self.opt.skipped_steps,
            # the last skipped step since the previous record, and the parameters whose gradient held inf/NaN
            "overflow_step": skip[0] if skip else None, "overflow": skip[1] if skip else [],
            "lr": self.opt.param_groups[0]["lr"], "grad_norm": self.opt.last_grad_norm,
            "samples_per_s": rate, "allreduce_calls": comm["allreduce_calls"],
            "allreduce_bytes": comm["allreduce_bytes"], "time": self.elapsed(),
            **{key: comm[key] for key in ("allreduce_bytes_by_dtype", "reduce_scatter_calls", "reduce_scatter_bytes", "all_gather_calls",
                                          "all_gather_bytes") if key in comm},
        })

    def _end_epoch(self, epoch: int, train_loss: float, losses: _Losses, seconds: float, samples: int,
                   ended: bool = True) -> None:
        """Evaluate (the model, and the EMA), log, and save. ``ended``: the epoch ended;
        else the run stopped in its middle (``--max-steps``), where an uninterrupted run
        makes no evaluation: this one is logged but competes for nothing (best_acc1,
        best_epoch, best.pt), so that a run stopped and resumed keeps the best.pt of one
        that was not. Until the first epoch ends there is no best: a stop then writes
        best.pt as the checkpoint of the stop (a run stopped early still has one to
        evaluate), and the first epoch's end replaces it, as in an uninterrupted run."""
        result = {**self.evaluate(), **self.evaluate_ema()}
        is_best = ended and result["val_acc1"] > self.state.best_acc1
        if is_best:
            self.state.best_acc1, self.state.best_epoch = result["val_acc1"], epoch + 1
        if ended and self.ema is not None:
            self.ema.record(result["ema_val_acc1"], epoch + 1)
        if self.main:
            self.metrics.write({"type": "eval", "step": self.state.step, "epoch": epoch + 1, "epoch_end": ended,
                                **result, "train_loss": train_loss, "train_steps": losses.trained_steps,
                                "train_skipped": losses.skipped_steps})
        where = (f"epoch {epoch + 1}/{self.epochs_shown}" if ended else
                 f"epoch {epoch + 1}/{self.epochs_shown}, stopped at step {self.state.step} in mid-epoch "
                 "(this evaluation does not compete for best)")
        logger.info("%s: train loss %.4f (%d step%s trained, %d skipped) | val loss %.4f, acc1 %.2f%%, acc5 %.2f%%%s "
                    "| %.0f img/s, loss scale %g, %d skipped in all, %s", where, train_loss, losses.trained_steps,
                    "s" * (losses.trained_steps != 1), losses.skipped_steps, result["val_loss"], result["val_acc1"],
                    result["val_acc5"], _ema_words(result), samples / max(seconds, 1e-9), self.opt.loss_scale,
                    self.opt.skipped_steps, _fmt_time(seconds))
        self.save(best=is_best or (not ended and self.state.best_epoch is None))

    def finish(self) -> dict:
        self.check_replicas()  # nothing, when the last checkpoint already checked this step
        wall = self.elapsed()
        last, best, state = self.checkpoints.last_path, self.checkpoints.best_checkpoint(), self.state
        summary = {"type": "final", "step": state.step, "epoch": state.epoch, "best_acc1": state.best_acc1,
                   "best_epoch": state.best_epoch, "skipped_steps": self.opt.skipped_steps,
                   "loss_scale": self.opt.loss_scale, "wall_s": wall, "checkpoint": last, "best_checkpoint": best,
                   "metrics": self.metrics_path, "replica_checks": self.replica_checks,
                   "replica_check_s": self.replica_check_s, "mpfp16_version": __version__}
        if self.ema is not None:
            summary.update(best_ema_acc1=self.ema.best_acc1, best_ema_epoch=self.ema.best_epoch,
                           ema_updates=self.ema.updates)
        if self.main:
            self.metrics.write(summary)
        self.metrics.close()
        best_words = (f"best val acc1 {state.best_acc1:.2f}% (epoch {state.best_epoch})" if state.best_epoch is not None
                      else "no epoch has ended, so nothing competed for best (best.pt is the checkpoint of the stop)")
        if self.ema is not None and self.ema.best_epoch is not None:
            best_words += f", EMA best acc1 {self.ema.best_acc1:.2f}% (epoch {self.ema.best_epoch})"
        logger.info("done: %s in %s, %d steps, %d skipped", best_words, _fmt_time(wall), state.step,
                    self.opt.skipped_steps)
        if self.replica_checks:
            logger.info("replicas: identical at %d checks, which took %.2fs (%.2f%% of the run)", self.replica_checks,
                        self.replica_check_s, 100 * self.replica_check_s / max(wall, 1e-9))
        logger.info("checkpoint: %s (best: %s)", last, best)
        logger.info("metrics: %s", self.metrics_path)
        return summary


class _Losses:
    """Sums of step losses (tensors on the device: no host sync per step): over the
    steps that trained, and over all of them. Its mean is over the steps that trained,
    or, where none did, over all (the loss of a record whose steps were all skipped)."""

    def __init__(self, device: torch.device) -> None:
        self.trained = torch.zeros((), device=device)
        self.every = torch.zeros((), device=device)
        self.trained_steps = self.steps = 0

    @property
    def skipped_steps(self) -> int:
        return self.steps - self.trained_steps

    def add(self, loss: torch.Tensor, trained: bool) -> None:
        self.every += loss
        self.steps += 1
        if trained:
            self.trained += loss
            self.trained_steps += 1

    def mean(self) -> torch.Tensor:
        if self.trained_steps:
            return self.trained / self.trained_steps
        return self.every / max(1, self.steps)


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """A batch's training targets as the loss takes them: class indices as they are,
    soft targets (class probabilities, floating) in fp32."""
    return labels.float() if labels.is_floating_point() else labels


def _ema_words(result: dict) -> str:
    """The model EMA's part of an evaluation's line, where there is one."""
    if "ema_val_acc1" not in result:
        return ""
    return f" | EMA acc1 {result['ema_val_acc1']:.2f}%, acc5 {result['ema_val_acc5']:.2f}%"


def train(cfg: TrainConfig) -> dict:
    """Set up torch.distributed from the environment, run, and tear down. SIGTERM and
    SIGINT stop the run cleanly (mpfp16/train/preemption.py)."""
    cfg.validate()
    info = build.init_distributed(cfg)
    signals = StopSignals(announce=info.is_main_process).install()
    trainer = None
    try:
        with build.deterministic_algorithms(cfg.use_deterministic_algorithms):  # cli.run's too: nesting is safe
            trainer = Trainer(cfg, info, signals)
            return trainer.fit()
    finally:
        signals.uninstall()
        if trainer is not None:
            trainer.release()
        trainer = None  # its DDP module goes before the process group (mdist.teardown)
        mdist.teardown()
