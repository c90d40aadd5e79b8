"""FP16Optimizer against the plain-torch reference in tests/reference.py."""

import io
import math

import pytest
import torch
import torch.nn as nn

import mpfp16
from reference import (OPTIMIZERS, ReferenceTrainer, assert_same_params, backward_both, batches, make_inner,
                       saved_masters, step_both, tiny_mlp, train_mpfp16, train_reference)

DTYPES = [torch.float16, torch.bfloat16]


def pair(dtype=torch.float16, norm=True, seed=0):
    """Two identical 16-bit models: one for mpfp16, one for the reference."""
    return (mpfp16.to_half(tiny_mlp(seed, norm), dtype), mpfp16.to_half(tiny_mlp(seed, norm), dtype))


def static_scale(dtype):
    return 1024.0 if dtype == torch.float16 else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_matches_reference_bit_for_bit(kind, master_weights, dtype):
    model, ref_model = pair(dtype)
    scale = static_scale(dtype)
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=scale,
                               master_weights=master_weights)
    data = batches(6)
    assert all(train_mpfp16(model, opt, data))
    train_reference(ref_model, kind, data, scale=scale or 1.0, master_weights=master_weights)
    assert_same_params(model, ref_model)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_masters_match_reference_masters(kind):
    model, ref_model = pair()
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=512.0)
    data = batches(5)
    train_mpfp16(model, opt, data)
    ref = train_reference(ref_model, kind, data, scale=512.0)
    for mine, theirs in zip(opt.master_params(), ref.masters):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    # The inner optimizer's state is the fp32 reference's state, tensor for tensor.
    for mine, theirs in zip(opt.master_params(), ref.masters):
        for key, value in ref.opt.state[theirs].items():
            torch.testing.assert_close(opt.state[mine][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("foreach", [False, True])
def test_foreach_inner_optimizer(foreach):
    """The unfused step runs the inner optimizer's own step, foreach or not, bit for
    bit. (Left to the default, foreach=True takes the fused step: tests/test_fused.py.)"""
    model, ref_model = pair()
    opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters(), foreach=foreach), loss_scale=256.0,
                               fused=False)
    data = batches(4)
    train_mpfp16(model, opt, data)
    train_reference(ref_model, "adamw", data, scale=256.0, foreach=foreach)
    assert_same_params(model, ref_model)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_clipping_matches_clip_grad_norm(kind):
    model, ref_model = pair()
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=128.0, max_grad_norm=0.05)
    data = batches(4)
    train_mpfp16(model, opt, data)
    train_reference(ref_model, kind, data, scale=128.0, max_grad_norm=0.05)
    assert_same_params(model, ref_model)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # it did clip


def test_grad_norm_is_the_unscaled_norm():
    model, ref_model = pair()
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=4096.0, track_grad_norm=True)
    ref = ReferenceTrainer(ref_model, "sgd", scale=4096.0)
    backward_both(model, opt, ref_model, ref, *batches(1)[0])
    expected = torch.nn.utils.get_total_norm([p.grad.float() / 4096.0 for p in ref_model.parameters()])
    opt.step()
    assert opt.last_grad_norm == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("master_weights", [True, False])
def test_gradient_accumulation(master_weights):
    model, ref_model = pair()
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=256.0,
                               master_weights=master_weights)
    data = batches(8)
    train_mpfp16(model, opt, data, accum=4)
    train_reference(ref_model, "sgd", data, scale=256.0, accum=4, master_weights=master_weights)
    assert_same_params(model, ref_model)


def _snapshot(model, opt):
    state = {k: (v.clone() if torch.is_tensor(v) else v)
             for i, s in enumerate(opt.state.values()) for k, v in ((f"{i}.{k}", v) for k, v in s.items())}
    masters = [m.clone() for m in opt.master_params()] if opt.master_weights else []
    return [p.detach().clone() for p in model.parameters()], masters, state


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("master_weights", [True, False])
def test_skipped_step_changes_nothing(kind, master_weights):
    model, _ = pair()
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), master_weights=master_weights)
    data = batches(3)
    train_mpfp16(model, opt, data[:2])  # some optimizer state, Adam's step counter included
    before = _snapshot(model, opt)
    scale = opt.loss_scale

    x, y = data[2]
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    model[0].weight.grad[0, 0] = float("inf")
    assert opt.step() is False

    after = _snapshot(model, opt)
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        assert torch.equal(a, b)
    assert before[2].keys() == after[2].keys()
    for k in before[2]:
        assert torch.equal(torch.as_tensor(before[2][k]), torch.as_tensor(after[2][k])), k
    if kind == "adam":
        assert all(float(s["step"]) == 2 for s in opt.state.values())
    assert opt.loss_scale == scale / 2
    assert opt.skipped_steps == 1
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_gradients_skip_in_every_mode(bad, dtype):
    model, _ = pair(dtype)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    model[1].weight.grad[0] = bad  # the fp32 LayerNorm weight
    assert opt.step() is False
    assert opt.skipped_steps == 1


def test_bf16_uses_no_loss_scaling():
    model, _ = pair(torch.bfloat16)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.loss_scale == 1.0 and not opt.scaler.dynamic
    fp16_model, _ = pair(torch.float16)
    assert mpfp16.FP16Optimizer(torch.optim.SGD(fp16_model.parameters(), lr=0.1)).scaler.dynamic


def test_fp32_model_is_stepped_like_plain_torch():
    model, ref_model = tiny_mlp(0), tiny_mlp(0)
    opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), loss_scale=None)
    ref_opt = make_inner("adamw", ref_model.parameters())
    for x, y in batches(4):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref_model(x), y).backward()
        ref_opt.step()
    assert_same_params(model, ref_model)


def test_dynamic_scale_matches_grad_scaler_on_a_model():
    """Same overflows (injected by hand) give the same scales and skips as GradScaler."""
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               loss_scale=mpfp16.DynamicLossScaler(2.0**10, growth_interval=3,
                                                                   min_scale=None, max_scale=None))
    ref_model = tiny_mlp(0)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    overflows = [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    for (x, y), overflow in zip(batches(len(overflows)), overflows):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        ref_opt.zero_grad()
        gs.scale(nn.functional.cross_entropy(ref_model(x), y)).backward()
        if overflow:
            model[0].bias.grad[0] = float("inf")
            ref_model[0].bias.grad[0] = float("inf")
        before = ref_model[0].bias.detach().clone()
        stepped = opt.step()
        gs.step(ref_opt)
        gs.update()
        assert stepped == (not torch.equal(before, ref_model[0].bias))
        assert opt.loss_scale == gs.get_scale()
    assert opt.skipped_steps == sum(overflows)


def test_stuck_scale_raises_with_step_and_causes():
    model = mpfp16.to_half(tiny_mlp(0))
    scaler = mpfp16.DynamicLossScaler(init_scale=4.0, min_scale=1.0, stuck_after=3)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=scaler)
    x, y = batches(1)[0]
    x = x.clone()
    x[0, 0] = float("nan")
    with pytest.raises(mpfp16.LossScaleStuckError, match=r"stuck at 1.*step 5.*NaN") as err:
        for _ in range(10):
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
    assert "\n" not in str(err.value)
    assert opt.skipped_steps == 5  # 4 -> 2 -> 1, then three overflows at the floor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unscaled_runs_stop_on_persistent_nan(dtype):
    model = tiny_mlp(0) if dtype == torch.float32 else mpfp16.to_half(tiny_mlp(0), dtype)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=None)
    x, y = batches(1)[0]
    with pytest.raises(mpfp16.LossScaleStuckError, match="step 4"):
        for _ in range(10):
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x), y) * float("nan"))
            opt.step()


def test_skip_is_logged_once_per_event(caplog):
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    with caplog.at_level("INFO", logger="mpfp16"):
        for overflow in (True, False, True):
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x), y))
            if overflow:
                model[0].weight.grad[0, 0] = float("nan")
            opt.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "mpfp16"]
    assert len(lines) == 2
    assert "step 1 skipped" in lines[0] and "65536 -> 32768" in lines[0]
    assert "step 3 skipped" in lines[1]


def test_micikevicius_small_updates_need_masters():
    """Micikevicius et al. 2018, 3.1: 1 + 1e-4 rounds back to 1 in fp16, so without
    master weights the updates are lost; with them they accumulate."""
    results = {}
    for master_weights in (True, False):
        w = nn.Parameter(torch.ones(1, dtype=torch.float16))
        opt = mpfp16.FP16Optimizer(torch.optim.SGD([w], lr=1.0), master_weights=master_weights)
        for _ in range(100):
            opt.zero_grad()
            opt.backward((w.float() * -1e-4).sum())  # gradient -1e-4: each step adds 1e-4
            assert opt.step()
        results[master_weights] = w.item()
    assert results[False] == 1.0
    assert results[True] == pytest.approx(1.01, abs=1e-3)


def test_memory_bytes_per_param():
    def report(master_weights, dtype=torch.float16):
        torch.manual_seed(0)
        model = mpfp16.to_half(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)), dtype)  # no alignment gaps
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   loss_scale=8.0 if dtype == torch.float16 else None, master_weights=master_weights)
        x = torch.randn(4, 32)
        opt.zero_grad()
        opt.backward(model(x).float().mean())
        assert opt.step()
        return opt.memory_bytes_per_param()

    masters, plain = report(True), report(False)
    assert masters == {"model_weights": 2.0, "model_grads": 2.0, "master_weights": 4.0,
                       "master_grads": 4.0, "optimizer_state": 4.0, "compensation": 0.0, "master_remainder": 0.0,
                       "total": 16.0}
    assert plain == {"model_weights": 2.0, "model_grads": 2.0, "master_weights": 0.0,
                     "master_grads": 0.0, "optimizer_state": 4.0, "compensation": 0.0, "master_remainder": 0.0,
                     "total": 8.0}
    assert report(False, torch.bfloat16)["total"] == 8.0


def test_params_are_views_of_flat_buffers():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    storages = {(p.dtype, p.untyped_storage().data_ptr()) for p in model.parameters()}
    assert len(storages) == 2  # one fp16 buffer, one fp32 buffer
    for p in model.parameters():
        assert p.data_ptr() % (mpfp16.flat_buffers.ALIGN * p.element_size()) == 0
    assert opt.optimizer.param_groups[0]["params"][0].dtype == torch.float32


def test_channels_last_weights_keep_their_layout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).to(memory_format=torch.channels_last)
    mpfp16.to_half(model)
    before = model[0].weight.detach().clone()
    mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert model[0].weight.grad.stride() == model[0].weight.stride()
    assert torch.equal(model[0].weight, before)


def test_model_zero_grad_is_repaired():
    """model.zero_grad() drops the flat gradient views; the step re-attaches them."""
    model, ref_model = pair()
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=64.0)
    ref = ReferenceTrainer(ref_model, "sgd", scale=64.0)
    for x, y in batches(3):
        model.zero_grad(set_to_none=True)
        opt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        ref.backward(nn.functional.cross_entropy(ref_model(x), y))
        ref.step()
    assert_same_params(model, ref_model)


@pytest.mark.parametrize("kind,fused,unscale", [("adamw", False, False), ("sgd", True, False), ("sgd", True, True)],
                         ids=["unfused-adamw", "fused-sgd", "fused-sgd-unscale_"])
def test_one_host_sync_per_step(monkeypatch, kind, fused, unscale):
    """Unscale, overflow check, clipping and copy-back read one value back to the host,
    on either backend (the fused one compiles in a first, uncounted step)."""
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), max_grad_norm=1.0, fused=fused)
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    if unscale:
        opt.unscale_()
    assert opt.step() and opt.fused == fused
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x2), y2))
    calls = []
    inner_step = opt.optimizer.step

    def uncounted_inner_step():  # AdamW reads its CPU step counter with .item(): not ours
        n = len(calls)
        inner_step()
        del calls[n:]

    monkeypatch.setattr(opt.optimizer, "step", uncounted_inner_step)
    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1])
    if unscale:
        opt.unscale_()
    assert opt.step()
    monkeypatch.undo()
    assert calls == ["item"]


# ----------------------------------------------------------------- state_dict


def _resume_run(kind, master_weights, dtype, split):
    """Train `split` steps, save both state_dicts to bytes, load them into fresh objects
    under weights_only, and train on."""
    data = batches(8)
    scaler = lambda: mpfp16.DynamicLossScaler(2.0**8, growth_interval=2) if dtype == torch.float16 else None

    def fresh():
        model = mpfp16.to_half(tiny_mlp(0), dtype)
        return model, mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=scaler(),
                                           master_weights=master_weights)

    model, opt = fresh()
    train_mpfp16(model, opt, data[:split])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = fresh()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    assert opt2.loss_scale == opt.loss_scale
    train_mpfp16(model2, opt2, data[split:])
    return model2, opt2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("kind", ["nesterov", "adam"])
def test_state_dict_round_trip_continues_bit_identically(kind, master_weights, dtype):
    straight, opt = _resume_run(kind, master_weights, dtype, split=8)
    resumed, opt2 = _resume_run(kind, master_weights, dtype, split=4)
    assert_same_params(straight, resumed)
    assert opt.loss_scale == opt2.loss_scale
    if dtype == torch.float16:
        assert opt.loss_scale > 2.0**8  # the scale grew, so the scaler state mattered


def test_state_dict_holds_masters_and_scaler():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.Adam(model.parameters()))
    train_mpfp16(model, opt, batches(1))
    sd = opt.state_dict()
    masters = [m for m in saved_masters(sd) if m is not None]
    assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)
    assert set(sd["scaler"]) >= {"scale", "growth_tracker", "hysteresis_tracker"}
    assert all(isinstance(v, (int, float)) for v in sd["scaler"].values())
    assert len(sd["optimizer"]["state"]) == 6


def test_load_state_dict_from_another_shape_fails():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(0)
    other = mpfp16.to_half(nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4)))
    other_opt = mpfp16.FP16Optimizer(torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"parameter 0 has shape \[32, 8\] in the state_dict and \[16, 8\] here"):
        opt.load_state_dict(other_opt.state_dict())
    with pytest.raises(ValueError, match="not an FP16Optimizer state_dict"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())


# ----------------------------------------------------------------- schedulers


@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
], ids=["step", "onecycle", "cosine", "lambda"])
def test_lr_schedulers_drive_the_wrapped_step(make_sched):
    model, ref_model = pair()
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=32.0)
    sched = make_sched(opt)
    ref = ReferenceTrainer(ref_model, "sgd", scale=32.0)
    ref_sched = make_sched(ref.opt)
    for x, y in batches(6):
        step_both(model, opt, ref_model, ref, x, y)
        sched.step()
        ref_sched.step()
        assert opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]
    assert_same_params(model, ref_model)


# ----------------------------------------------------------------- misuse


def test_float64_parameter_is_refused():
    model = nn.Linear(4, 4).double()
    with pytest.raises(TypeError, match="torch.float64"):
        mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_params_not_the_models_are_refused():
    model, other = pair()
    with pytest.raises(ValueError, match="not parameters of the model"):
        mpfp16.FP16Optimizer(torch.optim.SGD(other.parameters(), lr=0.1), model=model)


def test_step_without_backward_fails():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="no backward pass"):
        opt.step()
    x, y = batches(1)[0]
    opt.backward(nn.functional.cross_entropy(model(x), y))
    assert opt.step()
    with pytest.raises(RuntimeError, match="no backward pass"):
        opt.step()


def test_unscaled_backward_is_refused_when_scaling():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="outside opt.backward"):
        opt.step()


def test_wrapping_twice_and_closures_are_refused():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already an FP16Optimizer"):
        mpfp16.FP16Optimizer(opt)
    with pytest.raises(ValueError, match="masters of another"):
        mpfp16.FP16Optimizer(torch.optim.SGD(opt.optimizer.param_groups[0]["params"], lr=0.1))
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)


def test_model_converted_after_the_optimizer_is_detected():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model.half()  # re-allocates the fp32 LayerNorm parameters
    x, y = batches(1)[0]
    opt.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match="no longer lives in the FP16Optimizer's flat buffer"):
        opt.step()


@pytest.mark.parametrize("bad", ["static", -1.0, math.inf, True])
def test_bad_loss_scale_is_refused(bad):
    model = mpfp16.to_half(tiny_mlp(0))
    with pytest.raises((ValueError, TypeError), match="loss scale|loss_scale"):
        mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=bad)


def test_frozen_parameters_are_left_alone():
    model = mpfp16.to_half(tiny_mlp(0))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1))
    train_mpfp16(model, opt, batches(2))
    assert torch.equal(model[0].weight, frozen)


# ----------------------------------------------------------------- placement in flat buffers


def test_to_half_places_the_parameters_and_the_optimizer_moves_nothing():
    model = mpfp16.to_half(tiny_mlp(0))
    where = [p.data_ptr() for p in model.parameters()]
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 2  # fp16 and fp32 buffers
    mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert [p.data_ptr() for p in model.parameters()] == where
    mpfp16.to_half(model)  # again: already in place
    assert [p.data_ptr() for p in model.parameters()] == where


def test_a_parameter_whose_gradient_hook_is_held_is_never_moved():
    """DDP holds each parameter's gradient accumulator to hook its allreduce on it;
    moving the parameter would silently cut that hook off. The optimizer then keeps
    those parameters where they are (the per-tensor store), and moving them by hand is
    refused in one line."""
    model = tiny_mlp(0).half()  # converted by hand: not in a flat buffer
    p = model[0].weight
    held = p.view_as(p).grad_fn.next_functions[0][0]  # what DDP's reducer keeps
    where = [q.data_ptr() for q in model.parameters()]
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.store.kind == "per-tensor"
    assert [q.data_ptr() for q in model.parameters()] == where
    with pytest.raises(RuntimeError, match=r"^1 parameters .* would have to move into a flat buffer after "
                                           r"DistributedDataParallel .* before wrapping it in DDP, or build "
                                           r"FP16Optimizer before DDP$"):
        mpfp16.flatten_parameters(model)
    del held
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # nothing holds it now: it may move
    assert opt.store.kind == "flat"


def test_weights_written_after_the_optimizer_was_built_reach_the_masters():
    """model.load_state_dict (or DDP's broadcast from rank 0) writes the 16-bit weights
    after the masters were made: the next step starts from the new weights, exactly as
    an optimizer built after the write would."""
    new_weights = mpfp16.to_half(tiny_mlp(1)).state_dict()
    late = mpfp16.to_half(tiny_mlp(0))
    late_opt = mpfp16.FP16Optimizer(make_inner("sgd", late.parameters()), loss_scale=64.0)
    late.load_state_dict(new_weights)
    early = mpfp16.to_half(tiny_mlp(0))
    early.load_state_dict(new_weights)
    early_opt = mpfp16.FP16Optimizer(make_inner("sgd", early.parameters()), loss_scale=64.0)
    data = batches(3)
    train_mpfp16(late, late_opt, data)
    train_mpfp16(early, early_opt, data)
    assert_same_params(late, early)
    for a, b in zip(late_opt.master_params(), early_opt.master_params()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------- state_dict that does not fit


def _trained_state(dtype=torch.float16, **kw):
    model = mpfp16.to_half(tiny_mlp(0), dtype)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_scale=None, **kw)
    train_mpfp16(model, opt, batches(2))
    return opt.state_dict()


@pytest.mark.parametrize("saved,here,match", [
    (dict(), dict(master_weights=False), "saved with master_weights=True and this optimizer has master_weights=False"),
    (dict(master_weights=False, rounding="stochastic"), dict(master_weights=False, rounding="kahan"),
     "saved with rounding='stochastic' and this optimizer uses rounding='kahan'"),
    (dict(dtype=torch.float16), dict(dtype=torch.bfloat16), "parameter 0 is float16 in the state_dict and bfloat16"),
], ids=["master-weights", "rounding", "dtype"])
def test_a_state_dict_of_another_kind_is_refused_before_anything_changes(saved, here, match):
    state = _trained_state(**saved)
    dtype = here.pop("dtype", torch.float16)
    model = mpfp16.to_half(tiny_mlp(1), dtype)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_scale=None, **here)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state and opt.iteration == 0


def test_a_kahan_buffer_of_another_size_is_refused():
    state = _trained_state(master_weights=False, rounding="kahan")
    first = next(iter(state["params"].values()))
    first["compensation"] = first["compensation"].flatten()[:-16]
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_scale=None,
                               master_weights=False, rounding="kahan")
    with pytest.raises(ValueError, match=r"^parameter 0 has no Kahan compensation of its shape in the state_dict"):
        opt.load_state_dict(state)


@pytest.mark.parametrize("saved_kind,here_kind", [("adamw", "sgd"), ("sgd", "adam"), ("adam", "adamw")])
def test_the_state_of_another_kind_of_inner_optimizer_is_refused(saved_kind, here_kind):
    """torch's load_state_dict takes an Adam state into an SGD, and the next step failed
    with KeyError: 'momentum'."""
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner(saved_kind, model.parameters()), loss_scale=64.0)
    train_mpfp16(model, opt, batches(2))
    state = opt.state_dict()
    other = mpfp16.to_half(tiny_mlp(0))
    here = mpfp16.FP16Optimizer(make_inner(here_kind, other.parameters()), loss_scale=64.0)
    with pytest.raises(ValueError, match=r"^the state_dict holds the state of a (Adam|AdamW|SGD) optimizer and this "
                                         r"FP16Optimizer wraps a (SGD|Adam|AdamW)"):
        here.load_state_dict(state)
    del state["inner_optimizer"]  # written before the name was saved: the groups tell
    if {saved_kind, here_kind} != {"adam", "adamw"}:
        with pytest.raises(ValueError, match=r"^the state_dict's param group 0 has no .*: it was saved by another"):
            here.load_state_dict(state)
    assert not here.state and here.iteration == 0


def _changes_groups(how: str, inner: torch.optim.Optimizer, extra: nn.Module) -> None:
    """Each way the inner optimizer's groups can change under the wrapper."""
    if how == "add_param_group":  # torch's fine-tuning idiom, through the inner optimizer
        inner.add_param_group({"params": extra.parameters(), "lr": 0.01})
    elif how == "params_appended":
        inner.param_groups[0]["params"].append(extra.weight)
    elif how == "group_removed":
        inner.param_groups.pop()
    elif how == "inner_load_state_dict":  # loads neither masters nor scaler; new group list
        inner.load_state_dict(inner.state_dict())


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("how", ["add_param_group", "params_appended", "group_removed", "inner_load_state_dict"])
def test_groups_changed_through_the_inner_optimizer_are_refused_before_anything_moves(how, fused):
    """``inner.add_param_group`` after wrapping stepped the new 16-bit weights with the
    scaled gradient (128x too far) unfused, and never fused, in silence."""
    torch.manual_seed(0)
    a, b = mpfp16.to_half(nn.Linear(8, 8)), mpfp16.to_half(nn.Linear(8, 4))
    groups = [{"params": a.parameters()}, {"params": [nn.Parameter(torch.zeros(3))], "lr": 0.0}]
    inner = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    opt = mpfp16.FP16Optimizer(inner, loss_scale=128.0, fused=fused)
    _changes_groups(how, inner, b)
    before = [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]
    opt.zero_grad()
    opt.backward(b(a(torch.randn(4, 8))).float().pow(2).sum())
    for call in (opt.step, opt.unscale_, opt.state_dict):
        with pytest.raises(RuntimeError, match=r"^the inner optimizer's param.groups (changed|were replaced) after "
                                               r"FP16Optimizer wrapped it") as info:
            call()
        assert "\n" not in str(info.value)
    assert all(torch.equal(x, y) for x, y in zip(before, [*a.parameters(), *b.parameters()]))
    assert not opt.state and opt.iteration == 0


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_a_step_hook_on_the_inner_optimizer_runs_unfused_and_is_refused_fused(kind):
    """The fused step computes the inner optimizer's update without calling its step():
    a hook registered on the inner optimizer never ran there, in silence. It is refused
    in one line before anything moves; unfused, it runs once a step; on the
    FP16Optimizer, it runs once a step either way."""
    for fused in (False, True):
        model = mpfp16.to_half(tiny_mlp(0))
        opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), loss_scale=64.0, fused=fused)
        calls, own = [], []
        getattr(opt, f"register_step_{kind}_hook")(lambda *_: own.append(1))
        handle = getattr(opt.optimizer, f"register_step_{kind}_hook")(lambda *_: calls.append(1))
        if not fused:
            assert all(train_mpfp16(model, opt, batches(2))) and len(calls) == len(own) == 2
            continue
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=rf"^a step {kind}-hook is registered on the inner AdamW .*never run: "
                                               r"register it on the FP16Optimizer.*or pass fused=False$") as info:
            train_mpfp16(model, opt, batches(1))
        assert "\n" not in str(info.value) and not calls
        assert all(torch.equal(x, y) for x, y in zip(before, model.parameters())) and opt.iteration == 0
        handle.remove()
        # the FP16Optimizer's own pre-hook ran before the refused call too, as torch runs pre-hooks
        assert all(train_mpfp16(model, opt, batches(2))) and len(own) == 2 + (kind == "pre")


def test_groups_reloaded_through_the_wrapper_and_lr_changes_are_not_group_changes():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=64.0)
    train_mpfp16(model, opt, batches(2))
    opt.load_state_dict(opt.state_dict())  # the inner optimizer makes new groups: the wrapper shares them
    opt.param_groups[0]["lr"] = 0.01  # what a scheduler does
    assert all(train_mpfp16(model, opt, batches(2)))


@pytest.mark.parametrize("options,words", [
    (dict(max_grad_norm="1.0"), r"^max_grad_norm='1.0' must be a number or None, not str$"),
    (dict(max_grad_norm=True), r"^max_grad_norm=True must be a number or None, not bool$"),
    (dict(master_weights=None), r"^master_weights=None must be True, False or 'remainder', not NoneType$"),
    (dict(fused="yes"), r"^fused='yes' must be True, False or None, not str$"),
    (dict(reduce_overflow=0), r"^reduce_overflow=0 must be True or False, not int$"),
    (dict(track_grad_norm="no"), r"^track_grad_norm='no' must be True or False, not str$"),
    (dict(rounding_seed=1.5), r"^rounding_seed=1.5 must be an int, not float$"),
    (dict(model=[1]), r"^model= must be the torch.nn.Module the parameters belong to, not list$"),
])
def test_options_of_the_wrong_type_are_refused_in_one_line(options, words):
    """``max_grad_norm="1.0"`` failed inside a comparison with a TypeError of its own,
    and ``max_grad_norm=True`` was taken as 1.0."""
    model = mpfp16.to_half(tiny_mlp(0))
    with pytest.raises(TypeError, match=words):
        mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
    assert mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1).max_grad_norm == 1


@pytest.mark.parametrize("loss_scale", [128.0, mpfp16.DynamicLossScaler()], ids=["static", "dynamic-scaler"])
def test_a_loss_scale_over_a_bf16_model_is_refused_as_the_scripts_refuse_it(loss_scale):
    """The scripts refuse ``--loss-scale`` with ``--precision bf16``; the library took
    ``loss_scale=128.`` over bf16 in silence."""
    bf16 = mpfp16.to_half(tiny_mlp(0), torch.bfloat16)
    with pytest.raises(ValueError, match=r"^loss_scale=.* over a model that computes in bfloat16: bf16 has fp32's "
                                         r"exponent range, so its gradients need no loss scaling; pass "
                                         r"loss_scale=None"):
        mpfp16.FP16Optimizer(torch.optim.SGD(bf16.parameters(), lr=0.1), loss_scale=loss_scale)
    for fine in ("dynamic", None, 1.0):
        assert mpfp16.FP16Optimizer(torch.optim.SGD(bf16.parameters(), lr=0.1), loss_scale=fine).loss_scale == 1.0
    fp32 = tiny_mlp(0)  # may compute in fp16 under torch.autocast: a static scale is the user's to choose
    assert mpfp16.FP16Optimizer(torch.optim.SGD(fp32.parameters(), lr=0.1), loss_scale=128.0).loss_scale == 128.0


def _damage_indices(state: dict, how: str) -> None:
    inner = state["optimizer"]
    if how == "duplicated":  # one flipped bit in the pickle: '3' -> '2'
        inner["param_groups"][0]["params"][3] = inner["param_groups"][0]["params"][2]
    elif how == "unknown":
        inner["param_groups"][0]["params"][0] = "99"
    elif how == "fewer":
        inner["param_groups"][0]["params"].pop()
    elif how == "state-key":
        inner["state"]["42"] = inner["state"].pop("0")
    elif how == "state-shape":
        inner["state"]["0"]["momentum_buffer"] = inner["state"]["0"]["momentum_buffer"].flatten()[:3]


@pytest.mark.parametrize("how,words", [
    ("duplicated", r"param group 0 lists parameter '2' twice: its groups must name each of the \d+ parameters once"),
    ("unknown", r"param group 0 lists parameter '99' that is not one of its parameters"),
    ("fewer", r"param group 0 holds \d+ parameters and this optimizer's \d+"),
    ("state-key", r"inner optimizer state is keyed '42', which is not a parameter of its groups"),
    ("state-shape", r"momentum_buffer of parameter '0' has shape \[3\], and the parameter \[16, 8\]"),
])
def test_inner_state_indices_must_be_a_permutation_of_the_parameters(how, words):
    """A duplicated index crashed inside torch's SGD with a shape traceback at the next
    step; now refused at load, before anything changes."""
    state = _trained_state()
    _damage_indices(state, how)
    model = mpfp16.to_half(tiny_mlp(1))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_scale=None)
    with pytest.raises(ValueError, match=f"^the state_dict's .*{words}") as info:
        opt.load_state_dict(state)
    assert "\n" not in str(info.value) and not opt.state and opt.iteration == 0


def test_a_scaler_state_out_of_its_bounds_is_refused_before_anything_loads():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()))
    train_mpfp16(model, opt, batches(2))
    state = opt.state_dict()
    state["scaler"]["scale"] = 2.0 ** 32  # above max_scale 2^24
    other = mpfp16.to_half(tiny_mlp(1))
    here = mpfp16.FP16Optimizer(make_inner("sgd", other.parameters()))
    with pytest.raises(ValueError, match="scale"):
        here.load_state_dict(state)
    assert not here.state and here.iteration == 0 and here.loss_scale == 2.0 ** 16


@pytest.mark.parametrize("seed,words", [
    (2**64, r"^rounding_seed=18446744073709551616 is out of a generator's range: a seed is an int in \[-2\*\*63, "
            r"2\*\*64\)$"),
    (-(2**63) - 1, r"is out of a generator's range"),
    ("3", r"^rounding_seed='3' must be an int, not str$"),
])
def test_a_rounding_seed_a_generator_cannot_take_is_one_line(seed, words):
    model = mpfp16.to_half(tiny_mlp(0))
    with pytest.raises((ValueError, TypeError), match=words):
        mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), master_weights=False, rounding="stochastic",
                             rounding_seed=seed)
    mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), master_weights=False, rounding="stochastic",
                         rounding_seed=2**64 - 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adagrad_built_over_the_16_bit_model_is_the_reference_bit_for_bit(dtype):
    """torch's Adagrad fills its state when it is built (``sum`` in the parameters'
    16-bit dtype, ``initial_accumulator_value`` rounded to it); FP16Optimizer took that
    for a stepped optimizer and refused it. Now Adagrad builds its state again over the
    fp32 masters, in fp32, and the run is the plain-torch reference's, bit for bit. An
    Adagrad that has stepped is still refused."""
    model, ref_model = pair(dtype)
    scale = static_scale(dtype)
    inner = make_inner("adagrad", model.parameters())
    opt = mpfp16.FP16Optimizer(inner, loss_scale=scale)
    data = batches(4)
    assert all(train_mpfp16(model, opt, data))
    assert {s["sum"].dtype for s in inner.state.values()} == {torch.float32}
    train_reference(ref_model, "adagrad", data, scale=scale or 1.0)
    assert_same_params(model, ref_model)
    stepped = torch.optim.Adagrad(nn.Linear(2, 2).parameters())
    for p in stepped.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        mpfp16.FP16Optimizer(stepped)


def _fp16_loss_model():
    """A model that computes its loss itself, in fp16 (as transformers' heads do), and
    returns it cast to fp32 by to_half's output hook."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.fc(x), y)

    torch.manual_seed(0)
    return mpfp16.to_half(Head())


def test_a_16_bit_loss_takes_the_largest_scale_its_gradient_holds():
    """The loss's own gradient is the scale; for a loss computed in fp16 a scale above
    65504 makes it inf at every step: at 2^16 (GradScaler's start) the first step was
    always skipped. The dynamic scale now backs off to 2^15 before the step's first
    backward (through the accumulation count's division too), the step is taken, and
    the growth count starts again, as after GradScaler's back-off. A loss computed in
    fp32 over fp16 outputs keeps 2^16. A static scale above 2^15 is refused in one
    line."""
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    model = _fp16_loss_model()
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    for micro in range(2):
        opt.backward(model(x, y) / 2)
    assert opt.loss_scale == 2.0 ** 15 and opt.step() and opt.skipped_steps == 0
    assert opt.scaler.growth_tracker == 1
    fc = mpfp16.to_half(nn.Linear(4, 3))
    other = mpfp16.FP16Optimizer(torch.optim.SGD(fc.parameters(), lr=0.1))
    other.backward(nn.functional.cross_entropy(fc(x), y))  # fp32: the hook widened the logits
    assert other.loss_scale == 2.0 ** 16 and other.step()
    static = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=2.0 ** 16)
    with pytest.raises(ValueError, match=r"the loss is float16 and the static loss scale 65536 is above the largest "
                                         r"its gradient holds \(32768\)") as exc:
        static.backward(model(x, y))
    assert "\n" not in str(exc.value)
