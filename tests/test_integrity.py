"""Checkpoints that are damaged, hand-edited, or written to a full disk: one line naming
the file and what is wrong, on every rank; and the start-of-run sweep removes only what
an unfinished write left (issue 25, items 2, 5, 6, 9 and 11 b-d). Every field under the
checksums, and the values' own rules for checkpoints without them (issue 37, item 2)."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import struct
import subprocess
import zipfile

import pytest
import torch
import torch.nn as nn

import checkpoint_workers as CW
from dist_helpers import run_workers
from fault_workers import run_cli
import mpfp16
from mpfp16 import checkpoint
from mpfp16.checkpoint import dcp, file, integrity
from mpfp16.errors import CheckpointError, UserError
from mpfp16.train.checkpointing import check_continuation, check_scaler_state, check_training_state
from mpfp16.train.metrics import MetricsWriter

NO_SPACE = re.compile("no space left on device", re.I)


@contextlib.contextmanager
def tmpfs(folder, size: str):
    """A tmpfs of ``size`` mounted on ``folder`` (skipped where mounting is not
    allowed), always unmounted after."""
    os.makedirs(folder, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield str(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def fill(folder: str) -> None:
    """Write a file in ``folder`` until its file system is full."""
    with open(os.path.join(folder, "filler"), "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


def tensors_that_differ(a: dict, b: dict) -> set[str]:
    """The places (as integrity.display writes them) whose bits differ."""
    found_a, found_b = [], []
    integrity._walk(a, (), found_a)
    integrity._walk(b, (), found_b)
    other = dict(found_b)
    return {integrity.display(p) for p, t in found_a
            if p not in other or integrity.tensor_sums(t) != integrity.tensor_sums(other[p])}


def named_tensor(error: str) -> str:
    found = re.search(r"tensor (\S+)", error)
    assert found, error
    return found.group(1)


def training_state(model, opt, step: int) -> dict:
    """CW.training_state, its scheduler at ``step`` as the engine leaves it (stepped once
    per optimizer step; its multiplier is 1, so the learning rates are unchanged)."""
    state = CW.training_state(model, opt, step)
    state["scheduler"] = {**state["scheduler"], "last_epoch": step, "_step_count": step + 1}
    return state


def tiny_run(seed: int = 0):
    """A 16-bit model of 7 tensors with fp32 masters and a dynamic loss scale, one step
    taken: a real checkpoint whose pickle is small enough to flip bits of by the hundred."""
    torch.manual_seed(seed)
    model = mpfp16.to_half(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    opt.zero_grad()
    opt.backward(model(torch.randn(3, 4)).float().sum())
    opt.step()
    return model, opt


def same(a, b) -> bool:
    """Equal values of the same types all the way down; tensors bit for bit (their dtype,
    shape and bytes), floats by their 8 bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def pickle_span(blob: bytes) -> tuple[int, int]:
    """(start, length) of the pickle (``data.pkl``) in a torch.save zip."""
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def as_tensors_only(state: dict) -> dict:
    """``state`` with its checksums as versions before fields wrote them (algorithm /1:
    the tensors' sums alone, keyed by their paths' tuples)."""
    record = integrity.checksums(state)
    return {**state, integrity.KEY: {"algorithm": integrity.TENSORS_ONLY,
                                     "tensors": {integrity._path(k): v for k, v in record["tensors"].items()}}}


# ------------------------------------------------------------------ 6. a file


@pytest.fixture(scope="module")
def saved_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("file")
    model, opt = CW.local_run(0)
    CW.train(model, opt, 1)
    path = str(folder / "last.pt")
    checkpoint.FILE.save(path, training_state(model, opt, 1))
    return path, model, opt


@pytest.mark.slow  # two loads of the whole file per storage, over 60 of them: 14 s here
def test_one_flipped_bit_in_any_tensor_of_a_file_is_one_line_naming_the_file_and_the_tensor(saved_file):
    path, model, opt = saved_file
    clean = file.load(path)
    with open(path, "rb") as f:
        spans = CW.tensor_data_spans(f.read())
    assert len(spans) > 60  # every storage: weights, masters, exp_avg(_sq), buffers, RNG states
    rng = random.Random(0)
    caught_flips = 0
    for entry, start, length in spans:
        offset, bit = start + rng.randrange(length), rng.randrange(8)
        CW._flip(path, offset, bit)
        try:
            corrupt = file.load(path, verify=False)
            try:
                checkpoint.read(path, model)
                error = None
            except CheckpointError as exc:
                error = str(exc)
        finally:
            CW._flip(path, offset, bit)
        changed = tensors_that_differ(corrupt, clean)
        if not changed:  # the bit is in a flat buffer's padding, which no tensor holds: nothing to catch
            assert error is None, (entry, error)
            continue
        caught_flips += 1
        assert error is not None, (entry, changed)
        assert error.startswith(f"checkpoint {path} is corrupt: tensor ") and "\n" not in error, (entry, error)
        assert named_tensor(error) in changed, (entry, error)
    assert caught_flips >= len(spans) - 3
    assert file.load(path)["step"] == 1  # flipped back: it verifies again


def test_the_line_names_the_tensor_by_its_place_in_the_state(saved_file):
    path, _, _ = saved_file
    found: list = []
    integrity._walk(file.load(path), (), found)
    names = {integrity.display(p) for p, _ in found}
    assert "model.0.0.weight" in names and "optimizer.optimizer.state.0.0.weight.exp_avg" in names
    assert "optimizer.params.0.0.weight.master" in names


def test_a_checkpoint_written_before_checksums_loads_without_a_word(tmp_path, saved_file, recwarn, caplog):
    _, model, opt = saved_file
    state = CW.training_state(model, opt, 1)
    path = str(tmp_path / "old.pt")
    file.save_atomic({"format": checkpoint.FORMAT, **state}, path, checksum=False)
    assert "checksums" not in torch.load(path, weights_only=True)
    assert checkpoint.read(path, model)["step"] == 1
    assert not recwarn.list and not caplog.records


def test_the_checksums_add_up_over_any_split_of_a_tensor():
    """What lets a DCP folder be checked at any world size: each rank's piece sums to the whole."""
    for dtype in (torch.float16, torch.float32, torch.int64, torch.uint8, torch.bfloat16):
        t = (torch.randn(1003, 7) * 100).to(dtype)
        raw = t.reshape(-1).view(torch.uint8)
        whole = integrity.piece_sums(raw, 0)
        rng = random.Random(1)
        for _ in range(5):
            cuts = sorted({0, raw.numel(), *(rng.randrange(raw.numel()) for _ in range(4))})
            parts = sum(integrity.piece_sums(raw[a:b], a) for a, b in zip(cuts, cuts[1:]))
            assert torch.equal(parts, whole), (dtype, cuts)
        flipped = raw.clone()
        flipped[rng.randrange(raw.numel())] ^= 1 << rng.randrange(8)
        assert integrity.tensor_sums(flipped) != integrity.tensor_sums(raw)


# ------------------------------------------------------------------ 9. hand-edited fields of a file


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    model, opt = tiny_run()
    path = str(tmp_path_factory.mktemp("tiny") / "last.pt")
    checkpoint.FILE.save(path, training_state(model, opt, 1))
    return path, model, opt


@pytest.mark.parametrize("field,value", CW.EDITS, ids=[f"{f}={v!r}" for f, v in CW.EDITS])
def test_a_hand_edited_file_is_one_line_naming_the_file_and_the_field(tmp_path, tiny_file, field, value):
    """Edited with the checksums kept, the checksums name the field; with checksums
    written to match (on purpose), the training checkpoint's schema does."""
    src, model, opt = tiny_file
    state = torch.load(src, weights_only=True)
    path = str(tmp_path / "last.pt")
    torch.save(CW.edited(state, field, value), path)  # by hand: the format marker and the checksums kept
    error = CW.schema_error(path, model, opt)
    assert error is not None and "\n" not in error
    assert error.startswith(f"checkpoint {path} ") and (f"field {field}" in error or f"tensor {field}." in error), error
    edited = CW.edited({k: v for k, v in state.items() if k != integrity.KEY}, field, value)
    torch.save({**edited, integrity.KEY: integrity.checksums(edited)}, path)  # the checksums of what it holds now
    error = CW.schema_error(path, model, opt)
    assert error is not None and "\n" not in error
    assert error.startswith(f"checkpoint {path} ") and f"'{field}'" in error, error


def test_the_complete_file_passes_the_schema(saved_file):
    path, model, opt = saved_file
    assert CW.schema_error(path, model, opt) is None


# ------------------------------------------------------------------ issue 37, 2: every field under the checksums


def test_every_flipped_bit_in_a_files_pickle_is_refused_in_one_line_or_changes_nothing(tiny_file, tmp_path):
    """Bits of the pickle that holds every value but the tensors' bytes (1,500 flips in a
    run's last.pt had loaded 374 changed values: the lr, the step, the loss scale):
    160 of its 92,824 here, and every bit of its last 16 bytes (its last SETITEMS
    opcodes and number: a flip there returned a dict from inside the checkpoint, the
    checksums' own among them, as the whole), each loaded by mpfp16.checkpoint.file.load.
    Each of the 92,824 was flipped once, in a run of its own: 5,500 load the same values,
    and the other 87,324 are refused in one line."""
    src, _, _ = tiny_file
    blob = open(src, "rb").read()
    start, length = pickle_span(blob)
    clean = file.load(src)
    rng = random.Random(37)
    path = str(tmp_path / "last.pt")
    refused = 0
    flips = [(start + rng.randrange(length), rng.randrange(8)) for _ in range(160)]
    flips += [(start + length - 1 - i, bit) for i in range(16) for bit in range(8)]
    for offset, bit in flips:
        flipped = bytearray(blob)
        flipped[offset] ^= 1 << bit
        with open(path, "wb") as f:
            f.write(flipped)
        try:
            loaded = file.load(path)
        except CheckpointError as exc:
            assert path in str(exc) and "\n" not in str(exc), (offset, bit, str(exc))
            refused += 1
            continue
        assert same(loaded, clean), (offset - start, bit, [k for k in clean if not same(loaded.get(k), clean[k])])
    assert refused > 240  # most bits matter


def test_a_changed_field_is_named_and_so_is_one_missing_or_added(tiny_file, tmp_path):
    src, _, _ = tiny_file
    state = torch.load(src, weights_only=True)
    path = str(tmp_path / "last.pt")
    first = next(iter(state["optimizer"]["params"]))
    cases = [
        (("scheduler", "base_lrs"), [6.1e-6], "is corrupt: field scheduler.base_lrs does not match the checksum"),
        (("step",), 2, "is corrupt: field step does not match the checksum"),
        (("step",), 1.0, "is corrupt: field step does not match the checksum"),  # another type, an equal value
        (("optimizer", "scaler", "scale"), 2.0**32, "is corrupt: field optimizer.scaler.scale does not match"),
        (("model", "0.weight"), torch.zeros(0, 4, dtype=torch.float16), "is corrupt: tensor model.0.weight does"),
        (("optimizer", "params", first, "master"), torch.zeros(0), f"is corrupt: tensor optimizer.params.{first}.master's "
                                                                   "dtype or shape does not match"),  # sums of 0, as recorded
        (("config", "extra"), 1, "is corrupt: field config.extra has no checksum"),
        (("epoch",), None, "is incomplete: field epoch, which was saved with it, is missing"),
    ]
    state["optimizer"]["params"][first]["master"] = torch.zeros(4, 4)  # all zero: its sums are 0, whatever its shape
    state[integrity.KEY] = integrity.checksums({k: v for k, v in state.items() if k != integrity.KEY})
    for where, value, expected in cases:
        torch.save(_with(state, where, value), path)  # by hand, the checksums kept
        with pytest.raises(CheckpointError) as caught:
            file.load(path)
        error = str(caught.value)
        assert error.startswith(f"checkpoint {path} {expected}") and "\n" not in error, (where, error)


def _with(state, path: tuple, value):
    """A copy of ``state`` with ``path`` set to ``value`` (None: removed), the rest shared."""
    head, *rest = path
    out = dict(state) if isinstance(state, dict) else list(state)
    if rest:
        out[head] = _with(state[head], tuple(rest), value)
    elif value is None and isinstance(out, dict):
        del out[head]
    else:
        out[head] = value
    return out


def test_the_record_shares_no_object_with_the_state(tiny_file):
    """Pickle writes an object once and refers to it after: a record keyed by the
    state's own key strings had one flipped bit rename a field and its entry alike
    ('format' -> 'fopmat' loaded, and verified)."""
    src, _, _ = tiny_file
    state = file.load(src)
    record = state.pop(integrity.KEY)
    ids = set()

    def objects(obj):
        ids.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                objects(k)
                objects(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                objects(v)

    objects(state)
    fresh = integrity.checksums(state)
    shared = [k for k in (*fresh["tensors"], *fresh["fields"]) if id(k) in ids and not isinstance(k, int)]
    assert shared == [] and set(fresh["fields"]) == set(record["fields"])


def test_a_record_renamed_or_emptied_is_not_taken_for_a_checkpoint_without_checksums(tiny_file, tmp_path):
    src, _, _ = tiny_file
    state = torch.load(src, weights_only=True)
    path = str(tmp_path / "last.pt")
    for edited, expected in [
        ({**{k: v for k, v in state.items() if k != "checksums"}, "checksumr": state["checksums"]},
         "its checksums are under 'checksumr', not 'checksums'"),
        ({**state, "checksums": None}, "its 'checksums' entry is not a record of checksums"),
        ({**state, "checksums": {**state["checksums"], "algorithm": "mpfp16.word-sumr/2"}},
         "its checksums name the algorithm 'mpfp16.word-sumr/2', which no version wrote"),
        ({**state, "checksums": {k: v for k, v in state["checksums"].items() if k != "fields"}},
         "its 'checksums' entry (mpfp16.word-sums/2) has no record of its fields"),
    ]:
        torch.save(edited, path)
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {path} is corrupt: {expected}")):
            file.load(path)


def test_a_checkpoint_of_tensor_checksums_alone_loads_and_its_values_are_checked_by_their_rules(tiny_file, tmp_path):
    """Algorithm /1, as versions before fields wrote it: its tensors are verified, and
    values outside them are checked by the training checkpoint's and the scaler's rules."""
    src, model, opt = tiny_file
    state = {k: v for k, v in torch.load(src, weights_only=True).items() if k != integrity.KEY}
    path = str(tmp_path / "old.pt")
    torch.save(as_tensors_only(state), path)
    assert CW.schema_error(path, model, opt) is None
    spans = CW.tensor_data_spans(open(path, "rb").read())
    _, start, _ = next(s for s in spans if s[2] >= 8)
    CW._flip(path, start, 0)
    with pytest.raises(CheckpointError, match=f"checkpoint {re.escape(path)} is corrupt: tensor "):
        file.load(path)
    damaged = [
        (_with(state, ("step",), 2), "its 'step' is 2 and its scheduler's last_epoch 1"),
        (_with(state, ("scheduler", "base_lrs"), [-0.4]), "its scheduler's base_lrs[0] is -0.4"),
        (_with(state, ("scheduler", "base_lrs"), [float("nan")]), "its scheduler's base_lrs[0] is nan"),
        (_with(state, ("optimizer", "iteration"), 2), "its 'step' is 1 and its optimizer's iteration 2"),
        (_with(state, ("optimizer", "skipped_steps"), 3), "its optimizer's skipped_steps is 3, more than the 1"),
        (_with(state, ("optimizer", "scaler", "scale"), 2.0**32), "the loss scaler's scale is 4294967296.0"),
        (_with(state, ("optimizer", "scaler", "growth_tracker"), True), "the loss scaler's growth_tracker is True"),
    ]
    for edited, expected in damaged:
        torch.save(as_tensors_only(edited), path)
        loaded = file.load(path)  # nothing to verify but the tensors
        with pytest.raises(CheckpointError) as caught:
            check_training_state(loaded, path)
            check_scaler_state(loaded, path, opt.scaler)
        error = str(caught.value)
        assert error.startswith(f"checkpoint {path} is damaged: {expected}") and "\n" not in error, error


def test_a_resume_with_the_same_settings_checks_the_rates_and_the_position_against_them():
    """What a run of the settings the checkpoint was saved with can hold (check_continuation)."""
    schedule = [lambda s: 0.5 ** s]
    good = {"scheduler": {"base_lrs": [0.4], "last_epoch": 3}, "step": 3, "epoch": 1, "samples_done": 96,
            "optimizer": {"optimizer": {"param_groups": [{"lr": 0.4 * 0.5 ** 3}]}}}
    settings = dict(base_lrs=[0.4], multipliers=schedule, training_images=200, epochs=2, batch_size=16)
    check_continuation(good, "run/last.pt", **settings)
    for where, value, expected in [
        (("scheduler", "base_lrs"), [6.1e-6], "its scheduler's base_lrs are [6.1e-06], and the settings it was saved "
                                              "with give [0.4]"),
        (("optimizer", "optimizer", "param_groups"), [{"lr": 0.4}], "its optimizer's param group 0 has lr 0.4, and "
                                                                    "the schedule gives 0.05 at step 3"),
        (("samples_done",), 208, "its position in the epoch is sample 208, beyond the 200 training images"),
        (("epoch",), 3, "its 'epoch' is 3, beyond --epochs 2"),
    ]:
        with pytest.raises(CheckpointError) as caught:
            check_continuation(_with(good, where, value), "run/last.pt", **settings)
        assert str(caught.value) == f"checkpoint run/last.pt is damaged: {expected}"


# ------------------------------------------------------------------ issue 37, 2: a DCP folder, on 1 rank


def tiny_sharded_run(seed: int = 0):
    import mpfp16.distributed as mdist

    torch.manual_seed(seed)
    model = mdist.shard(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)))
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 8)).float().sum())
    opt.step()
    return model, opt


def _load_error(load) -> str | None:
    try:
        load()
    except CheckpointError as exc:
        return str(exc)
    return None


def test_a_changed_byte_in_a_shard_file_is_one_line_naming_the_folder_the_tensor_and_the_file(one_process_group,
                                                                                              tmp_path):
    """Each chunk of a .distcp file is a torch.save of one tensor's piece. A changed byte
    in its data fails the tensor's checksum; one in its framing (zip headers, pickle)
    made DCP fail in torch's words alone ("'utf-8' codec can't decode byte 0x92",
    "failed finding central directory"), naming neither the file nor the tensor.
    A field of meta.pt is named too."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401  (.metadata's records)

    model, opt = tiny_sharded_run()
    path = str(tmp_path / "last.dcp")
    checkpoint.DCP.save(path, training_state(model, opt, 1))
    clean = dcp.load_whole(path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = dcp._MetadataUnpickler(f).load()
    owner = {}  # byte of __0_0.distcp -> the tensor whose chunk holds it
    for index, info in metadata.storage_data.items():
        assert info.relative_path == "__0_0.distcp"
        owner.update({i: index.fqn.strip("/").replace("/", ".") for i in range(info.offset, info.offset + info.length)})
    data = {i for _, _, start, length in CW._dcp_spans(path) for i in range(start, start + length)}
    shard = os.path.join(path, "__0_0.distcp")
    blob = open(shard, "rb").read()
    rng = random.Random(37)
    framing = [i for i in sorted(owner) if i not in data]
    reader = tiny_sharded_run(1)
    named = 0
    for offset in rng.sample(framing, 40) + rng.sample(sorted(data), 4):
        with open(shard, "wb") as f:
            f.write(blob[:offset] + bytes([blob[offset] ^ 0xFF]) + blob[offset + 1:])
        whole = _load_error(lambda: same(dcp.load_whole(path), clean) or pytest.fail(f"byte {offset}: other values"))
        into_shards = _load_error(lambda: checkpoint.read(path, reader[0]))
        assert whole == into_shards, offset
        if whole is None:
            continue  # a byte that no reader looks at (a zip header's time stamp, say)
        named += 1
        assert whole.startswith(f"checkpoint {path} is corrupt: tensor {owner[offset]} (its data is in "
                                "__0_0.distcp) ") and "\n" not in whole, (offset, offset in data, whole)
    assert named >= 8  # the 4 in the data, and the framing bytes that a reader reads
    with open(shard, "wb") as f:
        f.write(blob)
    meta = torch.load(os.path.join(path, dcp.META), weights_only=True)
    meta["state"]["step"] = 2  # by hand, the checksums kept
    torch.save(meta, os.path.join(path, dcp.META))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {path} is corrupt: field step (in meta.pt) does "
                                                        "not match the checksum saved with it")):
        dcp.load_whole(path)
    meta["state"]["step"] = 1
    marker = meta["state"]["model"]["0.weight"]
    marker["shapf"] = marker.pop("shape")  # a bit flipped in a key of the sharded tensor's record: a bare KeyError
    torch.save(meta, os.path.join(path, dcp.META))
    for load in (lambda: dcp.load_whole(path), lambda: checkpoint.read(path, reader[0])):
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {path} is corrupt: meta.pt's record of the "
                                                            "sharded tensor model.0.weight (its shape and dtype) is "
                                                            "damaged")):
            load()


# ------------------------------------------------------------------ the sharded format, on 2 ranks


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp")
    with tmpfs(folder / "tmpfs", "1200k") as small:
        results = run_workers(CW.integrity_cases, folder / "out", 2, args=(str(folder), small), timeout=300)
    return folder, results


@pytest.mark.slow  # its fixture launches a worker group
def test_a_sharded_checkpoint_verifies(sharded):
    _, results = sharded
    assert [r["clean"] for r in results] == [None, None]


@pytest.mark.slow  # its fixture launches a worker group
def test_one_flipped_bit_in_a_shard_file_or_meta_pt_is_named_on_every_rank(sharded):
    folder, (r0, r1) = sharded
    assert r0["flips"] == r1["flips"]  # the same line on every rank
    assert {f["file"] for f in r0["flips"]} >= {"__0_0.distcp", "__1_0.distcp", "meta.pt"}
    for flip in r0["flips"]:
        for how in ("sharded", "whole"):  # into this run's shards, and whole on each rank
            error = flip[how]
            assert error is not None and "\n" not in error, flip
            assert error.startswith(f"checkpoint {folder / 'last.dcp'} is corrupt: tensor "), flip
            name = named_tensor(error)
            if flip["file"] == "meta.pt":
                assert "(its data is in meta.pt)" in error, flip
            else:
                assert name == flip["fqn"].strip("/").replace("/", "."), flip
                assert f"(its data is in {flip['file']}" in error or flip["file"] in error, flip


@pytest.mark.slow  # its fixture launches a worker group
def test_a_sharded_checkpoint_written_before_checksums_loads(sharded):
    _, results = sharded
    for r in results:
        assert r["old has none"] and r["old"] is None


@pytest.mark.slow  # its fixture launches a worker group
def test_a_truncated_metadata_is_called_truncated_not_a_pickled_object(sharded):
    _, results = sharded
    for r in results:
        for how in ("sharded", "whole"):
            error = r["truncated"][how]
            assert "truncated" in error and "pickled Python object" not in error and "\n" not in error, error


@pytest.mark.slow  # its fixture launches a worker group
def test_a_missing_shard_file_is_named(sharded):
    _, results = sharded
    for r in results:
        for how in ("sharded", "whole"):
            error = r["missing-shard"][how]
            assert "__1_0.distcp" in error and "missing" in error and "\n" not in error, error


@pytest.mark.slow  # its fixture launches a worker group
def test_a_hand_edited_meta_pt_is_one_line_naming_it_and_the_field(sharded):
    _, (r0, r1) = sharded
    assert r0["edits"] == r1["edits"]
    assert len(r0["edits"]) == len(CW.DCP_EDITS)
    for (field, _), error in r0["edits"].items():  # the checksums kept: they name the field, in meta.pt
        assert error is not None and "\n" not in error, field
        assert re.search(rf"last\.dcp is (corrupt|incomplete): (field|tensor) {field}\b.* \((in|of|its data is in) "
                         r"meta\.pt\)", error), error


@pytest.mark.slow  # its fixture launches a worker group
def test_a_sharded_state_loads_into_an_unsharded_optimizer_directly(sharded):
    _, results = sharded
    for r in results:
        assert r["sharded into local"] is None and r["sharded into local, masters"]  # the one state form
        assert r["sharded into local, read"] is None  # and through mpfp16.checkpoint


@pytest.mark.slow  # its fixture launches a worker group
def test_a_copy_of_a_complete_checkpoint_survives_a_start_and_saves(sharded):
    _, (r0, r1) = sharded
    assert r0["swept"] == [".sharded-step2-dead.tmp"]  # what a crash leaves, and nothing else
    # the run's own step-1 and step-2 folders went when its links moved off them; the copy stays and loads
    assert r0["run listing"] == sorted(["best.dcp", "last.dcp", "sharded-backup", r0["best"], r0["last"]])
    assert r0["first"] not in r0["run listing"] and r0["best"] != r0["last"]
    assert r0["backup"] is None and r1["backup"] is None


@pytest.mark.slow  # its fixture launches a worker group
def test_a_full_disk_during_a_sharded_save_is_one_line_on_every_rank(sharded):
    _, results = sharded
    errors = {r["full"] for r in results}
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error is not None and NO_SPACE.search(error) and "last.dcp" in error and "\n" not in error, error
    for r in results:
        assert r["full kept"] and r["full step"] == 1
        assert len(r["full listing"]) == 2 and "last.dcp" in r["full listing"]  # nothing left of the attempt


# ------------------------------------------------------------------ 2. a full disk, one process


def test_a_full_disk_during_a_file_save_is_one_line_and_the_previous_file_stays(tmp_path):
    with tmpfs(tmp_path / "small", "600k") as small:
        path = os.path.join(small, "last.pt")
        checkpoint.FILE.save(path, {"step": 1, "w": torch.randn(100_000)})
        with pytest.raises(CheckpointError) as caught:
            checkpoint.FILE.save(path, {"step": 2, "w": torch.randn(100_000)})
        error = str(caught.value)
        assert error.startswith(f"cannot write checkpoint {path}: ") and NO_SPACE.search(error), error
        assert "unexpected pos" not in error and "\n" not in error
        assert file.load(path)["step"] == 1 and os.listdir(small) == ["last.pt"]
        with pytest.raises(CheckpointError, match=f"cannot write checkpoint {small}/best.pt: No space left"):
            checkpoint.FILE.keep_as_best(path, os.path.join(small, "best.pt"))
        assert os.listdir(small) == ["last.pt"]


def test_a_write_that_fails_for_another_reason_is_not_called_a_full_disk(tmp_path):
    from mpfp16.serialization import write_failure

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert write_failure(short, str(tmp_path / "x.pt")) is None  # plenty of space here: not a full disk
    assert write_failure(OSError(28, "No space left on device"), str(tmp_path / "x.pt")) == "No space left on device"
    assert write_failure(PermissionError(13, "Permission denied"), str(tmp_path)) == "Permission denied"


def test_a_full_disk_under_the_metrics_file_is_one_line(tmp_path):
    with tmpfs(tmp_path / "small", "64k") as small:
        path = os.path.join(small, "metrics.jsonl")
        writer = MetricsWriter(path, True)
        fill(small)
        with pytest.raises(UserError) as caught:
            writer.write({"type": "train", "step": 1, "loss": 2.3, "note": "x" * 8000})
        assert str(caught.value) == f"cannot write metrics file {path}: No space left on device"
        writer.write({"type": "train", "step": 2})  # nothing more is written, nothing raised twice
        os.unlink(os.path.join(small, "filler"))


# ------------------------------------------------------------------ 2. a full disk, the script on 2 processes

TINY = ["-a", "resnet9-w4", "-b", "16", "--synthetic-size", "200,40", "--max-steps", "2", "--precision", "fp32",
        "--no-progress", "-p", "1"]


def _script(rank, argv):
    return run_cli(argv)


def _one_line_everywhere(results, status: int) -> list[str]:
    lines = []
    for rank, r in enumerate(results):
        assert r["status"] == status, (rank, r["stderr"][-2000:])
        assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
        errors = [line for line in r["stderr"].splitlines() if line.startswith("error:")]
        assert len(errors) == 1, (rank, r["stderr"][-2000:])
        lines.append(errors[0])
    return lines


@pytest.mark.slow
def test_the_script_on_a_full_disk_stops_every_rank_with_one_line(tmp_path):
    """A tmpfs that holds one checkpoint, not two: the save at step 1 fits, the one at
    step 2 does not; then a full disk under --metrics."""
    with tmpfs(tmp_path / "small", "400k") as small:
        argv = [*TINY, "--save-every", "1", "--checkpoint-dir", small]
        results = run_workers(_script, tmp_path / "out", 2, args=(argv,), timeout=240)
        path = os.path.join(small, "last.pt")
        for line in _one_line_everywhere(results, 2):
            assert line.startswith(f"error: cannot write checkpoint {path}: ") and NO_SPACE.search(line), line
        assert file.load(path)["step"] == 1  # the previous checkpoint, intact
        assert not [n for n in os.listdir(small) if n.endswith(".tmp")]
    with tmpfs(tmp_path / "full", "64k") as full:
        metrics = os.path.join(full, "metrics.jsonl")
        fill(full)
        argv = [*TINY, "--checkpoint-dir", str(tmp_path / "run"), "--metrics", metrics]
        results = run_workers(_script, tmp_path / "out2", 2, args=(argv,), timeout=240)
        for line in _one_line_everywhere(results, 2):
            assert line == f"error: cannot write metrics file {metrics}: No space left on device", line


# ------------------------------------------------------------------ 5 and 9 through the script


@pytest.mark.slow
def test_the_script_keeps_a_copy_of_a_checkpoint_and_refuses_a_hand_edited_one(tmp_path, capsys):
    """A user's copy of a complete checkpoint folder, beside the run's, survives the next
    start and its saves; the start's line counts only the unfinished write it removed.
    Then a meta.pt edited by hand (step="eight") is one line naming it and the field: the
    checksums', and with a digest written to match, the schema's."""
    import shutil

    import train_cifar
    from run_helpers import run_main

    run = tmp_path / "run"
    argv = ["-a", "resnet9-w4", "-b", "16", "--synthetic-size", "200,40", "--precision", "bf16", "--no-progress",
            "-p", "1", "--shard", "--checkpoint-dir", str(run)]
    status, err = run_main(train_cifar.main, [*argv, "--max-steps", "1"], capsys)
    assert status == 0, err
    first = os.readlink(run / "last.dcp")
    shutil.copytree(run / first, run / "sharded-backup")
    (run / ".sharded-step2-0123abcd.tmp").mkdir()  # what a killed save leaves
    result = run_main(train_cifar.main, [*argv, "--max-steps", "2", "--resume", "auto"], capsys)
    assert result[0] == 0, result[1]
    assert f"removed 1 unfinished checkpoint writes from {run}" in result.out
    names = sorted(os.listdir(run))
    assert "sharded-backup" in names and ".sharded-step2-0123abcd.tmp" not in names
    assert first not in names  # the run's own step-1 folder went once its links moved off it
    assert dcp.load_whole(str(run / "sharded-backup"))["step"] == 1  # the copy is whole, and verifies
    meta_path = run / "last.dcp" / dcp.META
    meta = torch.load(meta_path, weights_only=True)
    meta["state"]["step"] = "eight"
    torch.save(meta, meta_path)
    status, err = run_main(train_cifar.main, [*argv, "--max-steps", "3", "--resume", "auto"], capsys)
    assert status == 2 and "Traceback" not in err
    assert err.strip() == (f"error: checkpoint {run / 'last.dcp'} is corrupt: field step (in meta.pt) does not match "
                           "the checksum saved with it; restore the checkpoint from a copy, or resume from another one")
    meta["state"][integrity.KEY]["fields"][repr(("step",))] = integrity.field_digest("eight")  # on purpose
    torch.save(meta, meta_path)
    status, err = run_main(train_cifar.main, [*argv, "--max-steps", "3", "--resume", "auto"], capsys)
    assert status == 2 and "Traceback" not in err
    assert err.strip() == (f"error: checkpoint {run / 'last.dcp' / dcp.META} is damaged: its 'step' is 'eight', "
                           "and it must be an integer >= 0"), err


@pytest.mark.slow
def test_the_script_refuses_a_changed_learning_rate_step_or_loss_scale_in_one_line(tmp_path, capsys):
    """Through train_cifar.py (issue 37, item 2): base_lrs 0.4 -> 6.1e-6 had resumed with
    exit 0 and trained at 1/65,000 of the lr, and step 1 -> 2 with the scheduler still
    at 1. With the checksums kept, they name the field; in a checkpoint of tensor
    checksums alone (an earlier version's), the values' own rules refuse them, and a
    loss scale of 2**32 over max_scale 2**24."""
    import train_cifar
    from run_helpers import run_main

    run = tmp_path / "run"
    argv = ["-a", "resnet9-w4", "-b", "16", "--synthetic-size", "200,40", "--precision", "fp16", "--no-progress",
            "-p", "1", "--checkpoint-dir", str(run)]
    status, err = run_main(train_cifar.main, [*argv, "--max-steps", "1"], capsys)
    assert status == 0, err
    path = run / "last.pt"
    saved = torch.load(path, weights_only=True)
    plain = {k: v for k, v in saved.items() if k != integrity.KEY}
    lrs = saved["scheduler"]["base_lrs"]
    cases = [
        (_with(saved, ("scheduler", "base_lrs"), [6.1e-6] * len(lrs)),
         "is corrupt: field scheduler.base_lrs does not match the checksum saved with it; restore the checkpoint "
         "from a copy, or resume from another one"),
        (as_tensors_only(_with(plain, ("scheduler", "base_lrs"), [6.1e-6] * len(lrs))),
         f"is damaged: its scheduler's base_lrs are {[6.1e-6] * len(lrs)}, and the settings it was saved with give "
         f"{lrs}"),
        (as_tensors_only(_with(plain, ("step",), 2)),
         "is damaged: its 'step' is 2 and its scheduler's last_epoch 1, and they must be equal (the scheduler steps "
         "once per optimizer step)"),
        (as_tensors_only(_with(plain, ("optimizer", "scaler", "scale"), 2.0**32)),
         "is damaged: the loss scaler's scale is 4294967296.0, and it must be a normal fp32 number from 1.0 "
         "(min_scale) to 16777216.0 (max_scale)"),
    ]
    for state, expected in cases:
        torch.save(state, path)
        status, err = run_main(train_cifar.main, [*argv, "--max-steps", "2", "--resume", "auto"], capsys)
        assert status == 2 and err.strip() == f"error: checkpoint {path} {expected}", err
