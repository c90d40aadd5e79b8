"""The single-file format: written atomically, read only with ``torch.load(weights_only=True)``.

A checkpoint is a dict of tensors and plain Python values, so ``weights_only=True``
can read it and a checkpoint file can never run code. Writing goes to a temporary
file in the same folder, which is flushed and fsync'ed and then renamed over the
target: a crash at any moment leaves either the old checkpoint or the new one,
never a torn file; a full disk is one line that says so, and the earlier file stays.
Every file carries the checksums of its tensors (:mod:`.integrity`), which
:func:`load` verifies. (:mod:`mpfp16.checkpoint` chooses this format for a model
that is not sharded, and reads it into either layout.)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

import torch

from ..errors import CheckpointError, one_line
from ..serialization import fsync_dir, load_weights_only, write_failure
from . import integrity

__all__ = ["save_atomic", "copy_atomic", "load", "digest", "is_unfinished"]


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
        # Why, before the partial file goes: torch words a full disk "unexpected pos", and
        # only the free space left then tells (mpfp16.serialization.write_failure).
        why = write_failure(exc, tmp) if isinstance(exc, Exception) else None
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if why is not None:
            raise CheckpointError(f"cannot write checkpoint {path}: {why}") from None
        raise
    fsync_dir(folder)


_TMP_SUFFIX = ".tmp"


def is_unfinished(name: str) -> bool:
    """Whether ``name`` (in a checkpoint folder) is the temporary file of a write that
    a killed process left behind (``.NAME.XXXX.tmp`` next to NAME); it is never a valid
    checkpoint."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX) and ".pt." in name


def save_atomic(obj: dict, path: str, checksum: bool = True) -> None:
    """``torch.save(obj, path)``, atomically (module docstring), with the checksums of
    ``obj``'s tensors under ``"checksums"`` (:mod:`.integrity`; one it had is replaced).
    ``checksum=False`` writes none (to measure what they cost).

    Raises:
        CheckpointError: the file cannot be written (a full disk: "No space left on
            device"); what was at ``path`` is untouched.
    """
    if checksum:
        obj = {**{k: v for k, v in obj.items() if k != integrity.KEY}, integrity.KEY: integrity.checksums(obj)}
    _write_atomic(path, lambda f: torch.save(obj, f))


def copy_atomic(src: str, dst: str) -> None:
    """Copy a file, atomically."""
    with open(src, "rb") as source:
        _write_atomic(dst, lambda f: shutil.copyfileobj(source, f, 1 << 20))


def load(path: str, map_location="cpu", verify: bool = True) -> dict:
    """Read a checkpoint with ``torch.load(weights_only=True)``
    (:func:`mpfp16.serialization.load_weights_only`) and verify the checksums it
    carries (a file written before them carries none: nothing to verify).

    Raises:
        CheckpointError: the file is missing, truncated or corrupt, holds pickled
            Python objects (refused, never executed), is not a dict, or a tensor
            does not match its checksum (the line names it).
    """
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is a folder: pass a checkpoint file such as "
                              f"{os.path.join(path, 'last.pt')}, or --resume auto with --checkpoint-dir {path}")
    state = load_weights_only(path, map_location)
    if verify:
        integrity.verify(state, state.get(integrity.KEY), path)
    return state


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
