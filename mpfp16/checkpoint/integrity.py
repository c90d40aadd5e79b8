"""Per-tensor checksums, written with every checkpoint of either format and verified
when it is read: one changed bit in any tensor is one line naming the file and the
tensor, never a run that resumes from corrupt numbers.

    sums = checksums(state)           # {"algorithm", "tensors": {("model", "0.weight"): (plain, weighted), ...}}
    verify(state, sums, "run/last.pt")

**What is summed.** A tensor's bytes, in its logical (row-major) order, read as
little-endian 64-bit words (the last one padded with zero bytes): their sum, and their
sum weighted by row (rows of 256 words, weight = row + 1), both modulo 2**64: the
replica check's two sums (:func:`mpfp16.parallel.replicas.tensor_checksum`: exact
integer sums, read once on the tensor's own device), but defined over the byte's
place in the whole tensor instead of in one buffer, so that they **add up over
pieces**: the sums of
any split of a tensor into byte ranges add to the whole tensor's. That is what lets a
DCP folder be checked whatever the world size that reads it: each rank sums its own
shard at its place in the tensor, and the ranks' sums are added.

**What it catches.** One changed bit changes one word by ``±2**k`` (k < 64), which is
never 0 modulo 2**64: the plain sum always moves. The weighted sum also catches words
swapped between rows. It is a check against corruption, not a signature: someone who
edits a file on purpose can write matching sums.

Checkpoints written before checksums existed have none: nothing is verified, and
nothing is said.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..parallel.base import all_gather_object
from ..parallel.fsdp_shim import is_sharded

__all__ = ["ALGORITHM", "KEY", "checksums", "verify", "mismatch", "tensor_sums", "piece_sums", "display"]

ALGORITHM = "mpfp16.word-sums/1"
KEY = "checksums"  # where a checkpoint keeps them
_ROW = 256  # words per row of the weighted sum
_MASK = (1 << 64) - 1


# ------------------------------------------------------------------ one tensor


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in logical order, as a 1-D uint8 tensor (a view when ``t`` is contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _loose(part: torch.Tensor, offset: int) -> torch.Tensor:
    """The sums of bytes that all fall in one word (the word of byte ``offset``)."""
    buf = torch.zeros(8, dtype=torch.uint8, device=part.device)
    start = offset % 8
    buf[start:start + part.numel()] = part
    word = buf.view(torch.int64)[0]
    return torch.stack([word, word * (offset // 8 // _ROW + 1)])


def _aligned(part: torch.Tensor, first_word: int) -> torch.Tensor:
    """The sums of whole words (``part``: a multiple of 8 bytes), the first of which is
    word ``first_word`` of the tensor."""
    if part.data_ptr() % 8 or part.storage_offset() % 8:
        part = part.clone()
    words = part.view(torch.int64)
    m = words.numel()
    out = torch.zeros(2, dtype=torch.int64, device=part.device)
    lead = min((-first_word) % _ROW, m)  # the rest of a row that began before this piece
    if lead:
        s = words[:lead].sum()
        out += torch.stack([s, s * (first_word // _ROW + 1)])
    rows = (m - lead) // _ROW
    if rows:
        row_sums = words[lead:lead + rows * _ROW].view(rows, _ROW).sum(1)
        first_row = (first_word + lead) // _ROW
        weights = torch.arange(first_row + 1, first_row + rows + 1, dtype=torch.int64, device=part.device)
        out += torch.stack([row_sums.sum(), (row_sums * weights).sum()])
    done = lead + rows * _ROW
    if done < m:  # a row that goes on after this piece
        s = words[done:].sum()
        out += torch.stack([s, s * ((first_word + done) // _ROW + 1)])
    return out


def piece_sums(raw: torch.Tensor, offset: int) -> torch.Tensor:
    """The two sums (an int64 tensor of 2, on ``raw``'s device, wrapping around) that
    the bytes ``raw`` (1-D uint8) contribute when they start at byte ``offset`` of
    their tensor. Over any split of a tensor's bytes the pieces' sums add up, modulo
    2**64, to :func:`tensor_sums` of the whole."""
    n = raw.numel()
    out = torch.zeros(2, dtype=torch.int64, device=raw.device)
    if n == 0:
        return out
    head = min((-offset) % 8, n)
    if head:
        out += _loose(raw[:head], offset)
    body = (n - head) // 8 * 8
    if body:
        out += _aligned(raw[head:head + body], (offset + head) // 8)
    if head + body < n:
        out += _loose(raw[head + body:], offset + head + body)
    return out


def tensor_sums(t: torch.Tensor) -> tuple[int, int]:
    """A whole (not sharded) tensor's two sums, as integers in [0, 2**64)."""
    plain, weighted = piece_sums(_bytes(t), 0).tolist()
    return plain & _MASK, weighted & _MASK


def _shard_piece(t) -> tuple[torch.Tensor, int]:
    """A DTensor's local shard as bytes, and the byte of the whole tensor it starts at.
    Sharded along dim 0 over a 1-D mesh, as ``torch.chunk`` splits (DTensor's and
    FSDP2's rule); a replicated one counts on the mesh's first rank alone."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements, local = t.device_mesh, tuple(t.placements), t.to_local()
    if mesh.ndim != 1:
        raise ValueError(f"checksums need a 1-D device mesh, not {mesh.ndim}-D")
    coordinate = mesh.get_local_rank()
    if placements == (Replicate(),):
        return (_bytes(local) if coordinate == 0 else torch.empty(0, dtype=torch.uint8, device=local.device)), 0
    if placements != (Shard(0),):
        raise ValueError(f"checksums need tensors sharded along dim 0, not {placements}")
    rows = t.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(coordinate * chunk, rows)
    if local.shape[0] != min(rows, start + chunk) - start:
        raise ValueError(f"a shard of {local.shape[0]} rows at row {start} of {rows}: not torch.chunk's split")
    row_bytes = t.numel() // max(rows, 1) * t.element_size() if rows else 0
    return _bytes(local), start * row_bytes


# ------------------------------------------------------------------ a state


def _walk(obj, path: tuple, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if not (path == () and key == KEY):
                _walk(value, path + (key,), out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _walk(value, path + (i,), out)


def display(path: tuple) -> str:
    """A tensor's place in the state, as people write it: ``optimizer.optimizer.state.3.exp_avg``."""
    return ".".join(str(k) for k in path)


def checksums(state: dict) -> dict:
    """Every tensor's two sums, keyed by its place in ``state`` (a tuple of keys and
    indices). A collective when ``state`` holds DTensors (every rank of their mesh
    calls it with the same structure: one small all-gather per mesh); else this
    process alone.

    Returns:
        ``{"algorithm": ALGORITHM, "tensors": {path: (plain, weighted)}}``, plain
        integers that ``torch.load(weights_only=True)`` reads.
    """
    tensors: list = []
    _walk(state, (), tensors)
    local, sharded = {}, {}  # path -> sums tensor; mesh -> [(path, sums tensor)]
    for path, t in tensors:
        if is_sharded(t):
            raw, offset = _shard_piece(t)
            sharded.setdefault(t.device_mesh, []).append((path, piece_sums(raw, offset)))
        else:
            local[path] = piece_sums(_bytes(t), 0)
    sums = {}
    for path, value in _to_host(local).items():
        sums[path] = (value[0] & _MASK, value[1] & _MASK)
    for mesh, pieces in sharded.items():
        mine = list(_to_host(dict(pieces)).values())
        every = all_gather_object(mine, group=mesh.get_group())
        for i, (path, _) in enumerate(pieces):
            sums[path] = (sum(rank[i][0] for rank in every) & _MASK, sum(rank[i][1] for rank in every) & _MASK)
    return {"algorithm": ALGORITHM, "tensors": {path: sums[path] for path, _ in tensors}}


def _to_host(found: dict) -> dict:
    """``{path: [plain, weighted]}`` from sums on devices: one transfer per device."""
    by_device: dict = {}
    for path, value in found.items():
        by_device.setdefault(value.device, []).append((path, value))
    out = {}
    for items in by_device.values():
        values = torch.stack([v for _, v in items]).tolist()
        out.update({path: value for (path, _), value in zip(items, values)})
    return {path: out[path] for path in found}


def mismatch(computed: dict, saved, where: str, files=None) -> str | None:
    """The line that says how ``computed`` (:func:`checksums` of what was read) differs
    from ``saved`` (what the checkpoint recorded; None when it recorded nothing, which
    is not checked), or None when they agree.

    Args:
        where: the checkpoint, for the message.
        files: optional ``path -> [file names]`` that hold a tensor's data, for the message.
    """
    if saved is None:
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("tensors"), dict):
        return f"checkpoint {where} is corrupt: its {KEY!r} entry is not a record of checksums"
    if saved.get("algorithm") != ALGORITHM:
        return (f"checkpoint {where} was written with checksums {saved.get('algorithm')!r}, which this version "
                f"cannot verify (it knows {ALGORITHM!r})")
    recorded = saved["tensors"]
    for path, sums in computed["tensors"].items():
        if path not in recorded:
            return f"checkpoint {where} is corrupt: tensor {display(path)} has no checksum"
        if tuple(recorded[path]) != tuple(sums):
            held = files(path) if files is not None else None
            inside = f" (its data is in {', '.join(held)})" if held else ""
            return (f"checkpoint {where} is corrupt: tensor {display(path)}{inside} does not match the checksum "
                    "saved with it; restore the checkpoint from a copy, or resume from another one")
    extra = [p for p in recorded if p not in computed["tensors"]]
    if extra:  # removed by hand, say: the field is named
        held = files(extra[0]) if files is not None else None
        inside = f" (of {', '.join(held)})" if held else ""
        return (f"checkpoint {where} is incomplete: tensor {display(extra[0])}{inside}, which was saved with it, "
                "is missing")
    return None


def verify(state: dict, saved, where: str) -> None:
    """Raise one line when a whole (not sharded) ``state`` does not match the
    checksums ``saved`` with it (:func:`mismatch`).

    Raises:
        CheckpointError: naming ``where`` and the first tensor that differs.
    """
    if saved is None:
        return
    error = mismatch(checksums(state), saved, where)
    if error is not None:
        raise CheckpointError(error)
