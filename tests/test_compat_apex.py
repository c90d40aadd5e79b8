"""mpfp16.compat.apex against apex's documented semantics (tests/apex_reference.py):
the same weights, masters, skips and loss scales, step for step."""

import io
import logging
import os
import re

import pytest
import torch
import torch.nn as nn

import mpfp16
from apex_reference import ApexReference
from dist_helpers import check, python
from mpfp16.compat import apex as A
from mpfp16.errors import CheckpointError
from reference import batches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def net(seed=0):
    """An MLP with an affine BatchNorm, which apex's BN_convert_float keeps in fp32."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def half_pair(seed=0):
    """Two identical apex-style models: .half(), then affine BatchNorm back to fp32."""
    return A.BN_convert_float(net(seed).half()), A.BN_convert_float(net(seed).half())


INNER = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "nesterov-wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x.half()).float(), y)


def poisoned(data, steps):
    """Batches with an inf on the given steps: forced overflows."""
    out = []
    for i, (x, y) in enumerate(data):
        if i in steps:
            x = x.clone()
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def assert_same(compat_model, compat_opt, ref_model, ref):
    for p, q in zip(compat_model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    masters = [m for group in compat_opt.fp32_from_fp16_groups for m in group]
    ref_masters = [m for m, p in zip(ref.masters, ref.params) if m is not p]
    assert len(masters) == len(ref_masters)
    for m, r in zip(masters, ref_masters):
        assert torch.equal(m, r)


@pytest.mark.parametrize("kind", list(INNER))
@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
def test_dynamic_scaling_with_overflows_matches_apex_step_for_step(kind, clip):
    """Dynamic scale from 2^16 with a window of 3, forced overflows, and the
    clip-then-step order: weights, masters, skips and scales equal apex's."""
    model, ref_model = half_pair()
    opt = A.FP16_Optimizer(INNER[kind](model.parameters()), dynamic_loss_scale=True,
                           dynamic_loss_args={"scale_window": 3}, verbose=False)
    ref = ApexReference(ref_model, INNER[kind], dynamic=True, scale_window=3)
    scales, skipped = [], []
    for i, (x, y) in enumerate(poisoned(batches(12), {2, 3, 8})):
        opt.zero_grad()
        opt.backward(loss_of(model, x, y))
        ref.zero_grad()
        ref.backward(loss_of(ref_model, x, y))
        assert opt.overflow == ref.overflow
        if clip is not None:
            norm, ref_norm = opt.clip_master_grads(clip), ref.clip_master_grads(clip)
            assert (norm == -1) == (ref_norm == -1) and (norm == -1 or torch.equal(norm, ref_norm))
        opt.step()
        ref.step()
        scales.append(opt.loss_scale)
        skipped.append(opt.overflow)
        assert_same(model, opt, ref_model, ref)
    assert scales == ref.scales
    assert skipped == [i in (2, 3, 8) for i in range(12)]
    # Halved on each overflow (in backward), doubled after 3 clean updates:
    assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**14, 2.0**15, 2.0**15, 2.0**14,
                      2.0**14, 2.0**14, 2.0**15]


def test_the_scale_factor_is_ignored_and_the_bounds_hold_as_in_apex():
    scaler = A.fp16_optimizer.AmpLossScaler("dynamic", init_scale=2.0**23, scale_factor=10.0, scale_window=1,
                                             min_loss_scale=2.0**21)
    seen = []
    for overflow in (False, False, True, True, True, False):
        scaler.update_scale(overflow)
        seen.append(scaler.scale)
    assert seen == [2.0**24, 2.0**24, 2.0**23, 2.0**22, 2.0**21, 2.0**22]  # x2 / /2, capped, floored


def test_assigning_loss_scale_is_used_by_the_next_backward():
    model, ref_model = half_pair()
    opt = A.FP16_Optimizer(INNER["sgd"](model.parameters()), static_loss_scale=128.0, verbose=False)
    ref = ApexReference(ref_model, INNER["sgd"], scale=128.0)
    for i, (x, y) in enumerate(batches(4)):
        if i == 2:
            opt.loss_scale = ref.scale = 1000.1  # not a power of two: unscaled by 1./1000.1, as apex does
        opt.zero_grad()
        opt.backward(loss_of(model, x, y))
        ref.zero_grad()
        ref.backward(loss_of(ref_model, x, y))
        opt.step()
        ref.step()
        assert opt.loss_scale == ref.scale
    assert_same(model, opt, ref_model, ref)
    with pytest.raises(ValueError, match="positive finite"):
        opt.loss_scale = 0.0


def test_a_static_scale_overflow_is_skipped_where_apex_wrote_inf(caplog):
    """apex never checks a static scale: one overflow puts inf into every master. Here
    the step is skipped, with one warning; the reference shows what apex does."""
    model, ref_model = half_pair()
    opt = A.FP16_Optimizer(INNER["sgd"](model.parameters()), static_loss_scale=128.0, verbose=False)
    ref = ApexReference(ref_model, INNER["sgd"], scale=128.0)
    A.FP16_Optimizer._warned_static_overflow = False
    with caplog.at_level(logging.WARNING, logger="mpfp16"):
        for x, y in poisoned(batches(4), {1, 2}):
            opt.zero_grad()
            opt.backward(loss_of(model, x, y))
            opt.step()
            ref.zero_grad()
            ref.backward(loss_of(ref_model, x, y))
            ref.step()
    assert all(torch.isfinite(m).all() for group in opt.fp32_from_fp16_groups for m in group)
    assert not all(torch.isfinite(m).all() for m in ref.masters)  # what apex would have done
    assert opt.skipped_steps == 2 and opt.loss_scale == 128.0
    assert [r.getMessage() for r in caplog.records].count(
        "inf/NaN gradients with a static loss scale of 128: skipping the step (apex would have applied it and "
        "written inf/NaN into every master weight)") == 1


def test_a_scale_stuck_at_its_floor_stops_instead_of_skipping_forever():
    model = A.network_to_half(net())
    opt = A.FP16_Optimizer(INNER["sgd"](model.parameters()), dynamic_loss_scale=True,
                           dynamic_loss_args={"init_scale": 4.0, "min_loss_scale": 1.0}, verbose=False)
    x, y = poisoned(batches(1), {0})[0]
    with pytest.raises(mpfp16.LossScaleStuckError, match="stuck at 1"):
        for _ in range(10):
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x).float(), y))
            opt.step()


def test_closures_match_apex_and_retry_after_an_overflow():
    """step(closure): the closure zeroes, computes and calls backward; after an overflow
    it runs again (at the halved scale) before the inner step."""
    model, ref_model = half_pair()
    opt = A.FP16_Optimizer(INNER["sgd"](model.parameters()), dynamic_loss_scale=True, verbose=False)
    ref = ApexReference(ref_model, INNER["sgd"], dynamic=True)
    data = batches(4)
    for i, (x, y) in enumerate(data):
        calls = []

        def closure():
            calls.append(1)
            opt.zero_grad()
            bad = x.clone()
            if i == 1 and len(calls) == 1:
                bad[0, 0] = float("inf")  # the first try of step 1 overflows
            loss = loss_of(model, bad, y)
            opt.backward(loss)
            return loss

        returned = opt.step(closure)
        assert returned is not None and len(calls) == (2 if i == 1 else 1)
        if i == 1:
            ref.zero_grad()
            ref.backward(loss_of(ref_model, poisoned([(x, y)], {0})[0][0], y))
        ref.zero_grad()
        ref.backward(loss_of(ref_model, x, y))
        ref.step()
    assert_same(model, opt, ref_model, ref)
    assert opt.loss_scale == ref.scale == 2.0**15


def test_a_closure_that_always_overflows_ends_instead_of_looping():
    model = A.network_to_half(net())
    opt = A.FP16_Optimizer(INNER["sgd"](model.parameters()), static_loss_scale=8.0, verbose=False)
    x, y = poisoned(batches(1), {0})[0]
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        return loss

    with pytest.raises(mpfp16.LossScaleStuckError):
        opt.step(closure)
    assert len(calls) == 4


def test_lbfgs_through_a_closure():
    """LBFGS calls the closure several times: the 16-bit model must see the masters of
    each evaluation (the copy between calls), as with apex."""
    model = A.network_to_half(nn.Sequential(nn.Linear(8, 4)))
    opt = A.FP16_Optimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), static_loss_scale=64.0,
                           verbose=False)
    x, y = batches(1)[0]
    losses = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        losses.append(loss.item())
        return loss

    for _ in range(3):
        opt.step(closure)
    assert len(losses) > 3 and losses[-1] < losses[0]
    for p, m in zip(opt.fp16_groups[0], opt.fp32_from_fp16_groups[0]):
        assert torch.equal(p, m.half())


def test_apex_attributes_and_inspection():
    model = A.BN_convert_float(net().half())
    inner = torch.optim.SGD([{"params": list(model[0].parameters()) + list(model[1].parameters())},
                             {"params": model[3].parameters(), "lr": 0.01}], lr=0.1)
    opt = A.FP16_Optimizer(inner, static_loss_scale=256.0, verbose=False)
    assert [len(g) for g in opt.fp16_groups] == [2, 2] and [len(g) for g in opt.fp32_from_fp32_groups] == [2, 0]
    assert all(m.dtype == torch.float32 for g in opt.fp32_from_fp16_groups for m in g)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    x, y = batches(1)[0]
    opt.zero_grad()
    opt.backward(loss_of(model, x, y), update_master_grads=False)
    opt.update_master_grads()
    grads = opt.inspect_master_grad_data()
    assert [len(g) for g in grads] == [4, 2] and all(g.dtype == torch.float32 for row in grads for g in row)
    reference = net()
    nn.functional.cross_entropy(reference(x), y).backward()
    torch.testing.assert_close(grads[1][0], reference[3].weight.grad, rtol=2e-2, atol=2e-3)
    opt.step()


def test_state_dict_round_trip_under_weights_only():
    model, _ = half_pair()
    opt = A.FP16_Optimizer(INNER["adam"](model.parameters()), dynamic_loss_scale=True,
                           dynamic_loss_args={"scale_window": 2}, verbose=False)
    data = batches(6)

    def train(m, o, part):
        for x, y in part:
            o.zero_grad()
            o.backward(loss_of(m, x, y))
            o.step()

    train(model, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, _ = half_pair(seed=5)
    opt2 = A.FP16_Optimizer(INNER["adam"](model2.parameters()), dynamic_loss_scale=True,
                            dynamic_loss_args={"scale_window": 2}, verbose=False)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    train(model, opt, data[3:])
    train(model2, opt2, data[3:])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert opt.loss_scale == opt2.loss_scale


# ----------------------------------------------------------------- apex checkpoints

APEX_WRITER = r'''
import sys, types, torch
# apex's classes, as apex defines them, in modules of apex's names (apex is not installed)
apex, amp, scaler, fp16 = (types.ModuleType(n) for n in ("apex", "apex.amp", "apex.amp.scaler", "apex.fp16_utils"))
lsm = types.ModuleType("apex.fp16_utils.loss_scaler")
class LossScaler:
    def __init__(self):
        self.dynamic, self._loss_scale, self._max_loss_scale, self._min_loss_scale = True, 2.0**13, 2.0**24, None
        self._scale_seq_len, self._unskipped, self._has_overflow = 3, 2, False
        self._overflow_buf = torch.IntTensor([0])
class DynamicLossScaler:
    def __init__(self):
        self.cur_scale, self.cur_iter, self.last_overflow_iter, self.scale_factor, self.scale_window = 512.0, 7, 3, 2.0, 1000
LossScaler.__module__, DynamicLossScaler.__module__ = "apex.amp.scaler", "apex.fp16_utils.loss_scaler"
scaler.LossScaler, lsm.DynamicLossScaler = LossScaler, DynamicLossScaler
sys.modules.update({"apex": apex, "apex.amp": amp, "apex.amp.scaler": scaler, "apex.fp16_utils": fp16,
                    "apex.fp16_utils.loss_scaler": lsm})
kind, path, state_path = sys.argv[1:4]
state = torch.load(state_path, weights_only=True)
if kind == "evil":
    import os
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    state["optimizer"]["loss_scaler"] = Evil()
else:
    state["optimizer"]["loss_scaler"] = LossScaler() if kind == "amp" else DynamicLossScaler()
torch.save(state, path)
'''


def _apex_checkpoint(tmp_path, kind):
    """A checkpoint whose bytes are what apex writes: FP16_Optimizer.state_dict() with
    its scaler object pickled, written by another process that defines apex's classes."""
    model, _ = half_pair()
    opt = A.FP16_Optimizer(INNER["sgd"](model.parameters()), dynamic_loss_scale=True, verbose=False)
    x, y = batches(1)[0]
    opt.zero_grad()
    opt.backward(loss_of(model, x, y))
    opt.step()
    state_path, path = tmp_path / "state.pt", tmp_path / f"apex_{kind}.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, state_path)
    writer = tmp_path / "writer.py"
    writer.write_text(APEX_WRITER)
    check(python([str(writer), kind, str(path), str(state_path)]))
    return path, model, opt


@pytest.mark.slow
def test_an_apex_checkpoint_loads_with_only_its_scaler_allowed(tmp_path):
    path, model, opt = _apex_checkpoint(tmp_path, "amp")
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path, weights_only=True)  # what plain torch says
    ckpt = A.load_apex_checkpoint(str(path))
    assert ckpt["optimizer"]["loss_scaler"] == {
        "apex_class": "apex.amp.scaler.LossScaler", "dynamic": True, "_loss_scale": 2.0**13,
        "_max_loss_scale": 2.0**24, "_min_loss_scale": None, "_scale_seq_len": 3, "_unskipped": 2,
        "_has_overflow": False}
    model2, _ = half_pair(seed=3)
    opt2 = A.FP16_Optimizer(INNER["sgd"](model2.parameters()), dynamic_loss_scale=True, verbose=False)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    assert opt2.loss_scale == 2.0**13 and opt2.loss_scaler.unskipped == 2 and opt2.loss_scaler.scale_window == 3
    for a, b in zip(opt.fp32_from_fp16_groups[0], opt2.fp32_from_fp16_groups[0]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_an_old_fp16_utils_scaler_loads_its_scale(tmp_path):
    path, _, _ = _apex_checkpoint(tmp_path, "fp16_utils")
    ckpt = A.load_apex_checkpoint(str(path))
    assert ckpt["optimizer"]["loss_scaler"]["apex_class"] == "apex.fp16_utils.loss_scaler.DynamicLossScaler"
    model2, _ = half_pair()
    opt2 = A.FP16_Optimizer(INNER["sgd"](model2.parameters()), dynamic_loss_scale=True, verbose=False)
    opt2.load_state_dict(ckpt["optimizer"])
    assert opt2.loss_scale == 512.0


@pytest.mark.slow
def test_anything_else_pickled_is_refused_in_one_line(tmp_path):
    path, _, _ = _apex_checkpoint(tmp_path, "evil")
    with pytest.raises(CheckpointError, match=r"^refusing to load .*apex_evil.pt: it contains a pickled Python "
                                              r"object \((posix|os)\.system\); an apex checkpoint may hold only"):
        A.load_apex_checkpoint(str(path))


# ----------------------------------------------------------------- the rest of fp16_utils


def test_network_to_half_is_apex_s_sequential():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4, affine=False), nn.Flatten())
    half = A.network_to_half(model)
    assert isinstance(half[0], A.tofp16) and half[1] is model
    assert [n for n, _ in half.named_parameters()][:1] == ["1.0.weight"]  # names gain "1."
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    assert model[1].running_mean.dtype == torch.float32 and model[2].running_mean.dtype == torch.float16
    assert half(torch.randn(2, 3, 5, 5)).dtype == torch.float16  # fp16 out, as apex


def test_fp16_model_keeps_affine_batchnorm_and_casts_inputs():
    model = A.FP16Model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert model.network[0].weight.dtype == torch.float16 and model.network[1].weight.dtype == torch.float32
    assert model(torch.randn(3, 4)).dtype == torch.float16


@pytest.mark.parametrize("flat_master", [False, True])
def test_hand_written_master_loop_helpers(flat_master):
    model = nn.Linear(4, 3).half()
    model_params, masters = A.prep_param_lists(model, flat_master=flat_master)
    assert len(masters) == (1 if flat_master else 2) and all(m.dtype == torch.float32 for m in masters)
    model(torch.randn(2, 4).half()).float().sum().backward()
    A.model_grads_to_master_grads(model_params, masters, flat_master=flat_master)
    grads = torch.cat([p.grad.float().reshape(-1) for p in model_params])
    assert torch.equal(torch.cat([m.grad.reshape(-1) for m in masters]), grads)
    with torch.no_grad():
        for m in masters:
            m.add_(1.0)
    A.master_params_to_model_params(model_params, masters, flat_master=flat_master)
    assert torch.equal(torch.cat([p.float().reshape(-1) for p in model_params]),
                       torch.cat([m.reshape(-1) for m in masters]).half().float())
    with pytest.raises(TypeError, match="one dtype"):
        A.prep_param_lists(A.BN_convert_float(net().half()), flat_master=True)


def test_fp16_utils_scalers_follow_apex():
    s = A.DynamicLossScaler(init_scale=8.0, scale_factor=2.0, scale_window=2)
    seen = []
    for overflow in (False, True, False, False, False, True, True, True, True):
        s.update_scale(overflow)
        seen.append(s.loss_scale)
    # grows whenever (iter - last overflow) is a multiple of the window; never below 1
    assert seen == [8.0, 4.0, 4.0, 8.0, 8.0, 4.0, 2.0, 1.0, 1.0]
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert s.has_overflow([p]) and not A.LossScaler(4.0).has_overflow([p])
    assert A.to_python_float(torch.tensor([2.5])) == 2.5


# ----------------------------------------------------------------- apex's DDP


@pytest.mark.parametrize("kw,match", [
    ({"gradient_average": False}, "gradient_average=False"),
    ({"shared_param": True}, "shared_param=True has no faithful mapping"),
    ({"num_allreduce_streams": 2}, "num_allreduce_streams=2 has no faithful mapping"),
    ({"bogus": 1}, "unexpected keyword argument 'bogus'"),
])
def test_apex_ddp_options_without_a_mapping_are_refused(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        A.DistributedDataParallel(nn.Linear(2, 2), **kw)


@pytest.mark.slow
def test_the_ported_apex_example_runs_under_torchrun(tmp_path):
    """examples/apex_port.py, apex's own DDP + FP16_Optimizer example ported by changing
    its imports, on two gloo processes: the replicas agree and the loss falls."""
    from dist_helpers import torchrun

    proc = torchrun(["examples/apex_port.py", "--steps", "30"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"^final loss ([\d.]+) \(from ([\d.]+)\); replicas identical on 2 process\(es\)$",
                       proc.stdout, flags=re.M)
    assert len(found) == 1, proc.stdout[-2000:]
    last, first = (float(v) for v in found[0])
    assert last < first / 2


@pytest.mark.slow
def test_apex_s_distributed_example_order_trains_like_the_to_half_order(tmp_path):
    """apex's distributed_pytorch example: ``.half()``, torch's DDP, then FP16_Optimizer.
    DDP already holds the parameters, so they stay where they are (the per-tensor store);
    the gradients are averaged over the two ranks, the replicas stay identical, and the
    run equals the to_half order (flat buffers) bit for bit."""
    import dist_workers as W
    from dist_helpers import run_workers

    r0, r1 = run_workers(W.apex_distributed_example, tmp_path, args=(6,))
    assert r0["half"]["store"] == "per-tensor" and r0["to_half"]["store"] == "flat"
    for order in ("half", "to_half"):
        assert torch.equal(r0[order]["params"], r1[order]["params"]), order
    assert torch.equal(r0["half"]["params"], r0["to_half"]["params"])
    for a, b in zip(r0["half"]["masters"], r0["to_half"]["masters"]):
        assert torch.equal(a, b)
    for avg, g0, g1 in zip(r0["half"]["averaged"], r0["half"]["local"], r1["half"]["local"]):
        torch.testing.assert_close(avg, (g0 + g1) / 2, rtol=2e-3, atol=1e-4)  # the mean, in fp16
        assert not torch.allclose(avg, g0, rtol=2e-3, atol=1e-4)  # not this rank's own
