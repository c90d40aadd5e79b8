"""The DCP-folder format: each rank writes its shards, any world size reads them.

    dcp.save("run/last.dcp", {"model": model.state_dict(), "optimizer": opt.state_dict(), ...})
    state = dcp.load("run/last.dcp", targets={"model": model.state_dict()})   # into this run's sharding
    state = dcp.load_whole("run/last.dcp")                                     # plain tensors, no process group

(:mod:`mpfp16.checkpoint` chooses this format for a sharded model, reads it into either
layout, and is what the training scripts call.) A checkpoint is a folder written with
``torch.distributed.checkpoint`` (DCP) and named by a symbolic link:

``meta.pt``
    everything that is not a sharded tensor (plain tensors, numbers, strings, the
    structure), written by rank 0 with ``torch.save`` and read with
    ``weights_only=True``;
``.metadata`` and ``__R_0.distcp``
    DCP's index and each rank's shards of the DTensors.

**Resharding.** DCP reads any slice of a saved tensor, so a checkpoint saved on N
ranks loads on M: each sharded tensor is read into a DTensor of the reader's
sharding, bit for bit, or whole (:func:`load_whole`) by a run that is not sharded.

**Atomic.** Every rank writes into a temporary folder; rank 0 then renames it and
swaps the link (a new link renamed over the old one, which POSIX makes atomic), and
only then removes the folder the link named before. A crash at any moment leaves the
link naming a complete checkpoint, the previous one until the swap. Whatever fails
on any rank, every rank raises the same one-line :class:`CheckpointError`.

**Checked on load.** Every checkpoint carries the checksums of its whole state
(:mod:`.integrity`, the same function as the file format's): each rank sums the shards
it writes, and at load each rank sums the shards it read, of whatever sharding, and
every other value in ``meta.pt`` has its digest; one changed bit is one line naming
the folder, the tensor or field and the file that holds it. A shard that DCP cannot
read at all (a changed byte in the ``torch.save`` framing of its chunk) is found
by reading each chunk on its own, and named the same way.

**No code runs on load.** DCP reads its ``.metadata`` with ``pickle`` and its
non-tensor items with ``torch.load(weights_only=False)``. Here ``.metadata`` is read
first by an unpickler that builds DCP's own metadata records and nothing else, every
entry must be a tensor (a non-tensor item, which DCP would unpickle, is refused), and
the names, shapes and dtypes must be those ``meta.pt`` lists; only then does DCP read.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import secrets
import shutil
import warnings

import torch

from ..errors import CheckpointError, dtype_name, one_line
from ..parallel.ranks import all_gather_object, broadcast_object, failures, get_rank, get_world_size, raise_first
from ..parallel.fsdp_shim import is_sharded
from ..serialization import fsync_dir, load_weights_only, write_failure
from . import file as file_format
from . import integrity

__all__ = ["FORMAT", "META", "save", "load", "load_whole", "inspect", "link", "is_checkpoint", "read_meta",
           "data_folder", "remove_if_unlinked", "is_unfinished"]

FORMAT = "mpfp16.sharded-checkpoint/1"
META = "meta.pt"
DATA_PREFIX = "sharded-"
_MARK = "__mpfp16_dtensor__"


# ------------------------------------------------------------------ structure


def _walk_dtensors(obj, path: str, out: list) -> list:
    """``(path, DTensor)`` of every DTensor in ``obj``, in order."""
    if isinstance(obj, torch.Tensor) and is_sharded(obj):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk_dtensors(v, f"{path}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk_dtensors(v, f"{path}/{i}", out)
    return out


def _aliases(obj) -> dict[str, str]:
    """The DTensors of ``obj`` that hold the same data as one met before them (an
    optimizer's fp32 master that is the model's own sharded parameter): ``{path:
    first path}``, agreed by every rank (one small all-gather), so that each is
    written once; a rank's empty shards cannot tell tensors apart, and every rank
    must write the same tensors."""
    seen, found = {}, {}
    for path, t in _walk_dtensors(obj, "", []):
        local = t.to_local()
        same = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.stride()), local.dtype,
                tuple(t.shape))
        first = seen.setdefault(same, path)
        if first != path:
            found[path] = first
    every = all_gather_object(found)
    return {path: first for path, first in found.items() if all(f.get(path) == first for f in every)}


def _split(obj, path: str, dtensors: dict, aliases: dict[str, str]):
    """``obj`` with each DTensor replaced by a marker naming it in ``dtensors``; an
    alias (:func:`_aliases`) by a marker naming the first, which a load puts at both."""
    if isinstance(obj, torch.Tensor) and is_sharded(obj):
        from torch.distributed.tensor import Shard

        if tuple(obj.placements) != (Shard(0),):
            raise ValueError(f"{path}: only tensors sharded along dim 0 over a 1-D mesh are supported, "
                             f"got placements {obj.placements}")
        first = aliases.get(path, path)
        if first == path:
            dtensors[path] = obj
        return {_MARK: first, "shape": list(obj.shape), "dtype": dtype_name(obj.dtype)}
    if isinstance(obj, dict):
        return {k: _split(v, f"{path}/{k}", dtensors, aliases) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, f"{path}/{i}", dtensors, aliases) for i, v in enumerate(obj))
    return obj


def _markers(obj, found: dict) -> dict:
    """``{path: marker}`` of the DTensors ``obj`` holds. Two markers of one path (a
    tensor written once for two places) must be the same record: where they differ,
    one is damaged, and the record kept is one :func:`_check_markers` refuses."""
    if isinstance(obj, dict):
        if _MARK in obj:
            key = obj[_MARK]
            found[key] = obj if found.get(key, obj) == obj else {_MARK: key, "shape": None, "dtype": None}
        else:
            for v in obj.values():
                _markers(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _markers(v, found)
    return found


def _join(obj, tensors: dict):
    if isinstance(obj, dict):
        if _MARK in obj:
            return tensors[obj[_MARK]]
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _flat_targets(targets, path: str, out: dict) -> dict:
    if isinstance(targets, torch.Tensor):
        out[path] = targets
    elif isinstance(targets, dict):
        for k, v in targets.items():
            _flat_targets(v, f"{path}/{k}", out)
    return out


# ------------------------------------------------------------------ the folder


def is_checkpoint(path: str) -> bool:
    """True when ``path`` (a link or a folder) holds a sharded checkpoint's ``meta.pt``."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META))


def link(path: str, data_folder: str) -> None:
    """Point the link ``path`` at ``data_folder`` (in the same folder), atomically: a new
    link renamed over the old one. On failure the old link is untouched and the new one
    is gone."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    os.symlink(os.path.basename(data_folder), tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


def is_unfinished(name: str) -> bool:
    """Whether ``name`` (in a checkpoint folder) is what an unfinished write of this
    format leaves: a temporary data folder (``.sharded-...tmp``) or link
    (``.last.dcp.XXXX.tmp``)."""
    return name.startswith(".") and name.endswith(".tmp") and (".dcp." in name or name.startswith(f".{DATA_PREFIX}"))


def data_folder(path: str) -> str | None:
    """The data folder that the link ``path`` names (a name in the link's folder), or
    None when ``path`` is not a link to one."""
    if not os.path.islink(path):
        return None
    name = os.readlink(path)
    return name if name.startswith(DATA_PREFIX) and os.sep not in name else None


def remove_if_unlinked(parent: str, name: str | None) -> bool:
    """Delete the data folder ``parent/name`` if no link in ``parent`` names it any more:
    the folder a link named until this run's own newer save (or removal) moved the
    link off it. Only such a folder goes: a start never sweeps complete checkpoints,
    and a folder no link ever named (a user's copy, say) is never this run's to
    delete. Returns whether it was removed."""
    full = os.path.join(parent, name) if name else None
    if full is None or not name.startswith(DATA_PREFIX) or os.path.islink(full) or not os.path.isdir(full):
        return False
    try:
        names = os.listdir(parent)
    except OSError:
        return False
    if any(os.path.islink(os.path.join(parent, n)) and os.readlink(os.path.join(parent, n)) == name for n in names):
        return False
    shutil.rmtree(full, ignore_errors=True)
    return True


def _dcp_errors() -> tuple:
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)  # DCP's own is a BaseException


DCP_ERRORS = _dcp_errors()


def _dcp_error(exc: BaseException, folder: str | None = None) -> str:
    """DCP's error in one line: the first failing rank and what it raised (DCP's own
    message carries every rank's traceback); ``folder``: the one being written, whose
    free space tells a full disk from another short write."""
    failures_ = getattr(exc, "failures", None)
    if isinstance(failures_, dict) and failures_:
        rank, failure = sorted(failures_.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {_why(inner, folder) if isinstance(inner, BaseException) else inner}"
    return _why(exc, folder)


def _why(exc: BaseException, folder: str | None) -> str:
    """One exception in one line; a full disk said so (:func:`mpfp16.serialization.write_failure`),
    and the file an OSError names, named."""
    why = write_failure(exc, folder) if folder is not None and isinstance(exc, Exception) else None
    if why is None:
        why = one_line(exc)
    name = getattr(exc, "filename", None)
    if isinstance(exc, OSError) and name:
        why = f"{why}: {name}"
    return why


def _agree(error: str | None) -> None:
    """Raise the first failing rank's error on every rank, as one CheckpointError."""
    raise_first(failures(error), CheckpointError)


def _finish(path: str, tmp: str, final: str, skeleton: dict) -> None:
    """Rank 0, once every rank wrote its shards: meta.pt, then the rename and the link.
    What the failed attempt made is removed; the link still names the previous
    checkpoint until the swap."""
    meta = {"format": FORMAT, "state": skeleton, "world_size": get_world_size()}
    previous = data_folder(path)
    try:
        with open(os.path.join(tmp, META), "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(os.path.dirname(final))
        link(path, final)
    except BaseException as exc:
        why = write_failure(exc, tmp if os.path.isdir(tmp) else final) if isinstance(exc, Exception) else None
        if os.path.isdir(final) and os.path.realpath(path) != os.path.realpath(final):
            shutil.rmtree(final, ignore_errors=True)
        if why is not None:
            raise OSError(why) from None
        raise
    remove_if_unlinked(os.path.dirname(final), previous)  # the checkpoint this save replaced


def save(path: str, state: dict, tag: str = "", checksum: bool = True) -> str:
    """Write ``state`` as a sharded checkpoint named by the link ``path``; a collective:
    every rank calls it with its own shards. Returns the data folder.

    ``state`` holds nested dicts and lists of DTensors (sharded along dim 0, as
    :func:`mpfp16.distributed.shard` makes them), plain tensors and plain values;
    everything but the DTensors is rank 0's. The checksums of every tensor go with it
    (:mod:`.integrity`; ``checksum=False``: none, to measure what they cost).

    Raises:
        CheckpointError: one line, the same on every rank, whatever failed on any rank
            (a full disk while writing shards, anything raised while rank 0 finishes);
            the link still names the previous checkpoint, and the attempt left nothing.
    """
    import torch.distributed.checkpoint as dcp

    parent = os.path.dirname(os.path.abspath(path))
    state = {k: v for k, v in state.items() if k != integrity.KEY}
    if checksum:  # a collective: each rank sums its own shards
        state[integrity.KEY] = integrity.checksums(state)
    dtensors: dict = {}
    skeleton = _split(state, "", dtensors, _aliases(state))
    stamp = broadcast_object(f"{DATA_PREFIX}{tag + '-' if tag else ''}{secrets.token_hex(4)}")
    tmp = os.path.join(parent, f".{stamp}.tmp")
    final = os.path.join(parent, stamp)
    main = get_rank() == 0
    error = None
    if main:
        try:
            os.makedirs(tmp)
        except OSError as exc:
            error = f"cannot write checkpoint {path}: {one_line(exc)}"
    _agree(error)
    try:
        try:
            dcp.save(dtensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        except DCP_ERRORS as exc:  # a full disk on one rank: DCP tells every rank
            error = f"cannot write checkpoint {path}: {_dcp_error(exc, tmp)}"
        _agree(error)
        if main:
            try:
                _finish(path, tmp, final, skeleton)
            except Exception as exc:  # not only OSError: every rank must hear of it now, not at a timeout
                error = f"cannot write checkpoint {path}: {one_line(exc)}"
        _agree(error)
    finally:
        if main and os.path.isdir(tmp):  # a failed write leaves nothing behind
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------ loading


class _Refused(pickle.UnpicklingError):
    """``.metadata`` names a class that is not one of DCP's metadata records."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
            "StorageMeta", "_MEM_FORMAT_ENCODING")
    } | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
         ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def _check_markers(path: str, markers: dict) -> None:
    """Raise one line unless every marker of ``meta.pt`` names its sharded tensor, a
    shape (a list of integers >= 0) and a torch dtype: a damaged one (a key renamed
    by a flipped bit) raised a bare KeyError at load."""
    for key, marker in markers.items():
        shape, dtype = marker.get("shape"), marker.get("dtype")
        if not (isinstance(key, str) and isinstance(shape, list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
                and isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)):
            name = integrity.display(tuple(k for k in key.split("/") if k)) if isinstance(key, str) else repr(key)
            raise CheckpointError(f"checkpoint {path} is corrupt: {META}'s record of the sharded tensor {name[:80]} "
                                  "(its shape and dtype) is damaged; restore the checkpoint from a copy, or resume "
                                  "from another one")


def _check_metadata(path: str, markers: dict):
    """Read DCP's ``.metadata`` safely and check it lists exactly the tensors of
    ``markers``, with their shapes and dtypes. Returns it."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    _check_markers(path, markers)
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: no .metadata") from None
    except _Refused as exc:
        raise CheckpointError(f"refusing to load {path}: its .metadata holds a pickled Python object ({exc}) that is "
                              "not DCP metadata") from None
    except Exception as exc:  # cut short (EOFError, "pickle data was truncated") or garbage
        raise CheckpointError(f"checkpoint {path} is corrupt: its .metadata is truncated or damaged "
                              f"({one_line(exc)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"checkpoint {path}: .metadata is not DCP metadata")
    entries = metadata.state_dict_metadata
    not_tensors = [k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata)]
    if not_tensors:
        raise CheckpointError(f"refusing to load {path}: {not_tensors[0]} is not a tensor (DCP would unpickle it)")
    if set(entries) != set(markers):
        extra = sorted(set(entries) ^ set(markers))
        raise CheckpointError(f"checkpoint {path}: .metadata and meta.pt list different tensors (first {extra[0]})")
    for key, marker in markers.items():
        md = entries[key]
        if list(md.size) != list(marker["shape"]) or str(md.properties.dtype) != f"torch.{marker['dtype']}":
            raise CheckpointError(f"checkpoint {path}: {key} is {list(md.size)} {md.properties.dtype} in .metadata "
                                  f"and {marker['shape']} {marker['dtype']} in meta.pt")
    for name in sorted(_data_files(metadata)):
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path} is incomplete: its shard file {name}, which .metadata lists, "
                                  "is missing")
    return metadata


def _data_files(metadata, fqn: str | None = None) -> set[str]:
    """The shard files (``__0_0.distcp``...) that ``.metadata`` says hold data: all, or
    those holding the tensor ``fqn``."""
    storage = getattr(metadata, "storage_data", None) or {}
    return {info.relative_path for index, info in storage.items()
            if getattr(info, "relative_path", None) and (fqn is None or getattr(index, "fqn", None) == fqn)}


def _verify(path: str, state: dict, metadata) -> str | None:
    """The line that says which tensor or field of ``state`` (as read) does not match
    the checksums saved with it, naming the files that hold it (a field: meta.pt);
    None when all match or the checkpoint carries none. A collective when ``state``
    holds DTensors."""
    saved = state.get(integrity.KEY)
    if saved is None:
        return integrity.misplaced(state, path)

    def files(where: tuple) -> list[str]:
        held = sorted(_data_files(metadata, "".join(f"/{k}" for k in where)))
        return held or [META]

    return integrity.mismatch(integrity.checksums(state), saved, path, files)


def _damaged_chunk(path: str, metadata) -> str | None:
    """After DCP failed to read the checkpoint ``path``: the line naming the first
    chunk of a shard file that does not read on its own (``torch.load`` of its bytes,
    weights_only), or not as the piece of its tensor that ``.metadata`` says it is
    (dtype and shape), with its tensor and file; None when every chunk reads (the
    failure is elsewhere). A changed byte in a chunk's ``torch.save`` framing (its
    zip headers, its pickle) makes DCP's read fail with torch's words alone, on every
    rank, naming neither the file nor the tensor."""
    entries = metadata.state_dict_metadata
    storage = getattr(metadata, "storage_data", None) or {}
    for index, info in sorted(storage.items(), key=lambda kv: (str(kv[1].relative_path), kv[1].offset)):
        if getattr(info, "transform_descriptors", None):  # not written by this module: its bytes are not a torch.save
            return None
        why = None
        try:
            with open(os.path.join(path, info.relative_path), "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            if len(blob) != info.length:
                why = f"it is cut short ({len(blob)} of {info.length} bytes)"
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    piece = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
                md = entries.get(index.fqn)
                chunk = next((c for c in getattr(md, "chunks", ()) if list(c.offsets) == list(index.offset or ())),
                             None)
                if not isinstance(piece, torch.Tensor):
                    why = f"it holds a {type(piece).__name__}, not a tensor"
                elif chunk is not None and (piece.dtype, list(piece.shape)) != (md.properties.dtype, list(chunk.sizes)):
                    why = (f"it holds a {str(piece.dtype).replace('torch.', '')} {list(piece.shape)} piece where "
                           f".metadata says {str(md.properties.dtype).replace('torch.', '')} {list(chunk.sizes)}")
        except Exception as exc:  # whatever torch's reader raises on damaged bytes
            why = one_line(exc)
        if why is not None:
            name = integrity.display(tuple(k for k in index.fqn.split("/") if k))
            return (f"checkpoint {path} is corrupt: tensor {name} (its data is in {info.relative_path}) does not "
                    f"read: {why}; restore the checkpoint from a copy, or resume from another one")
    return None


def _reader(path: str, metadata):
    """DCP's file reader, given the metadata read by :func:`_check_metadata` instead of
    unpickling ``.metadata`` itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def read_meta(path: str) -> dict:
    """``meta.pt`` of the checkpoint ``path`` (weights_only), checked."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint folder")
    meta = load_weights_only(os.path.join(path, META))
    file_format.check_structure(os.path.join(path, META))
    if meta.get("format") != FORMAT or not isinstance(meta.get("state"), dict):
        raise CheckpointError(f"{path} is not an mpfp16 sharded checkpoint (no 'format': '{FORMAT}' in {META})")
    return meta


def inspect(path: str) -> dict:
    """``meta.pt`` of the checkpoint ``path``, once its ``.metadata`` was read safely and
    found to list exactly the tensors ``meta.pt`` names (this rank alone).

    Raises:
        CheckpointError: as :func:`load`.
    """
    meta = read_meta(path)
    _check_metadata(path, _markers(meta["state"], {}))
    return meta


def load(path: str, targets: dict | None = None, mesh=None, verify: bool = True) -> dict:
    """Read the checkpoint ``path`` (a collective). Returns its state: DTensors of this
    run's sharding where it saved DTensors, and rank 0's plain values.

    Args:
        targets: nested dicts of DTensors to read into in place, at the places the
            state has them (``{"model": model.state_dict()}``: the model's own sharded
            parameters receive the saved values). Other sharded tensors are made new,
            sharded along dim 0 over ``mesh``.
        mesh: the device mesh for new DTensors; default that of the first target.
        verify: check the tensors read against the checksums saved with them
            (a checkpoint written before them has none: nothing to check).

    Raises:
        CheckpointError: one line, on every rank: the folder is missing or incomplete
            (a shard file missing: named), ``meta.pt`` is not a checkpoint,
            ``.metadata`` is truncated or holds anything but DCP's records of tensors,
            the tensors do not fit, a chunk of a shard file does not read (named, with
            its tensor), or a tensor or field does not match its checksum (named, with
            the files that hold it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import empty as dtensor_empty

    error, meta, markers, metadata = None, None, {}, None
    try:
        meta = read_meta(path)
        markers = _markers(meta["state"], {})
        metadata = _check_metadata(path, markers)
    except CheckpointError as exc:
        error = str(exc)
    _agree(error)
    given = _flat_targets(targets or {}, "", {})
    if mesh is None:
        mesh = next((t.device_mesh for t in given.values() if is_sharded(t)), None)
    buffers = {}
    for key, marker in markers.items():
        target = given.get(key)
        if target is not None and is_sharded(target):
            if list(target.shape) != marker["shape"] or str(target.dtype) != f"torch.{marker['dtype']}":
                error = (f"checkpoint {path}: {key} is {marker['shape']} {marker['dtype']} there and "
                         f"{list(target.shape)} {target.dtype} here")
                break
            buffers[key] = target
        else:
            if mesh is None:
                error = "loading a sharded checkpoint needs a device mesh (pass mesh=, or sharded targets)"
                break
            buffers[key] = dtensor_empty(marker["shape"], dtype=getattr(torch, marker["dtype"]), device_mesh=mesh,
                                         placements=[Shard(0)])
    _agree(error)
    try:
        with torch.no_grad():
            dcp.load(buffers, storage_reader=_reader(path, metadata))
    except DCP_ERRORS as exc:  # every rank: DCP gathers the failures
        error = _damaged_chunk(path, metadata) or f"checkpoint {path} does not load: {_dcp_error(exc)}"
    _agree(error)
    state = _join(meta["state"], buffers)
    if verify:
        _agree(_verify(path, state, metadata))  # every rank sums its own shards; one all-gather
    return state


def load_whole(path: str, verify: bool = True) -> dict:
    """Read the checkpoint ``path`` whole, into plain CPU tensors of the saved shapes:
    for a run that is not sharded, on any number of ranks, with or without a process
    group. Each rank reads on its own (no collective), so a caller on several ranks
    agrees on the outcome itself (:func:`mpfp16.checkpoint.read` does).

    Raises:
        CheckpointError: one line, on this rank: as :func:`load`.
    """
    import torch.distributed.checkpoint as dcp

    meta = read_meta(path)
    markers = _markers(meta["state"], {})
    metadata = _check_metadata(path, markers)
    buffers = {key: torch.empty(marker["shape"], dtype=getattr(torch, marker["dtype"]))
               for key, marker in markers.items()}
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist says so already
            dcp.load(buffers, storage_reader=_reader(path, metadata), no_dist=True)
    except DCP_ERRORS as exc:
        raise CheckpointError(_damaged_chunk(path, metadata)
                              or f"checkpoint {path} does not load: {_dcp_error(exc)}") from None
    state = _join(meta["state"], buffers)
    error = _verify(path, state, metadata) if verify else None
    if error is not None:
        raise CheckpointError(error)
    return state
