"""Reading a torch.save file that may come from anywhere, without running its code, and
saying why a write failed.

Every checkpoint is read with ``torch.load(weights_only=True)``: tensors and plain
values only, and a pickled Python object is refused, never executed. Callers can
allow a few named classes (mpfp16.compat.apex allows apex's loss scalers), and every
way a file can be wrong is one line naming the file. :func:`write_failure` says
why a write failed in the operating system's words, a full disk included, which
``torch.save`` reports only as "unexpected pos".
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import warnings

import torch

from .errors import CheckpointError, one_line

__all__ = ["load_weights_only", "fsync_dir", "write_failure", "NO_SPACE"]

NO_SPACE = "No space left on device"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# How torch's zip writer words a write that came up short (it drops the OSError's errno):
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", "PytorchStreamWriter failed writing ...".
_SHORT_WRITE = re.compile(r"unexpected pos|PytorchStreamWriter failed|iostream error", re.I)
_FULL_BELOW = 1 << 20  # bytes free under which a short write is put down to a full disk


def _free_bytes(path: str) -> int | None:
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # no statvfs on this platform
        return None
    return st.f_bavail * st.f_frsize


def write_failure(exc: BaseException, path: str) -> str | None:
    """Why writing ``path`` failed, in the operating system's words, when the file
    system made it fail: "No space left on device" when it is full, else an OSError's
    reason; None when something else failed (a bug, which should propagate).

    Call it before the partly written file is removed: a short write that torch
    reports without an errno ("unexpected pos") is put down to a full disk only while
    the file system of ``path`` has (almost) no space left.
    """
    seen, cause = set(), exc
    while cause is not None and id(cause) not in seen:  # torch.save on a file object keeps the OSError as context
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
            return NO_SPACE if cause.errno == errno.ENOSPC else (cause.strerror or NO_SPACE)
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, OSError):
        return one_line(exc)
    if isinstance(exc, RuntimeError) and _SHORT_WRITE.search(str(exc)):
        free = _free_bytes(path)
        if free is not None and free < _FULL_BELOW:
            return NO_SPACE
    return None


def fsync_dir(folder: str) -> None:
    """Flush ``folder``'s entries (a rename or a new link in it) to disk."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not every platform can open a folder
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_weights_only(path: str, map_location="cpu", allowed: tuple = (),
                      refusal_hint: str = "checkpoints may hold only tensors and plain values") -> dict:
    """Read ``path`` with ``torch.load(weights_only=True)``.

    Args:
        path: the file.
        map_location: as for ``torch.load``.
        allowed: classes the unpickler may build besides tensors and plain values
            (``torch.serialization.safe_globals``); their ``__module__`` and
            ``__qualname__`` are the names found in the file.
        refusal_hint: what the error says is allowed, when something else is found.

    Raises:
        CheckpointError: the file is missing, a folder, not a torch.save file,
            truncated or corrupt, holds a pickled object that is not allowed (refused,
            never executed), or is not a dict.
    """
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is a folder, not a file")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {one_line(exc)}") from None
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save's zip, or its legacy pickle
        raise CheckpointError(f"checkpoint {path} is not a torch.save file (it starts with {head!r})")
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(allowed)):
            warnings.simplefilter("ignore")  # garbage may look like an unusual pickle protocol
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch words it "Unsupported global: GLOBAL x.y", or "unsupported GLOBAL x.y whose
        # module x is blocked" for modules it never allows (os, posix, subprocess...)
        found = re.search(r"unsupported global:? (?:global )?([\w.]+)", str(exc), flags=re.I)
        if found:
            raise CheckpointError(f"refusing to load {path}: it contains a pickled Python object "
                                  f"({found.group(1)}); {refusal_hint} (weights_only=True)") from None
        raise CheckpointError(f"checkpoint {path} is corrupt: not a torch.save file") from None
    except Exception as exc:  # an untrusted file can break the reader in any way
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated: {one_line(exc)}") from None
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(ckpt).__name__}, not a dict")
    return ckpt
