"""A skipped step names its culprits: ``opt.last_overflow``, the skip's log line and
LossScaleStuckError, against inf and NaN placed by hand at known parameters
(docs/OVERFLOW.md). The two-rank cases are in tests/test_distributed.py and
tests/test_sharding.py (their worker groups), the training scripts' record in
tests/test_scripts.py."""

import json
import logging

import pytest
import torch
import torch.nn as nn

import mpfp16
import mpfp16.compat.apex as A
from mpfp16.overflow import OVERFLOW_REPORTED
from mpfp16.stores.nonfinite import find_nonfinite
from reference import batches, tiny_mlp

NAN, INF = float("nan"), float("inf")
# tiny_mlp: 0.weight [16, 8], 0.bias, 1.weight, 1.bias (LayerNorm, fp32), 3.weight [4, 16], 3.bias [4]
NAMED = [{"name": "0.weight", "kind": "inf", "count": 4, "ranks": []},
         {"name": "3.bias", "kind": "nan", "count": 1, "ranks": []}]
UNNAMED = [{**NAMED[0], "name": "param 0 [16, 8]"}, {**NAMED[1], "name": "param 5 [4]"}]
LINE = "inf in 0.weight (4), nan in 3.bias (1)"


@torch.no_grad()
def poison(model):
    """After a backward: four infs in 0.weight (one negative); in 3.bias one NaN and
    two infs (a NaN wins, and its NaNs are counted)."""
    model[0].weight.grad[1, :3] = INF
    model[0].weight.grad[2, 0] = -INF
    model[3].bias.grad[0] = NAN
    model[3].bias.grad[1:3] = INF


def backward(model, opt, seed=0):
    x, y = batches(1, seed=seed + 1)[0]
    opt.backward(nn.functional.cross_entropy(model(x).float(), y))


def per_tensor_model(dtype=torch.float16):
    """A 16-bit model whose parameters can no longer move (their gradient accumulators
    held, as DDP holds them): the optimizer gives it the per-tensor store."""
    model = mpfp16.to_half(tiny_mlp(0), dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.detach().clone()
    model._held = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
    return model


STORES = {
    "flat": dict(fused=False),
    "flat-no-masters": dict(fused=False, master_weights=False),
    "fused": dict(fused=True),
    "fused-no-masters": dict(fused=True, master_weights=False),
    "fused-unscale_": dict(fused=True, unscale=True),   # the fused step then reads the fp32 gradients
    "flat-unscale_": dict(fused=False, unscale=True),
    "per-tensor": dict(per_tensor=True),
    "per-tensor-no-masters": dict(per_tensor=True, master_weights=False),
    "bf16": dict(fused=False, dtype=torch.bfloat16),
}


def build(per_tensor=False, dtype=torch.float16, named=True, **kw):
    kw.pop("unscale", None)
    model = per_tensor_model(dtype) if per_tensor else mpfp16.to_half(tiny_mlp(0), dtype)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model=model if named else None, **kw)
    return model, opt


@pytest.mark.parametrize("name", list(STORES))
def test_the_parameters_that_held_inf_and_nan_are_named_with_their_counts(name):
    settings = STORES[name]
    model, opt = build(**settings)
    assert opt.store.kind == ("per-tensor" if settings.get("per_tensor") else "flat")
    assert opt.last_overflow == []  # before any step
    opt.zero_grad()
    backward(model, opt)
    poison(model)
    if settings.get("unscale"):
        opt.unscale_()
    weights = [p.detach().clone() for p in model.parameters()]
    assert not opt.step()
    assert opt.last_overflow == NAMED
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))  # still skipped, nothing moved
    json.dumps(opt.last_overflow)
    opt.zero_grad()
    backward(model, opt)
    assert opt.step() and opt.last_overflow == []  # a clean step clears it


@pytest.mark.parametrize("fused", [False, True])
def test_without_a_model_a_parameter_is_its_index_and_shape(fused):
    model, opt = build(named=False, fused=fused)
    opt.zero_grad()
    backward(model, opt)
    poison(model)
    assert not opt.step() and opt.last_overflow == UNNAMED


def test_the_first_few_in_parameter_order_and_the_rank_whose_loss_was_nan():
    """A NaN loss makes every gradient NaN (no ReLU, whose backward would zero some):
    the first OVERFLOW_REPORTED parameters are named, each wholly NaN, and the loss
    of rank 0 (the only one) is said to be non-finite."""
    torch.manual_seed(0)
    model = mpfp16.to_half(nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)]))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    opt.zero_grad()
    opt.backward(model(torch.randn(2, 4)).float().sum() * NAN)
    assert not opt.step()
    names = [n for n, _ in model.named_parameters()][:OVERFLOW_REPORTED]
    assert OVERFLOW_REPORTED == 8 and len(names) == 8
    assert opt.last_overflow == [{"name": n, "kind": "nan", "count": p.numel(), "ranks": [0]}
                                 for n, p in list(model.named_parameters())[:8]]


def test_the_skip_log_line_names_them(caplog):
    model, opt = build()
    with caplog.at_level(logging.INFO, logger="mpfp16"):
        opt.zero_grad()
        backward(model, opt)
        poison(model)
        opt.step()
        torch.manual_seed(0)
        wide = mpfp16.to_half(nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]))
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(wide.parameters(), lr=0.1), model=wide)
        opt.zero_grad()
        opt.backward(wide(torch.randn(2, 4)).float().sum() * NAN)
        opt.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "mpfp16"]
    assert lines == [
        f"step 1 skipped: inf/NaN in the gradients: {LINE}; loss scale 65536 -> 32768 (1 skipped so far)",
        "step 1 skipped: inf/NaN in the gradients: nan in 0.weight (16), nan in 0.bias (4), nan in 1.weight (16) "
        "and 3 more, the loss non-finite on rank 0; loss scale 65536 -> 32768 (1 skipped so far)"]


def test_a_stuck_scale_names_the_layers_that_kept_overflowing():
    model = mpfp16.to_half(tiny_mlp(0))
    scaler = mpfp16.DynamicLossScaler(init_scale=2.0, min_scale=1.0, stuck_after=2)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=scaler, model=model)
    with pytest.raises(mpfp16.LossScaleStuckError) as err:
        for _ in range(5):
            opt.zero_grad()
            backward(model, opt)
            poison(model)
            opt.step()
    message = str(err.value)
    assert message.startswith("loss scale stuck at 1: the gradients held inf/NaN on 2 consecutive steps")
    assert message.endswith(f" At the last step: {LINE}.") and "\n" not in message
    assert err.value.overflow == NAMED and opt.skipped_steps == 3


def test_find_nonfinite_against_counts_by_hand():
    a = torch.tensor([1.0, NAN, INF, -INF, NAN], dtype=torch.bfloat16)  # 2 NaN, 2 inf
    b = torch.tensor([1.0, 65504.0, -65504.0], dtype=torch.float16)      # the largest finite fp16: finite
    c = torch.tensor([[-INF, 0.0], [3.0, INF]])                          # 2 inf, fp32
    d = torch.full((3,), NAN, dtype=torch.float16)[1:]                    # a view: 2 NaN
    pairs = [(7, a), (1, b), (4, c), (2, None), (3, torch.empty(0)), (0, d)]
    assert find_nonfinite(pairs, 8) == [(0, 2, 0), (4, 0, 2), (7, 2, 2)]
    assert find_nonfinite(pairs, 2) == [(0, 2, 0), (4, 0, 2)]  # the smallest indices first
    assert find_nonfinite([(0, b)], 8) == []


def test_apex_compat_names_them_in_its_log_line_and_its_stuck_error(caplog):
    model = mpfp16.to_half(tiny_mlp(0))
    opt = A.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                           dynamic_loss_args={"init_scale": 2.0, "min_loss_scale": 1.0}, verbose=False)
    x, y = batches(1)[0]
    with caplog.at_level(logging.INFO, logger="mpfp16"), pytest.raises(mpfp16.LossScaleStuckError) as err:
        for _ in range(10):
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x).float(), y), update_master_grads=False)
            poison(model)
            opt.update_master_grads()
            assert opt.last_overflow == UNNAMED
            opt.step()
    first = [r.getMessage() for r in caplog.records if r.name == "mpfp16"][0]
    unnamed = "inf in param 0 [16, 8] (4), nan in param 5 [4] (1)"
    assert first == f"Gradient overflow. Skipping step, loss scale reduced to 1 (inf/NaN: {unnamed})"
    assert str(err.value).endswith(f" At the last step: {unnamed}.") and "\n" not in str(err.value)
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x).float(), y))
    opt.step()
    assert opt.last_overflow == []


@pytest.mark.parametrize("fused", [False, True])
def test_under_fp32_accumulation_the_fp32_sum_is_scanned(fused):
    """With accumulate_dtype=torch.float32 the 16-bit gradients are zero after each
    backward and the micro-batches' sum is in fp32: a term of the second micro-batch's
    loss whose gradient, scaled, exceeds fp16 (1e4 * 65536) makes 3.bias's four
    elements inf there, and there only."""
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, fused=fused,
                               accumulate_dtype=torch.float32)
    assert all(g.accumulating for g in opt.store.groups if g.half)
    opt.zero_grad()
    backward(model, opt)
    x, y = batches(1, seed=2)[0]
    opt.backward(nn.functional.cross_entropy(model(x).float(), y) + (model[3].bias.float() * 1e4).sum())
    assert not opt.step()
    assert opt.last_overflow == [{"name": "3.bias", "kind": "inf", "count": 4, "ranks": []}]
