"""Reading a torch.save file that may come from anywhere, without running its code.

Every checkpoint is read with ``torch.load(weights_only=True)``: tensors and plain
values only, and a pickled Python object is refused, never executed. Callers can
allow a few named classes (mpfp16.compat.apex allows apex's loss scalers), and every
way a file can be wrong is one line naming the file.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings

import torch

from .errors import CheckpointError, one_line

__all__ = ["load_weights_only", "fsync_dir"]


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
