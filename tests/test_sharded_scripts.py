"""--shard in the training scripts: exact resume, any world size, and what survives what."""

import os
import subprocess
import sys

import pytest

import train_cifar
from dist_helpers import free_port
from run_helpers import assert_same_sharded_state, kill_a_worker_once_saved, records, run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["-a", "resnet9-w4", "-b", "16", "--no-progress", "-p", "1", "--synthetic-size", "200,40", "--shard"]


def torchrun(args, nproc=2, max_restarts=0, popen=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--max-restarts", str(max_restarts),
           "--monitor-interval", "0.2", "train_cifar.py", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if popen:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


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
def test_two_processes_record_reduce_scatter_and_resume_on_one(tmp_path):
    run = tmp_path / "run"
    proc = torchrun([*TINY, "--max-steps", "4", "--accum-steps", "2", "-b", "8", "--checkpoint-dir", str(run)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in records(run / "metrics.jsonl") if r["type"] == "train"]
    assert all(r["allreduce_calls"] == 0 and r["reduce_scatter_calls"] > 0 and r["all_gather_bytes"] > 0
               for r in train)
    assert len({r["reduce_scatter_bytes"] for r in train}) == 1  # per step, and one reduce-scatter per step
    # the same checkpoint on one process: refused as a changed setting, accepted when allowed
    one = [*TINY, "--max-steps", "6", "--accum-steps", "2", "-b", "8", "--checkpoint-dir", str(run), "--resume",
           "auto"]
    proc = subprocess.run([sys.executable, "train_cifar.py", *one], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "processes 2 -> 1" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "train_cifar.py", *one, "--allow-changed-config"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert [r["step"] for r in records(run / "metrics.jsonl") if r["type"] == "train"][-2:] == [5, 6]


@pytest.mark.slow
def test_elastic_restart_after_sigkill_is_bit_identical(tmp_path):
    args = [*TINY, "--epochs", "3", "--max-steps", "20", "--save-every", "3", "--resume", "auto"]
    straight = torchrun(args + ["--checkpoint-dir", str(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = tmp_path / "killed"
    proc = torchrun(args + ["--checkpoint-dir", str(killed)], max_restarts=1, popen=True)
    kill_a_worker_once_saved(proc, killed / "last.dcp")
    assert_same_sharded_state(tmp_path / "straight" / "last.dcp", killed / "last.dcp", tmp_path)


def test_checkpoint_kinds_are_not_mixed(tmp_path, capsys):
    unsharded = [a for a in TINY if a != "--shard"]
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    assert run_main(train_cifar.main, unsharded + ["--max-steps", "1", "--checkpoint-dir", str(plain)], capsys)[0] == 0
    assert run_main(train_cifar.main, TINY + ["--max-steps", "1", "--checkpoint-dir", str(sharded)], capsys)[0] == 0
    cases = [
        (TINY + ["--max-steps", "2", "--checkpoint-dir", str(plain), "--resume", "auto"],
         "holds an unsharded run (last.pt): continue it without --shard"),
        (unsharded + ["--max-steps", "2", "--checkpoint-dir", str(sharded), "--resume", "auto"],
         "holds a sharded run (last.dcp): continue it with --shard"),
        (TINY + ["--max-steps", "2", "--checkpoint-dir", str(tmp_path / "a"), "--resume", str(plain / "last.pt")],
         "is a file, not a sharded checkpoint folder"),
        (unsharded + ["--max-steps", "2", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
                      str(sharded / "last.dcp")], "is a sharded run's checkpoint: resume it with --shard"),
        (TINY + ["--max-steps", "2", "--checkpoint-dir", str(sharded)], "holds an earlier run"),
        (TINY + ["--no-master-weights"], "drop --no-master-weights"),
        (TINY + ["--allreduce-strategy", "fp32_accumulate"], "--shard reduce-scatters instead"),
    ]
    for argv, message in cases:
        status, err = run_main(train_cifar.main, argv, capsys)
        assert status != 0 and message in err.strip().splitlines()[-1], (argv, err)  # after argparse's usage
        assert "Traceback" not in err
