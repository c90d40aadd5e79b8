"""--shard in the training scripts: exact resume, any world size, and what survives what."""

import os

import pytest
import torch

import checkpoint_workers as CW
import train_cifar
from dist_helpers import scripts, torchrun as launch
from mpfp16.checkpoint import dcp
from mpfp16.state_format import upgrade_state_dict
from run_helpers import assert_same_sharded_state, kill_a_worker_once_saved, records, run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["-a", "resnet9-w4", "-b", "16", "--no-progress", "-p", "1", "--synthetic-size", "200,40", "--shard"]


def torchrun(args, nproc=2, max_restarts=0, popen=False):
    return launch(["train_cifar.py", *args], nproc, max_restarts=max_restarts, popen=popen)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["--accum-steps", "2", "-b", "8", "--max-grad-norm", "5"],
    ["--optimizer", "adamw", "--lr", "0.01", "--precision", "bf16"],
], ids=["fp16-accum-clip", "bf16-adamw"])
def test_one_process_resume_mid_epoch_is_bit_identical(tmp_path, capsys, extra):
    common = [*TINY, "--epochs", "3", *extra]  # 12 steps an epoch: the resume lands mid-epoch
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    assert run_main(train_cifar.main, common + ["--max-steps", "16", "--checkpoint-dir", str(straight)], capsys)[0] == 0
    assert run_main(train_cifar.main, common + ["--max-steps", "8", "--checkpoint-dir", str(parts)], capsys)[0] == 0
    assert run_main(train_cifar.main, common + ["--max-steps", "16", "--checkpoint-dir", str(parts),
                                                "--resume", "auto"], capsys)[0] == 0
    assert_same_sharded_state(straight / "last.dcp", parts / "last.dcp", tmp_path)
    losses = lambda d: {r["step"]: r["loss"] for r in records(d / "metrics.jsonl") if r["type"] == "train"}
    assert all(losses(straight)[s] == losses(parts)[s] for s in range(9, 17))
    # one data folder per link, nothing left over from the earlier saves
    names = sorted(n for n in os.listdir(parts) if n.startswith("sharded-"))
    assert len(names) == len({os.path.realpath(parts / n) for n in ("last.dcp", "best.dcp")})


@pytest.mark.slow
def test_two_processes_record_reduce_scatter_and_resume_on_one(tmp_path, capsys):
    run = tmp_path / "run"
    [[r0, r1]] = scripts("train_cifar", [[*TINY, "--max-steps", "4", "--accum-steps", "2", "-b", "8", "--checkpoint-dir",
                                    str(run)]], tmp_path / "out")
    assert r0["status"] == r1["status"] == 0, r0["stderr"][-3000:]
    train = [r for r in records(run / "metrics.jsonl") if r["type"] == "train"]
    assert all(r["allreduce_calls"] == 0 and r["reduce_scatter_calls"] > 0 and r["all_gather_bytes"] > 0
               for r in train)
    assert len({r["reduce_scatter_bytes"] for r in train}) == 1  # per step, and one reduce-scatter per step
    # the same checkpoint on one process: refused as a changed setting, accepted when allowed
    one = [*TINY, "--max-steps", "6", "--accum-steps", "2", "-b", "8", "--checkpoint-dir", str(run), "--resume",
           "auto"]
    status, err = run_main(train_cifar.main, one, capsys)
    assert status == 2 and "processes 2 -> 1" in err and "Traceback" not in err
    result = run_main(train_cifar.main, one + ["--allow-changed-config"], capsys)
    assert result[0] == 0, result[1][-3000:]
    assert "resumed from" in result.out
    assert [r["step"] for r in records(run / "metrics.jsonl") if r["type"] == "train"][-2:] == [5, 6]


@pytest.mark.slow
def test_elastic_restart_after_sigkill_is_bit_identical(tmp_path):
    args = [*TINY, "--epochs", "3", "--max-steps", "20", "--save-every", "3", "--resume", "auto"]
    # the uninterrupted run: the same two processes, started as torchrun starts them
    [[r0, r1]] = scripts("train_cifar", [args + ["--checkpoint-dir", str(tmp_path / "straight")]], tmp_path / "out")
    assert r0["status"] == r1["status"] == 0, r0["stderr"][-2000:]
    killed = tmp_path / "killed"
    proc = torchrun(args + ["--checkpoint-dir", str(killed)], max_restarts=1, popen=True)
    kill_a_worker_once_saved(proc, killed / "last.dcp")
    assert_same_sharded_state(tmp_path / "straight" / "last.dcp", killed / "last.dcp", tmp_path)


def saved_snapshot(state: dict, names: list[str] | None = None) -> dict:
    """A training checkpoint (whole tensors, either layout, any format version) as
    checkpoint_workers.snapshot sees a live run, plus its position. ``names``: the
    parameters' names, for a version that did not record them."""
    opt = upgrade_state_dict(state["optimizer"], state["model"])
    keys, model = list(opt["params"]), state["model"]
    names = names if keys == [str(i) for i in range(len(keys))] else keys  # an early version recorded no names
    name_of = dict(zip(keys, names))
    masters = {name_of[k]: (e["master"] if e["master"] is not None else model[name_of[k]])
               for k, e in opt["params"].items()}
    return {"masters": masters, "buffers": {k: v for k, v in model.items() if k not in masters},
            "state": {f"{name_of[key]}.{k}": v for key, s in opt["optimizer"]["state"].items() for k, v in s.items()},
            "scaler": opt["scaler"], "skipped": opt["skipped_steps"], "iteration": opt["iteration"],
            "position": position_of(state["step"], state["epoch"], state["batches_done"],
                                    state["scheduler"]["last_epoch"], state["best_acc1"]),
            "rng": state["rng"][0]["torch"]}


def position_of(*values) -> tuple:
    return tuple(float(v) if isinstance(v, float) else int(v) for v in values)


def snapshot_at_fit(monkeypatch) -> list:
    """Each resumed run's state as fit() starts (resumed, nothing trained since)."""
    from mpfp16.train import engine

    taken, real_fit = [], engine.Trainer.fit

    def fit(self):
        taken.append({**CW.snapshot(self.model, self.opt), "rng": torch.get_rng_state(),
                      "position": position_of(self.step, self.epoch, self.batches_done, self.sched.last_epoch,
                                              self.best_acc1)})
        return real_fit(self)

    monkeypatch.setattr(engine.Trainer, "fit", fit)
    return taken


def assert_resumed_exactly(live: dict, saved: dict) -> None:
    assert CW.differences(live, saved) == []
    assert live["position"] == saved["position"] and torch.equal(live["rng"], saved["rng"])


@pytest.mark.slow
def test_either_kind_resumes_as_the_other(tmp_path, capsys, monkeypatch):
    """A plain run stopped at step 4 continues with --shard, and that one without it:
    masters, optimizer state, scaler, counters, position and RNG as saved, bit for bit;
    --resume auto takes the newer of last.pt and last.dcp, and each save removes the
    checkpoint of the other kind it supersedes."""
    unsharded = [a for a in TINY if a != "--shard"]
    run, common = tmp_path / "run", ["--epochs", "3", "--checkpoint-dir", str(tmp_path / "run")]  # 12 steps an epoch
    assert run_main(train_cifar.main, unsharded + common + ["--max-steps", "4"], capsys)[0] == 0
    saved = saved_snapshot(torch.load(run / "last.pt", weights_only=True))
    step4 = (run / "last.pt").read_bytes()
    taken = snapshot_at_fit(monkeypatch)
    status, err = run_main(train_cifar.main, TINY + common + ["--max-steps", "8", "--resume", "auto"], capsys)
    assert status == 0 and err == "", err  # --shard is free on resume: no warning
    assert_resumed_exactly(taken[-1], saved)
    assert not (run / "last.pt").exists() and (run / "last.dcp").exists()

    saved = saved_snapshot(dcp.load_whole(str(run / "last.dcp")))
    (run / "last.pt").write_bytes(step4)  # an older last of the other kind beside it: auto takes the newer
    status, err = run_main(train_cifar.main, unsharded + common + ["--max-steps", "12", "--resume", "auto"], capsys)
    assert status == 0 and err == "", err
    assert_resumed_exactly(taken[-1], saved)
    assert (run / "last.pt").exists() and not (run / "last.dcp").exists()
    assert [r["step"] for r in records(run / "metrics.jsonl") if r["type"] == "train"] == list(range(1, 13))
    names = set(os.listdir(run))
    assert not any(n.startswith(".") and n.endswith(".tmp") for n in names)
    assert all(os.path.exists(run / n) for n in names)  # no link left dangling
    assert not [n for n in names if n.startswith("sharded-")] or os.path.islink(run / "best.dcp")


@pytest.mark.slow
def test_a_checkpoint_written_before_the_stores_resumes_either_way(tmp_path, capsys, monkeypatch):
    """"mpfp16.checkpoint/1" with an "mpfp16.FP16Optimizer/1" optimizer state, as
    earlier versions wrote it: resumed as it is, and with --shard."""
    unsharded = [a for a in TINY if a != "--shard"]
    first = tmp_path / "first"
    assert run_main(train_cifar.main, unsharded + ["--epochs", "3", "--max-steps", "3", "--checkpoint-dir",
                                                   str(first)], capsys)[0] == 0
    state = torch.load(first / "last.pt", weights_only=True)
    names = list(state["optimizer"]["params"])
    state["optimizer"] = CW.as_old_flat(state["optimizer"])
    del state["checksums"]  # those versions wrote none (and these no longer fit the edited state)
    assert "param_names" not in state["optimizer"] and "store" not in state["optimizer"]
    saved = saved_snapshot(state, names)
    taken = snapshot_at_fit(monkeypatch)
    for flags in (unsharded, TINY):
        run = tmp_path / f"old{len(flags)}"
        run.mkdir()
        torch.save(state, run / "last.pt")
        status, err = run_main(train_cifar.main, flags + ["--epochs", "3", "--max-steps", "4", "--checkpoint-dir",
                                                          str(run), "--resume", "auto"], capsys)
        assert status == 0 and err == "", err
        assert_resumed_exactly(taken[-1], saved)


@pytest.mark.slow
def test_what_a_sharded_run_still_refuses(tmp_path, capsys):
    unsharded = [a for a in TINY if a != "--shard"]
    sharded = tmp_path / "sharded"
    assert run_main(train_cifar.main, TINY + ["--max-steps", "1", "--checkpoint-dir", str(sharded)], capsys)[0] == 0
    cases = [
        (TINY + ["--max-steps", "2", "--checkpoint-dir", str(sharded)], "holds an earlier run"),
        (unsharded + ["--max-steps", "2", "--checkpoint-dir", str(sharded)],
         f"holds an earlier run ({sharded / 'last.dcp'}, {sharded / 'best.dcp'}, {sharded / 'metrics.jsonl'})"),
        (TINY + ["--no-master-weights"], "drop --no-master-weights"),
        (TINY + ["--allreduce-strategy", "fp32_accumulate"], "--shard reduce-scatters instead"),
        (TINY + ["--fused", "on"], "drop --fused on"),
        (TINY + ["--channels-last"], "drop --channels-last with --shard"),  # was FSDP2's NotImplementedError
    ]
    for argv, message in cases:
        status, err = run_main(train_cifar.main, argv, capsys)
        assert status != 0 and message in err.strip().splitlines()[-1], (argv, err)
        assert "Traceback" not in err
