"""Checksums of the whole checkpoint, written with every checkpoint of either format
and verified when it is read: one changed bit anywhere in its content, a tensor or
any other value, is one line naming the file and the place, never a run that
resumes from corrupt numbers or a changed step, learning rate or loss scale.

    sums = checksums(state)   # {"algorithm", "tensors": {"('model', '0.weight')": (plain, weighted), ...},
                              #  "fields": {"('step',)": digest, "('model', '0.weight')": digest, ...}}
    verify(state, sums, "run/last.pt")

**Tensors.** A tensor's bytes, in its logical (row-major) order, read as
little-endian 64-bit words (the last one padded with zero bytes): their sum, and their
sum weighted by row (rows of 256 words, weight = row + 1), both modulo 2**64: the
replica check's two sums (:func:`mpfp16.parallel.replicas.tensor_checksum`: exact
integer sums, read once on the tensor's own device), but defined over the byte's
place in the whole tensor instead of in one buffer, so that they **add up over
pieces**: the sums of
any split of a tensor into byte ranges add to the whole tensor's. That is what lets a
DCP folder be checked whatever the world size that reads it: each rank sums its own
shard at its place in the tensor, and the ranks' sums are added.

One changed bit changes one word by ``±2**k`` (k < 64), which is never 0 modulo
2**64: the plain sum always moves. The weighted sum also catches words swapped
between rows.

**Fields** (algorithm ``/2``). Every leaf of the state's nested dicts, lists and
tuples, keyed by its place: a tensor (its dtype and shape, which its sums do not
cover: a zero tensor cut to shape ``[0]`` sums to 0 too), a number, a string,
None, an empty dict or list, or a list or tuple that holds only such scalars (one
leaf: ``scheduler.base_lrs``, Python's RNG state). Each is written as its type's
name and its exact value (a float by its 8 bytes) and hashed to 64 bits
(blake2b), so that a value read back with ``torch.load(weights_only=True)`` gives
the digest it was saved with, and another value, another type (``1`` for ``1.0``
or ``True``), a field gone or one added does not. The record itself (``state[KEY]``)
is left out of what it covers. Its entries are keyed by ``repr`` of each place's
tuple of keys and indices, new strings: pickle writes an object once and refers to
it after, so a record that held the state's own key strings would have one flipped
bit rename a field and its entry alike (:func:`_key`). What makes the pickle return
another object than the one written (:func:`mpfp16.checkpoint.file.check_structure`)
is the readers' to refuse.

These are checks against corruption, not a signature: someone who edits a file on
purpose can write matching sums.

Checkpoints written before checksums existed have none: nothing is verified, and
nothing is said. Those written with algorithm ``/1`` (tensors only) have their
tensors verified, and their other values are checked by the readers' own rules
alone (:func:`mpfp16.train.checkpointing.check_training_state`, the loss scaler's).
"""

from __future__ import annotations

import ast
import hashlib
import re
import struct

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import CheckpointError
from ..parallel.ranks import all_gather_object
from ..parallel.fsdp_shim import is_sharded

__all__ = ["ALGORITHM", "TENSORS_ONLY", "KEY", "checksums", "verify", "mismatch", "misplaced", "tensor_sums",
           "piece_sums", "field_digest", "fields", "display"]

ALGORITHM = "mpfp16.word-sums/2"  # the tensors' sums and every field's digest
TENSORS_ONLY = "mpfp16.word-sums/1"  # what earlier versions wrote: the tensors' sums alone
_NAMED = re.compile(r"mpfp16\.word-sums/(\d+)")
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
    if isinstance(obj, torch.Tensor) and not is_sharded(obj) and is_traceable_wrapper_subclass(obj):
        # a tensor that wraps others (torchao's quantized optimizer states: codes, scales,
        # a lookup table) has no bytes of its own to sum: its inner tensors, each by name
        names, _ = obj.__tensor_flatten__()
        for name in names:
            _walk(getattr(obj, name), path + (name,), out)
    elif isinstance(obj, torch.Tensor):
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


# ------------------------------------------------------------------ fields


def _is_scalar(value) -> bool:
    return not isinstance(value, (torch.Tensor, dict, list, tuple))


def _leaves(obj, path: tuple, out: list) -> None:
    """``(path, value)`` of every field of ``obj`` (module docstring): a tensor, a
    scalar, an empty dict, or a list or tuple of scalars only (empty included)."""
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            if not (path == () and key == KEY):
                _leaves(value, path + (key,), out)
    elif isinstance(obj, (list, tuple)) and not all(_is_scalar(v) for v in obj):
        for i, value in enumerate(obj):
            _leaves(value, path + (i,), out)
    else:
        out.append((path, obj))


def _encode(value) -> str:
    """``value`` as its type's name and its exact value: the same string for a value
    and what ``torch.load(weights_only=True)`` reads back of it, and another for any
    other value or type."""
    kind = type(value)
    if isinstance(value, torch.Tensor):  # its bytes are the sums' (tensor_sums)
        return f"Tensor {str(value.dtype).replace('torch.', '')} {list(value.shape)}"
    if kind is float:  # its 8 bytes: -0.0 is not 0.0, and one NaN is not another
        return "float " + struct.pack("<d", value).hex()
    if kind in (int, bool, type(None)):
        return f"{kind.__name__} {value!r}"
    if kind is str:
        return "str " + repr(value)
    if kind in (bytes, bytearray):
        return f"{kind.__name__} {bytes(value).hex()}"
    if kind is complex:
        return "complex " + struct.pack("<dd", value.real, value.imag).hex()
    if isinstance(value, (list, tuple)):  # torch.Size included, by its name
        return f"{kind.__qualname__} [{', '.join(_encode(v) for v in value)}]"
    if isinstance(value, dict):  # an empty one: a leaf (_leaves)
        return f"{kind.__qualname__} {{}}"
    return f"{kind.__module__}.{kind.__qualname__} {value!r}"  # torch.dtype, torch.device, ...


def field_digest(value) -> int:
    """The 64-bit digest of one field's value (:func:`_encode`, hashed with blake2b)."""
    text = _encode(value).encode("utf-8", "backslashreplace")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def fields(state: dict) -> dict:
    """``{path: digest}`` of every field of ``state`` (tensors by dtype and shape),
    this process alone (a DTensor's shape is the whole tensor's)."""
    found: list = []
    _leaves(state, (), found)
    return {path: field_digest(value) for path, value in found}


# ------------------------------------------------------------------ the record


def _key(path: tuple) -> str:
    """A place as the record keys it: ``repr(path)``, a new string. Keyed by the
    path's tuple, the record would hold the state's own key objects, which pickle
    writes once and refers to: one flipped bit in a key would rename the field and
    its record's entry alike, and the renamed field would verify."""
    return repr(path)


def _path(key) -> tuple | None:
    """The path of a record's key (a :func:`_key`, or the tuple that algorithm /1 used)."""
    if isinstance(key, tuple):
        return key
    try:
        path = ast.literal_eval(key) if isinstance(key, str) else None
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return path if isinstance(path, tuple) else None


def checksums(state: dict) -> dict:
    """Every tensor's two sums and every field's digest, keyed by its place in
    ``state`` (``repr`` of its tuple of keys and indices: :func:`_key`). A collective
    when ``state`` holds DTensors (every rank of their mesh calls it with the same
    structure: one small all-gather per mesh); else this process alone.

    Returns:
        ``{"algorithm": ALGORITHM, "tensors": {key: (plain, weighted)}, "fields":
        {key: digest}}``, plain strings and integers that
        ``torch.load(weights_only=True)`` reads, none of them an object of ``state``.
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
    return {"algorithm": ALGORITHM, "tensors": {_key(path): sums[path] for path, _ in tensors},
            "fields": {_key(path): digest for path, digest in fields(state).items()}}


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


_RESTORE = "restore the checkpoint from a copy, or resume from another one"


def _unreadable(saved, where: str) -> str | None:
    """The line that says ``saved`` is no record that this version can verify, or
    None when it is one (of :data:`ALGORITHM` or :data:`TENSORS_ONLY`)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("tensors"), dict):
        return f"checkpoint {where} is corrupt: its {KEY!r} entry is not a record of checksums"
    algorithm = saved.get("algorithm")
    if algorithm == ALGORITHM:
        if not isinstance(saved.get("fields"), dict):
            return f"checkpoint {where} is corrupt: its {KEY!r} entry ({ALGORITHM}) has no record of its fields"
        return None
    if algorithm == TENSORS_ONLY:
        return None
    named = _NAMED.fullmatch(algorithm) if isinstance(algorithm, str) else None
    if named and int(named.group(1)) > int(_NAMED.fullmatch(ALGORITHM).group(1)):  # a later version's
        return (f"checkpoint {where} was written with checksums {algorithm!r}, which this version cannot verify "
                f"(it knows {ALGORITHM!r} and {TENSORS_ONLY!r})")
    return (f"checkpoint {where} is corrupt: its checksums name the algorithm {algorithm!r}, which no version "
            f"wrote; {_RESTORE}")


def mismatch(computed: dict, saved, where: str, files=None) -> str | None:
    """The line that says how ``computed`` (:func:`checksums` of what was read) differs
    from ``saved`` (what the checkpoint recorded; None when it recorded nothing, which
    is not checked), or None when they agree. A record of :data:`TENSORS_ONLY` has
    its tensors compared, and nothing else.

    Args:
        where: the checkpoint, for the message.
        files: optional ``path -> [file names]`` that hold a tensor's data or a
            field, for the message.
    """
    if saved is None:
        return None
    error = _unreadable(saved, where)
    if error is not None:
        return error

    def shown(key) -> str:  # a key that is no literal (a damaged file made a tensor a key): its start, on one line
        path = _path(key)
        text = display(path) if path is not None else " ".join(str(key).split())
        return text if len(text) <= 80 else text[:77] + "..."

    def inside(key, words: str = "its data is in") -> str:
        path = _path(key)
        held = files(path) if files is not None and path is not None else None
        return f" ({words} {', '.join(held)})" if held else ""

    def keyed(record: dict) -> dict:  # algorithm /1 keyed its record by the tuples themselves
        return {_key(k) if isinstance(k, tuple) else k: v for k, v in record.items()}

    recorded = keyed(saved["tensors"])
    for key, sums in computed["tensors"].items():
        if key not in recorded:
            return f"checkpoint {where} is corrupt: tensor {shown(key)} has no checksum"
        if not isinstance(recorded[key], (tuple, list)) or tuple(recorded[key]) != tuple(sums):
            return (f"checkpoint {where} is corrupt: tensor {shown(key)}{inside(key)} does not match the checksum "
                    f"saved with it; {_RESTORE}")
    extra = [k for k in recorded if k not in computed["tensors"]]
    if extra:  # removed by hand, say: the field is named
        return (f"checkpoint {where} is incomplete: tensor {shown(extra[0])}{inside(extra[0], 'of')}, which was "
                "saved with it, is missing")
    if saved["algorithm"] == TENSORS_ONLY:
        return None
    recorded, tensors = keyed(saved["fields"]), computed["tensors"]
    for key, digest in computed["fields"].items():
        kind = "tensor" if key in tensors else "field"
        if key not in recorded:
            return f"checkpoint {where} is corrupt: {kind} {shown(key)}{inside(key, 'in')} has no checksum"
        if recorded[key] != digest:
            what = f"tensor {shown(key)}'s dtype or shape" if kind == "tensor" else f"field {shown(key)}"
            return (f"checkpoint {where} is corrupt: {what}{inside(key, 'in')} does not match the checksum saved "
                    f"with it; {_RESTORE}")
    extra = [k for k in recorded if k not in computed["fields"]]
    if extra:
        return (f"checkpoint {where} is incomplete: field {shown(extra[0])}{inside(extra[0], 'of')}, which was "
                "saved with it, is missing")
    return None


def misplaced(state: dict, where: str) -> str | None:
    """For a ``state`` that holds no record of checksums (``state.get(KEY)`` is None,
    as in a checkpoint written before them): the line that says it lost the one it
    had, under another top-level key (one flipped bit in the key's name) or as None;
    None when it never had one."""
    if KEY in state:
        return f"checkpoint {where} is corrupt: its {KEY!r} entry is not a record of checksums"
    for key, value in state.items():
        if not isinstance(value, dict):
            continue
        algorithm = value.get("algorithm")
        if (isinstance(algorithm, str) and algorithm.startswith("mpfp16.word-sums")) or (
                isinstance(value.get("tensors"), dict) and isinstance(value.get("fields"), dict)):
            name = repr(key) if isinstance(key, (str, int)) else f"a {type(key).__name__}"
            return f"checkpoint {where} is corrupt: its checksums are under {name[:60]}, not {KEY!r}; {_RESTORE}"
    return None


def verify(state: dict, saved, where: str) -> None:
    """Raise one line when a whole (not sharded) ``state`` does not match the
    checksums ``saved`` with it (:func:`mismatch`), or holds them under another key
    (:func:`misplaced`).

    Raises:
        CheckpointError: naming ``where`` and the first tensor or field that differs.
    """
    error = misplaced(state, where) if saved is None else mismatch(checksums(state), saved, where)
    if error is not None:
        raise CheckpointError(error)

