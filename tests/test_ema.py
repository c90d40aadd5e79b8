"""--model-ema (mpfp16/train/ema.py): torchvision's average, bit for bit, taken from the
fp32 masters; its schedule of updates (skipped steps, epochs, warm-up); its checkpoint;
and the engine's fixes that came with it: an evaluation at a stop in mid-epoch does not
compete for best.pt, and an epoch's train loss leaves its skipped steps out."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

import train_cifar
from mpfp16.convert import to_half
from mpfp16.errors import CheckpointError, UserError
from mpfp16.flat_buffers import flatten_parameters
from mpfp16.optimizer import FP16Optimizer
from mpfp16.train import engine
from mpfp16.train.checkpointing import check_training_state
from mpfp16.train.config import TrainConfig
from mpfp16.train.ema import ModelEMA, average_, check_options, ema_decay, is_state
from mpfp16.train.models import resnet9
from run_helpers import assert_same_final_state, poison_step, records, run_main

TINY_CIFAR = ["-a", "resnet9-w4", "-b", "16", "--no-progress", "-p", "1"]  # tests/test_scripts.py's
EMA = ["--model-ema", "--model-ema-decay", "0.999"]


def torchvision_ema(model: nn.Module, decay: float) -> AveragedModel:
    """torchvision's utils.ExponentialMovingAverage (references/classification/utils.py)."""
    def ema_avg(avg_model_param, model_param, num_averaged):
        return decay * avg_model_param + (1 - decay) * model_param

    return AveragedModel(model, "cpu", ema_avg, use_buffers=True)


def small_run(dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    model = resnet9(4, 10)
    if dtype == torch.float32:
        flatten_parameters(model)
    else:
        to_half(model, dtype)
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                        loss_scale="dynamic" if dtype == torch.float16 else None, model=model)
    return model, opt


def one_step(model, opt, seed: int, nan: bool = False) -> bool:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    if nan:
        x[0] = float("nan")
    model.train()
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x).float(), y))
    return opt.step()


def masters_model(model, opt, like: nn.Module) -> nn.Module:
    """An fp32 copy of ``model`` holding its masters and its buffers: what torchvision's
    EMA would average, were its model's weights the masters."""
    names = {id(p): n for n, p in model.named_parameters()}
    params, buffers = dict(like.named_parameters()), dict(like.named_buffers())
    with torch.no_grad():
        for p, value in zip(opt.model_params(), opt.trained_values()):
            params[names[id(p)]].copy_(value)
        for name, b in model.named_buffers():
            buffers[name].copy_(b)
    return like


# ----------------------------------------------------------------- the average


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_the_average_is_torchvisions_of_the_masters_bit_for_bit(dtype):
    """Of an fp32 model, ModelEMA is torchvision's ExponentialMovingAverage, bit for bit
    (parameters, BatchNorm statistics, num_batches_tracked truncated as torchvision's
    arithmetic truncates it); of a 16-bit one, it is torchvision's average of a model
    whose weights are the fp32 masters."""
    model, opt = small_run(dtype)
    decay = 0.9
    ema = ModelEMA(model, opt, decay=decay, every=1)
    assert all(t.dtype == torch.float32 for t in ema.module.state_dict().values() if t.is_floating_point())
    shadow = copy.deepcopy(ema.module)
    reference = torchvision_ema(shadow, decay)
    for step in range(4):
        stepped = one_step(model, opt, step)
        assert ema.after_step(0, stepped) == stepped
        if stepped:
            reference.update_parameters(masters_model(model, opt, shadow))
    mine, theirs = ema.module.state_dict(), reference.module.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
    assert ema.n_averaged == int(reference.n_averaged) == ema.updates > 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_average_is_torchvisions_arithmetic_in_any_dtype(dtype):
    torch.manual_seed(0)
    avg, value = torch.randn(1000).to(dtype), torch.randn(1000).to(dtype)
    expected = 0.999 * avg + (1 - 0.999) * value
    average_([avg], [value], 0.999)
    assert torch.equal(avg, expected)


def test_a_16_bit_average_loses_what_the_masters_average_keeps():
    """At torchvision's decay, an fp16 average of the fp16 weights (torchvision's EMA
    of an fp16 model) stays where it started; the fp32 one of the masters moves."""
    model, opt = small_run(torch.float16)
    ema = ModelEMA(model, opt, decay=0.99998, every=1)
    theirs = torchvision_ema(model, 0.99998)
    conv, updates, seed = "0.0.weight", 0, 0
    while updates < 6:
        seed += 1
        if not one_step(model, opt, seed):
            continue  # a skipped step (the first loss scale): no update in either
        ema.after_step(0, True)
        theirs.update_parameters(model)
        updates += 1
        if updates == 1:  # the first update copies
            start_theirs = theirs.module.state_dict()[conv].clone()
            start_mine = ema.module.state_dict()[conv].clone()
    assert theirs.module.state_dict()[conv].dtype == torch.float16
    assert (theirs.module.state_dict()[conv] != start_theirs).float().mean() < 0.01  # nearly every update lost
    assert (ema.module.state_dict()[conv] != start_mine).float().mean() > 0.9


def test_updates_fall_every_n_trained_steps_of_an_epoch_and_the_warm_up_resets():
    """torchvision's ``i % model_ema_steps == 0``, ``i`` counting the trained steps of the
    epoch from 0: a skipped step is neither averaged nor counted; each epoch starts its
    count again; in the warm-up epochs each update is followed by a reset, so the next
    one copies the model."""
    model, opt = small_run(torch.float32)
    ema = ModelEMA(model, opt, decay=0.5, every=3, warmup_epochs=1)
    # epoch 0 (warm-up): trained, skipped, trained x 3, ...
    pattern = [(0, True), (0, False), (0, True), (0, True), (0, True), (0, True), (1, True), (1, False), (1, True),
               (1, True), (1, True)]
    updated = [ema.after_step(epoch, stepped) for epoch, stepped in pattern]
    # epoch 0's trained steps are 0..4 (the skipped one apart): updates at 0 and 3; epoch 1's at 0 and 3
    assert updated == [True, False, False, False, True, False, True, False, False, False, True]
    assert ema.updates == 4 and ema.epoch == 1 and ema.epoch_steps == 4
    assert ema.n_averaged == 2  # reset to 0 after each warm-up update, then counted from 0 in epoch 1

    copied = ModelEMA(model, opt, decay=0.5, every=1, warmup_epochs=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    copied.after_step(0, True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    copied.after_step(0, True)  # in the warm-up: a copy, not an average
    assert all(torch.equal(e, p) for e, p in zip(copied.module.parameters(), model.parameters()))


def test_the_decay_is_adjusted_as_torchvision_adjusts_it():
    adjust = 8 * 128 * 32 / 600
    assert ema_decay(8, 128, 1, 32, 600, 0.99998) == 1.0 - min(1.0, (1.0 - 0.99998) * adjust)
    assert ema_decay(2, 64, 2, 32, 600, 0.99998) == ema_decay(2, 128, 1, 32, 600, 0.99998)  # samples per step
    assert ema_decay(1, 512, 1, 32, 1, 0.9) == 0.0  # alpha capped at 1: the average is the model


def test_the_state_round_trips_and_a_damaged_one_is_refused():
    model, opt = small_run(torch.float16)
    ema = ModelEMA(model, opt, decay=0.9, every=2)
    for step in range(3):
        ema.after_step(0, one_step(model, opt, step))
    ema.record(12.5, 1)
    state = copy.deepcopy(ema.state_dict())
    assert is_state(state)
    fresh = ModelEMA(*small_run(torch.float16, seed=1), decay=0.9, every=2)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.module.state_dict().values(), state["module"].values()))
    assert (fresh.n_averaged, fresh.epoch_steps, fresh.updates, fresh.best_acc1, fresh.best_epoch) == \
        (ema.n_averaged, ema.epoch_steps, ema.updates, 12.5, 1)
    wider = to_half(resnet9(8, 10))
    other = ModelEMA(wider, FP16Optimizer(torch.optim.SGD(wider.parameters(), lr=0.1), model=wider), decay=0.9,
                     every=2)
    with pytest.raises(ValueError, match="its EMA does not fit this model"):
        other.load_state_dict(state)

    base = {"scheduler": {"last_epoch": 0, "base_lrs": [0.1]}, "step": 0, "epoch": 0, "batches_done": 0,
            "best_acc1": -1.0, "best_epoch": None, "rng": [{"torch": torch.zeros(4, dtype=torch.uint8),
                                                           "python": (3, (1, 2), None)}]}
    check_training_state({**base, "model_ema": state}, "x.pt")
    for damaged in ({**state, "n_averaged": -1}, {**state, "module": [1]}, {**state, "epoch_steps": "3"}, [1]):
        with pytest.raises(CheckpointError, match="its 'model_ema' is"):
            check_training_state({**base, "model_ema": damaged}, "x.pt")


def test_shard_is_refused_in_one_line():
    cfg = TrainConfig(task="cifar", model_ema=True, shard=True)
    with pytest.raises(UserError, match="--model-ema keeps an fp32 average of the whole masters, and --shard"):
        check_options(cfg)
    check_options(dataclasses.replace(cfg, shard=False))
    check_options(dataclasses.replace(cfg, model_ema=False))


# ----------------------------------------------------------------- the engine's step and loss


def test_the_epoch_loss_is_over_the_steps_that_trained():
    losses = engine._Losses(torch.device("cpu"))
    for loss, trained in [(2.0, True), (float("nan"), False), (4.0, True)]:
        losses.add(torch.tensor(loss), trained)
    assert float(losses.mean()) == 3.0 and (losses.trained_steps, losses.skipped_steps) == (2, 1)
    skipped = engine._Losses(torch.device("cpu"))
    skipped.add(torch.tensor(5.0), False)
    assert float(skipped.mean()) == 5.0  # a record whose steps all skipped: their own loss


def test_a_step_takes_soft_targets_and_hard_ones():
    """Mixup's soft targets (class probabilities, floating) train as F.cross_entropy
    takes them, in fp32; one-hot ones give the hard labels' step."""
    from mpfp16.train.state import TrainState

    def trainer(seed=0):
        torch.manual_seed(seed)
        t = engine.Trainer.__new__(engine.Trainer)
        t.cfg, t.device, t.state = TrainConfig(task="cifar", accum_steps=1, label_smoothing=0.1), \
            torch.device("cpu"), TrainState()
        t.model = t.ddp = flatten_parameters(nn.Linear(4, 3))
        t.opt = FP16Optimizer(torch.optim.SGD(t.model.parameters(), lr=1.0), loss_scale=None, model=t.model)
        t.sched = torch.optim.lr_scheduler.LambdaLR(t.opt, lambda step: 1.0)
        t._prepare = lambda x: x
        return t

    images, labels = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    hard, one_hot = trainer(), trainer()
    loss_hard = hard.train_step(iter([(images, labels)]))
    loss_one_hot = one_hot.train_step(iter([(images, nn.functional.one_hot(labels, 3).half())]))
    assert hard.last_stepped and one_hot.last_stepped
    assert torch.allclose(loss_hard, loss_one_hot, rtol=1e-6)
    for p, q in zip(hard.model.parameters(), one_hot.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    soft = trainer()
    targets = torch.softmax(torch.randn(5, 3), dim=1)
    expected = nn.functional.cross_entropy(soft.model(images).detach(), targets, label_smoothing=0.1)
    assert torch.allclose(soft.train_step(iter([(images, targets.half())])), expected, rtol=1e-3)


# ----------------------------------------------------------------- the scripts, end to end


def ema_tensors(path) -> dict:
    return torch.load(path, weights_only=True)["model_ema"]


def assert_same_ema(a_path, b_path) -> None:
    a, b = ema_tensors(a_path), ema_tensors(b_path)
    assert {k: v for k, v in a.items() if k != "module"} == {k: v for k, v in b.items() if k != "module"}
    assert a["module"].keys() == b["module"].keys()
    for key in a["module"]:
        assert torch.equal(a["module"][key], b["module"][key]), key


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["--precision", "fp16"],
    ["--precision", "fp16", "-b", "8", "--accum-steps", "2", "--warmup-epochs", "1"],
], ids=["fp16", "fp16-accum-warmup"])
def test_a_resumed_runs_ema_is_the_uninterrupted_runs_bit_for_bit(cifar_root, tmp_path, capsys, extra):
    """10 steps, a stop in mid-epoch, --resume auto to 20 == 20 straight steps: last.pt,
    the EMA's average and counters, bit for bit (an epoch is 12 steps: the resume lands
    in mid-epoch, and the run crosses an epoch's end after it, where the EMA's count
    starts again). The EMA is evaluated after each epoch, and a checkpoint's EMA too."""
    common = [cifar_root, *TINY_CIFAR, "--epochs", "3", *EMA, "--model-ema-steps", "3", *extra]
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    result = run_main(train_cifar.main, common + ["--max-steps", "20", "--checkpoint-dir", str(straight)], capsys)
    assert result[0] == 0, result[1]
    assert "model EMA: fp32, of the fp32 masters, every 3 trained steps" in result.out
    assert result.out.count("| EMA acc1 ") == 2  # epoch 1's end and the stop
    assert run_main(train_cifar.main, common + ["--max-steps", "10", "--checkpoint-dir", str(parts)], capsys)[0] == 0
    assert ema_tensors(parts / "last.pt")["epoch_steps"] == 10
    assert run_main(train_cifar.main, common + ["--max-steps", "20", "--checkpoint-dir", str(parts),
                                                "--resume", "auto"], capsys)[0] == 0
    assert_same_final_state(straight / "last.pt", parts / "last.pt")
    assert_same_ema(straight / "last.pt", parts / "last.pt")
    ema = ema_tensors(parts / "last.pt")
    assert (ema["epoch"], ema["epoch_steps"]) == (1, 8) and ema["updates"] == 4 + 3  # 0, 3, 6, 9; 0, 3, 6
    evals = [r for r in records(parts / "metrics.jsonl") if r["type"] == "eval"]
    assert all({"ema_val_loss", "ema_val_acc1", "ema_val_acc5"} <= set(r) for r in evals)
    final = records(straight / "metrics.jsonl")[-1]
    assert final["ema_updates"] == 7 and final["best_ema_epoch"] == 1

    result = run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, *EMA, "-e", "--resume", str(parts / "last.pt"),
                                         "--checkpoint-dir", str(parts)], capsys)
    assert result[0] == 0, result[1]
    assert "on 40 images | EMA acc1 " in result.out


@pytest.mark.slow
def test_a_stop_in_mid_epoch_does_not_compete_for_best(cifar_root, tmp_path, capsys):
    """2 epochs straight against: a stop at step 5 (before any epoch ended), a resume
    to step 18 (a stop in epoch 2's middle), a resume to the end. The stops' evaluations
    are logged but compete for nothing, so best.pt, best_acc1 and best_epoch are the
    uninterrupted run's (they were the stop's before)."""
    common = [cifar_root, *TINY_CIFAR, "--epochs", "2"]
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    assert run_main(train_cifar.main, common + ["--checkpoint-dir", str(straight)], capsys)[0] == 0
    result = run_main(train_cifar.main, common + ["--max-steps", "5", "--checkpoint-dir", str(parts)], capsys)
    assert result[0] == 0, result[1]
    assert "stopped at step 5 in mid-epoch (this evaluation does not compete for best)" in result.out
    assert "done: no epoch has ended, so nothing competed for best" in result.out
    early = torch.load(parts / "best.pt", weights_only=True)  # a run stopped before an epoch ended has one
    assert early["step"] == 5 and early["best_epoch"] is None and early["best_acc1"] == -1.0
    assert run_main(train_cifar.main, common + ["--max-steps", "18", "--checkpoint-dir", str(parts),
                                                "--resume", "auto"], capsys)[0] == 0
    mid = torch.load(parts / "best.pt", weights_only=True)
    assert mid["step"] == 12 and mid["best_epoch"] == 1  # epoch 1's end, not the stop at 18
    assert run_main(train_cifar.main, common + ["--checkpoint-dir", str(parts), "--resume", "auto"], capsys)[0] == 0
    assert_same_final_state(straight / "best.pt", parts / "best.pt")
    assert_same_final_state(straight / "last.pt", parts / "last.pt")
    a, b = (torch.load(d / "best.pt", weights_only=True) for d in (straight, parts))
    assert (a["best_acc1"], a["best_epoch"]) == (b["best_acc1"], b["best_epoch"])
    finals = [records(d / "metrics.jsonl")[-1] for d in (straight, parts)]
    assert finals[0]["best_acc1"] == finals[1]["best_acc1"] and finals[0]["best_epoch"] == finals[1]["best_epoch"]
    evals = [r for r in records(parts / "metrics.jsonl") if r["type"] == "eval"]
    assert [(r["step"], r["epoch_end"]) for r in evals] == [(5, False), (12, True), (18, False), (24, True)]


@pytest.mark.slow
def test_one_skipped_step_leaves_the_epoch_loss_finite(cifar_root, tmp_path, capsys, monkeypatch):
    """One NaN image in the second step's batch: that step is skipped, and the epoch's
    train loss (printed, and in the metrics) is over the 11 steps that trained, with 1
    skipped; a logged window's loss too. The EMA neither averages nor counts it."""
    poison_step(monkeypatch, 1)
    metrics = tmp_path / "m.jsonl"
    result = run_main(train_cifar.main, [cifar_root, *TINY_CIFAR, "-p", "4", "--epochs", "1", "--model-ema",
                                         "--model-ema-steps", "1", "--checkpoint-dir", str(tmp_path), "--metrics",
                                         str(metrics)], capsys)
    assert result[0] == 0, result[1]
    line = next(x for x in result.out.splitlines() if x.startswith("epoch 1/1: train loss "))
    assert "(11 steps trained, 1 skipped)" in line and "nan" not in line
    recs = records(metrics)
    train = [r for r in recs if r["type"] == "train"]
    assert [r["step"] for r in train] == [4, 8, 12] and all(r["loss"] is not None and r["loss"] > 0 for r in train)
    [evaluation] = [r for r in recs if r["type"] == "eval"]
    assert math.isfinite(evaluation["train_loss"]) and evaluation["train_loss"] > 0
    assert (evaluation["train_steps"], evaluation["train_skipped"]) == (11, 1)
    assert recs[-1]["skipped_steps"] == 1 and recs[-1]["ema_updates"] == 11


def ddp_worker(rank, argv):
    """One rank of a 2-process run."""
    from dist_helpers import run_captured

    return run_captured("train_cifar", argv)


@pytest.mark.slow
def test_every_rank_keeps_the_same_ema(cifar_root, tmp_path):
    """2 processes, the replicas compared at every step, the EMA's included."""
    from dist_helpers import run_workers

    argv = [cifar_root, *TINY_CIFAR, "--precision", "bf16", "--epochs", "1", *EMA, "--model-ema-steps", "2",
            "--check-replicas", "1", "--checkpoint-dir", str(tmp_path / "ck")]
    results = run_workers(ddp_worker, tmp_path / "out", args=(argv,), timeout=240)
    assert [r["status"] for r in results] == [0, 0], results[0]["stderr"][-2000:]
    assert "replicas: identical at" in results[0]["stdout"]
    ema = ema_tensors(tmp_path / "ck" / "last.pt")
    assert ema["updates"] == 3  # 6 steps of 2 x 16: updates at 0, 2, 4
