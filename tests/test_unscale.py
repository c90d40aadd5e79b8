"""The public unscale phase, in the order users write the step: backward, unscale_(),
clip with your own function, step(); and the guard against gradients that did not
come through backward(), with activation checkpointing and double backward."""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import mpfp16
from reference import assert_same_params, batches, make_inner, tiny_mlp

MAX_NORM = 0.05  # small enough that every step clips


def train(model, opt, data, how):
    """``how``: "max_grad_norm" (the constructor clips), "unscale" (unscale_(), then
    clip_grad_norm_ on the master params), or "unscale-twice"."""
    for x, y in data:
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        if how.startswith("unscale"):
            opt.unscale_()
            if how == "unscale-twice":
                opt.unscale_()  # a no-op: the gradients are not divided again
            torch.nn.utils.clip_grad_norm_(opt.master_params(), MAX_NORM)
        assert opt.step()


def run(how, kind="sgd", fused=False, master_weights=True, dtype=torch.float16):
    model = mpfp16.to_half(tiny_mlp(0), dtype)
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=512.0 if dtype == torch.float16
                               else None, master_weights=master_weights, fused=fused,
                               max_grad_norm=MAX_NORM if how == "max_grad_norm" else None)
    train(model, opt, batches(4), how)
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_unscale_then_clip_grad_norm_is_the_max_grad_norm_path(kind, master_weights, dtype):
    a, _ = run("max_grad_norm", kind, master_weights=master_weights, dtype=dtype)
    b, _ = run("unscale", kind, master_weights=master_weights, dtype=dtype)
    c, _ = run("unscale-twice", kind, master_weights=master_weights, dtype=dtype)
    assert_same_params(a, b)
    assert_same_params(a, c)


@pytest.mark.parametrize("master_weights", [True, False])
def test_unscale_with_the_fused_backend(master_weights):
    """The fused kernels then read the unscaled fp32 gradients: SGD is bit-identical to
    the unfused backend given the same clipped gradients, and close to the fused
    max_grad_norm path (whose norm comes from a flat sum of squares)."""
    unfused, _ = run("unscale", master_weights=master_weights)
    fused, opt = run("unscale", fused=True, master_weights=master_weights)
    assert opt.fused
    assert_same_params(unfused, fused)
    clipped_by_constructor, _ = run("max_grad_norm", fused=True, master_weights=master_weights)
    for p, q in zip(fused.parameters(), clipped_by_constructor.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-3, atol=1e-5)


def test_master_params_hold_the_unscaled_gradients_after_unscale():
    model = mpfp16.to_half(tiny_mlp(0))
    ref = tiny_mlp(0)
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=1024.0, fused=True)
    x, y = batches(1)[0]
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    opt.unscale_()
    nn.functional.cross_entropy(ref(x), y).backward()
    for m, p in zip(opt.master_params(), ref.parameters()):
        assert m.grad.dtype == torch.float32
        torch.testing.assert_close(m.grad, p.grad, rtol=2e-2, atol=2e-3)  # fp16 forward against fp32


def test_a_backward_after_unscale_is_refused():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=1024.0)
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    opt.unscale_()
    opt.backward(nn.functional.cross_entropy(model(x2), y2))
    for call in (opt.unscale_, opt.step):  # LayerNorm's fp32 gradients were unscaled in place
        with pytest.raises(RuntimeError, match=r"^a backward pass ran after unscale_\(\) in this step"):
            call()
    opt.zero_grad()  # a new step starts clean
    opt.backward(nn.functional.cross_entropy(model(x), y))
    opt.unscale_()
    assert opt.step()


def test_unscale_follows_grad_scaler_step_for_step():
    """fp32 parameters, a dynamic scale, overflows on purpose: the same weights, scales
    and skips as torch.amp.GradScaler's unscale_ / clip / step / update."""
    torch.manual_seed(0)
    ours_model, theirs_model = tiny_mlp(0), tiny_mlp(0)
    mpfp16.flatten_parameters(ours_model)
    scaler_settings = dict(init_scale=2.0**10, growth_interval=2)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(ours_model.parameters(), lr=0.1, momentum=0.9),
                               loss_scale=mpfp16.DynamicLossScaler(**scaler_settings, min_scale=None,
                                                                   max_scale=None))
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **scaler_settings)
    for step, (x, y) in enumerate(batches(8)):
        if step in (3, 6):
            x = x.clone()
            x[0, 0] = float("inf")
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(ours_model(x), y))
        opt.unscale_()
        torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.5)
        stepped = opt.step()

        theirs_opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(theirs_model(x), y)).backward()
        scaler.unscale_(theirs_opt)
        torch.nn.utils.clip_grad_norm_(theirs_model.parameters(), 0.5)
        scale_before = scaler.get_scale()
        scaler.step(theirs_opt)
        scaler.update()
        assert stepped == (scaler.get_scale() >= scale_before), step
        assert opt.loss_scale == scaler.get_scale(), step
    assert opt.skipped_steps == 2
    assert_same_params(ours_model, theirs_model)


# ----------------------------------------------------------------- the misuse guard


class Checkpointed(nn.Module):
    """tiny_mlp with its middle under activation checkpointing."""

    def __init__(self, reentrant):
        super().__init__()
        self.net = tiny_mlp(0)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.net[0](x)
        if self.reentrant is None:
            h = self.net[2](self.net[1](h))
        else:
            h = checkpoint(lambda t: self.net[2](self.net[1](t)), h, use_reentrant=self.reentrant)
        return self.net[3](h)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("pattern", ["plain", "accumulate", "double-backward"])
def test_activation_checkpointing_and_double_backward_pass_the_guard(reentrant, pattern):
    """Every gradient comes from opt.backward(): the step must accept it, and equal
    the step of the same model without checkpointing."""
    def train_with(checkpointing):
        model = mpfp16.to_half(Checkpointed(reentrant if checkpointing else None))
        opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=2.0**16)
        for x, y in batches(3):
            opt.zero_grad()
            if pattern == "accumulate":
                for half_x, half_y in zip(x.chunk(2), y.chunk(2)):
                    opt.backward(nn.functional.cross_entropy(model(half_x), half_y) / 2)
            elif pattern == "double-backward":
                loss = nn.functional.cross_entropy(model(x), y) / 2
                opt.backward(loss, retain_graph=True)
                opt.backward(loss)
            else:
                opt.backward(nn.functional.cross_entropy(model(x), y))
            assert opt.step()
        return model

    assert_same_params(train_with(True), train_with(False))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_gradient_from_loss_backward_is_still_caught(reentrant):
    model = mpfp16.to_half(Checkpointed(reentrant))
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=2.0**16)
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    nn.functional.cross_entropy(model(x2), y2).backward()  # not scaled
    with pytest.raises(RuntimeError, match="gradients were computed outside opt.backward"):
        opt.step()
