"""Never lose a run: protected run directories, resume that refuses changed meaning,
early checks of where a run writes, and preemption that saves (docs/RESILIENCE.md)."""

import contextlib
import os
import re
import signal
import subprocess
import time

import pytest
import torch

import dist_helpers
import train_cifar
from run_helpers import assert_same_final_state, records

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
    """train_cifar.py as a child process: under torchrun with 2 processes if asked, else
    from the fork server (its own signals, stderr and exit status)."""
    if torchrun:
        return dist_helpers.torchrun(["train_cifar.py", *argv], popen=True, merge=False)
    return dist_helpers.Forked("train_cifar.py", argv)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_resuming_another_runs_checkpoint_into_a_folder_with_a_run_is_refused(cifar_root, tmp_path, capsys):
    for name in ("a", "b"):
        assert run([cifar_root, *TINY, "--max-steps", "2", "--checkpoint-dir", str(tmp_path / name)], capsys)[0] == 0
    status, err, _ = run([cifar_root, *TINY, "--max-steps", "3", "--checkpoint-dir", str(tmp_path / "b"),
                          "--resume", str(tmp_path / "a" / "last.pt")], capsys)
    assert status == 2 and err.startswith(f"error: {tmp_path / 'b'} holds an earlier run ({tmp_path / 'b' / 'last.pt'}")
    status, _, _ = run([cifar_root, *TINY, "--max-steps", "3", "--checkpoint-dir", str(tmp_path / "c"),
                        "--resume", str(tmp_path / "a" / "last.pt")], capsys)
    assert status == 0  # into a new folder: fine


@pytest.mark.slow  # three short runs
def test_the_advice_of_a_refused_resume_works(cifar_root, tmp_path, capsys):
    """--resume DIR/best.pt into DIR is refused (its later last.pt would be replaced),
    with advice that is then followed and works; --resume auto without a last.pt, or
    with a last.dcp whose folder is gone, says what is there and what is missing, and
    no longer says "use --resume auto"."""
    ck, other = tmp_path / "ck", tmp_path / "other"
    common = [cifar_root, *TINY, "--precision", "fp32"]
    assert run(common + ["--max-steps", "2", "--checkpoint-dir", str(ck)], capsys)[0] == 0
    best, last = ck / "best.pt", ck / "last.pt"

    status, err, out = run(common + ["--max-steps", "3", "--resume", str(best), "--checkpoint-dir", str(ck)], capsys)
    assert status == 2 and "data:" not in out
    assert err == (f"error: {best} is a checkpoint of the run in {ck} ({last}, {best}); continuing from it there "
                   "would replace that run's later checkpoints and mix two histories in its metrics: continue the run "
                   f"in {ck} from its last checkpoint with --resume auto, or continue from {best} in another folder "
                   f"with --resume {best} --checkpoint-dir OTHER\n")
    status, err, _ = run(common + ["--max-steps", "3", "--resume", str(best), "--checkpoint-dir", str(other)], capsys)
    assert status == 0, err  # the advice, followed
    assert torch.load(other / "last.pt", weights_only=True)["step"] == 3 and last.exists()

    last.unlink()
    status, err, _ = run(common + ["--max-steps", "3", "--resume", "auto", "--checkpoint-dir", str(ck)], capsys)
    assert status == 2 and err == (f"error: --resume auto found nothing to continue in {ck} (no last.pt or last.dcp; "
                                   f"it holds {best}): continue from {best} in another folder with --resume {best} "
                                   f"--checkpoint-dir OTHER, or start afresh in {ck} with --overwrite and without "
                                   "--resume\n")

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    os.symlink("sharded-step4-0a1b", sharded / "last.dcp")  # its folder deleted
    status, err, out = run(common + ["--max-steps", "1", "--resume", "auto", "--checkpoint-dir", str(sharded)], capsys)
    assert status == 2 and "data:" not in out
    assert err == (f"error: --resume auto found nothing to continue in {sharded} ({sharded / 'last.dcp'} names "
                   f"{sharded / 'sharded-step4-0a1b'}, which is gone; it holds {sharded / 'last.dcp'}): start afresh "
                   f"in {sharded} with --overwrite and without --resume, or in another --checkpoint-dir\n")
    status, err, _ = run(common + ["--max-steps", "1", "--overwrite", "--checkpoint-dir", str(sharded)], capsys)
    assert status == 0, err  # the advice, followed
    assert not os.path.lexists(sharded / "last.dcp") and (sharded / "last.pt").exists()


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_allowed_changes_take_effect(cifar_root, tmp_path, capsys):
    """With --allow-changed-config the new lr and weight decay are what the optimizer
    uses, and the position in the epoch is kept in samples. A static loss scale changed
    on resume is the new one (the saved scale was kept, in silence)."""
    common = [cifar_root, *TINY, "--checkpoint-dir", str(tmp_path), "--lr-schedule", "cosine"]
    assert run(common + ["--max-steps", "3", "--loss-scale", "128"], capsys)[0] == 0
    assert run(common + ["--max-steps", "4", "--resume", "auto", "--allow-changed-config", "--lr", "0.2",
                         "--wd", "0", "-b", "8", "--loss-scale", "1024"], capsys)[0] == 0
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ckpt["optimizer"]["scaler"]["scale"] == 1024.0
    group = ckpt["optimizer"]["optimizer"]["param_groups"][0]
    assert group["initial_lr"] == 0.2 and group["weight_decay"] == 0.0
    assert ckpt["batches_done"] == 3 * 16 // 8 + 1  # 48 samples were 6 batches of 8, then one more step
    lr4 = [r["lr"] for r in records(tmp_path / "metrics.jsonl") if r["type"] == "train" and r["step"] == 4][0]
    lr3 = [r["lr"] for r in records(tmp_path / "metrics.jsonl") if r["type"] == "train" and r["step"] == 3][0]
    assert lr4 < 0.2 and lr3 > 0.3  # the cosine schedule continues from the new peak


def epoch_order(size=200, seed=0):
    from mpfp16.train.data import ResumableDistributedSampler

    return ResumableDistributedSampler(range(size), 1, 0, shuffle=True, seed=seed).order()


def logged_keys(*paths):
    keys = []
    for path in paths:
        with open(path) as f:
            keys += [tuple(map(int, line.split())) for line in f]
    return keys


def assert_epoch_trained_once(before, after, trained, size=200):
    """Epoch 0's samples before and after the resume: none twice, none skipped (the
    first ``trained`` of the epoch's one order)."""
    keys = [index for epoch, index in before + after if epoch == 0]
    assert len(keys) == len(set(keys)) == trained
    assert sorted(keys) == sorted(epoch_order(size)[:trained])


ONE_EPOCH = ["-a", "resnet9-w4", "--precision", "fp32", "--no-progress", "-p", "1", "--epochs", "1"]


@pytest.mark.slow
def test_two_processes_resumed_on_one_with_another_batch_train_each_sample_once(cifar_root, tmp_path, capsys,
                                                                                 monkeypatch):
    """2 processes x -b 6 stop after 5 steps (60 samples); 1 process x -b 16 with
    --allow-changed-config trains the 8 steps the other 140 samples fill (128), then a
    shorter one of 4, up to sample 192, where an uninterrupted epoch of -b 16 ends, and
    epoch 1 ends at step 14: no sample twice (it repeated 30 before) and none skipped
    (it left out 4 that an uninterrupted epoch trains)."""
    import fault_workers as FW
    from dist_helpers import run_workers

    ck = tmp_path / "ck"
    first = [cifar_root, *ONE_EPOCH, "-b", "6", "--max-steps", "5", "--checkpoint-dir", str(ck)]
    results = run_workers(FW.script_recording_samples, tmp_path / "out", args=(first, str(tmp_path)), timeout=240)
    assert [r["status"] for r in results] == [0, 0], results[0]["stderr"][-2000:]
    monkeypatch.setattr("mpfp16.train.data.InMemoryImages.__getitem__", FW.recording_getitem(tmp_path / "resumed.txt"))
    status, err, out = run([cifar_root, *ONE_EPOCH, "-b", "16", "--resume", "auto", "--allow-changed-config",
                            "--checkpoint-dir", str(ck)], capsys)
    assert status == 0, err
    assert_epoch_trained_once(logged_keys(tmp_path / "rank0.txt", tmp_path / "rank1.txt"),
                              logged_keys(tmp_path / "resumed.txt"), trained=60 + 128 + 4)
    assert ("epoch 1 resumed at sample 60 of 200: 8 full steps, then a shorter last step of 4 samples (4 per process, "
            "in one micro-batch) up to sample 192, where an uninterrupted epoch of this shape ends\n") in out
    recs = records(ck / "metrics.jsonl")
    assert [(r["epoch"], r["step"]) for r in recs if r["type"] == "eval"][-1] == (1, 14)
    assert recs[-1]["type"] == "final" and recs[-1]["step"] == 14


@pytest.mark.slow
def test_one_process_resumed_on_two_with_another_batch_train_each_sample_once(cifar_root, tmp_path, capsys,
                                                                               monkeypatch):
    """1 process x -b 12 stops after 3 steps (36 samples, not a whole number of the
    resumed run's micro-batches of 2 x 4); 2 processes x -b 4 x --accum-steps 3 train
    the 6 steps the other 164 fill (144), then a shorter one of 12 (micro-batches of 3
    and 3 on each process), up to sample 192, where an uninterrupted epoch of theirs
    ends. Before, it trained the 144 and left out those 12 (and before that, skipped the
    rest of the epoch)."""
    import fault_workers as FW
    from dist_helpers import run_workers

    ck = tmp_path / "ck"
    monkeypatch.setattr("mpfp16.train.data.InMemoryImages.__getitem__", FW.recording_getitem(tmp_path / "first.txt"))
    status, err, _ = run([cifar_root, *ONE_EPOCH, "-b", "12", "--max-steps", "3", "--checkpoint-dir", str(ck)],
                         capsys)
    assert status == 0, err
    monkeypatch.undo()  # this process's run is over: its recording ends here
    resumed = [cifar_root, *ONE_EPOCH, "-b", "4", "--accum-steps", "3", "--resume", "auto", "--allow-changed-config",
               "--checkpoint-dir", str(ck)]
    results = run_workers(FW.script_recording_samples, tmp_path / "out", args=(resumed, str(tmp_path)), timeout=240)
    assert [r["status"] for r in results] == [0, 0], results[0]["stderr"][-2000:]
    assert_epoch_trained_once(logged_keys(tmp_path / "first.txt"),
                              logged_keys(tmp_path / "rank0.txt", tmp_path / "rank1.txt"), trained=36 + 144 + 12)
    said = ("epoch 1 resumed at sample 36 of 200: 6 full steps, then a shorter last step of 12 samples (6 per process, "
            "in micro-batches of 3, 3) up to sample 192, where an uninterrupted epoch of this shape ends")
    assert said in results[0]["stdout"] and said not in results[1]["stdout"] + results[1]["stderr"]  # rank 0's
    recs = records(ck / "metrics.jsonl")
    assert [(r["epoch"], r["step"]) for r in recs if r["type"] == "eval"][-1] == (1, 10)


@pytest.mark.slow
@pytest.mark.parametrize("free", [["--max-steps", "5"], ["--save-every", "1"], ["-p", "2"], ["--no-progress"],
                                  ["-j", "1"], ["--metrics", "{tmp}/elsewhere.jsonl"]],
                         ids=["max-steps", "save-every", "print-freq", "no-progress", "workers", "metrics"])
def test_flags_that_change_neither_order_nor_schedule_are_free(cifar_root, tmp_path, capsys, free):
    common = [cifar_root, *TINY, "--checkpoint-dir", str(tmp_path)]
    assert run(common + ["--max-steps", "3"], capsys)[0] == 0
    status, err, _ = run(common + ["--max-steps", "4", "--resume", "auto",
                                   *[f.format(tmp=tmp_path) for f in free]], capsys)
    assert status == 0 and err == ""


@pytest.mark.slow
def test_max_steps_beyond_the_schedule_ends_at_epochs_and_says_so(cifar_root, tmp_path, capsys):
    """--max-steps only shortens: 50 steps asked of a 1-epoch schedule of 12 end at step
    12, with one line that says so (the run went on at lr 0 to step 50 before)."""
    status, err, out = run([cifar_root, *TINY, "--precision", "fp32", "--epochs", "1", "--max-steps", "50",
                            "--checkpoint-dir", str(tmp_path)], capsys)
    assert status == 0 and err == ""
    line = ("--max-steps 50 is beyond the end of the schedule: the run ends with --epochs 1, at step 12 (--max-steps "
            "only shortens a run; raise --epochs to train longer)")
    assert out.splitlines().count(line) == 1
    recs = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs if r["type"] == "train"][-1] == 12 and recs[-1]["step"] == 12
    assert recs[-1]["epoch"] == 1
    from mpfp16.train.build import beyond_the_schedule

    assert beyond_the_schedule(12, 1, 12) is None and beyond_the_schedule(5, 1, 12) is None  # a cap it reaches
    assert beyond_the_schedule(None, 1, 12) is None and beyond_the_schedule(13, 1, 12) is not None


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
    exits 128 + the signal; --resume auto then ends where an uninterrupted run ends.
    Under torchrun, the run that gets the signal is torchrun's; the uninterrupted and
    the resumed runs are the same two processes started as torchrun starts them
    (dist_helpers.scripts), without its agent."""
    args = [cifar_root, *TINY, "--epochs", "3", "--max-steps", "30"]  # 12 steps per epoch (6 under torchrun)
    run_through(args + ["--checkpoint-dir", str(tmp_path / "straight")], torchrun, tmp_path / "straight-out")

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
        assert_torchrun_got_the_signal(proc, err, sig)
    else:
        assert proc.returncode == 128 + sig
        assert err.splitlines() == [f"{signal.Signals(sig).name}: finishing this step and saving; send it again to "
                                    "stop at once", line]

    run_through(args + ["--checkpoint-dir", str(parts), "--resume", "auto"], torchrun, tmp_path / "resumed-out")
    assert_same_final_state(tmp_path / "straight" / "last.pt", parts / "last.pt")


def run_through(argv, two_processes, out_dir):
    """A run that must succeed, on 2 processes as torchrun starts them or on one."""
    if two_processes:
        [[r0, r1]] = dist_helpers.scripts("train_cifar", [argv], out_dir)
        assert r0["status"] == r1["status"] == 0, r0["stderr"][-2000:]
    else:
        proc = script(argv)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]


def assert_torchrun_got_the_signal(proc, err, sig):
    """What torchrun itself does when it gets SIGTERM or SIGINT (torch 2.x, not ours to
    change): it forwards the signal to every worker, waits for them (up to its
    --shutdown-timeout, 30 s by default, then SIGKILL), and exits 1 with its own
    traceback of a SignalException, whatever status the workers stopped with."""
    assert proc.returncode == 1
    assert f"Received {int(sig)} death signal, shutting down workers" in err
    assert err.rstrip().splitlines()[-1] == (f"torch.distributed.elastic.multiprocessing.api.SignalException: "
                                             f"Process {proc.pid} got signal: {int(sig)}")


@pytest.mark.slow
@pytest.mark.parametrize("sig,target", [(signal.SIGINT, "torchrun"), (signal.SIGTERM, "a worker")],
                         ids=["sigint-to-torchrun", "sigterm-to-a-worker"])
def test_what_torchrun_says_after_a_clean_stop(cifar_root, tmp_path, sig, target):
    """Under torchrun every rank saves and exits 128 + the signal with rank 0's one
    line, and torchrun exits 1 with its own traceback: a SignalException when it got
    the signal itself, a ChildFailedError listing each worker's exitcode 143 (130) when
    only a worker did (the first to exit; torchrun then ends the others with SIGTERM).
    torchrun has no flag that passes its workers' status on."""
    from run_helpers import children

    ck = tmp_path / "ck"
    proc = script([cifar_root, *TINY, "--precision", "fp32", "--epochs", "3", "--checkpoint-dir", str(ck)],
                  torchrun=True)
    wait_for_step(ck / "metrics.jsonl", 2, proc)
    pid = proc.pid if target == "torchrun" else sorted(children(proc.pid))[0]
    os.kill(pid, sig)
    _, err = proc.communicate(timeout=120)
    stopped = records(ck / "metrics.jsonl")[-1]
    assert stopped["type"] == "stopped" and stopped["reason"] == signal.Signals(sig).name
    assert torch.load(ck / "last.pt", weights_only=True)["step"] == stopped["step"]
    assert err.count(f"stopped by {signal.Signals(sig).name} at step {stopped['step']}: saved {ck / 'last.pt'}; "
                     "continue with --resume auto") == 1
    if target == "torchrun":
        assert_torchrun_got_the_signal(proc, err, sig)
    else:
        assert proc.returncode == 1
        assert err.rstrip().splitlines()[-1] == "=" * 60  # the end of its ChildFailedError report
        assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in err
        # The workers exit 128 + the signal; torchrun stops the group once the first has, so one
        # still on its way out may be ended by torchrun's own SIGTERM (its checkpoint is written).
        codes = re.findall(r"exitcode  : (-?\d+)", err)
        assert str(128 + sig) in codes and set(codes) <= {str(128 + sig), str(-signal.SIGTERM)}, codes


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
