"""Checkpoints: written atomically, read only with ``torch.load(weights_only=True)``.

A checkpoint is a dict of tensors and plain Python values, so ``weights_only=True``
can read it and a checkpoint file can never run code. Writing goes to a temporary
file in the same folder, which is flushed and fsync'ed and then renamed over the
target: a crash at any moment leaves either the old checkpoint or the new one,
never a torn file.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile

import torch

from ..errors import CheckpointError, one_line
from ..serialization import fsync_dir, load_weights_only

__all__ = ["save_atomic", "copy_atomic", "load", "digest", "check_same_everywhere", "describe_mismatch", "rng_state",
           "set_rng_state", "remove_stale_temps"]


def _write_atomic(path: str, write) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=_TMP_SUFFIX, dir=folder)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {one_line(exc)}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write checkpoint {path}: {one_line(exc)}") from None
        raise
    fsync_dir(folder)


_TMP_SUFFIX = ".tmp"


def remove_stale_temps(folder: str) -> list[str]:
    """Delete the temporary files of writes that a killed process left behind
    (``.NAME.XXXX.tmp`` next to NAME); they are never a valid checkpoint."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    for name in os.listdir(folder):
        if name.startswith(".") and name.endswith(_TMP_SUFFIX) and ".pt." in name:
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def save_atomic(obj: dict, path: str) -> None:
    """``torch.save(obj, path)``, atomically (module docstring)."""
    _write_atomic(path, lambda f: torch.save(obj, f))


def copy_atomic(src: str, dst: str) -> None:
    """Copy a file, atomically."""
    with open(src, "rb") as source:
        _write_atomic(dst, lambda f: shutil.copyfileobj(source, f, 1 << 20))


def load(path: str, map_location="cpu") -> dict:
    """Read a checkpoint with ``torch.load(weights_only=True)``
    (:func:`mpfp16.serialization.load_weights_only`).

    Raises:
        CheckpointError: the file is missing, truncated or corrupt, holds pickled
            Python objects (refused, never executed), or is not a dict.
    """
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is a folder: pass a checkpoint file such as "
                              f"{os.path.join(path, 'last.pt')}, or --resume auto with --checkpoint-dir {path}")
    return load_weights_only(path, map_location)


def digest(path: str) -> str:
    """A hex digest of the file's bytes: two ranks that read files with equal digests
    read the same checkpoint."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {one_line(exc)}") from None
    return h.hexdigest()


def rng_state() -> dict:
    """This process's random number generators, as tensors and plain values."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def check_same_everywhere(found: list[dict]) -> None:
    """Raise unless every rank read a checkpoint, and the same one.

    Args:
        found: per rank, in rank order, ``{"path", "error"}`` and, when it was read,
            ``{"step", "digest"}`` (:func:`digest` of the file).

    Raises:
        CheckpointError: one line naming the ranks, the files and their steps.
    """
    failed = [(rank, f) for rank, f in enumerate(found) if f["error"] is not None]
    if failed:
        rank, f = failed[0]
        if len(found) == 1:
            raise CheckpointError(f["error"])
        readers = [r for r, g in enumerate(found) if g["error"] is None]
        also = f" (rank {readers[0]} read it)" if readers else ""
        raise CheckpointError(f"cannot resume on every rank: rank {rank}: {f['error']}{also}")
    if len({f["digest"] for f in found}) > 1:
        files = ", ".join(f"rank {rank} read {f['path']} (step {f['step']}, content {f['digest'][:12]})"
                          for rank, f in enumerate(found))
        raise CheckpointError(f"the ranks found different checkpoints: {files}; every rank must read the same "
                              "file (a shared file system, or rank 0's checkpoint copied to every node)")


def describe_mismatch(mine: dict, saved: dict) -> str:
    """Which keys and shapes differ between two model state_dicts, in one line."""
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    reshaped = [k for k in mine if k in saved and torch.is_tensor(saved[k]) and saved[k].shape != mine[k].shape]
    parts = []
    if missing:
        parts.append(f"{len(missing)} of its tensors missing (first {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unknown here (first {unexpected[0]})")
    if reshaped:
        k = reshaped[0]
        parts.append(f"{len(reshaped)} of another shape (first {k}: {list(saved[k].shape)} saved, "
                     f"{list(mine[k].shape)} here)")
    return ", ".join(parts) or "the tensors do not load"
