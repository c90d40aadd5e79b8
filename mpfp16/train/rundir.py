"""The run directory: checked before training starts, locked while a run writes to it,
never overwritten by accident.

- :func:`claim` does all of it at the start of a run, on rank 0, and gives every rank
  rank 0's verdict.
- :func:`check_folder` and :func:`check_file` find an unwritable location, or a file
  where a folder should be, before any data is loaded or any kernel compiled.
- :func:`existing_run` names what an earlier run left in the folder, so that a
  fresh start can refuse to replace it unless asked.
- :class:`RunLock` is an advisory POSIX lock on ``DIR/.mpfp16.lock``: a second live
  run writing the same folder is refused, and the lock goes away with its process,
  however that process ends (the OS releases it), so a dead run never blocks a
  restart. POSIX locks are not inherited by forked children (data loader workers).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import tempfile

import logging

from .. import checkpoint
from ..errors import UserError, one_line
from ..parallel.ranks import broadcast_object, is_main_process
from . import resume as decide
from .config import TrainConfig

__all__ = ["claim", "last_paths", "check_folder", "check_file", "existing_run", "dangling_links", "RunLock",
           "CHECKPOINT_NAMES"]

logger = logging.getLogger("mpfp16")

# A run's checkpoints, in either format (.dcp: links to DCP folders).
CHECKPOINT_NAMES = tuple(f"{kind}{fmt.suffix}" for fmt in checkpoint.FORMATS for kind in ("last", "best"))
LOCK_NAME = ".mpfp16.lock"


def last_paths(folder: str) -> list[str]:
    """The "last" checkpoints in ``folder`` (one per format) that exist."""
    return [p for p in (os.path.join(folder, "last" + fmt.suffix) for fmt in checkpoint.FORMATS) if os.path.exists(p)]


def claim(cfg: TrainConfig, metrics_path: str) -> RunLock | None:
    """Check every place the run writes to, refuse to replace an earlier run (or, with
    ``--overwrite``, delete it), sweep away unfinished checkpoint writes, and lock the
    checkpoint directory; rank 0 does it and every rank gets its verdict. Returns the
    lock (None on the other ranks, and for ``--evaluate``, which writes no checkpoint).

    Raises:
        UserError: one line, on every rank.
    """
    lock, error = None, None
    if is_main_process():
        try:
            lock = _check_run_dir(cfg, metrics_path)
        except UserError as exc:
            error = str(exc)
        except OSError as exc:  # removing the old run's files for --overwrite, say
            error = f"cannot prepare {cfg.checkpoint_dir}: {one_line(exc)}"
    error = broadcast_object(error)
    if error is not None:
        raise UserError(error)
    return lock


def _check_run_dir(cfg: TrainConfig, metrics_path: str) -> RunLock | None:
    check_folder(cfg.checkpoint_dir, "checkpoint directory")
    check_file(metrics_path, "metrics file")
    if cfg.tensorboard:
        check_folder(cfg.tensorboard, "TensorBoard directory")
    if cfg.evaluate:  # writes no checkpoint
        return None
    lock = RunLock(cfg.checkpoint_dir)
    try:
        folder, resume = cfg.checkpoint_dir, cfg.resume
        lasts, checkpoints = last_paths(folder), existing_run(folder, None)
        named = resume not in (None, "auto") and os.path.exists(resume)
        continues = bool(lasts) if resume == "auto" else (
            named and any(os.path.samefile(resume, p) for p in lasts))
        own_checkpoint = named and any(os.path.exists(p) and os.path.samefile(resume, p) for p in checkpoints)
        has_records = os.path.isfile(metrics_path) and os.path.getsize(metrics_path) > 0
        for path in decide.earlier_run(resume=resume, continues=continues, checkpoints=checkpoints,
                                       metrics=metrics_path if has_records else None, overwrite=cfg.overwrite,
                                       folder=folder, dangling=dangling_links(checkpoints),
                                       own_checkpoint=own_checkpoint):
            os.unlink(path)  # --overwrite; the sweep below takes the folders of DCP links
        stale = checkpoint.remove_unfinished(folder)
        if stale:
            logger.info("removed %d unfinished checkpoint writes from %s", len(stale), folder)
    except BaseException:
        lock.release()
        raise
    return lock


def check_folder(path: str, what: str) -> None:
    """Create ``path`` if needed and make sure a file can be written in it.

    Raises:
        UserError: one line naming ``what`` (for example "checkpoint directory"),
            the path and the problem.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{what} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {what} {path}: {one_line(exc)}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".mpfp16-write-test.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"{what} {path} is not writable: {one_line(exc)}") from None


def check_file(path: str, what: str) -> None:
    """Make sure ``path`` can be written: its folder is writable and it is not a folder."""
    if os.path.isdir(path):
        raise UserError(f"{what} {path} is a folder, not a file")
    check_folder(os.path.dirname(os.path.abspath(path)), f"the folder of the {what}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UserError(f"{what} {path} is not writable")


def existing_run(folder: str, metrics_path: str | None) -> list[str]:
    """The files of an earlier run that a fresh start would replace: its checkpoints in
    ``folder`` and a metrics file that already holds records."""
    found = [os.path.join(folder, name) for name in CHECKPOINT_NAMES if os.path.lexists(os.path.join(folder, name))]
    if metrics_path and os.path.isfile(metrics_path) and os.path.getsize(metrics_path) > 0:
        found.append(metrics_path)
    return found


def dangling_links(paths: list[str]) -> dict[str, str]:
    """The links among ``paths`` that name nothing (a ``last.dcp`` whose folder is gone),
    with the path each names."""
    return {path: os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
            for path in paths if os.path.islink(path) and not os.path.exists(path)}


class RunLock:
    """Hold ``folder``'s lock for as long as this object lives (or until :meth:`release`).

    Raises:
        UserError: another live process holds it; the line names that process.
    """

    def __init__(self, folder: str) -> None:
        self._fd = None
        self.path = os.path.join(folder, LOCK_NAME)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(f"cannot create the lock file {self.path}: {one_line(exc)}") from None
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            self._fd = None
            raise UserError(f"another run is writing {folder} ({holder}): wait for it to end, or use another "
                            "--checkpoint-dir") from None
        started = datetime.datetime.now().isoformat(timespec="seconds")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None

    def __del__(self) -> None:
        self.release()
