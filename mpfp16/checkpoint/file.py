"""The single-file format: written atomically, read only with ``torch.load(weights_only=True)``.

A checkpoint is a dict of tensors and plain Python values, so ``weights_only=True``
can read it and a checkpoint file can never run code. Writing goes to a temporary
file in the same folder, which is flushed and fsync'ed and then renamed over the
target: a crash at any moment leaves either the old checkpoint or the new one,
never a torn file; a full disk is one line that says so, and the earlier file stays.
Every file carries the checksums of its whole content (:mod:`.integrity`: each
tensor's sums, each other value's digest), which :func:`load` verifies, once it
found the pickle whole (:func:`check_structure`). (:mod:`mpfp16.checkpoint` chooses
this format for a model that is not sharded, and reads it into either layout.)
"""

from __future__ import annotations

import hashlib
import os
import pickletools
import shutil
import tempfile
import zipfile

import torch

from ..errors import CheckpointError, one_line
from ..serialization import fsync_dir, load_weights_only, write_failure
from . import integrity

__all__ = ["save_atomic", "copy_atomic", "load", "check_structure", "digest", "is_unfinished"]


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
    ``obj``'s tensors and other values under ``"checksums"`` (:mod:`.integrity`; one
    it had is replaced).
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
    carries (a file written before them carries none: nothing to verify; one of
    :data:`.integrity.TENSORS_ONLY` has its tensors verified).

    Raises:
        CheckpointError: the file is missing, truncated or corrupt, holds pickled
            Python objects (refused, never executed), is not a dict, or a tensor or
            another field does not match its checksum (the line names it).
    """
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is a folder: pass a checkpoint file such as "
                              f"{os.path.join(path, 'last.pt')}, or --resume auto with --checkpoint-dir {path}")
    state = load_weights_only(path, map_location)
    if verify:
        check_structure(path)
        integrity.verify(state, state.get(integrity.KEY), path)
    return state


def _balanced(data: bytes) -> bool:
    """Whether the pickle ``data`` ends as one that was written whole does: every
    MARK closed, and one object on the stack at STOP, from the opcodes' own stack
    effects (:mod:`pickletools`; nothing is built)."""
    mark = pickletools.markobject
    depth, marks = 0, []
    for op, _, _ in pickletools.genops(data):
        before, after = op.stack_before, op.stack_after
        if mark in after:  # MARK
            marks.append(depth)
            continue
        if mark in before:  # takes what is above the mark, and what it says lies below
            if not marks:
                return False
            depth = marks.pop() - before.index(mark)
        else:
            depth -= len(before)
        if depth < 0:
            return False
        if op.name == "STOP":
            return depth == 0 and not marks
        depth += len(after)
    return False


def _stored_pickle(path: str) -> bytes | None:
    """The bytes of ``data.pkl`` in the torch.save zip at ``path``, as stored: read at
    its place, not through :mod:`zipfile`, which refuses an entry whose CRC-32 does not
    match (torch's reader does not check it), so that what torch unpickled is what is
    checked. None when the file is not such a zip."""
    try:
        with zipfile.ZipFile(path) as z:
            info = next((i for i in z.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1),
                        None)
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            return None
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            header = f.read(30)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                return None
            f.seek(info.header_offset + 30 + int.from_bytes(header[26:28], "little")
                   + int.from_bytes(header[28:30], "little"))
            return f.read(info.file_size)
    except (OSError, zipfile.BadZipFile, ValueError, RuntimeError):
        return None


def check_structure(path: str) -> None:
    """Raise one line unless the pickle of the torch.save file at ``path`` (its
    ``data.pkl``; a file of torch's legacy format is not checked) is well formed
    (:func:`_balanced`). The unpickler returns whatever is on top of its stack at
    STOP: one flipped bit near the end of the pickle (a SETITEMS opcode, the length
    of the last number) left the checkpoint's dict unfinished and returned an object
    inside it, the checksums' own record among them, which reads as a dict written
    before checksums, and verified.

    Raises:
        CheckpointError: naming the file.
    """
    data = _stored_pickle(path)
    if data is None:
        return  # not a zip of torch's (its legacy format): torch.load read it, and nothing more is known of it
    try:
        whole = _balanced(data)
    except ValueError:  # an opcode pickle does not know, or an argument cut short
        whole = False
    if not whole:
        raise CheckpointError(f"checkpoint {path} is corrupt: its pickle (data.pkl) is not one object written "
                              "whole; restore the checkpoint from a copy, or resume from another one")


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
