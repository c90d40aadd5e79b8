"""A training run's checkpoints: what goes into one, where it goes, and how a run
resumes from one, exactly.

The format (a file, or a DCP folder for a sharded model) is chosen once, from the
model (:func:`mpfp16.checkpoint.format_for`); nothing here branches on it. A run reads
a checkpoint of either format (:func:`mpfp16.checkpoint.read` converts it to its own
layout), so ``--shard`` may change on resume. The decisions (which checkpoint
``--resume auto`` takes, whether changed settings are refused) are
:mod:`mpfp16.train.resume`'s.

What a checkpoint holds is checked before any of it is loaded, beyond its checksums
(which a checkpoint of an earlier version may lack, or hold for its tensors alone):
each field's type, and the rules that every checkpoint of the scripts keeps
(:func:`check_training_state`, :func:`check_scaler_state`, :func:`check_continuation`).
"""

from __future__ import annotations

import logging
import math
import numbers
import os

import torch

from .. import __version__, checkpoint
from .. import distributed as mdist
from ..errors import CheckpointError, UserError, one_line
from . import ema as ema_mod
from . import resume as decide
from . import rundir
from .config import FREE_ON_RESUME
from .state import TrainState

__all__ = ["RunCheckpoints", "TRAINING_STATE", "check_training_state", "check_scaler_state",
           "check_continuation"]

logger = logging.getLogger("mpfp16")


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _rng(value) -> bool:
    """Every rank's :func:`mpfp16.checkpoint.rng_state`: torch's state (a uint8 tensor)
    and Python's (version, internal state, gauss)."""
    def one(state) -> bool:
        if not isinstance(state, dict) or not (torch.is_tensor(state.get("torch"))
                                               and state["torch"].dtype == torch.uint8):
            return False
        py = state.get("python")
        return (isinstance(py, (tuple, list)) and len(py) == 3 and isinstance(py[0], int)
                and isinstance(py[1], (tuple, list)) and all(isinstance(x, int) for x in py[1])
                and (py[2] is None or _number(py[2])))
    return isinstance(value, list) and len(value) > 0 and all(one(s) for s in value)


def _scheduler(value) -> bool:
    """A ``LambdaLR`` state_dict: its step count and base learning rates."""
    return (isinstance(value, dict) and _integer(value.get("last_epoch"))
            and isinstance(value.get("base_lrs"), list) and all(_number(x) for x in value["base_lrs"]))


# The training checkpoint (:meth:`RunCheckpoints.state`), field by field: (required, is it
# right, what it must be). "format", "model" and "optimizer" are mpfp16.checkpoint.read's.
TRAINING_STATE = {
    "scheduler": (True, _scheduler, "a learning-rate scheduler's state (a dict with last_epoch, an integer >= 0, "
                                    "and base_lrs)"),
    "step": (True, _integer, "an integer >= 0"),
    "epoch": (True, _integer, "an integer >= 0"),
    "batches_done": (True, _integer, "an integer >= 0"),
    "samples_done": (False, _integer, "an integer >= 0"),
    "best_acc1": (True, _number, "a number"),
    "best_epoch": (True, lambda v: v is None or _integer(v), "an integer or None"),
    "rng": (True, _rng, "a list of every rank's random number generator states"),
    "elapsed": (False, _number, "a number of seconds"),
    "config": (False, lambda v: isinstance(v, dict), "a dict of the run's settings"),
    "run": (False, lambda v: isinstance(v, dict), "a dict of the run's facts"),
    "comm": (False, lambda v: isinstance(v, list), "a list of every rank's communication hook state"),
    "mpfp16_version": (False, lambda v: isinstance(v, str), "the version of mpfp16 that wrote it, a string"),
    "model_ema": (False, ema_mod.is_state, "the model EMA's state (a dict of its fp32 average, 'module', and its "
                                           "counts n_averaged, epoch, epoch_steps, updates, integers >= 0)"),
}


def _shown(value) -> str:
    text = repr(value) if isinstance(value, (str, int, float, type(None))) else type(value).__name__
    return text[:60]


def check_training_state(state: dict, where: str) -> None:
    """Raise one line naming ``where`` (the file) and the first field of
    :data:`TRAINING_STATE` that ``state`` lacks or holds of the wrong type, or whose
    value breaks a rule that every checkpoint of the scripts keeps: a hand-edited
    checkpoint, or a damaged one that carries no checksums of its fields (written
    before they existed), is refused before any of it is loaded.

    The rules: the scheduler (a ``LambdaLR`` that :meth:`Trainer.train_step
    <mpfp16.train.engine.Trainer.train_step>` steps once per optimizer step, skipped
    steps included, from ``last_epoch`` 0 when it is built) has counted ``step``
    steps, and so has the FP16Optimizer (``iteration``, of which ``skipped_steps``
    were skipped); a resume, with ``--allow-changed-config`` or ``--evaluate`` too,
    changes neither count. The base learning rates are positive and finite, one per
    param group.

    Raises:
        CheckpointError: the same on every rank (it decides from the state alone).
    """
    for field, (required, right, what) in TRAINING_STATE.items():
        if field not in state:
            if required:
                raise CheckpointError(f"checkpoint {where} is not a complete training checkpoint: it has no "
                                      f"{field!r} (it must be {what})")
            continue
        value = state[field]
        if not right(value):
            raise CheckpointError(f"checkpoint {where} is damaged: its {field!r} is {_shown(value)}, and it must be "
                                  f"{what}")
    step, sched = state["step"], state["scheduler"]
    damaged = f"checkpoint {where} is damaged:"
    if sched["last_epoch"] != step:
        raise CheckpointError(f"{damaged} its 'step' is {step} and its scheduler's last_epoch {sched['last_epoch']!r}, "
                              "and they must be equal (the scheduler steps once per optimizer step)")
    for i, lr in enumerate(sched["base_lrs"]):
        if not (math.isfinite(lr) and lr > 0):
            raise CheckpointError(f"{damaged} its scheduler's base_lrs[{i}] is {lr!r}, and it must be a positive "
                                  "learning rate")
    opt = state.get("optimizer")
    if not isinstance(opt, dict):
        return  # mpfp16.checkpoint.read refuses it
    for name in ("iteration", "skipped_steps"):
        if not _integer(opt.get(name)):
            raise CheckpointError(f"{damaged} its optimizer's {name} is {_shown(opt.get(name))}, and it must be an "
                                  "integer >= 0")
    if opt["iteration"] != step:
        raise CheckpointError(f"{damaged} its 'step' is {step} and its optimizer's iteration {opt['iteration']}, and "
                              "they must be equal (the optimizer counts every step it took or skipped)")
    if opt["skipped_steps"] > opt["iteration"]:
        raise CheckpointError(f"{damaged} its optimizer's skipped_steps is {opt['skipped_steps']}, more than the "
                              f"{opt['iteration']} steps it took")
    groups = _param_groups(opt)
    if groups is not None and len(groups) != len(sched["base_lrs"]):
        raise CheckpointError(f"{damaged} its scheduler has {len(sched['base_lrs'])} base_lrs and its optimizer "
                              f"{len(groups)} param groups, and they must be as many")


def check_scaler_state(state: dict, where: str, scaler) -> None:
    """Raise one line where the checkpoint's loss scaler state is one that ``scaler``
    (this run's, of the same kind) cannot be in (:meth:`mpfp16.LossScaler.check_state_dict`),
    before anything is loaded. A scaler of another kind is the optimizer's load to
    refuse, naming the precision.

    Raises:
        CheckpointError: the same on every rank.
    """
    opt = state.get("optimizer")
    if not isinstance(opt, dict) or opt.get("scaler_type") != type(scaler).__name__:
        return
    try:
        scaler.check_state_dict(opt.get("scaler"))
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {where} is damaged: {one_line(exc)}") from None


def _param_groups(opt: dict) -> list | None:
    """The inner optimizer's param groups in an FP16Optimizer state_dict (of any
    version), or None where they are not a list (the optimizer's own load refuses it)."""
    inner = opt.get("optimizer")
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    return groups if isinstance(groups, list) else None


def _records_every_setting(state: dict, cfg, run_facts: dict) -> bool:
    """Whether the checkpoint recorded every setting and fact that a resume compares
    (:func:`mpfp16.train.resume.changed_settings` compares only those it recorded): only
    then does "nothing changed" mean that this run's settings are the ones it was saved
    with. One of an earlier version may lack some, whose defaults may have changed since."""
    config, run = state.get("config"), state.get("run")
    return (isinstance(config, dict) and isinstance(run, dict) and all(name in run for name in run_facts)
            and all(name in config for name in cfg.as_dict() if name not in FREE_ON_RESUME))


def check_continuation(state: dict, where: str, *, base_lrs: list[float], multipliers: list,
                       training_images: int, epochs: int, batch_size: int) -> None:
    """Raise one line where a checkpoint that a run resumes with the settings it
    was saved with (no change found, so none allowed) holds what no run of those
    settings can: other base learning rates than these settings give, a param group
    whose learning rate is not its base rate times the schedule at ``step`` (as the
    scheduler set it), a position in the epoch beyond the training set, or an epoch
    beyond ``--epochs``. With changed settings none of this holds, and the new ones
    replace the learning rates.

    Args:
        state: the training checkpoint, as saved (:func:`check_training_state` passed).
        base_lrs: this run's, from its settings (its scheduler before the load).
        multipliers: this run's schedule, per param group (``LambdaLR.lr_lambdas``).
        training_images: the training set's size.
        epochs: ``--epochs``.
        batch_size: ``-b``, for a checkpoint that recorded its position in batches.

    Raises:
        CheckpointError: the same on every rank (it decides from the state and the settings).
    """
    damaged = f"checkpoint {where} is damaged:"
    saved_lrs, step = state["scheduler"]["base_lrs"], state["step"]
    if list(saved_lrs) != list(base_lrs):
        raise CheckpointError(f"{damaged} its scheduler's base_lrs are {list(saved_lrs)}, and the settings it was "
                              f"saved with give {list(base_lrs)}")
    groups = _param_groups(state["optimizer"]) or []
    for i, (group, base, multiplier) in enumerate(zip(groups, saved_lrs, multipliers)):
        lr = group.get("lr") if isinstance(group, dict) else None
        if type(lr) is float and lr != base * multiplier(step):  # LambdaLR.get_lr's product, bit for bit
            raise CheckpointError(f"{damaged} its optimizer's param group {i} has lr {lr!r}, and the schedule gives "
                                  f"{base * multiplier(step)!r} at step {step}")
    position = decide.samples_done(state, batch_size)
    if position > training_images:
        raise CheckpointError(f"{damaged} its position in the epoch is sample {position}, beyond the "
                              f"{training_images} training images")
    if state["epoch"] > epochs:
        raise CheckpointError(f"{damaged} its 'epoch' is {state['epoch']}, beyond --epochs {epochs}")


class RunCheckpoints:
    """``DIR/last`` and ``DIR/best`` of a run, in the format of its model.

    It is given the run's parts once: the model, the module a step calls (``ddp``: a DDP
    wrapper, or the model itself), the optimizer, the scheduler, this process's place
    (``info``), the run's facts (:meth:`mpfp16.train.engine.Trainer.run_facts`), the
    training set's size and, with ``--model-ema``, the model EMA
    (:class:`mpfp16.train.ema.ModelEMA`, saved as ``model_ema``). A save takes the run's
    :class:`~mpfp16.train.state.TrainState` and :meth:`resume` returns the one it loaded;
    the parts are saved and loaded through their own ``state_dict``/``load_state_dict``.
    It writes no field of the trainer's. Every rank calls every method.
    """

    def __init__(self, cfg, info, model, ddp, opt, sched, *, run_facts: dict, training_images: int,
                 ema=None) -> None:
        self.cfg, self.info = cfg, info
        self.model, self.ddp, self.opt, self.sched = model, ddp, opt, sched
        self.ema = ema
        self.ema_resumed = False  # whether the last resume loaded a model EMA
        self.run_facts, self.training_images = run_facts, training_images
        self.format = checkpoint.format_for(model)
        self.last_path = os.path.join(cfg.checkpoint_dir, "last" + self.format.suffix)
        self.best_path = os.path.join(cfg.checkpoint_dir, "best" + self.format.suffix)
        self.saved_at: int | None = None  # the step of the last save
        # The other formats' checkpoints in DIR that this run's saves replace (once each).
        self._superseded = {kind: [os.path.join(cfg.checkpoint_dir, kind + fmt.suffix)
                                   for fmt in checkpoint.FORMATS if fmt is not self.format]
                            for kind in ("last", "best")}

    # ------------------------------------------------------------------ saving

    def state(self, train: TrainState, elapsed: float) -> dict:
        """Everything a resume needs to continue bit-identically from ``train``, after
        ``elapsed`` seconds of training in all (RNG states are gathered from every rank:
        a collective)."""
        rng = mdist.all_gather_object(checkpoint.rng_state())
        comm = mdist.comm_state_dict(self.ddp) if self.ddp is not self.model else None
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "step": train.step,
            "epoch": train.epoch,
            "batches_done": train.batches_done(self.cfg.batch_size, self.info.world_size),
            "samples_done": train.samples_done,  # the position over all ranks: the same for any world size
            "best_acc1": train.best_acc1,
            "best_epoch": train.best_epoch,
            "rng": rng,
            "elapsed": elapsed,
            "config": self.cfg.as_dict(),
            "run": self.run_facts,
            "mpfp16_version": __version__,  # the release that wrote it (CHANGELOG.md)
            # Every rank's communication-hook state (PowerSGD's error feedback differs between them).
            **({"comm": mdist.gather_object(comm)} if comm is not None else {}),
            # The fp32 average of the masters, the same on every rank (mpfp16/train/ema.py).
            **({"model_ema": self.ema.state_dict()} if self.ema is not None else {}),
        }

    def save(self, train: TrainState, elapsed: float, best: bool = False) -> None:
        """Write DIR/last (and DIR/best) of ``train``; then the same run's checkpoints of
        the other format, now superseded, go (a run resumed with or without ``--shard``),
        so that the folder never holds two "last" checkpoints that disagree. The caller
        has checked that the ranks hold the same state and that no metrics write failed
        (:meth:`mpfp16.train.engine.Trainer.save`)."""
        self.format.save(self.last_path, self.state(train, elapsed), tag=f"step{train.step}")
        if best:
            self.format.keep_as_best(self.last_path, self.best_path)
        for kind in ("last", "best") if best else ("last",):
            for path in self._superseded[kind]:
                checkpoint.remove(path)
            self._superseded[kind] = []
        self.saved_at = train.step

    def best_checkpoint(self) -> str:
        """DIR/best of this run's format, or, until this run wrote one, the other
        format's that it resumed with."""
        return next((p for p in self._superseded["best"] if os.path.lexists(p)), self.best_path)

    # ------------------------------------------------------------------ resuming

    def find(self) -> str | None:
        """The checkpoint to resume from: ``--resume PATH``, or for ``auto`` the newest
        "last" in DIR of either format, as rank 0 finds them (its file system decides;
        every rank then checks it reads the same one)."""
        cfg = self.cfg
        if cfg.resume != "auto":
            return cfg.resume
        path, error = None, None
        if mdist.is_main_process():
            lasts = rundir.last_paths(cfg.checkpoint_dir)
            try:
                steps = {p: checkpoint.saved_step(p) if len(lasts) > 1 else None for p in lasts}
                path = decide.pick_last(steps, own=self.last_path)
            except CheckpointError as exc:
                error = f"--resume auto cannot tell which of {' and '.join(lasts)} is newer: {exc}"
        path, error = mdist.broadcast_object((path, error))
        if error is not None:
            raise CheckpointError(error)
        logger.info("resume auto: %s", f"resuming from {path}" if path else f"no {self.last_path}, starting fresh")
        return path

    def resume(self) -> TrainState:
        """Load ``--resume`` into the model, the optimizer and the scheduler, whatever
        format and layout wrote it, and return the position and progress it holds (a
        fresh run's where there is nothing to resume). Settings that changed are refused
        unless ``--allow-changed-config``; then the ranks check they hold the same state."""
        cfg = self.cfg
        path = self.find()
        if path is None:
            if cfg.evaluate and cfg.weights is None:  # --test-only --weights FILE evaluates those weights
                raise UserError("--evaluate needs a checkpoint: pass --resume PATH")
            return TrainState()
        changes: list = []

        def judge(saved: dict) -> None:  # before the checkpoint is converted to this run's layout
            fmt = checkpoint.format_of(path)
            where = os.path.join(path, checkpoint.dcp.META) if fmt is checkpoint.DCP else path
            check_training_state(saved, where)
            check_scaler_state(saved, where, self.opt.scaler)
            if cfg.evaluate:
                return
            changes.extend(decide.changed_settings(cfg, saved.get("config"), saved.get("run"), self.run_facts,
                                                   saved_processes=len(saved.get("rng", ()))))
            warning = decide.judge_changes(changes, cfg.allow_changed_config, path)
            if warning:
                logger.warning("%s", warning)
            if not changes and _records_every_setting(saved, cfg, self.run_facts):
                check_continuation(saved, where, base_lrs=self.sched.base_lrs, multipliers=self.sched.lr_lambdas,
                                   training_images=self.training_images, epochs=cfg.epochs,
                                   batch_size=cfg.batch_size)

        ckpt = checkpoint.read(path, self.model, check=judge)
        train = self._load(path, ckpt, changes)
        mdist.check_replicas(self.model, self.opt, context=f" after resuming from {path}")
        logger.info("resumed from %s: epoch %d, step %d", path, train.epoch, train.step)
        return train

    def _load(self, path: str, ckpt: dict, changes: list) -> TrainState:
        cfg, model, opt = self.cfg, self.model, self.opt
        saved_cfg = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
        try:
            model.load_state_dict(ckpt["model"])
        except (RuntimeError, KeyError, TypeError, AttributeError):
            saved = ckpt.get("model")
            why = checkpoint.describe_mismatch(model.state_dict(), saved) if isinstance(saved, dict) else "no model"
            raise CheckpointError(f"checkpoint {path} (arch {saved_cfg.get('arch', '?')}) does not fit this model "
                                  f"(arch {cfg.arch}): {why}") from None
        fresh_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        fresh_scaler = opt.scaler.state_dict()  # a static --loss-scale changed on resume takes its new value
        try:
            opt.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            if saved_cfg.get("precision", cfg.precision) != cfg.precision:
                raise CheckpointError(f"checkpoint {path} holds a --precision {saved_cfg['precision']} run and this "
                                      f"one is {cfg.precision}: their optimizer states (loss scaling, masters) "
                                      f"differ; resume with --precision {saved_cfg['precision']}") from None
            raise CheckpointError(f"checkpoint {path}: optimizer state does not fit: {exc}") from None
        self.sched.load_state_dict(ckpt["scheduler"])
        rngs = ckpt["rng"]
        if len(rngs) == self.info.world_size:
            checkpoint.set_rng_state(rngs[self.info.rank])
        if not cfg.evaluate:
            self._load_comm_state(path, ckpt.get("comm"), bool(changes))
        self._load_ema(path, ckpt.get("model_ema"))
        if changes:
            self._apply_changed_settings(fresh_groups)
            if any(name == "loss_scale" for name, _, _ in changes) and not opt.scaler.dynamic:
                opt.scaler.load_state_dict(fresh_scaler)  # it kept the saved scale in silence
        return TrainState(step=int(ckpt["step"]), epoch=int(ckpt["epoch"]),
                          samples_done=decide.samples_done(ckpt, cfg.batch_size),
                          best_acc1=float(ckpt["best_acc1"]), best_epoch=ckpt["best_epoch"],
                          elapsed_before=float(ckpt.get("elapsed", 0.0)))

    def _load_ema(self, path: str, saved) -> None:
        """Give the model EMA its saved state. A checkpoint without one (of a run without
        ``--model-ema``, resumed with it, which only ``--allow-changed-config`` lets
        through, or written before the setting existed) leaves the average to start
        from the model at its next update, said in one line."""
        if self.ema is None:
            return
        if saved is None:
            logger.warning("%s holds no model EMA (its run was without --model-ema): %s", path,
                           "only the model is evaluated" if self.cfg.evaluate else
                           "the average starts from the model at its next update")
            return
        try:
            self.ema.load_state_dict(saved)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: {one_line(exc)}") from None
        self.ema_resumed = True

    def _load_comm_state(self, path: str, saved, changed: bool) -> None:
        """Give the communication hook its state back (:func:`mpfp16.train.resume.comm_state`)."""
        cfg, ddp, rank = self.cfg, self.ddp, self.info.rank
        has_state = ddp is not self.model and mdist.comm_state_dict(ddp) is not None
        action, warning = decide.comm_state(hook_has_state=has_state, saved=saved, world_size=self.info.world_size,
                                            changed=changed, strategy=cfg.allreduce_strategy, path=path)
        if warning:
            logger.warning("%s", warning)
        if action != "load":
            return
        try:
            inexact = mdist.load_comm_state_dict(ddp, saved[rank])
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: {one_line(exc)}") from None
        warning = decide.judge_inexact_comm_state(inexact, cfg.allow_changed_config, path)
        if warning:
            logger.warning("%s", warning)

    def _apply_changed_settings(self, fresh_groups: list[dict]) -> None:
        """With --allow-changed-config: the new optimizer settings and lr replace the
        saved ones. The scheduler takes the new base learning rates, and the learning
        rates they give at its saved step, through its own ``load_state_dict`` (its
        ``base_lrs`` and ``_last_lr`` are fields of its state_dict); each param group
        takes its rate as the scheduler computes it (``LambdaLR.get_lr``'s product, bit
        for bit). The position needs no conversion: it is in samples of the epoch's
        order over all ranks (:func:`mpfp16.train.resume.samples_done`), the same for
        any batch, accumulation and number of processes."""
        opt, sched = self.opt, self.sched
        for group, fresh in zip(opt.param_groups, fresh_groups):
            group.update({k: v for k, v in fresh.items() if k != "lr"})
        saved = sched.state_dict()
        base_lrs = [g["initial_lr"] for g in fresh_groups]
        lrs = [base * multiplier(saved["last_epoch"]) for base, multiplier in zip(base_lrs, sched.lr_lambdas)]
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        sched.load_state_dict({**saved, "base_lrs": base_lrs, "_last_lr": lrs})
