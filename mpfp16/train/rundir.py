"""The run directory: checked before training starts, locked while a run writes to it,
never overwritten by accident.

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

from ..errors import UserError, one_line

__all__ = ["check_folder", "check_file", "existing_run", "RunLock", "CHECKPOINT_NAMES"]

CHECKPOINT_NAMES = ("last.pt", "best.pt", "last.dcp", "best.dcp")  # .dcp: links to sharded checkpoints
LOCK_NAME = ".mpfp16.lock"


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
