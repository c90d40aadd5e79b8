"""Resume decisions, as pure functions of the configuration and what was found on disk.

Nothing here reads a file, talks to another rank or trains: the engine gathers the
facts (which checkpoints a folder holds and their steps, what a checkpoint recorded)
and these functions say what they mean. Each one returns its verdict or raises the
one-line error the run stops with, so that every rule of resuming can be read, and
tested (tests/test_resume.py), on its own.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError, UserError
from .config import TrainConfig

__all__ = ["pick_last", "earlier_run", "changed_settings", "judge_changes", "comm_state", "judge_inexact_comm_state",
           "samples_done", "steps_left_in_epoch"]


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


def steps_left_in_epoch(samples_done: int, *, dataset_size: int, world_size: int, batch_size: int,
                        accum_steps: int) -> int:
    """The optimizer steps that the rest of the epoch holds, from ``samples_done``
    (:func:`samples_done`) on: each of ``world_size`` processes takes an equal share
    of the samples left (:class:`mpfp16.train.data.ResumableDistributedSampler`), in
    micro-batches of ``batch_size``, ``accum_steps`` of them a step. A rest that cannot
    fill one more step of every process is not trained, as at the end of any epoch;
    0 means the epoch is over."""
    per_process = max(0, dataset_size - samples_done) // world_size
    return per_process // batch_size // accum_steps
