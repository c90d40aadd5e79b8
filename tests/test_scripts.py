"""train_cifar.py and train_imagenet.py end to end, on tiny data, in one process and
as 2-process gloo runs under torchrun."""

import argparse
import os
import random

import pytest
import torch

import dist_helpers
import mpfp16
import train_cifar
import train_imagenet
from fake_data import write_fake_imagefolder
from run_helpers import assert_same_final_state, poison_step, records, run_main

TINY_CIFAR = ["-a", "resnet9-w4", "-b", "16", "--no-progress", "-p", "1"]
# resnet18 has over 1M parameters: --fused off spares each run the kernel compilation,
# except where a test asks for the fused step on purpose.
TINY_IMAGENET = ["-a", "resnet18", "--image-size", "32", "-b", "4", "--no-progress", "-p", "1", "-j", "0",
                 "--fused", "off"]


@pytest.fixture(scope="module")
def imagenet_root(tmp_path_factory):
    return write_fake_imagefolder(tmp_path_factory.mktemp("imagenet"))


@pytest.mark.slow
def test_cifar_on_fake_cifar_files(cifar_root, tmp_path, capsys):
    result = run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "--epochs", "1", "--max-steps", "3",
                                         "--checkpoint-dir", str(tmp_path)], capsys)
    assert result[0] == 0, result[1]
    assert f"checkpoint: {tmp_path / 'last.pt'}" in result.out and "metrics: " in result.out
    assert "CIFAR-10 from" in result.out
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ckpt["step"] == 3 and set(ckpt) >= {"model", "optimizer", "step", "epoch", "rng", "scheduler"}
    assert ckpt["mpfp16_version"] == mpfp16.__version__  # the release that wrote it
    assert (tmp_path / "best.pt").exists()


@pytest.mark.slow
def test_evaluate_a_checkpoint(cifar_root, tmp_path, capsys):
    assert run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "--max-steps", "2", "--checkpoint-dir",
                                       str(tmp_path)], capsys)[0] == 0
    result = run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "-e", "--resume", str(tmp_path / "best.pt"),
                                         "--checkpoint-dir", str(tmp_path)], capsys)
    assert result[0] == 0, result[1]
    assert "evaluation: loss" in result.out and "on 40 images" in result.out


@pytest.mark.slow
def test_metrics_file_has_the_promised_keys(cifar_root, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    status, err = run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "--epochs", "1", "--max-steps", "4",
                                              "--checkpoint-dir", str(tmp_path), "--metrics", str(metrics)], capsys)
    assert status == 0, err
    recs = records(metrics)
    train = [r for r in recs if r["type"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert set(r) >= {"step", "epoch", "loss", "loss_scale", "skipped_steps", "lr", "grad_norm",
                          "samples_per_s", "allreduce_calls", "allreduce_bytes"}
        assert r["loss"] > 0 and r["samples_per_s"] > 0 and r["loss_scale"] == 65536.0
    evals = [r for r in recs if r["type"] == "eval"]
    assert evals and set(evals[-1]) >= {"val_loss", "val_acc1", "val_acc5"}
    assert recs[-1]["type"] == "final" and recs[-1]["step"] == 4 and recs[-1]["mpfp16_version"] == mpfp16.__version__


@pytest.mark.slow
def test_a_skipped_step_names_its_culprits_in_the_metrics(cifar_root, tmp_path, capsys, monkeypatch):
    """One NaN image in the second step's batch: its train record carries the
    parameters whose gradient held NaN (opt.last_overflow), the others none."""
    from mpfp16.train import models

    poison_step(monkeypatch, 1)
    metrics = tmp_path / "m.jsonl"
    result = run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "--epochs", "1", "--max-steps", "3",
                                         "--checkpoint-dir", str(tmp_path), "--metrics", str(metrics)], capsys)
    assert result[0] == 0, result[1]
    train = [r for r in records(metrics) if r["type"] == "train"]
    assert [(r["step"], r["skipped_steps"], r["overflow_step"]) for r in train] == [(1, 0, None), (2, 1, 2),
                                                                                    (3, 1, None)]
    assert train[0]["overflow"] == train[2]["overflow"] == []
    names = [name for name, _ in models.build_cifar_model("resnet9-w4", 10).named_parameters()][:8]
    assert [e["name"] for e in train[1]["overflow"]] == names
    assert all(e["kind"] == "nan" and e["count"] > 0 and e["ranks"] == [0] for e in train[1]["overflow"])
    assert f"step 2 skipped: inf/NaN in the gradients: nan in {names[0]} (" in result.out + result[1]


@pytest.mark.slow
def test_imagenet_on_a_tiny_imagefolder(imagenet_root, tmp_path, capsys):
    status, err = run_main(train_imagenet.main, [imagenet_root, *TINY_IMAGENET, "--epochs", "1",
                                                 "--checkpoint-dir", str(tmp_path), "--no-bn-wd",
                                                 "--zero-init-residual", "--warmup-epochs", "1", "--fused", "on"],
                           capsys)
    assert status == 0, err
    recs = records(tmp_path / "metrics.jsonl")
    assert recs[-1]["type"] == "final" and recs[-1]["step"] == 6  # 24 images / batch 4
    assert [r for r in recs if r["type"] == "eval"][-1]["val_samples"] == 9


@pytest.mark.slow
def test_imagenet_progressive_resizing_and_embedded_data(tmp_path, capsys):
    result = run_main(train_imagenet.main, [*TINY_IMAGENET, "--synthetic-size", "16,8", "--epochs", "2",
                                            "--resize-phases", "0:16,1:32", "--precision", "bf16",
                                            "--checkpoint-dir", str(tmp_path)], capsys)
    assert result[0] == 0, result[1]
    assert "embedded synthetic data" in result.out


@pytest.mark.slow
def test_embedded_cifar_data_is_learnable(tmp_path, capsys):
    """A short bf16 run on the embedded set gets well above chance (10%)."""
    status, err = run_main(train_cifar.main, ["-a", "resnet9-w8", "--precision", "bf16", "--synthetic-size",
                                              "1280,400", "--epochs", "3", "--no-progress",
                                              "--checkpoint-dir", str(tmp_path)], capsys)
    assert status == 0, err
    final = records(tmp_path / "metrics.jsonl")[-1]
    assert final["best_acc1"] > 40


# ----------------------------------------------------------------- exact resume


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["--precision", "fp16", "-b", "8", "--accum-steps", "2", "--accumulate-dtype", "fp32", "--max-grad-norm", "5"],
    ["--precision", "fp16", "--no-master-weights", "--optimizer", "adamw", "--lr", "0.01"],
    ["--precision", "bf16"],
    ["--precision", "bf16", "--master-weights", "remainder", "--optimizer", "adamw", "--lr", "0.01"],
    ["--precision", "fp16", "--optimizer", "adamw", "--lr", "0.01", "--state-dtype", "bf16", "--state-rounding",
     "stochastic"],
], ids=["fp16-accum-fp32-sum-clip", "fp16-no-master-adamw", "bf16", "bf16-remainder-adamw",
        "fp16-adamw-bf16-states-stochastic"])
def test_resume_mid_epoch_is_bit_identical(cifar_root, tmp_path, capsys, extra):
    """10 steps, a resume, 10 more == 20 straight steps (an epoch is 12 steps here, so
    the resume lands mid-epoch and the run crosses an epoch boundary after it)."""
    common = [cifar_root, *TINY_CIFAR, "--epochs", "3", *extra]  # 200 images, 16 per step: 12 steps an epoch
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    assert run_main(train_cifar.main, common + ["--max-steps", "20", "--checkpoint-dir", str(straight)], capsys)[0] == 0
    assert run_main(train_cifar.main, common + ["--max-steps", "10", "--checkpoint-dir", str(parts)], capsys)[0] == 0
    mid = torch.load(parts / "last.pt", weights_only=True)
    assert mid["step"] == 10 and mid["epoch"] == 0 and mid["batches_done"] > 0  # mid-epoch
    assert mid["optimizer"]["master_mode"] == ("remainder" if "remainder" in extra else
                                               "none" if "--no-master-weights" in extra else "fp32")
    if "--state-dtype" in extra:  # the states are saved in bf16, and the resume keeps them so
        states = [s for s in mid["optimizer"]["optimizer"]["state"].values() if "exp_avg" in s]
        assert states and all(s["exp_avg"].dtype == torch.bfloat16 for s in states)
    assert run_main(train_cifar.main, common + ["--max-steps", "20", "--checkpoint-dir", str(parts),
                                                "--resume", "auto"], capsys)[0] == 0
    assert_same_final_state(straight / "last.pt", parts / "last.pt")
    final = torch.load(parts / "last.pt", weights_only=True)
    assert final["step"] == 20 and final["epoch"] == 1
    losses = lambda d: {r["step"]: r["loss"] for r in records(d / "metrics.jsonl") if r["type"] == "train"}
    tail_a, tail_b = losses(straight), losses(parts)
    assert all(tail_a[s] == tail_b[s] for s in range(11, 21))


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv,message", [
    (["{missing}"], "does not exist"),
    (["{empty}"], "holds no CIFAR-10 data"),
    (["{garbage}"], "is not a CIFAR-10 batch file"),
    (["{cifar}", "-a", "resnet7"], "unknown CIFAR arch 'resnet7'"),
    (["{cifar}", "--resume", "{corrupt}"], "corrupt.pt is not a torch.save file (it starts with b'"),
    (["{cifar}", "--resume", "{truncated}"], "truncated.pt is corrupt or truncated"),
    (["{cifar}", "--resume", "{text}"], "notes.txt is not a torch.save file (it starts with b'hell')"),
    (["{cifar}", "--resume", "{empty}"], "empty is a folder: pass a checkpoint file such as "),
    (["{cifar}", "--resume", "{pickled}"], "contains a pickled Python object (argparse.Namespace)"),
    (["{cifar}", "--resume", "{nothere}"], "does not exist"),
], ids=["missing", "empty", "garbage", "arch", "random-bytes-ckpt", "truncated-ckpt", "text-ckpt", "folder-ckpt",
        "pickled-ckpt", "missing-ckpt"])
def test_bad_input_is_one_line_and_nonzero(cifar_root, tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    garbage = tmp_path / "garbage" / "cifar-10-batches-py"
    garbage.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (garbage / name).write_bytes(b"not a pickle at all")
    (tmp_path / "corrupt.pt").write_bytes(random.Random(0).randbytes(4096))
    (tmp_path / "notes.txt").write_text("hello, this is not a checkpoint")
    torch.save({"format": "mpfp16.checkpoint/1", "model": {"w": torch.zeros(1000)}}, tmp_path / "whole.pt")
    (tmp_path / "truncated.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:1500])
    torch.save({"format": "mpfp16.checkpoint/1", "model": argparse.Namespace(evil=True)}, tmp_path / "pickled.pt")
    paths = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "garbage": tmp_path / "garbage",
             "cifar": cifar_root, "corrupt": tmp_path / "corrupt.pt", "pickled": tmp_path / "pickled.pt",
             "nothere": tmp_path / "nothere.pt", "truncated": tmp_path / "truncated.pt", "text": tmp_path / "notes.txt"}
    argv = [*TINY_CIFAR, "--max-steps", "1", "--checkpoint-dir", str(tmp_path / "ck"),
            *[a.format(**paths) for a in argv]]
    status, err = run_main(train_cifar.main, argv, capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.slow
def test_mismatched_checkpoint_is_refused(cifar_root, tmp_path, capsys):
    assert run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "--max-steps", "1", "--checkpoint-dir",
                                       str(tmp_path)], capsys)[0] == 0
    resume = [cifar_root, *TINY_CIFAR, "--max-steps", "2", "--checkpoint-dir", str(tmp_path), "--resume", "auto"]
    status, err = run_main(train_cifar.main, resume + ["-a", "resnet9-w8"], capsys)
    assert status == 2 and err == (f"error: checkpoint {tmp_path / 'last.pt'} was saved with other settings "
                                   "(arch resnet9-w4 -> resnet9-w8): resume with the same ones, or pass "
                                   "--allow-changed-config to continue anyway, no longer bit-identically\n")
    status, err = run_main(train_cifar.main, resume + ["-a", "resnet9-w8", "--allow-changed-config"], capsys)
    assert status == 2 and err.splitlines()[0].startswith("WARNING: resuming ")  # the changed settings
    assert err.splitlines()[1:] == [f"error: checkpoint {tmp_path / 'last.pt'} (arch resnet9-w4) does not fit this "
                                    "model (arch resnet9-w8): 41 of another shape (first 0.0.weight: [4, 3, 3, 3] "
                                    "saved, [8, 3, 3, 3] here)"]
    status, err = run_main(train_cifar.main, resume + ["-a", "resnet18", "--allow-changed-config"], capsys)
    assert status == 2 and "122 of its tensors missing (first conv1.weight), 49 unknown here (first 0.0.weight)" \
        in err


@pytest.mark.slow
def test_a_checkpoint_of_another_precision_says_so(cifar_root, tmp_path, capsys):
    assert run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "--max-steps", "1", "--precision", "fp32",
                                       "--checkpoint-dir", str(tmp_path)], capsys)[0] == 0
    resume = [cifar_root, *TINY_CIFAR, "--max-steps", "2", "--checkpoint-dir", str(tmp_path), "--resume", "auto"]
    status, err = run_main(train_cifar.main, resume, capsys)
    assert status == 2 and "was saved with other settings (precision fp32 -> fp16)" in err
    status, err = run_main(train_cifar.main, resume + ["--allow-changed-config"], capsys)
    assert status == 2 and err.endswith(
        "holds a --precision fp32 run and this one is fp16: their optimizer states (loss scaling, masters) differ; "
        "resume with --precision fp32\n")


def test_empty_imagefolder_and_unknown_arch(tmp_path, capsys):
    (tmp_path / "root" / "train").mkdir(parents=True)
    status, err = run_main(train_imagenet.main, [str(tmp_path / "root"), *TINY_IMAGENET], capsys)
    assert status == 2 and "error:" in err and err.count("\n") == 1
    status, err = run_main(train_imagenet.main, [*TINY_IMAGENET[:0], "-a", "resnet5000", "--max-steps", "1"],
                           capsys)
    assert status == 2 and "unknown torchvision arch 'resnet5000'" in err


@pytest.mark.parametrize("link,target,kind", [("cat/loop", "..", "loop"), ("cat/again", "../dog", "twice")])
def test_a_link_that_counts_images_again_is_refused(tmp_path, capsys, link, target, kind):
    """ImageFolder follows links: train/cat/loop -> .. made 48 training images 2,928,
    and a second way into a class folder counts its images twice. One line naming the
    link, before training."""
    root = write_fake_imagefolder(tmp_path / "root")
    path = tmp_path / "root" / "train" / link
    os.symlink(target, path)
    status, err = run_main(train_imagenet.main, [root, *TINY_IMAGENET, "--max-steps", "1", "--checkpoint-dir",
                                                 str(tmp_path / "ck")], capsys)
    assert status == 2 and err.count("\n") == 1
    real = os.path.realpath(path)
    if kind == "loop":
        assert err == (f"error: {path} is a link to {real}, and following it leads back to "
                       f"{tmp_path / 'root' / 'train'}: a loop, which would count its images again at every turn; "
                       "remove the link\n")
    else:
        assert err == (f"error: {path} is a link to {real}, which {tmp_path / 'root' / 'train'} holds already "
                       f"({tmp_path / 'root' / 'train' / 'dog'}): its images would count twice; remove the link\n")


@pytest.mark.slow
def test_a_single_class_is_warned_about_once(tmp_path, capsys):
    root = write_fake_imagefolder(tmp_path / "root", classes=("cat",))
    status, err = run_main(train_imagenet.main, [root, *TINY_IMAGENET, "--max-steps", "1", "--checkpoint-dir",
                                                 str(tmp_path / "ck")], capsys)
    assert status == 0, err
    assert err == (f"WARNING: the training split {tmp_path / 'root' / 'train'} holds a single class folder 'cat': "
                   "every prediction is right and accuracy will read 100% whatever the model learns; a classifier "
                   "needs two classes or more\n")


@pytest.mark.slow
def test_fused_on_that_cannot_compile_is_one_line(cifar_root, tmp_path, capsys, monkeypatch):
    import torch._inductor.exc

    from mpfp16.stores import kernels as fused

    def broken(fn, **static):
        raise torch._inductor.exc.InvalidCxxCompiler()

    monkeypatch.setattr(fused, "compiled", broken)
    status, err = run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "--max-steps", "2", "--fused", "on",
                                              "--checkpoint-dir", str(tmp_path)], capsys)
    assert status == 1
    assert err == ("error: fused=True cannot be honoured: compiling the fused step failed on rank 0 "
                   "(InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: "
                   "(None, 'g++'))\n")


@pytest.mark.parametrize("argv", [["--epochs", "0"], ["--lr", "-1"], ["--loss-scale", "huge"],
                                  ["--precision", "fp8"], ["--precision", "bf16", "--loss-scale", "128"]])
def test_bad_flags_are_one_line_pointing_to_help(capsys, argv):
    """No usage block first: the line names the flag and points to --help."""
    for main in (train_cifar.main, train_imagenet.main):
        status, err = run_main(main, argv, capsys)
        assert status == 2 and err.count("\n") == 1 and ": error: " in err and err.endswith(" (see --help)\n"), err


@pytest.mark.parametrize("main,argv,message", [
    (train_cifar.main, ["--lr", "inf"], "argument --lr: must be a positive finite number, got inf"),
    (train_cifar.main, ["--wd", "-1"], "argument --wd/--weight-decay: must be a finite number >= 0, got -1"),
    (train_cifar.main, ["--momentum", "2"], "argument --momentum: must be a number in [0, 1], got 2"),
    (train_imagenet.main, ["--image-size", "1"], "argument --image-size: must be at least 8, got 1"),
    (train_imagenet.main, ["--resize-phases", "0:4"], "with sizes from 8 to 4096, got '0:4'"),
    (train_imagenet.main, ["--image-size", "99999"], "argument --image-size: must be at most 4096, got 99999"),
], ids=["lr-inf", "wd-negative", "momentum", "image-size", "resize-phases", "image-size-huge"])
def test_bad_values_are_named_plainly(capsys, main, argv, message):
    status, err = run_main(main, argv, capsys)
    assert status == 2 and err.count("\n") == 1 and err.endswith(f"{message} (see --help)\n"), err


def test_an_image_size_the_model_cannot_take_is_refused_before_training(tmp_path, capsys):
    status, err = run_main(train_imagenet.main, ["-a", "vit_b_16", "--image-size", "72", "--checkpoint-dir",
                                                 str(tmp_path)], capsys)
    assert status == 2
    assert err == "error: vit_b_16 cannot take 72x72 images: the size must be a multiple of its patch size, 16\n"
    assert not os.listdir(tmp_path) or os.listdir(tmp_path) == [".mpfp16.lock"]


@pytest.mark.slow
def test_no_traceback_from_the_real_command_line(tmp_path):
    proc = dist_helpers.python(["train_cifar.py", str(tmp_path / "absent")], timeout=120, merge=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: data path {tmp_path / 'absent'} does not exist"]


@pytest.mark.slow
def test_a_bad_torchrun_environment_is_one_line_from_the_real_command_line(tmp_path):
    """WORLD_SIZE=0, RANK never set: the line names WORLD_SIZE (it blamed RANK, in a
    traceback), exit status 2, before any data is loaded."""
    proc = dist_helpers.python(["train_cifar.py", "--synthetic-size", "64,16", "--checkpoint-dir", str(tmp_path)],
                               timeout=120, merge=False, env={"WORLD_SIZE": "0"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: environment variable WORLD_SIZE=0 must be at least 1"]
    assert "data:" not in proc.stdout and not any(tmp_path.iterdir())


# ----------------------------------------------------------------- torchrun, 2 processes


@pytest.mark.slow
def test_cifar_under_torchrun(cifar_root, tmp_path):
    """The command line of the README, under torchrun itself."""
    proc = dist_helpers.torchrun(["train_cifar.py", cifar_root, *TINY_CIFAR, "--max-steps", "3", "--accum-steps",
                                  "2", "--checkpoint-dir", str(tmp_path)], merge=False)
    dist_helpers.check(proc)
    train = [r for r in records(tmp_path / "metrics.jsonl") if r["type"] == "train"]
    assert len(train) == 3
    assert all(r["allreduce_calls"] >= 1 and r["allreduce_bytes"] > 0 for r in train)
    assert len({r["allreduce_bytes"] for r in train}) == 1  # per step, not running totals
    assert "[rank 1]" not in proc.stdout  # only rank 0 reports


@pytest.mark.slow
def test_imagenet_on_two_processes(imagenet_root, tmp_path):
    """As torchrun starts it (dist_helpers.scripts; torchrun itself: test_cifar_under_torchrun), with the
    micro-batches' fp32 gradient sum carried by the step's one exchange."""
    [[r0, r1]] = dist_helpers.scripts("train_imagenet", [[imagenet_root, *TINY_IMAGENET, "--max-steps", "2",
                                                    "--allreduce-strategy", "fp32_accumulate", "--accum-steps", "2",
                                                    "--accumulate-dtype", "fp32",
                                                    "--checkpoint-dir", str(tmp_path / "ck")]], tmp_path / "out")
    assert r0["status"] == r1["status"] == 0, r0["stderr"][-3000:]
    evals = [r for r in records(tmp_path / "ck" / "metrics.jsonl") if r["type"] == "eval"]
    assert evals[-1]["val_samples"] == 9  # 9 images sharded 5 + 4, each counted once


# ----------------------------------------------------------------- one resume decision

@pytest.mark.slow
def test_ranks_must_resume_from_the_same_checkpoint(cifar_root, tmp_path):
    """Each rank runs in its own folder with --checkpoint-dir ckpt: one path, a file per
    "node". Identical copies resume; a different or missing copy is one line on every
    rank, naming the ranks and the files."""
    import shutil

    import dist_workers as W
    from dist_helpers import run_workers

    def run(folders, *extra):
        argv = [cifar_root, *TINY_CIFAR, "--checkpoint-dir", "ckpt", "--check-replicas", "2", *extra]
        for folder in set(folders):
            (tmp_path / folder).mkdir(exist_ok=True)
        return run_workers(W.script_in_own_folder, tmp_path / "out", args=(str(tmp_path), folders, argv),
                           timeout=240)

    assert [r["status"] for r in run(["a", "a"], "--max-steps", "2")] == [0, 0]
    assert [r["status"] for r in run(["b", "b"], "--max-steps", "3", "--seed", "1")] == [0, 0]

    def place(folder, source):
        (tmp_path / folder / "ckpt").mkdir(parents=True)
        shutil.copy(tmp_path / source / "ckpt" / "last.pt", tmp_path / folder / "ckpt" / "last.pt")

    place("same0", "a"), place("same1", "a")
    r0, r1 = run(["same0", "same1"], "--max-steps", "4", "--resume", "auto")
    assert r0["status"] == r1["status"] == 0, r0["stderr"][-2000:] + r1["stderr"][-2000:]
    final = records(tmp_path / "same0" / "ckpt" / "metrics.jsonl")[-1]
    assert final["step"] == 4 and final["replica_checks"] == 1  # at step 4; the save after it reuses it

    place("diff0", "a"), place("diff1", "b")
    r0, r1 = run(["diff0", "diff1"], "--max-steps", "4", "--resume", "auto")
    assert r0["status"] == r1["status"] == 2
    assert r0["stderr"] == r1["stderr"]
    line = r0["stderr"].strip()
    assert "\n" not in line
    assert line.startswith("error: the ranks found different checkpoints: rank 0 read ckpt/last.pt (step 2, content ")
    assert "rank 1 read ckpt/last.pt (step 3, content " in line

    place("miss0", "a"), (tmp_path / "miss1").mkdir()
    r0, r1 = run(["miss0", "miss1"], "--max-steps", "4", "--resume", "auto")
    assert r0["status"] == r1["status"] == 2
    assert r0["stderr"] == r1["stderr"] == ("error: cannot resume on every rank: rank 1: checkpoint ckpt/last.pt "
                                             "does not exist (rank 0 read it)\n")


@pytest.mark.slow
def test_a_rank_that_drifts_stops_the_run_with_one_line(cifar_root, tmp_path):
    import dist_workers as W
    from dist_helpers import run_workers

    argv = [cifar_root, *TINY_CIFAR, "--max-steps", "4", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--check-replicas", "2"]
    # Rank 1's step 2 ends one ulp off in one master: the check at step 2 must see it.
    r0, r1 = run_workers(W.script_in_own_folder, tmp_path / "out", args=(str(tmp_path), [".", "."], argv, 1, 2),
                         timeout=240)
    assert r0["status"] == r1["status"] == 1
    assert r0["stderr"] == r1["stderr"]
    assert r0["stderr"].startswith("error: replicas diverged at step 2: master weight of ")
    assert r0["stderr"].count("\n") == 1
    assert not (tmp_path / "ckpt" / "last.pt").exists()  # nothing diverged was saved
