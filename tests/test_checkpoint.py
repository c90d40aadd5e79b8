"""mpfp16.checkpoint: one interface, two formats, either read as the other, bit for bit;
checkpoints of earlier versions still load; a failed save is one line on every rank."""

import os

import pytest
import torch

import checkpoint_workers as CW
from dist_helpers import run_workers
from mpfp16 import checkpoint
from mpfp16.errors import CheckpointError

CROSS = ["file into sharded", "dcp into local", "dcp into sharded", "old file into local", "old file into sharded",
         "old dcp into sharded", "old dcp into local"]


@pytest.fixture(scope="module", params=[1, 2], ids=["one-rank", "two-ranks"])
def worked(request, tmp_path_factory):
    """Every case of checkpoint_workers.cases, on 1 and on 2 gloo ranks (one worker group each)."""
    folder = tmp_path_factory.mktemp(f"ckpt{request.param}")
    results = run_workers(CW.cases, folder / "out", request.param, args=(str(folder),), timeout=300)
    return folder, results


@pytest.mark.slow  # its fixture launches a worker group
@pytest.mark.parametrize("case", CROSS)
def test_either_format_reads_into_either_layout_bit_for_bit(worked, case):
    """Masters (gathered), inner optimizer state, buffers, scaler and counters are the
    saved ones, whichever layout saved and whichever reads."""
    _, results = worked
    for rank, r in enumerate(results):
        assert r[case] == [], (rank, r[case])
    assert results[0]["local"]["iteration"] == 2 and results[0]["sharded"]["iteration"] == 4


@pytest.mark.slow  # its fixture launches a worker group
def test_a_dcp_folder_reads_whole_without_a_process_group(worked):
    folder, results = worked
    assert not torch.distributed.is_initialized()
    model, opt = CW.local_run(9)
    assert CW.differences(CW.read_into(str(folder / "sharded.dcp"), model, opt), results[0]["sharded"]) == []
    assert checkpoint.saved_step(str(folder / "sharded.dcp")) == 4
    assert checkpoint.saved_step(str(folder / "local.pt")) == 2


@pytest.mark.slow  # its fixture launches a worker group
@pytest.mark.parametrize("kind", ["dcp-rename", "dcp-link", "file-rename"])
def test_any_error_while_rank0_finishes_a_save_is_one_line_on_every_rank_at_once(worked, kind):
    _, results = worked
    errors = {r[kind]["error"] for r in results}
    assert len(errors) == 1 and None not in errors  # the same, on every rank
    error = errors.pop()
    assert error.startswith("cannot write checkpoint ") and f"injected {kind} failure" in error and "\n" not in error
    for r in results:
        assert r[kind]["seconds"] < 20  # not the process group's timeout
        assert r[kind]["same"] and r[kind]["step"] == 1  # the previous checkpoint, intact
    kept = results[0][kind]["listing"]
    assert kept == (["last.pt"] if kind.startswith("file") else ["last.dcp", os.path.basename(
        os.path.realpath(worked[0] / kind / "last.dcp"))])  # nothing left of the failed attempt


def test_what_is_not_a_training_checkpoint_is_one_line(tmp_path):
    model, opt = CW.local_run(0)
    torch.save({"model": {}, "optimizer": {}}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="plain.pt is not an mpfp16 training checkpoint"):
        checkpoint.read(str(tmp_path / "plain.pt"), model)
    (tmp_path / "folder").mkdir()
    with pytest.raises(CheckpointError, match="folder is a folder: pass a checkpoint file"):
        checkpoint.read(str(tmp_path / "folder"), model)


def test_one_sweep_removes_the_unfinished_writes_of_both_formats(tmp_path):
    for name in (".last.pt.abc123.tmp", ".best.pt.x.tmp", ".last.dcp.1234.tmp", ".sharded-step3-ab.tmp"):
        (tmp_path / name).write_text("partial")
    (tmp_path / ".sharded-step4-cd.tmp").mkdir()
    (tmp_path / "sharded-step2-ef").mkdir()  # no link names it: a complete checkpoint all the same (a copy)
    (tmp_path / "sharded-step5-01").mkdir()
    os.symlink("sharded-step5-01", tmp_path / "last.dcp")
    (tmp_path / "last.pt").write_text("kept")
    (tmp_path / "notes.tmp").write_text("not ours")
    removed = checkpoint.remove_unfinished(str(tmp_path))
    assert sorted(removed) == sorted([".last.pt.abc123.tmp", ".best.pt.x.tmp", ".last.dcp.1234.tmp",
                                      ".sharded-step3-ab.tmp", ".sharded-step4-cd.tmp"])
    assert sorted(os.listdir(tmp_path)) == ["last.dcp", "last.pt", "notes.tmp", "sharded-step2-ef", "sharded-step5-01"]


# ------------------------------------------------------------------ issue 37, 2: checkpoints of earlier versions


def _old_training_state(model, opt, step: int) -> dict:
    """A training checkpoint as versions before the stores wrote one: its optimizer state
    "mpfp16.FP16Optimizer/1", its scheduler stepped once per optimizer step."""
    state = CW.training_state(model, opt, step)
    state["scheduler"] = {**state["scheduler"], "last_epoch": step, "_step_count": step + 1}
    return {**state, "optimizer": CW.as_old_flat(state["optimizer"])}


@pytest.mark.parametrize("checksums", ["none", "tensors only"])
def test_a_checkpoint_of_an_earlier_version_loads_and_its_damage_is_refused_by_the_rules(tmp_path, checksums):
    """Written before checksums existed, or with the tensors' alone (algorithm /1): it
    loads as it did, and a value outside the tensors that breaks its own rule is one line
    naming the file (a step ahead of the scheduler had resumed; a scale of 2**32 over
    max_scale 2**24 had been taken)."""
    from mpfp16.checkpoint import file, integrity
    from mpfp16.train.checkpointing import check_scaler_state, check_training_state

    model, opt = CW.local_run(0)
    CW.train(model, opt, 1)
    state = {"format": checkpoint.FORMAT, **_old_training_state(model, opt, 1)}

    def write(state: dict) -> str:
        path = str(tmp_path / "last.pt")
        if checksums == "none":
            file.save_atomic(state, path, checksum=False)
        else:
            record = integrity.checksums(state)
            torch.save({**state, integrity.KEY: {"algorithm": integrity.TENSORS_ONLY, "tensors": {
                integrity._path(k): v for k, v in record["tensors"].items()}}}, path)
        return path

    def check(saved, path):
        check_training_state(saved, path)
        check_scaler_state(saved, path, other_opt.scaler)

    other, other_opt = CW.local_run(1)
    path = write(state)
    loaded = checkpoint.read(path, other, check=lambda s: check(s, path))
    other.load_state_dict(loaded["model"])
    other_opt.load_state_dict(loaded["optimizer"])
    assert CW.differences(CW.snapshot(other, other_opt), CW.snapshot(model, opt)) == []
    scaler = state["optimizer"]["scaler"]
    for edited, expected in [
        ({**state, "step": 2}, "its 'step' is 2 and its scheduler's last_epoch 1"),
        ({**state, "scheduler": {**state["scheduler"], "base_lrs": [0.0]}}, "its scheduler's base_lrs[0] is 0.0"),
        ({**state, "optimizer": {**state["optimizer"], "scaler": {**scaler, "scale": 2.0**32}}},
         "the loss scaler's scale is 4294967296.0, and it must be a normal fp32 number from 1.0 (min_scale) to "
         "16777216.0 (max_scale)"),
    ]:
        path = write(edited)
        with pytest.raises(CheckpointError) as caught:
            checkpoint.read(path, other, check=lambda s: check(s, path))
        assert str(caught.value).startswith(f"checkpoint {path} is damaged: {expected}"), str(caught.value)
