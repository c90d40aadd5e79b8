"""Resume decisions, as pure functions of the configuration and what was found on disk.

Nothing here reads a file, talks to another rank or trains: the engine gathers the
facts (which checkpoints a folder holds and their steps, what a checkpoint recorded)
and these functions say what they mean. Each one returns its verdict or raises the
one-line error the run stops with, so that every rule of resuming can be read, and
tested (tests/test_resume.py), on its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import CheckpointError, UserError
from .config import TrainConfig

__all__ = ["pick_last", "earlier_run", "changed_settings", "judge_changes", "comm_state", "judge_inexact_comm_state",
           "samples_done", "EpochRest", "epoch_rest", "steps_left_in_epoch", "describe_rest"]


def pick_last(found: dict[str, int | None], own: str) -> str | None:
    """The checkpoint ``--resume auto`` continues.

    Args:
        found: the run folder's "last" checkpoints, one per format, with the step each
            recorded (None where it recorded none).
        own: the path of the "last" checkpoint this run writes.

    Returns:
        None when the folder holds none; else the one with the highest step (a run
        resumed in the other format and saved since has the newer one), and on a tie
        ``own``, which needs no conversion.
    """
    if not found:
        return None
    return max(found, key=lambda path: (found[path] if found[path] is not None else -1, path == own))


def earlier_run(*, resume: str | None, continues: bool, checkpoints: list[str], metrics: str | None,
                overwrite: bool, folder: str, dangling: dict[str, str] | None = None,
                own_checkpoint: bool = False) -> list[str]:
    """What an earlier run in the folder means for this start.

    Args:
        resume: ``--resume``: None, ``"auto"`` or a path.
        continues: whether this run continues the run in its folder (``--resume auto``
            found a "last" checkpoint there, or ``--resume PATH`` names one of them).
        checkpoints: the checkpoints in the folder (links that name nothing included).
        metrics: the metrics file, when it already holds records.
        overwrite: ``--overwrite``.
        folder: the checkpoint folder, for the message.
        dangling: the checkpoints among ``checkpoints`` that are links to a folder that
            is gone, with the folder each names.
        own_checkpoint: ``--resume PATH`` names one of the folder's own checkpoints that
            is not a "last" one (its ``best``).

    Returns:
        The files to delete before starting (``--overwrite``; the metrics file is
        truncated when it is opened instead); none when the run continues its folder.

    Raises:
        UserError: the folder holds an earlier run that this one would replace. The
            line names every file of it, and only advice that works from here:
            ``--overwrite`` never goes with ``--resume``, and ``--resume auto`` is
            offered only where it would find a checkpoint to continue.
    """
    if continues:
        return []
    earlier = list(checkpoints) + ([metrics] if metrics and resume is None else [])
    if earlier and not overwrite:
        raise UserError(_earlier_run_advice(resume, checkpoints, earlier, folder, dangling or {}, own_checkpoint))
    return [path for path in earlier if path != metrics]


def _is_last(path: str) -> bool:
    return os.path.basename(path).startswith("last")


def _earlier_run_advice(resume, checkpoints: list[str], earlier: list[str], folder: str, dangling: dict[str, str],
                        own_checkpoint: bool) -> str:
    """The one line that refuses a start in a folder with an earlier run (:func:`earlier_run`)."""
    listed = ", ".join(earlier)
    loadable = [path for path in checkpoints if path not in dangling]
    has_last = any(_is_last(path) for path in loadable)
    gone = [f"{link} names {target}, which is gone" for link, target in dangling.items()]
    if resume is None:
        if has_last or not checkpoints:  # --resume auto continues it (or, with only metrics, appends to them)
            return (f"{folder} holds an earlier run ({listed}): continue it with --resume auto, start elsewhere "
                    "with another --checkpoint-dir, or replace it with --overwrite")
        branch = [f"continue from {loadable[0]} in another folder with --resume {loadable[0]} --checkpoint-dir "
                  "OTHER"] if loadable else []
        return (f"{folder} holds an earlier run ({'; '.join([listed, *gone])}) with no last checkpoint to continue: "
                + ", ".join(branch + ["start elsewhere with another --checkpoint-dir"]) + ", or replace it with "
                "--overwrite")
    if resume == "auto":  # no "last" checkpoint that loads: say what is there and what is missing
        facts = [] if any(_is_last(path) for path in checkpoints) else ["no last.pt or last.dcp"]
        facts += gone
        facts.append(f"it holds {listed}")
        found = f"--resume auto found nothing to continue in {folder} ({'; '.join(facts)}): "
        if loadable:
            return (found + f"continue from {loadable[0]} in another folder with --resume {loadable[0]} "
                    f"--checkpoint-dir OTHER, or start afresh in {folder} with --overwrite and without --resume")
        return found + f"start afresh in {folder} with --overwrite and without --resume, or in another --checkpoint-dir"
    elsewhere = f"continue from {resume} in another folder with --resume {resume} --checkpoint-dir OTHER"
    own = f"continue the run in {folder} from its last checkpoint with --resume auto, or " if has_last else ""
    if own_checkpoint:  # DIR/best.pt into DIR: its later checkpoints would be replaced
        return (f"{resume} is a checkpoint of the run in {folder} ({listed}); continuing from it there would "
                f"replace that run's later checkpoints and mix two histories in its metrics: {own}{elsewhere}")
    return f"{folder} holds an earlier run ({listed}): {own}{elsewhere}"


def changed_settings(cfg: TrainConfig, saved_config, saved_run, run_facts: dict,
                     saved_processes: int) -> list[tuple[str, object, object]]:
    """(name, saved, now) for each setting and fact of the run that differs from the
    checkpoint's. A checkpoint without a record of its run (an early one) tells the
    number of processes by its RNG states, ``saved_processes``."""
    saved_config = saved_config if isinstance(saved_config, dict) else {}
    saved_run = saved_run if isinstance(saved_run, dict) else {"processes": saved_processes}
    changes = cfg.changed_on_resume(saved_config)
    return changes + [(name, saved_run[name], now) for name, now in run_facts.items()
                      if name in saved_run and saved_run[name] != now]


def judge_changes(changes: list[tuple[str, object, object]], allow: bool, path: str) -> str | None:
    """Whether a resume with ``changes`` goes on.

    The saved position counts batches and the schedule counts steps, so a changed
    batch, epoch count or lr would silently skip or repeat samples and bend the
    schedule: refused unless ``--allow-changed-config``.

    Returns:
        None when nothing changed; the warning to log when the changes are allowed.

    Raises:
        UserError: one line listing each change.
    """
    if not changes:
        return None
    listed = ", ".join(f"{name} {old} -> {new}" for name, old, new in changes)
    if not allow:
        raise UserError(f"checkpoint {path} was saved with other settings ({listed}): resume with the same ones, or "
                        "pass --allow-changed-config to continue anyway, no longer bit-identically")
    return (f"resuming {path} with changed settings ({listed}): the run is no longer bit-identical to an "
            "uninterrupted one")


def comm_state(*, hook_has_state: bool, saved, world_size: int, changed: bool, strategy: str,
               path: str) -> tuple[str, str | None]:
    """What to do with the communication hook's saved state (PowerSGD's, one entry per
    rank): without it a resumed PowerSGD run would restart its error feedback and draw
    new Q's, and differ from an uninterrupted one.

    Args:
        hook_has_state: this run trains under DDP with a hook that keeps state.
        saved: the checkpoint's ``comm`` entry (None when it has none).
        changed: the resume already changed a setting (allowed, and named).

    Returns:
        ``("none", None)``: nothing to load; ``("load", None)``: load this rank's
        entry; ``("fresh", warning)``: the hook starts afresh, with the warning to log.

    Raises:
        CheckpointError: the checkpoint holds no state for this run's processes and
            nothing else changed.
    """
    if not hook_has_state:
        return "none", None
    if isinstance(saved, list) and len(saved) == world_size and all(isinstance(s, dict) for s in saved):
        return "load", None
    if not changed:  # a changed strategy or process count was already named
        raise CheckpointError(f"checkpoint {path} holds no {strategy} state for {world_size} processes")
    return "fresh", f"{path}: no {strategy} state for {world_size} processes in the checkpoint; it starts afresh"


def judge_inexact_comm_state(inexact: str | None, allow: bool, path: str) -> str | None:
    """A hook state that loaded but cannot continue exactly (``inexact`` says why):
    refused unless ``--allow-changed-config``, like a changed setting.

    Returns:
        None when exact; the warning to log when allowed.

    Raises:
        CheckpointError: one line.
    """
    if not inexact:
        return None
    if not allow:
        raise CheckpointError(f"checkpoint {path} cannot be resumed bit-identically: {inexact}; resume from another "
                              "checkpoint, or pass --allow-changed-config to continue anyway")
    return f"resuming {path}: {inexact}; the run is no longer bit-identical to an uninterrupted one"


def samples_done(saved: dict, batch_size: int) -> int:
    """Where a checkpoint stopped in its epoch, in samples of the epoch's order over all
    processes: the one position that means the same for any number of processes,
    batch size and accumulation steps.

    Args:
        saved: the checkpoint's training state: ``samples_done`` where it recorded one;
            an earlier checkpoint recorded only each process's ``batches_done``, of the
            batch size in its ``config``, on the processes its ``run`` (or its RNG
            states, one per process) counts.
        batch_size: ``-b`` now, for a checkpoint that recorded no config.
    """
    if saved.get("samples_done") is not None:
        return int(saved["samples_done"])
    config = saved.get("config") if isinstance(saved.get("config"), dict) else {}
    run = saved.get("run") if isinstance(saved.get("run"), dict) else {}
    processes = run.get("processes") or len(saved.get("rng") or ()) or 1
    return int(saved["batches_done"]) * int(config.get("batch_size", batch_size)) * int(processes)


@dataclass(frozen=True)
class EpochRest:
    """How the rest of an epoch is trained (:func:`epoch_rest`)."""

    full_steps: int  # steps of accum_steps micro-batches of batch_size on every process
    last_step: tuple[int, ...]  # the micro-batches of one shorter last step, per process; () where there is none
    untrained: int  # samples of the epoch's order after the last step: not trained in this epoch
    tail: int  # what an uninterrupted epoch of this shape leaves untrained: dataset_size % samples per step
    uneven: int  # of untrained beyond tail: the samples that split unevenly across processes (< world_size)
    single: int  # ... and those of a micro-batch of one sample, not taken (0 or world_size)

    @property
    def steps(self) -> int:
        """Optimizer steps left in the epoch; 0: it is over."""
        return self.full_steps + bool(self.last_step)


def epoch_rest(samples_done: int, *, dataset_size: int, world_size: int, batch_size: int,
               accum_steps: int) -> EpochRest:
    """How the rest of an epoch is trained, from ``samples_done`` on (:func:`samples_done`):
    each of ``world_size`` processes takes an equal share of the samples left
    (:class:`mpfp16.train.data.ResumableDistributedSampler`), ``accum_steps``
    micro-batches of ``batch_size`` a step.

    The rule, the same for an uninterrupted epoch and a resumed one: with S samples a
    step over all processes, an epoch of N samples ends at the order's sample
    ``N - N % S``; its last ``N % S`` (``tail``, less than a step) are not trained in
    that epoch (the next epoch's order is another), as with ``drop_last``. An
    uninterrupted epoch, or one resumed with the same shape, gets there in full steps.
    One resumed with another shape (processes, ``-b``, ``--accum-steps``; the position
    is then not a whole number of its steps) takes full steps while the rest fills
    one, and where that stops short of the end, one more, shorter step of the samples
    before it: each process's equal share in micro-batches of at most ``batch_size``,
    as even as possible. So nothing is left out only because of the resume, except:

    - ``uneven``: the samples before the end that do not split evenly across the
      processes (fewer than ``world_size``; the last step's gradient is the mean of
      equal shares);
    - ``single``: with ``batch_size`` above 1, a share that would put one sample in a
      micro-batch gives up one sample per process (batch statistics of one sample:
      BatchNorm refuses them in training where its feature map is 1x1).

    ``untrained`` is ``tail + uneven + single`` when the rest reaches the end, and
    what is left when the run had gone past it (trained with a smaller step), which
    is less than ``tail``.
    """
    per_step = world_size * batch_size * accum_steps
    rest = max(0, dataset_size - samples_done)
    full_steps = rest // per_step
    tail = dataset_size % per_step
    before_end = rest - full_steps * per_step - tail  # the samples a full step cannot take before the end
    share, uneven = (before_end // world_size, before_end % world_size) if before_end > 0 else (0, 0)
    last_step, single = _micro_batches(share, batch_size), 0
    if batch_size > 1 and last_step and min(last_step) < 2:
        last_step, single = _micro_batches(share - 1, batch_size), world_size
    untrained = rest - full_steps * per_step - sum(last_step) * world_size
    return EpochRest(full_steps, last_step, untrained, tail, uneven, single)


def _micro_batches(share: int, batch_size: int) -> tuple[int, ...]:
    """``share`` samples in the fewest micro-batches of at most ``batch_size``, their sizes
    as even as possible (the larger first)."""
    if share <= 0:
        return ()
    count = -(-share // batch_size)
    return tuple(share // count + (i < share % count) for i in range(count))


def steps_left_in_epoch(samples_done: int, *, dataset_size: int, world_size: int, batch_size: int,
                        accum_steps: int) -> int:
    """The optimizer steps that the rest of the epoch holds, from ``samples_done`` on
    (:func:`epoch_rest`); 0 means the epoch is over."""
    return epoch_rest(samples_done, dataset_size=dataset_size, world_size=world_size, batch_size=batch_size,
                      accum_steps=accum_steps).steps


def describe_rest(rest: EpochRest, *, epoch: int, samples_done: int, dataset_size: int,
                  world_size: int) -> tuple[str, str] | None:
    """The line that says how a resumed epoch ends, where it differs from an uninterrupted
    one of its shape (:func:`epoch_rest`): ``("info", line)`` for a shorter last step,
    ``("warning", line)`` where samples are left out because of the resume, with their
    count; None where it ends as an uninterrupted epoch does."""
    extra = rest.uneven + rest.single
    if not rest.last_step and not extra:
        return None
    at = f"epoch {epoch + 1} resumed at sample {samples_done} of {dataset_size}"
    end, uninterrupted_end = dataset_size - rest.untrained, dataset_size - rest.tail
    said = []
    if rest.last_step:
        share = sum(rest.last_step)
        batches = "one micro-batch" if len(rest.last_step) == 1 else \
            f"micro-batches of {', '.join(map(str, rest.last_step))}"
        said.append(f"{rest.full_steps} full step{'s' * (rest.full_steps != 1)}, then a shorter last step of "
                    f"{share * world_size} samples ({share} per process, in {batches}) up to sample {end}")
    if not extra:
        return "info", f"{at}: {said[0]}, where an uninterrupted epoch of this shape ends"
    why = []
    if rest.uneven:
        why.append(f"{rest.uneven} that {_do(rest.uneven)} not split evenly across {world_size} processes")
    if rest.single:
        why.append(f"{rest.single} that would make micro-batches of one sample")
    said.append(f"{rest.untrained} sample{'s' * (rest.untrained != 1)} of its order {_do(rest.untrained, 'are')} not "
                f"trained in this epoch, {extra} more than an uninterrupted epoch of this shape leaves (it ends at "
                f"sample {uninterrupted_end}): {' and '.join(why)}")
    return "warning", f"{at}: {'; '.join(said)}"


def _do(count: int, plural: str = "do") -> str:
    return plural if count != 1 else {"do": "does", "are": "is"}[plural]
