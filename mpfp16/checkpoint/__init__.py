"""Checkpoints of a training run: one interface, two formats, either read as the other.

    fmt = mpfp16.checkpoint.format_for(model)       # a DCP folder for a sharded model, else a file
    fmt.save("run/last" + fmt.suffix, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7})
    fmt.keep_as_best("run/last" + fmt.suffix, "run/best" + fmt.suffix)
    state = mpfp16.checkpoint.read("run/last.pt", model)   # either format, for this run's model
    model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])

The two formats (:mod:`.file`, :mod:`.dcp`):

- **a file** (``.pt``): rank 0 writes it atomically; ``torch.load(weights_only=True)``
  reads it;
- **a DCP folder** (``.dcp``, a link naming a folder of ``torch.distributed.checkpoint``
  shards): every rank writes its shards; any number of ranks reads it.

Which one a run writes follows from its model, once; the caller never branches on it.
:func:`read` takes either: a plain run reads a DCP folder whole (no process group
needed), and a sharded run cuts its shards from a file. The state comes back in the
layout of the model given (the optimizer's state has one form for every layout), with the same
masters, optimizer state and counters, bit for bit.

Every call is made by every rank, and every failure is one line, the same
:class:`~mpfp16.errors.CheckpointError` on every rank.
"""

from __future__ import annotations

import os
import random
import shutil

import torch

from ..errors import CheckpointError, one_line
from ..parallel.ranks import all_gather_object, failures, get_rank, get_world_size, is_initialized, raise_first
from ..parallel.fsdp_shim import held_like, is_sharded
from . import dcp, file

__all__ = ["FORMAT", "Format", "FILE", "DCP", "FORMATS", "format_for", "format_of", "read", "saved_step", "remove",
           "remove_unfinished", "check_same_everywhere", "describe_mismatch", "rng_state", "set_rng_state"]

FORMAT = "mpfp16.checkpoint/1"  # the training checkpoint: {"format", "model", "optimizer", ...}


def _agree(error: str | None) -> None:
    raise_first(failures(error), CheckpointError)


def _on_main(action, failure: str) -> None:
    """Run ``action()`` on rank 0 alone; if it raised, every rank raises the same
    CheckpointError (``failure: why``)."""
    error = None
    if get_rank() == 0:
        try:
            action()
        except Exception as exc:  # whatever it was, the other ranks must hear of it now, not at a timeout
            error = str(exc) if isinstance(exc, CheckpointError) else f"{failure}: {one_line(exc)}"
    _agree(error)


class Format:
    """How a run writes its checkpoints. Every method is called by every rank."""

    suffix = ""
    name = ""

    def save(self, path: str, state: dict, tag: str = "") -> None:
        """Write ``state`` (a training checkpoint without its ``format`` key, which is
        added) at ``path``, replacing what was there only once the write is complete.
        ``tag`` names the write where the format keeps one folder per write."""
        raise NotImplementedError

    def keep_as_best(self, last_path: str, best_path: str) -> None:
        """Make ``best_path`` hold what ``last_path`` holds now."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<checkpoint format {self.name} ({self.suffix})>"


class _File(Format):
    suffix, name = ".pt", "file"

    def save(self, path: str, state: dict, tag: str = "") -> None:
        _on_main(lambda: file.save_atomic({"format": FORMAT, **state}, path), f"cannot write checkpoint {path}")

    def keep_as_best(self, last_path: str, best_path: str) -> None:
        _on_main(lambda: file.copy_atomic(last_path, best_path), f"cannot write checkpoint {best_path}")


class _Dcp(Format):
    suffix, name = ".dcp", "DCP folder"

    def save(self, path: str, state: dict, tag: str = "") -> None:
        dcp.save(path, {"format": FORMAT, **state}, tag=tag)

    def keep_as_best(self, last_path: str, best_path: str) -> None:
        def link_best():
            previous = dcp.data_folder(best_path)
            dcp.link(best_path, os.path.realpath(last_path))
            dcp.remove_if_unlinked(os.path.dirname(os.path.abspath(best_path)), previous)

        _on_main(link_best, f"cannot write checkpoint {best_path}")


FILE, DCP = _File(), _Dcp()
FORMATS = (FILE, DCP)


def format_for(model: torch.nn.Module) -> Format:
    """The format a run of ``model`` writes: a DCP folder when its parameters are
    sharded (:func:`mpfp16.distributed.shard`), else a file."""
    return DCP if any(is_sharded(p) for p in model.parameters()) else FILE


def format_of(path: str) -> Format:
    """The format of what is at ``path``: a DCP folder (a link or folder holding
    ``meta.pt``), else a file (whatever it holds, :func:`read` says)."""
    return DCP if dcp.is_checkpoint(path) else FILE


# ------------------------------------------------------------------ reading


def saved_step(path: str) -> int | None:
    """The ``step`` recorded in the checkpoint at ``path`` (this rank reads it).

    Raises:
        CheckpointError: it cannot be read.
    """
    if format_of(path) is DCP:
        step = dcp.read_meta(path)["state"].get("step")
    else:
        step = file.load(path).get("step")
    return int(step) if isinstance(step, (int, float)) else None


def _facts(path: str) -> tuple[dict, dict | None]:
    """What this rank finds at ``path``: ``({"path", "error"} and, when readable,
    {"step", "digest"}, the state or None)``. A file is read whole here; of a DCP
    folder only ``meta.pt`` and DCP's index (checked), whose digests name its content."""
    try:
        if format_of(path) is DCP:
            meta = dcp.inspect(path)
            digest = "".join(file.digest(os.path.join(path, name)) for name in (dcp.META, ".metadata"))
            return {"path": path, "error": None, "step": meta["state"].get("step"), "digest": digest}, None
        state = file.load(path, map_location="cpu")  # RNG states must stay CPU tensors
        found = {"path": path, "error": None, "step": state.get("step"),
                 "digest": file.digest(path) if is_initialized() and get_world_size() > 1 else None}
        return found, state
    except CheckpointError as exc:
        return {"path": path, "error": str(exc)}, None


def _read_dcp(path: str, model: torch.nn.Module) -> dict:
    """A DCP folder: into the model's own shards when it is sharded (a collective that
    reshards), else whole on each rank."""
    if format_for(model) is DCP:
        return dcp.load(path, targets={"model": model.state_dict()})
    state, error = None, None
    try:
        state = dcp.load_whole(path)
    except CheckpointError as exc:
        error = str(exc)
    _agree(error)
    return state


def read(path: str, model: torch.nn.Module, check=None) -> dict:
    """Read the training checkpoint at ``path`` (a file or a DCP folder, whichever run
    wrote it) for ``model``; a collective. Returns its state, for
    ``model.load_state_dict(state["model"])`` then ``opt.load_state_dict(state["optimizer"])``:
    the model's tensors as ``model`` holds them (whole, or each rank's shard), and the
    optimizer's state in its one form, which every store loads
    (mpfp16/state_format.py).

    First every rank finds out what it sees at ``path``, and the ranks check that they
    all see the same checkpoint (without a shared file system they may not).

    Args:
        check: called with the state as saved, before its model part is made like
            this run's; what it raises propagates. It must decide from the state alone,
            so that every rank raises the same (a resume that changed a setting, say).

    Raises:
        CheckpointError: one line, the same on every rank: a rank cannot read it, the
            ranks found different checkpoints, it is not a training checkpoint, or its
            parameters do not match by name and shape.
    """
    found, state = _facts(path)
    check_same_everywhere(all_gather_object(found))
    if state is None:
        state = _read_dcp(path, model)
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mpfp16 training checkpoint (no 'format': '{FORMAT}')")
    if not isinstance(state.get("model"), dict) or not isinstance(state.get("optimizer"), dict):
        raise CheckpointError(f"{path} is not an mpfp16 training checkpoint (no model or optimizer state)")
    if check is not None:
        check(state)
    error = None
    try:
        state = _for_model(state, model)
    except (ValueError, KeyError, TypeError) as exc:
        error = f"checkpoint {path} does not fit this run: {one_line(exc)}"
    _agree(error)
    return state


def _for_model(state: dict, model: torch.nn.Module) -> dict:
    """``state`` with its model's tensors as ``model`` holds them (whole, in its dtype;
    or a DTensor of its sharding, each rank cutting its own shard) and its optimizer
    state in this version's form: a sharded run of an earlier version kept its fp32
    masters in the model's state alone, where the upgrade finds them."""
    from ..state_format import upgrade_state_dict

    targets = model.state_dict()
    model_state = {key: held_like(value, targets[key]) if key in targets and torch.is_tensor(value) else value
                   for key, value in state["model"].items()}
    return {**state, "model": model_state, "optimizer": upgrade_state_dict(state["optimizer"], state["model"])}


def check_same_everywhere(found: list[dict]) -> None:
    """Raise unless every rank read a checkpoint, and the same one.

    Args:
        found: per rank, in rank order, ``{"path", "error"}`` and, when it was read,
            ``{"step", "digest"}`` (:func:`mpfp16.checkpoint.file.digest` of the file).

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


# ------------------------------------------------------------------ the folder


def remove(path: str) -> None:
    """Delete the checkpoint at ``path`` (a file, or a DCP link and the folder it alone
    names); rank 0 does it, every rank hears of a failure."""
    def delete():
        named = dcp.data_folder(path)
        if os.path.lexists(path):
            os.unlink(path)
        dcp.remove_if_unlinked(os.path.dirname(os.path.abspath(path)), named)

    _on_main(delete, f"cannot remove checkpoint {path}")


def remove_unfinished(folder: str) -> list[str]:
    """Delete what unfinished writes of either format left in ``folder``: their
    temporary files, links and folders (``.last.pt.XXXX.tmp``, ``.last.dcp.XXXX.tmp``,
    ``.sharded-...tmp``), which are never a complete checkpoint. A complete checkpoint
    is never swept, linked or not (a user's copy of a DCP folder, say). One sweep, by
    the caller that owns the folder (rank 0, holding its lock). Returns what was removed."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in [n for n in names if file.is_unfinished(n) or dcp.is_unfinished(n)]:
        full = os.path.join(folder, name)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
        except OSError:
            continue
        removed.append(name)
    return removed
