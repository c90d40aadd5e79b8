"""Never lose a run: protected run directories, resume that refuses changed meaning,
early checks of where a run writes, and preemption that saves (README, "What survives
what")."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import train_cifar
from dist_helpers import free_port
from run_helpers import assert_same_final_state, records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["-a", "resnet9-w4", "-b", "16", "--no-progress", "-p", "1"]


def run(argv, capsys):
    """train_cifar's main() in this process: (exit status, stderr, stdout)."""
    try:
        status = train_cifar.main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.err, captured.out


def script(argv, torchrun=False):
    """train_cifar.py as a child process (under torchrun with 2 processes if asked)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(free_port())] if torchrun else [sys.executable]
    return subprocess.Popen([*launcher, "train_cifar.py", *argv], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(metrics, step, proc, timeout=120):
    """Until the metrics file shows a logged ``step`` (or later)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "the run never got there"
        if metrics.exists() and any(r["type"] == "train" and r["step"] >= step for r in records(metrics)):
            return
        time.sleep(0.02)


# ----------------------------------------------------------------- 1. protected run directories


def test_a_fresh_run_never_replaces_an_earlier_one(cifar_root, tmp_path, capsys):
    ck = tmp_path / "ck"
    common = [cifar_root, *TINY, "--checkpoint-dir", str(ck)]
    assert run(common + ["--max-steps", "4"], capsys)[0] == 0
    before = {name: (ck / name).read_bytes() for name in ("last.pt", "best.pt", "metrics.jsonl")}

    status, err, out = run(common + ["--max-steps", "2"], capsys)  # the user forgot --resume auto
    assert status == 2 and err == (f"error: {ck} holds an earlier run ({ck / 'last.pt'}, {ck / 'best.pt'}, "
                                   f"{ck / 'metrics.jsonl'}): continue it with --resume auto, start elsewhere with "
                                   "another --checkpoint-dir, or replace it with --overwrite\n")
    assert "data:" not in out  # refused before any data was loaded
    assert {name: (ck / name).read_bytes() for name in before} == before

    assert run(common + ["--max-steps", "6", "--resume", "auto"], capsys)[0] == 0
    assert torch.load(ck / "last.pt", weights_only=True)["step"] == 6

    assert run(common + ["--max-steps", "2", "--overwrite"], capsys)[0] == 0
    assert torch.load(ck / "last.pt", weights_only=True)["step"] == 2
    kinds = [r["type"] for r in records(ck / "metrics.jsonl")]
    assert kinds.count("config") == 1 and kinds.count("final") == 1  # the old records are gone

    status, err, _ = run(common + ["--overwrite", "--resume", "auto"], capsys)
    assert status == 2 and "--overwrite starts a new run" in err


def test_resuming_another_runs_checkpoint_into_a_folder_with_a_run_is_refused(cifar_root, tmp_path, capsys):
    for name in ("a", "b"):
        assert run([cifar_root, *TINY, "--max-steps", "2", "--checkpoint-dir", str(tmp_path / name)], capsys)[0] == 0
    status, err, _ = run([cifar_root, *TINY, "--max-steps", "3", "--checkpoint-dir", str(tmp_path / "b"),
                          "--resume", str(tmp_path / "a" / "last.pt")], capsys)
    assert status == 2 and err.startswith(f"error: {tmp_path / 'b'} holds an earlier run ({tmp_path / 'b' / 'last.pt'}")
    status, _, _ = run([cifar_root, *TINY, "--max-steps", "3", "--checkpoint-dir", str(tmp_path / "c"),
                        "--resume", str(tmp_path / "a" / "last.pt")], capsys)
    assert status == 0  # into a new folder: fine


@pytest.mark.slow
def test_a_second_live_run_is_locked_out_and_a_dead_ones_lock_is_not(cifar_root, tmp_path, capsys):
    ck = tmp_path / "ck"
    first = script([cifar_root, *TINY, "--epochs", "30", "--checkpoint-dir", str(ck)])
    try:
        wait_for_step(ck / "metrics.jsonl", 1, first)
        os.kill(first.pid, signal.SIGSTOP)  # alive, holding the lock
        status, err, _ = run([cifar_root, *TINY, "--max-steps", "2", "--checkpoint-dir", str(ck), "--resume", "auto"],
                             capsys)
        assert status == 2
        assert err.startswith(f"error: another run is writing {ck} (pid {first.pid} on ")
        assert err.endswith(": wait for it to end, or use another --checkpoint-dir\n")
    finally:
        first.kill()  # SIGKILL: no chance to release anything
        first.communicate()
    status, err, _ = run([cifar_root, *TINY, "--max-steps", "2", "--checkpoint-dir", str(ck), "--resume", "auto"],
                         capsys)
    assert status == 0, err


# ----------------------------------------------------------------- 2. resume refuses changed meaning


@pytest.mark.parametrize("changed,listed", [
    (["-b", "8"], "batch_size 16 -> 8"),
    (["--epochs", "30"], "epochs 24 -> 30"),
    (["--lr", "0.1", "--accum-steps", "2"], "accum_steps 1 -> 2, lr 0.4 -> 0.1"),
    (["--seed", "3", "--wd", "0"], "weight_decay 0.0005 -> 0.0, seed 0 -> 3"),
], ids=["batch", "epochs", "lr-accum", "seed-wd"])
def test_resume_refuses_changed_settings_and_names_each(cifar_root, tmp_path, capsys, changed, listed):
    common = [cifar_root, *TINY, "--checkpoint-dir", str(tmp_path)]
    assert run(common + ["--max-steps", "3"], capsys)[0] == 0
    status, err, _ = run(common + ["--max-steps", "6", "--resume", "auto", *changed], capsys)
    assert status == 2 and err == (f"error: checkpoint {tmp_path / 'last.pt'} was saved with other settings "
                                   f"({listed}): resume with the same ones, or pass --allow-changed-config to "
                                   "continue anyway, no longer bit-identically\n")
    status, err, _ = run(common + ["--max-steps", "6", "--resume", "auto", "--allow-changed-config", *changed], capsys)
    assert status == 0
    assert err == (f"WARNING: resuming {tmp_path / 'last.pt'} with changed settings ({listed}): the run is no longer "
                   "bit-identical to an uninterrupted one\n")


def test_allowed_changes_take_effect(cifar_root, tmp_path, capsys):
    """With --allow-changed-config the new lr and weight decay are what the optimizer
    uses, and the position in the epoch is kept in samples."""
    common = [cifar_root, *TINY, "--checkpoint-dir", str(tmp_path), "--lr-schedule", "cosine"]
    assert run(common + ["--max-steps", "3"], capsys)[0] == 0
    assert run(common + ["--max-steps", "4", "--resume", "auto", "--allow-changed-config", "--lr", "0.2",
                         "--wd", "0", "-b", "8"], capsys)[0] == 0
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    group = ckpt["optimizer"]["optimizer"]["param_groups"][0]
    assert group["initial_lr"] == 0.2 and group["weight_decay"] == 0.0
    assert ckpt["batches_done"] == 3 * 16 // 8 + 1  # 48 samples were 6 batches of 8, then one more step
    lr4 = [r["lr"] for r in records(tmp_path / "metrics.jsonl") if r["type"] == "train" and r["step"] == 4][0]
    lr3 = [r["lr"] for r in records(tmp_path / "metrics.jsonl") if r["type"] == "train" and r["step"] == 3][0]
    assert lr4 < 0.2 and lr3 > 0.3  # the cosine schedule continues from the new peak


@pytest.mark.parametrize("free", [["--max-steps", "5"], ["--save-every", "1"], ["-p", "2"], ["--no-progress"],
                                  ["-j", "1"], ["--metrics", "{tmp}/elsewhere.jsonl"]],
                         ids=["max-steps", "save-every", "print-freq", "no-progress", "workers", "metrics"])
def test_flags_that_change_neither_order_nor_schedule_are_free(cifar_root, tmp_path, capsys, free):
    common = [cifar_root, *TINY, "--checkpoint-dir", str(tmp_path)]
    assert run(common + ["--max-steps", "3"], capsys)[0] == 0
    status, err, _ = run(common + ["--max-steps", "4", "--resume", "auto",
                                   *[f.format(tmp=tmp_path) for f in free]], capsys)
    assert status == 0 and err == ""


# ----------------------------------------------------------------- 3. fail before training


@contextlib.contextmanager
def immutable(folder):
    """A folder that nobody can write to, root included (chattr +i), or skip."""
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
    elif subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        yield folder
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
        folder.chmod(0o755)


@pytest.mark.parametrize("case", ["dir-is-file", "under-a-file", "read-only-dir", "metrics-is-dir",
                                  "tensorboard-is-file"])
def test_unwritable_places_are_found_before_training(cifar_root, tmp_path, capsys, case):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    ck, extra = tmp_path / "ck", []
    with contextlib.ExitStack() as stack:
        if case == "dir-is-file":
            ck, expected = blocker, f"error: checkpoint directory {blocker} is a file, not a folder\n"
        elif case == "under-a-file":
            ck = blocker / "ck"
            expected = f"error: cannot create checkpoint directory {ck}: Not a directory\n"
        elif case == "read-only-dir":
            ck = stack.enter_context(immutable(tmp_path / "ro"))
            expected = f"error: checkpoint directory {ck} is not writable: "
        elif case == "metrics-is-dir":
            (tmp_path / "m").mkdir()
            extra = ["--metrics", str(tmp_path / "m")]
            expected = f"error: metrics file {tmp_path / 'm'} is a folder, not a file\n"
        else:
            extra = ["--tensorboard", str(blocker)]
            expected = f"error: TensorBoard directory {blocker} is a file, not a folder\n"
        status, err, out = run([cifar_root, *TINY, "--max-steps", "1", "--checkpoint-dir", str(ck), *extra], capsys)
    assert status == 2 and err.startswith(expected) and err.count("\n") == 1
    assert "data:" not in out and "model:" not in out  # nothing was loaded or built


# ----------------------------------------------------------------- 4. preemption


@pytest.mark.slow
@pytest.mark.parametrize("sig,torchrun", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["sigterm", "sigint", "sigterm-torchrun"])
def test_a_signal_mid_epoch_saves_and_the_resumed_run_is_bit_identical(cifar_root, tmp_path, sig, torchrun):
    """The run finishes its step, saves, records why it stopped, prints one line and
    exits 128 + the signal; --resume auto then ends where an uninterrupted run ends."""
    args = [cifar_root, *TINY, "--epochs", "3", "--max-steps", "30"]  # 12 steps per epoch (6 under torchrun)
    straight = script(args + ["--checkpoint-dir", str(tmp_path / "straight")], torchrun)
    assert straight.communicate(timeout=300) and straight.returncode == 0

    parts = tmp_path / "parts"
    proc = script(args + ["--checkpoint-dir", str(parts)], torchrun)
    wait_for_step(parts / "metrics.jsonl", 3, proc)
    target = proc.pid
    os.kill(target, signal.SIGSTOP)  # the signal arrives while a step is in progress
    os.kill(target, sig)
    os.kill(target, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    stopped = records(parts / "metrics.jsonl")[-1]
    assert stopped["type"] == "stopped" and stopped["reason"] == signal.Signals(sig).name
    saved = torch.load(parts / "last.pt", weights_only=True)
    assert saved["step"] == stopped["step"] < 30
    line = (f"stopped by {signal.Signals(sig).name} at step {stopped['step']}: saved {parts / 'last.pt'}; "
            "continue with --resume auto")
    if torchrun:  # torchrun's agent forwards the signal to every worker; rank 0 speaks for them
        assert err.count(line) == 1
    else:
        assert proc.returncode == 128 + sig
        assert err.splitlines() == [f"{signal.Signals(sig).name}: finishing this step and saving; send it again to "
                                    "stop at once", line]

    resumed = script(args + ["--checkpoint-dir", str(parts), "--resume", "auto"], torchrun)
    assert resumed.communicate(timeout=300) and resumed.returncode == 0
    assert_same_final_state(tmp_path / "straight" / "last.pt", parts / "last.pt")


@pytest.mark.slow
def test_a_second_signal_ends_the_run_at_once_and_corrupts_nothing(cifar_root, tmp_path):
    ck = tmp_path / "ck"
    proc = script([cifar_root, *TINY, "--epochs", "30", "--save-every", "2", "--checkpoint-dir", str(ck)])
    wait_for_step(ck / "metrics.jsonl", 3, proc)
    os.kill(proc.pid, signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)  # killed by it, or already saved
    assert torch.load(ck / "last.pt", weights_only=True)["step"] >= 2  # the checkpoint still loads
    assert run_quiet([cifar_root, *TINY, "--epochs", "30", "--max-steps", "6", "--checkpoint-dir", str(ck),
                      "--resume", "auto"]) == 0


def run_quiet(argv):
    proc = script(argv)
    proc.communicate(timeout=300)
    return proc.returncode
