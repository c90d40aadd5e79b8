"""Checkpoints that are damaged, hand-edited, or written to a full disk: one line naming
the file and what is wrong, on every rank; and the start-of-run sweep removes only what
an unfinished write left (issue 25, items 2, 5, 6, 9 and 11 b-d)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess

import pytest
import torch

import checkpoint_workers as CW
from dist_helpers import run_workers
from fault_workers import run_cli
from mpfp16 import checkpoint
from mpfp16.checkpoint import dcp, file, integrity
from mpfp16.errors import CheckpointError, UserError
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


# ------------------------------------------------------------------ 6. a file


@pytest.fixture(scope="module")
def saved_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("file")
    model, opt = CW.local_run(0)
    CW.train(model, opt, 1)
    path = str(folder / "last.pt")
    checkpoint.FILE.save(path, CW.training_state(model, opt, 1))
    return path, model, opt


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
                checkpoint.read(path, model, opt)
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
    assert "model.0.0.weight" in names and "optimizer.optimizer.state.0.exp_avg" in names
    assert "optimizer.master_params.0" in names


def test_a_checkpoint_written_before_checksums_loads_without_a_word(tmp_path, saved_file, recwarn, caplog):
    _, model, opt = saved_file
    state = CW.training_state(model, opt, 1)
    path = str(tmp_path / "old.pt")
    file.save_atomic({"format": checkpoint.FORMAT, **state}, path, checksum=False)
    assert "checksums" not in torch.load(path, weights_only=True)
    assert checkpoint.read(path, model, opt)["step"] == 1
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


@pytest.mark.parametrize("field,value", CW.EDITS, ids=[f"{f}={v!r}" for f, v in CW.EDITS])
def test_a_hand_edited_file_is_one_line_naming_the_file_and_the_field(tmp_path, saved_file, field, value):
    src, model, opt = saved_file
    state = torch.load(src, weights_only=True)
    path = str(tmp_path / "last.pt")
    torch.save(CW.edited(state, field, value), path)  # by hand: the format marker and the checksums kept
    error = CW.schema_error(path, model, opt)
    assert error is not None and "\n" not in error
    assert error.startswith(f"checkpoint {path} ") and (f"'{field}'" in error or f"tensor {field}." in error), error


def test_the_complete_file_passes_the_schema(saved_file):
    path, model, opt = saved_file
    assert CW.schema_error(path, model, opt) is None


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
    for (field, _), error in r0["edits"].items():
        assert error is not None and "\n" not in error, field
        assert f"'{field}'" in error or f"tensor {field}." in error, error
        assert "last.dcp/meta.pt" in error or "last.dcp is incomplete: tensor rng.0.torch (of meta.pt)" in error, error


@pytest.mark.slow  # its fixture launches a worker group
def test_a_sharded_state_into_an_unsharded_optimizer_points_to_mpfp16_checkpoint(sharded):
    _, results = sharded
    for r in results:
        assert "load it through mpfp16.checkpoint" in r["sharded into local"]
        assert "format entry" not in r["sharded into local"]
        assert r["sharded into local, read"] is None  # which converts it


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
    Then a meta.pt edited by hand (step="eight") is one line naming it and the field."""
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
    assert err.strip() == (f"error: checkpoint {run / 'last.dcp' / dcp.META} is damaged: its 'step' is 'eight', "
                           "and it must be an integer >= 0"), err
