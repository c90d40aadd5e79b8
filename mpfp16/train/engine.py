"""The train/eval loop shared by both scripts: data, model, precision, DDP, accumulation,
metrics, progress, checkpoints and exact resume.

One optimizer step is ``accum_steps`` micro-batches; the allreduce runs only on the
last of them. ``step`` counts optimizer steps, skipped ones included; ``--max-steps``,
``--save-every`` and the learning-rate schedule are in those units.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

from .. import distributed as mdist
from .. import sharded_checkpoint
from ..convert import NORM_TYPES, to_half
from ..errors import CheckpointError, UserError, one_line
from ..flat import flatten_parameters
from ..optimizer import FP16Optimizer
from . import checkpoint as ckpt_io
from . import data as data_mod
from . import models, rundir
from .config import SYNTHETIC_SIZES, TrainConfig
from .metrics import MetricsWriter
from .preemption import StopSignals, Stopped
from .schedule import lr_multiplier

__all__ = ["Trainer", "train"]

logger = logging.getLogger("mpfp16")

CHECKPOINT_FORMAT = "mpfp16.checkpoint/1"
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _fmt_time(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def param_groups(model: nn.Module, weight_decay: float, no_bn_wd: bool) -> list[dict]:
    """One group, or, with ``no_bn_wd``, normalization-layer parameters and biases in a
    group without weight decay."""
    if not no_bn_wd:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    no_decay_ids = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, NORM_TYPES) or name == "bias" or p.ndim <= 1:
                no_decay_ids.add(id(p))
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if id(p) not in no_decay_ids], "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) in no_decay_ids], "weight_decay": 0.0}]


class Trainer:
    """Everything one training run holds. ``fit()`` runs it."""

    def __init__(self, cfg: TrainConfig, info: mdist.DistInfo, signals: StopSignals | None = None) -> None:
        self.cfg, self.info = cfg, info
        self.device = info.device
        self.main = info.is_main_process
        self.signals = signals
        torch.manual_seed(cfg.seed)

        models.check_arch(cfg.task, cfg.arch)  # before loading data, which can take long
        # The sizes the epochs train at: a phase that starts at epoch 0 replaces --image-size.
        sizes = [self._image_size(0)] + [size for start, size in cfg.resize_phases if start > 0]
        models.check_image_sizes(cfg.task, cfg.arch, sizes)
        # A sharded run's checkpoints are folders named by links (mpfp16/sharded_checkpoint.py).
        suffix = ".dcp" if cfg.shard else ".pt"
        self.last_path = os.path.join(cfg.checkpoint_dir, "last" + suffix)
        self.best_path = os.path.join(cfg.checkpoint_dir, "best" + suffix)
        self.metrics_path = cfg.metrics or os.path.join(cfg.checkpoint_dir, "metrics.jsonl")
        self.lock = self._claim_run_dir()  # before any data is loaded or any kernel compiled
        try:
            self._build(cfg, info)
        except BaseException:
            self.release()
            raise

    def _build(self, cfg: TrainConfig, info: mdist.DistInfo) -> None:
        # A CPU group for the stop flag, so that agreeing on it never waits on a GPU stream.
        self.control_group = dist.new_group(backend="gloo") if info.backend == "nccl" else None
        self.spec = self._build_data()
        self.model = self._build_model()
        self.opt = self._build_optimizer()
        self.ddp = self._wrap()
        self.samples_per_step = cfg.batch_size * cfg.accum_steps * info.world_size
        self.steps_per_epoch = len(self.train_sampler) // cfg.batch_size // cfg.accum_steps
        if self.steps_per_epoch == 0:
            raise UserError(
                f"an epoch has no full optimizer step: {len(self.train_sampler)} training samples per process "
                f"for a batch of {cfg.batch_size} x {cfg.accum_steps} accumulation steps; lower -b or --accum-steps"
            )
        # The lr schedule spans --epochs; --max-steps only says where to stop, so that a
        # run stopped early and resumed follows the same schedule as one that was not.
        schedule_steps = cfg.epochs * self.steps_per_epoch
        self.total_steps = cfg.max_steps if cfg.max_steps is not None else schedule_steps
        warmup = round(cfg.warmup_epochs * self.steps_per_epoch)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_multiplier(s, schedule_steps, warmup, cfg.lr_schedule))
        self.epochs_shown = max(cfg.epochs, math.ceil(self.total_steps / self.steps_per_epoch))

        self.step = 0
        self.epoch = 0
        self.batches_done = 0  # micro-batches of the current epoch already trained on
        self.best_acc1, self.best_epoch = -1.0, None
        self.elapsed_before = 0.0
        self.replica_checks, self.replica_check_s, self._checked_at = 0, 0.0, None
        self._saved_at = None
        self._resume()
        self.metrics = MetricsWriter(self.metrics_path, self.main, cfg.tensorboard, truncate=cfg.overwrite)

    def release(self) -> None:
        """Let go of the run directory's lock (the OS does it too when the process ends)."""
        if self.lock is not None:
            self.lock.release()

    # ------------------------------------------------------------------ the run directory

    def _claim_run_dir(self) -> rundir.RunLock | None:
        """Rank 0 checks every place the run writes to, refuses to replace an earlier
        run, and locks the checkpoint directory; every rank gets rank 0's verdict."""
        lock, error = None, None
        if self.main:
            try:
                lock = self._check_run_dir()
            except UserError as exc:
                error = str(exc)
            except OSError as exc:  # removing the old run's files for --overwrite, say
                error = f"cannot prepare {self.cfg.checkpoint_dir}: {one_line(exc)}"
        error = mdist.broadcast_object(error)
        if error is not None:
            raise UserError(error)
        return lock

    def _check_run_dir(self) -> rundir.RunLock | None:
        cfg = self.cfg
        rundir.check_folder(cfg.checkpoint_dir, "checkpoint directory")
        rundir.check_file(self.metrics_path, "metrics file")
        if cfg.tensorboard:
            rundir.check_folder(cfg.tensorboard, "TensorBoard directory")
        if cfg.evaluate:  # writes no checkpoint
            return None
        lock = rundir.RunLock(cfg.checkpoint_dir)
        try:
            earlier = self._earlier_run()
            if earlier and not cfg.overwrite:
                raise UserError(f"{cfg.checkpoint_dir} holds an earlier run ({', '.join(earlier)}): continue it with "
                                "--resume auto, start elsewhere with another --checkpoint-dir, or replace it with "
                                "--overwrite")
            for path in earlier:  # --overwrite: the metrics file is truncated when it is opened
                if path != self.metrics_path:
                    os.unlink(path)
            stale = ckpt_io.remove_stale_temps(cfg.checkpoint_dir) + sharded_checkpoint.remove_unreferenced(
                cfg.checkpoint_dir)
            if stale:
                logger.info("removed %d unfinished checkpoint writes from %s", len(stale), cfg.checkpoint_dir)
        except BaseException:
            lock.release()
            raise
        return lock

    def _earlier_run(self) -> list[str]:
        """The files of an earlier run that this run would replace: none when it
        continues the run in its folder, its checkpoints when it starts from another
        one, and its metrics too when it starts fresh."""
        resume = self.cfg.resume
        if resume == "auto" and os.path.exists(self.last_path):
            return []
        if resume == "auto":
            self._refuse_other_kind()
        if resume not in (None, "auto") and os.path.exists(resume) and os.path.exists(self.last_path) \
                and os.path.samefile(resume, self.last_path):
            return []
        return rundir.existing_run(self.cfg.checkpoint_dir, self.metrics_path if resume is None else None)

    def _refuse_other_kind(self) -> None:
        """--resume auto in a folder whose run was sharded when this one is not, or the
        reverse: say so, rather than start afresh beside it."""
        other = os.path.join(self.cfg.checkpoint_dir, "last.pt" if self.cfg.shard else "last.dcp")
        if os.path.exists(other):
            fix = "without --shard" if self.cfg.shard else "with --shard"
            raise UserError(f"{self.cfg.checkpoint_dir} holds {'an unsharded' if self.cfg.shard else 'a sharded'} "
                            f"run ({os.path.basename(other)}): continue it {fix}")

    # ------------------------------------------------------------------ building

    def _build_data(self) -> data_mod.DataSpec:
        cfg, info = self.cfg, self.info
        if cfg.task == "cifar":
            spec = data_mod.cifar_data(cfg.data, cfg.seed, cfg.synthetic_size or SYNTHETIC_SIZES[cfg.task])
        else:
            spec = data_mod.imagenet_data(cfg.data, self._image_size(0), cfg.seed, cfg.bad_images,
                                          cfg.synthetic_size or SYNTHETIC_SIZES[cfg.task])
        logger.info("data: %s", spec.description)
        self.train_sampler = data_mod.ResumableDistributedSampler(spec.train, info.world_size, info.rank,
                                                                  shuffle=True, seed=cfg.seed)
        self.val_sampler = data_mod.ShardSampler(len(spec.val), info.world_size, info.rank)
        shape = (1, 3, 1, 1)
        self.mean = torch.tensor(spec.mean, device=self.device).view(shape) * 255
        self.std = torch.tensor(spec.std, device=self.device).view(shape) * 255
        return spec

    def _image_size(self, epoch: int) -> int:
        size = self.cfg.image_size
        for start, phase_size in self.cfg.resize_phases:
            if epoch >= start:
                size = phase_size
        return size

    def _build_model(self) -> nn.Module:
        cfg = self.cfg
        if cfg.task == "cifar":
            model = models.build_cifar_model(cfg.arch, self.spec.num_classes)
        else:
            model = models.build_imagenet_model(cfg.arch, self.spec.num_classes, image_size=self._image_size(0))
        if cfg.zero_init_residual:
            count = models.zero_init_residual_bn(model)
            logger.info("zero-initialized the last BatchNorm gamma of %d residual blocks", count)
        model = model.to(self.device)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        dtype = TORCH_DTYPES[cfg.precision]
        if cfg.shard:  # the fp32 parameters become the sharded masters
            model = mdist.shard(model, dtype, reduce_dtype=TORCH_DTYPES.get(cfg.allreduce_dtype))
        elif dtype != torch.float32:
            to_half(model, dtype)
        else:
            flatten_parameters(model)  # as to_half does: nothing moves when DDP wraps the model
        n = sum(p.numel() for p in model.parameters())
        logger.info("model: %s, %.2fM parameters, %s%s%s", cfg.arch, n / 1e6, cfg.precision,
                    "" if cfg.precision == "fp32" else (" with fp32 master weights" if cfg.master_weights
                                                        else " without master weights"),
                    f", sharded over {self.info.world_size} process{'es' * (self.info.world_size > 1)} (FSDP2)"
                    if cfg.shard else "")
        return model

    def _build_optimizer(self) -> FP16Optimizer:
        cfg = self.cfg
        lr = cfg.lr
        if cfg.scale_lr:
            lr = cfg.lr * cfg.batch_size * cfg.accum_steps * self.info.world_size / 256
            logger.info("learning rate %.4g for a global batch of %d (%.4g per 256)", lr,
                        cfg.batch_size * cfg.accum_steps * self.info.world_size, cfg.lr)
        groups = param_groups(self.model, cfg.weight_decay, cfg.no_bn_wd)
        build = {"sgd": lambda: torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov),
                 "adamw": lambda: torch.optim.AdamW(groups, lr=lr)}
        try:
            inner = build[cfg.optimizer]()  # validate() refused any other name
        except ValueError as exc:  # e.g. Nesterov without momentum
            raise UserError(f"optimizer settings: {exc}") from None
        loss_scale = None if cfg.precision != "fp16" else cfg.loss_scale
        fused = {"auto": None, "on": True, "off": False}[cfg.fused]
        try:
            return FP16Optimizer(inner, loss_scale=loss_scale, master_weights=cfg.master_weights,
                                 max_grad_norm=cfg.max_grad_norm, model=self.model, track_grad_norm=True,
                                 fused=fused, rounding=cfg.rounding if cfg.precision != "fp32" else "nearest",
                                 rounding_seed=cfg.seed)
        except ValueError as exc:  # --fused on with an optimizer it cannot fuse
            raise UserError(str(exc)) from None

    def _wrap(self) -> nn.Module:
        if not self.info.distributed or self.cfg.shard:  # a sharded model is called as it is
            return self.model
        cfg = self.cfg
        return mdist.wrap(self.model, allreduce_dtype=TORCH_DTYPES.get(cfg.allreduce_dtype),
                          predivide_factor=cfg.predivide_factor, bucket_mb=cfg.bucket_mb,
                          strategy=cfg.allreduce_strategy, powersgd_rank=cfg.powersgd_rank,
                          powersgd_start_iter=cfg.powersgd_start_iter)

    # ------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        """Load ``--resume``: rank 0 resolves ``auto`` and every rank loads what rank 0
        chose; then the ranks check that they read the same file and hold the same
        state. Ranks that found different checkpoints (no shared file system) stop
        with one line naming the ranks and files, never a silent divergence."""
        cfg = self.cfg
        path = cfg.resume
        if path == "auto":
            path = self.last_path if os.path.exists(self.last_path) else None
            path = mdist.broadcast_object(path)  # rank 0's file system decides
            logger.info("resume auto: %s", f"resuming from {path}" if path else f"no {self.last_path}, starting fresh")
        if path is None:
            if cfg.evaluate:
                raise UserError("--evaluate needs a checkpoint: pass --resume PATH")
            return
        if cfg.shard:  # one collective read: every rank gets the same error, if any
            ckpt = self._read_sharded_checkpoint(path)
        else:
            try:
                ckpt = self._read_checkpoint(path)
                found = {"path": path, "step": ckpt.get("step"), "error": None,
                         "digest": ckpt_io.digest(path) if self.info.distributed else None}
            except CheckpointError as exc:
                ckpt, found = None, {"path": path, "error": str(exc)}
            ckpt_io.check_same_everywhere(mdist.all_gather_object(found))
        changes = [] if cfg.evaluate else self._changed_settings(path, ckpt)
        self._load(path, ckpt, changes)
        mdist.check_replicas(self.model, self.opt, context=f" after resuming from {path}")
        logger.info("resumed from %s: epoch %d, step %d", path, self.epoch, self.step)

    @staticmethod
    def _read_checkpoint(path: str) -> dict:
        if sharded_checkpoint.is_checkpoint(path):
            raise CheckpointError(f"{path} is a sharded run's checkpoint: resume it with --shard")
        ckpt = ckpt_io.load(path, map_location="cpu")  # RNG states must stay CPU tensors
        if ckpt.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} is not an mpfp16 training checkpoint (no 'format': '{CHECKPOINT_FORMAT}')")
        return ckpt

    def _read_sharded_checkpoint(self, path: str) -> dict:
        """Read a sharded checkpoint into this run's sharding: the model's own sharded
        parameters receive the saved masters (any world size saved it). First the ranks
        check that they see the same checkpoint (its meta.pt and DCP index), as for an
        unsharded one: each reads its plain values from its own file system."""
        try:
            digest = "".join(ckpt_io.digest(os.path.join(path, name)) for name in (sharded_checkpoint.META,
                                                                                    ".metadata"))
            found = {"path": path, "step": sharded_checkpoint.read_meta(path)["state"].get("step"), "error": None,
                     "digest": digest}
        except CheckpointError as exc:
            found = {"path": path, "error": str(exc)}
        everywhere = mdist.all_gather_object(found)
        if any(f["error"] is None for f in everywhere):  # where no rank can read it, load() says why
            ckpt_io.check_same_everywhere(everywhere)
        ckpt = sharded_checkpoint.load(path, targets={"model": self.model.state_dict()})
        if ckpt.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} is not an mpfp16 training checkpoint (no 'format': '{CHECKPOINT_FORMAT}')")
        return ckpt

    def _run_facts(self) -> dict:
        """What the run's meaning depends on besides its flags."""
        return {"processes": self.info.world_size, "training images": len(self.spec.train)}

    def _changed_settings(self, path: str, ckpt: dict) -> list[tuple[str, object, object]]:
        """The settings that differ from the checkpoint's, refused unless
        ``--allow-changed-config``: the saved position counts batches and the
        schedule counts steps, so a changed batch, epoch count or lr would silently
        skip or repeat samples and bend the schedule."""
        saved = ckpt.get("config")
        saved = saved if isinstance(saved, dict) else {}
        run = ckpt.get("run") if isinstance(ckpt.get("run"), dict) else {"processes": len(ckpt.get("rng", ()))}
        changes = self.cfg.changed_on_resume(saved)
        changes += [(name, run[name], now) for name, now in self._run_facts().items()
                    if name in run and run[name] != now]
        if not changes:
            return []
        listed = ", ".join(f"{name} {old} -> {new}" for name, old, new in changes)
        if not self.cfg.allow_changed_config:
            raise UserError(f"checkpoint {path} was saved with other settings ({listed}): resume with the same "
                            "ones, or pass --allow-changed-config to continue anyway, no longer bit-identically")
        logger.warning("resuming %s with changed settings (%s): the run is no longer bit-identical to an "
                       "uninterrupted one", path, listed)
        return changes

    def _load(self, path: str, ckpt: dict, changes: list) -> None:
        cfg = self.cfg
        saved_cfg = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
        try:
            self.model.load_state_dict(ckpt["model"])
        except (RuntimeError, KeyError, TypeError, AttributeError):
            saved = ckpt.get("model")
            why = ckpt_io.describe_mismatch(self.model.state_dict(), saved) if isinstance(saved, dict) else "no model"
            raise CheckpointError(f"checkpoint {path} (arch {saved_cfg.get('arch', '?')}) does not fit this model "
                                  f"(arch {cfg.arch}): {why}") from None
        fresh_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        try:
            self.opt.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            if saved_cfg.get("precision", cfg.precision) != cfg.precision:
                raise CheckpointError(f"checkpoint {path} holds a --precision {saved_cfg['precision']} run and this "
                                      f"one is {cfg.precision}: their optimizer states (loss scaling, masters) "
                                      f"differ; resume with --precision {saved_cfg['precision']}") from None
            raise CheckpointError(f"checkpoint {path}: optimizer state does not fit: {exc}") from None
        self.sched.load_state_dict(ckpt["scheduler"])
        self.step, self.epoch, self.batches_done = int(ckpt["step"]), int(ckpt["epoch"]), int(ckpt["batches_done"])
        self.best_acc1 = float(ckpt["best_acc1"])
        self.best_epoch = ckpt["best_epoch"]
        self.elapsed_before = float(ckpt.get("elapsed", 0.0))
        rngs = ckpt["rng"]
        if len(rngs) == self.info.world_size:
            ckpt_io.set_rng_state(rngs[self.info.rank])
        self._load_comm_state(path, ckpt, changes)
        if changes:
            self._apply_changed_settings(saved_cfg, fresh_groups)

    def _load_comm_state(self, path: str, ckpt: dict, changes: list) -> None:
        """Give the communication hook its state back (PowerSGD's, one entry per rank):
        without it, a resumed PowerSGD run would restart its error feedback and draw new
        Q's, and differ from an uninterrupted one. A resume that cannot continue it
        exactly is refused unless --allow-changed-config, like a changed setting."""
        if self.cfg.evaluate or self.ddp is self.model or mdist.comm_state_dict(self.ddp) is None:
            return  # no training, one process, or a strategy without state
        saved = ckpt.get("comm")
        if not (isinstance(saved, list) and len(saved) == self.info.world_size and isinstance(saved[0], dict)):
            if not changes:  # a changed strategy or process count was already named
                raise CheckpointError(f"checkpoint {path} holds no {self.cfg.allreduce_strategy} state for "
                                      f"{self.info.world_size} processes")
            logger.warning("%s: no %s state for %d processes in the checkpoint; it starts afresh", path,
                           self.cfg.allreduce_strategy, self.info.world_size)
            return
        try:
            inexact = mdist.load_comm_state_dict(self.ddp, saved[self.info.rank])
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: {one_line(exc)}") from None
        if inexact and not self.cfg.allow_changed_config:
            raise CheckpointError(f"checkpoint {path} cannot be resumed bit-identically: {inexact}; resume from "
                                  "another checkpoint, or pass --allow-changed-config to continue anyway")
        if inexact:
            logger.warning("resuming %s: %s; the run is no longer bit-identical to an uninterrupted one", path,
                           inexact)

    def _apply_changed_settings(self, saved_cfg: dict, fresh_groups: list[dict]) -> None:
        """With --allow-changed-config: the new optimizer settings and lr replace the
        saved ones, and the position in the epoch is kept in samples, not batches."""
        for group, fresh in zip(self.opt.param_groups, fresh_groups):
            group.update({k: v for k, v in fresh.items() if k != "lr"})
        self.sched.base_lrs = [g["initial_lr"] for g in fresh_groups]
        for i, group in enumerate(self.opt.param_groups):
            group["lr"] = self.sched.base_lrs[i] * self.sched.lr_lambdas[i](self.sched.last_epoch)
        self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]
        per_batch = saved_cfg.get("batch_size", self.cfg.batch_size)
        samples = self.batches_done * per_batch
        micro = self.cfg.batch_size * self.cfg.accum_steps
        self.batches_done = samples // micro * self.cfg.accum_steps

    def check_replicas(self) -> None:
        """Compare weights, masters and optimizer state across ranks (every
        ``--check-replicas`` steps, before each checkpoint, at the end). BatchNorm
        statistics are rank 0's first, as DDP makes them at the next forward."""
        if not (self.info.world_size > 1 and self.cfg.check_replicas) or self._checked_at == self.step:
            return
        started = time.perf_counter()
        mdist.broadcast_buffers(self.model)
        mdist.check_replicas(self.model, self.opt, context=f" at step {self.step}")
        self._checked_at = self.step
        self.replica_checks += 1
        self.replica_check_s += time.perf_counter() - started

    def _checkpoint(self) -> dict:
        rng = mdist.all_gather_object(ckpt_io.rng_state())
        comm = mdist.comm_state_dict(self.ddp) if self.ddp is not self.model else None
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "best_acc1": self.best_acc1,
            "best_epoch": self.best_epoch,
            "rng": rng,
            "elapsed": self.elapsed(),
            "config": self.cfg.as_dict(),
            "run": self._run_facts(),
            # Every rank's communication-hook state (PowerSGD's error feedback differs between them).
            **({"comm": mdist.gather_object(comm)} if comm is not None else {}),
        }

    def save(self, best: bool = False) -> None:
        """Write DIR/last.pt (and DIR/best.pt): every rank takes part (RNG states are
        gathered), rank 0 writes. A sharded run writes DIR/last.dcp (and best.dcp),
        every rank its shards."""
        self.check_replicas()  # never save a state the ranks do not share
        state = self._checkpoint()
        if self.cfg.shard:  # every rank writes its shards
            folder = sharded_checkpoint.save(self.last_path, state, tag=f"step{self.step}")
            if best and self.main:
                sharded_checkpoint.link(self.best_path, folder)
                sharded_checkpoint.remove_unreferenced(self.cfg.checkpoint_dir)
        elif self.main:
            ckpt_io.save_atomic(state, self.last_path)
            if best:
                ckpt_io.copy_atomic(self.last_path, self.best_path)
        self._saved_at = self.step

    # ------------------------------------------------------------------ the loop

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def fit(self) -> dict:
        cfg = self.cfg
        self.started = time.perf_counter()
        if self.main:
            self.metrics.write({"type": "config", **cfg.as_dict(), "world_size": self.info.world_size,
                                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps})
        if cfg.evaluate:
            result = self.evaluate()
            logger.info("evaluation: loss %.4f, acc1 %.2f%%, acc5 %.2f%% on %d images", result["val_loss"],
                        result["val_acc1"], result["val_acc5"], result["val_samples"])
            self.metrics.write({"type": "eval", "step": self.step, "epoch": self.epoch, **result})
            self.metrics.close()
            return result
        logger.info("training %d steps (%d per epoch) of %d samples; checkpoints in %s, metrics in %s",
                    self.total_steps, self.steps_per_epoch, self.samples_per_step, cfg.checkpoint_dir,
                    self.metrics_path)
        self._stop_if_asked(save=False)  # a signal during start-up: nothing trained yet
        while self.step < self.total_steps:
            self.train_epoch()
        return self.finish()

    def _stop_if_asked(self, save: bool = True) -> None:
        """If any rank got SIGTERM or SIGINT, every rank saves (after the step in
        progress, which has finished) and the run ends with :class:`Stopped`."""
        signum = self.signals.agreed(self.control_group) if self.signals is not None else None
        if signum is None:
            return
        name = signal.Signals(signum).name
        if save and self._saved_at != self.step:
            self.save()
        if self.main:
            self.metrics.write({"type": "stopped", "reason": name, "step": self.step, "epoch": self.epoch,
                                "time": self.elapsed()})
        self.metrics.close()
        saved = f"saved {self.last_path}; continue with --resume auto" if save else "nothing to save"
        raise Stopped(signum, f"stopped by {name} at step {self.step}: {saved}", announce=self.main)

    def _loader(self, epoch: int):
        size = self._image_size(epoch)
        if self.cfg.task == "imagenet" and self.spec.train.transform is not None:
            train_tf, val_tf = data_mod.imagenet_transforms(size)
            self.spec.train.transform, self.spec.val.transform = train_tf, val_tf
        self.train_sampler.set_epoch(epoch, self.batches_done * self.cfg.batch_size)
        return data_mod.make_loader(self.spec.train, self.train_sampler, self.cfg.batch_size, self.cfg.workers,
                                    self.device.type == "cuda", drop_last=True)

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
        if self.cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images

    def train_epoch(self) -> None:
        cfg = self.cfg
        epoch = self.epoch
        steps_left = min(self.steps_per_epoch - self.batches_done // cfg.accum_steps, self.total_steps - self.step)
        show = self.main and cfg.progress and sys.stderr.isatty()
        bar = tqdm(total=self.steps_per_epoch, initial=self.batches_done // cfg.accum_steps, disable=not show,
                   desc=f"epoch {epoch + 1}/{self.epochs_shown}", dynamic_ncols=True, leave=False)
        self.model.train()
        epoch_start, epoch_loss, epoch_steps = time.perf_counter(), torch.zeros((), device=self.device), 0
        window_start, window_loss, window_steps = time.perf_counter(), torch.zeros((), device=self.device), 0
        batches = iter(self._loader(epoch))
        try:
            for _ in range(steps_left):
                loss = self.train_step(batches)
                self.step += 1
                self.batches_done += cfg.accum_steps
                comm = mdist.comm_stats(self.ddp)
                comm = comm.pop_step() if comm is not None else {"allreduce_calls": 0, "allreduce_bytes": 0}
                window_loss += loss
                window_steps += 1
                epoch_loss += loss
                epoch_steps += 1
                bar.update(1)
                if self.step % cfg.print_freq == 0 or self.step == self.total_steps:
                    mean_loss = self._mean_across_ranks(window_loss / window_steps)
                    rate = window_steps * self.samples_per_step / (time.perf_counter() - window_start)
                    self._log_step(mean_loss, rate, comm)
                    bar.set_postfix(loss=f"{mean_loss:.4f}", scale=f"{self.opt.loss_scale:g}", img_s=f"{rate:.0f}")
                    window_start, window_steps = time.perf_counter(), 0
                    window_loss = torch.zeros((), device=self.device)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < self.total_steps:
                    self.save()
                elif cfg.check_replicas and self.step % cfg.check_replicas == 0:
                    self.check_replicas()
                if self.step < self.total_steps:
                    self._stop_if_asked()
        finally:
            bar.close()
        epoch_loss = self._mean_across_ranks(epoch_loss / max(1, epoch_steps))
        if self.batches_done // cfg.accum_steps >= self.steps_per_epoch:
            self.epoch, self.batches_done = epoch + 1, 0
        self._end_epoch(epoch, epoch_loss, time.perf_counter() - epoch_start,
                        epoch_steps * self.samples_per_step)

    def train_step(self, batches) -> torch.Tensor:
        """One optimizer step over ``accum_steps`` micro-batches. Returns the mean loss
        (a tensor on the device: no host sync here)."""
        cfg = self.cfg
        self.opt.zero_grad()
        self._snapshot_buffers()
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.accum_steps):
            images, labels = next(batches)
            images, labels = self._prepare(images), labels.to(self.device, non_blocking=True)
            # Only the last micro-batch's backward allreduces: the others accumulate
            # locally under no_sync, so the wire carries one allreduce per step.
            with mdist.sync_gradients(self.ddp, micro == cfg.accum_steps - 1):
                loss = nn.functional.cross_entropy(self.ddp(images).float(), labels,
                                                   label_smoothing=cfg.label_smoothing)
                self.opt.backward(loss / cfg.accum_steps)
            total += loss.detach()
        if not self.opt.step():
            self._restore_buffers()
        self.sched.step()
        return total / cfg.accum_steps

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
        if not self.main:
            return
        self.metrics.write({
            "type": "train", "step": self.step, "epoch": self.epoch, "loss": loss,
            "loss_scale": self.opt.loss_scale, "skipped_steps": self.opt.skipped_steps,
            "lr": self.opt.param_groups[0]["lr"], "grad_norm": self.opt.last_grad_norm,
            "samples_per_s": rate, "allreduce_calls": comm["allreduce_calls"],
            "allreduce_bytes": comm["allreduce_bytes"], "time": self.elapsed(),
            **{key: comm[key] for key in ("reduce_scatter_calls", "reduce_scatter_bytes", "all_gather_calls",
                                          "all_gather_bytes") if key in comm},
        })

    def _end_epoch(self, epoch: int, train_loss: float, seconds: float, samples: int) -> None:
        result = self.evaluate()
        is_best = result["val_acc1"] > self.best_acc1
        if is_best:
            self.best_acc1, self.best_epoch = result["val_acc1"], epoch + 1
        if self.main:
            self.metrics.write({"type": "eval", "step": self.step, "epoch": epoch + 1, **result})
        logger.info("epoch %d/%d: train loss %.4f | val loss %.4f, acc1 %.2f%%, acc5 %.2f%% | %.0f img/s, "
                    "loss scale %g, %d skipped, %s", epoch + 1, self.epochs_shown, train_loss, result["val_loss"],
                    result["val_acc1"], result["val_acc5"], samples / max(seconds, 1e-9), self.opt.loss_scale,
                    self.opt.skipped_steps, _fmt_time(seconds))
        self.save(best=is_best)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and top-1/top-5 accuracy over the whole validation split, sharded across
        ranks and summed, so every sample counts once."""
        model = self.model  # not the DDP wrapper: ranks may run different numbers of batches
        mdist.broadcast_buffers(model)  # BatchNorm statistics: rank 0's, as DDP does at forward
        model.eval()
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, top1, top5, count
        loader = data_mod.make_loader(self.spec.val, self.val_sampler, self.cfg.batch_size, self.cfg.workers,
                                      self.device.type == "cuda", drop_last=False)
        k = min(5, self.spec.num_classes)
        batches, spare = 0, None
        for images, labels in loader:
            batches += 1
            images, labels = self._prepare(images), labels.to(self.device, non_blocking=True)
            spare = images[:1]
            logits = model(images).float()
            top = logits.topk(k, dim=1).indices
            sums[0] += nn.functional.cross_entropy(logits, labels, reduction="sum").double()
            sums[1] += (top[:, 0] == labels).sum()
            sums[2] += (top == labels[:, None]).any(dim=1).sum()
            sums[3] += len(labels)
        if self.cfg.shard:
            self._even_out_forwards(batches, spare)
        if self.info.distributed:
            dist.all_reduce(sums)
        model.train()
        loss, top1, top5, count = sums.tolist()
        count = max(count, 1.0)
        return {"val_loss": loss / count, "val_acc1": 100 * top1 / count, "val_acc5": 100 * top5 / count,
                "val_samples": int(count)}

    def _even_out_forwards(self, done: int, spare: torch.Tensor | None) -> None:
        """A sharded model's forward is a collective (its all-gathers): a rank whose
        validation shard has fewer batches runs forwards on one image (``spare``),
        ignored, until it made as many as the rank with the most."""
        per_rank = -(-len(self.spec.val) // self.info.world_size)
        most = -(-per_rank // self.cfg.batch_size)
        if spare is None:
            size = self._image_size(self.epoch)
            spare = torch.zeros(1, 3, size, size, device=self.device)
        for _ in range(most - done):
            self.model(spare)

    def finish(self) -> dict:
        self.check_replicas()  # nothing, when the last checkpoint already checked this step
        wall = self.elapsed()
        summary = {"type": "final", "step": self.step, "epoch": self.epoch, "best_acc1": self.best_acc1,
                   "best_epoch": self.best_epoch, "skipped_steps": self.opt.skipped_steps,
                   "loss_scale": self.opt.loss_scale, "wall_s": wall, "checkpoint": self.last_path,
                   "best_checkpoint": self.best_path, "metrics": self.metrics_path,
                   "replica_checks": self.replica_checks, "replica_check_s": self.replica_check_s}
        if self.main:
            self.metrics.write(summary)
        self.metrics.close()
        logger.info("done: best val acc1 %.2f%% (epoch %s) in %s, %d steps, %d skipped", self.best_acc1,
                    self.best_epoch, _fmt_time(wall), self.step, self.opt.skipped_steps)
        if self.replica_checks:
            logger.info("replicas: identical at %d checks, which took %.2fs (%.2f%% of the run)", self.replica_checks,
                        self.replica_check_s, 100 * self.replica_check_s / max(wall, 1e-9))
        logger.info("checkpoint: %s (best: %s)", self.last_path, self.best_path)
        logger.info("metrics: %s", self.metrics_path)
        return summary


def train(cfg: TrainConfig) -> dict:
    """Set up torch.distributed from the environment, run, and tear down. SIGTERM and
    SIGINT stop the run cleanly (mpfp16/train/preemption.py)."""
    cfg.validate()
    info = mdist.init(backend=cfg.dist_backend, timeout_s=cfg.dist_timeout, device=cfg.device,
                      group_of_one=cfg.shard)
    signals = StopSignals(announce=info.is_main_process).install()
    trainer = None
    try:
        trainer = Trainer(cfg, info, signals)
        return trainer.fit()
    finally:
        signals.uninstall()
        if trainer is not None:
            trainer.release()
        trainer = None  # its DDP module goes before the process group (mdist.teardown)
        mdist.teardown()
