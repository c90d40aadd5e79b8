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
import pickle
import random
import re
import shutil
import tempfile
import warnings

import torch

from .errors import CheckpointError

__all__ = ["save_atomic", "copy_atomic", "load", "digest", "rng_state", "set_rng_state", "remove_stale_temps"]


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not every platform can open a folder
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, write) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=_TMP_SUFFIX, dir=folder)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from None
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
            raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from None
        raise
    _fsync_dir(folder)


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
    """Read a checkpoint with ``weights_only=True``.

    Raises:
        CheckpointError: the file is missing, truncated or corrupt, holds pickled
            Python objects (refused, never executed), or is not a dict.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with warnings.catch_warnings():  # garbage may look like an unusual pickle protocol
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if found:
            raise CheckpointError(
                f"refusing to load {path}: it contains a pickled Python object ({found.group(1)}); "
                "checkpoints may hold only tensors and plain values (weights_only=True)"
            ) from None
        raise CheckpointError(f"checkpoint {path} is corrupt: not a torch.save file") from None
    except Exception as exc:  # an untrusted file can break the reader in any way
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated: {first}") from None
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(ckpt).__name__}, not a dict")
    return ckpt


def digest(path: str) -> str:
    """A hex digest of the file's bytes: two ranks that read files with equal digests
    read the same checkpoint."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
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
