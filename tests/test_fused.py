"""The fused step (mpfp16/stores/fused.py, kernels.py): the same floating-point operations as torch.optim,
in one compiled kernel per flat segment."""

import copy
import logging

import pytest
import torch
import torch.nn as nn

import mpfp16
import mpfp16.stores.fused
from mpfp16.stores import kernels as F
from reference import (ReferenceTrainer, adam_by_hand, assert_same_params, backward_both, batches, exact_sqrt,
                       make_inner, step_both, tiny_mlp, train_mpfp16, train_reference)

T = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    n = 4099  # not a multiple of the vector width: the tail loop too
    return torch.randn(n, generator=g), torch.randn(n, generator=g), torch.rand(n, generator=g) + 0.5


def test_helpers_match_the_eager_cpu_kernels(data):
    a, b, c = data
    k = torch.compile(lambda a, b, c, x, w, low: (F.add_alpha(a, b, x), F.addcmul(a, b, c, x),
                                                  F.addcdiv(a, b, c, x), F.lerp(a, b, w), F.lerp(a, b, w, low)))
    for x, w in [(0.1, 0.1), (-0.001, 0.9), (3.7, 0.5), (1.0, -0.3)]:
        got = k(a, b, c, T(x), T(w), abs(w) < 0.5)
        expected = (torch.add(a, b, alpha=x), torch.addcmul(a, b, c, value=x), torch.addcdiv(a, b, c, value=x),
                    torch.lerp(a, b, w), torch.lerp(a, b, w))
        for name, g, e in zip(("add", "addcmul", "addcdiv", "lerp", "lerp with its branch known"), got, expected):
            assert torch.equal(g, e), f"{name} x={x} w={w}"


SGD_VARIANTS = [
    dict(momentum=0.9, weight_decay=1e-4),
    dict(momentum=0.9, nesterov=True, weight_decay=1e-4),
    dict(momentum=0.9, dampening=0.1, maximize=True),
    dict(momentum=0.0, weight_decay=1e-3),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("kw", SGD_VARIANTS, ids=["momentum", "nesterov", "dampening-maximize", "plain"])
def test_fused_sgd_is_bit_identical_to_torch(kw, master_weights, dtype):
    model, ref_model = mpfp16.to_half(tiny_mlp(0), dtype), mpfp16.to_half(tiny_mlp(0), dtype)
    scale = 512.0 if dtype == torch.float16 else None
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, **kw), loss_scale=scale,
                               master_weights=master_weights, fused=True)
    ref = ReferenceTrainer(ref_model, "sgd", scale=scale or 1.0, master_weights=master_weights)
    ref.opt = torch.optim.SGD(ref.masters, lr=0.05, **kw)
    for x, y in batches(5):
        assert step_both(model, opt, ref_model, ref, x, y)
    assert opt.fused
    assert_same_params(model, ref_model)
    if kw["momentum"]:
        for mine, theirs in zip(opt.master_params(), ref.masters):
            assert torch.equal(opt.state[mine]["momentum_buffer"], ref.opt.state[theirs]["momentum_buffer"])


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_fused_adam_differs_from_torch_only_by_the_rounding_of_sqrt(decoupled):
    """torch's CPU sqrt kernel is accurate to about 1 ulp but not correctly rounded;
    the compiled kernel's is. With a correctly rounded sqrt in torch's own sequence of
    operations, the fused kernel is bit-identical; with torch's sqrt, the moments are
    identical and the parameters differ in the last bits."""
    g = torch.Generator().manual_seed(1)
    n = 10_007
    p0 = torch.randn(n, generator=g) * 0.1
    grads = [(torch.randn(n, generator=g) * 256).half() for _ in range(3)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    weights, master = p0.half(), p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    exact = dict(p=p0.clone(), m=torch.zeros(n), v=torch.zeros(n))
    eager = dict(p=p0.clone(), m=torch.zeros(n), v=torch.zeros(n))
    torch_p = nn.Parameter(p0.clone())
    torch_opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([torch_p], **hyper)
    kernel = F.compiled(F.adam_update, has_master=True, has_weight_decay=True, decoupled=decoupled, maximize=False,
                        lerp_low=True, rounding="nearest")
    for step, g16 in enumerate(grads, start=1):
        grad = g16.float() * T(1 / 256)
        lr, (b1, b2), wd, eps = hyper["lr"], hyper["betas"], hyper["weight_decay"], hyper["eps"]
        kernel(weights, g16, master, m, v, None, None, T(1 / 256), T(1.0), T(wd), T(1 - lr * wd), T(1 - b1), T(b2),
               T(1 - b2),
               T((1 - b2**step) ** 0.5), T(eps), T(-lr / (1 - b1**step)))
        adam_by_hand(exact["p"], grad, exact["m"], exact["v"], step, lr, (b1, b2), eps, wd, decoupled, exact_sqrt)
        adam_by_hand(eager["p"], grad, eager["m"], eager["v"], step, lr, (b1, b2), eps, wd, decoupled, torch.sqrt)
        torch_p.grad = grad
        torch_opt.step()
        assert torch.equal(master, exact["p"]) and torch.equal(m, exact["m"]) and torch.equal(v, exact["v"])
        assert torch.equal(eager["p"], torch_p.detach())  # the by-hand sequence is torch's
        assert torch.equal(m, torch_opt.state[torch_p]["exp_avg"])
        assert torch.equal(v, torch_opt.state[torch_p]["exp_avg_sq"])
        torch.testing.assert_close(master, torch_p.detach(), rtol=1e-6, atol=1e-8)  # updates are ~1e-2
    assert torch.equal(weights, master.half())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
def test_adam_in_two_passes_is_adam_in_one(rounding):
    """Adam with coupled weight decay on 16-bit weights without masters runs as two
    kernels on CPU (adam_moments, adam_apply); they compute what adam_update computes,
    bit for bit, in every rounding mode."""
    g = torch.Generator().manual_seed(2)
    n = 4099
    w0 = (torch.randn(n, generator=g) * 0.1).half()
    noise = torch.rand(n, generator=g) if rounding == "stochastic" else None
    comp0 = (torch.randn(n, generator=g) * 1e-4).half() if rounding == "kahan" else None
    one_pass = dict(w=w0.clone(), m=torch.zeros(n), v=torch.zeros(n), comp=None if comp0 is None else comp0.clone())
    two = {k: (None if t is None else t.clone()) for k, t in one_pass.items()}
    update = F.compiled(F.adam_update, has_master=False, has_weight_decay=True, decoupled=False, maximize=False,
                        lerp_low=True, rounding=rounding)
    moments = F.compiled(F.adam_moments, maximize=False, lerp_low=True)
    apply = F.compiled(F.adam_apply, rounding=rounding)
    for step in range(1, 4):
        g16 = (torch.randn(n, generator=g) * 256).half()
        scalars = dict(inv=T(1 / 256), clip=T(0.5), wd=T(1e-2), b1=T(0.1), b2=T(0.999), ob2=T(1e-3),
                       bc2=T((1 - 0.999**step) ** 0.5), eps=T(1e-8), nss=T(-1e-2 / (1 - 0.9**step)))
        sc = scalars
        update(one_pass["w"], g16, None, one_pass["m"], one_pass["v"], noise, one_pass["comp"], sc["inv"], sc["clip"],
               sc["wd"], T(1.0), sc["b1"], sc["b2"], sc["ob2"], sc["bc2"], sc["eps"], sc["nss"])
        moments(two["w"], g16, two["m"], two["v"], sc["inv"], sc["clip"], sc["wd"], sc["b1"], sc["b2"], sc["ob2"])
        apply(two["w"], two["m"], two["v"], noise, two["comp"], sc["bc2"], sc["eps"], sc["nss"])
        for k in one_pass:
            assert (one_pass[k] is None and two[k] is None) or torch.equal(one_pass[k], two[k]), (k, step)
    assert not torch.equal(one_pass["w"], w0)


@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_fused_adam_training_follows_the_reference(kind, master_weights):
    model, ref_model = mpfp16.to_half(tiny_mlp(0)), mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=256.0, fused=True,
                               master_weights=master_weights)
    data = batches(5)
    train_mpfp16(model, opt, data)
    ref = train_reference(ref_model, kind, data, scale=256.0, master_weights=master_weights)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3 if p.dtype == torch.float16 else 1e-5, atol=1e-6)
    steps = {float(s["step"]) for s in opt.state.values()}
    assert steps == {5.0} and steps == {float(s["step"]) for s in ref.opt.state.values()}


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_param_groups_that_alternate_in_the_buffer(kind):
    """to_half lays the parameters out in model order, so groups that alternate
    (weights with decay, biases without) make several segments each; every segment
    is stepped once, with its group's settings and its own Adam step counters."""
    def run(fused):
        model = mpfp16.to_half(tiny_mlp(0))
        decay = [p for name, p in model.named_parameters() if name.endswith("weight") and p.ndim > 1]
        rest = [p for name, p in model.named_parameters() if not (name.endswith("weight") and p.ndim > 1)]
        inner = make_inner(kind, [{"params": decay}, {"params": rest, "weight_decay": 0.0}])
        opt = mpfp16.FP16Optimizer(inner, loss_scale=256.0, fused=fused)
        train_mpfp16(model, opt, batches(4))
        return model, opt

    (fused, opt), (unfused, _) = run(True), run(False)
    half = next(g for g in opt.store.groups if g.half)
    assert [s.group_index for s in half.segments] == [0, 1, 0, 1]
    if kind == "sgd":
        assert_same_params(fused, unfused)
    else:
        assert {float(s["step"]) for s in opt.state.values()} == {4.0}
        for p, q in zip(fused.parameters(), unfused.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-6)


def test_fused_clipping_is_clip_grad_norm_but_the_norms_last_bits():
    """What docs/API.md claims for max_grad_norm= on the fused step: the norm comes from
    the overflow check's one flat sum of squares, within 1e-6 of clip_grad_norm_'s; the
    masters are then clip_grad_norm_'s but for that norm's last bits: within 2 fp32
    epsilons of the larger of the master and its update (the conformance suite proves the
    step bit for bit given the norm)."""
    model, ref_model = mpfp16.to_half(tiny_mlp(0)), mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=128.0, max_grad_norm=0.05,
                               fused=True)
    ref = ReferenceTrainer(ref_model, "sgd", scale=128.0, max_grad_norm=0.05)
    eps = torch.finfo(torch.float32).eps
    for x, y in batches(3):
        start = [m.detach().clone() for m in ref.masters]
        backward_both(model, opt, ref_model, ref, x, y)
        expected_norm = torch.nn.utils.get_total_norm([p.grad.float() / 128 for p in ref_model.parameters()])
        opt.step()
        ref.step()
        assert opt.last_grad_norm == pytest.approx(float(expected_norm), rel=1e-6) and opt.last_grad_norm > 0.05
        with torch.no_grad():
            for mine, theirs, before in zip(opt.master_params(), ref.masters, start):
                assert ((mine - theirs).abs() <= 2 * eps * torch.maximum(theirs.abs(), (theirs - before).abs())).all()
                theirs.copy_(mine)  # each step from the same masters and momentum
                ref.opt.state[theirs]["momentum_buffer"].copy_(opt.state[mine]["momentum_buffer"])
            for p, q in zip(model.parameters(), ref_model.parameters()):
                q.copy_(p)


def test_a_skipped_fused_step_changes_nothing():
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("adam", model.parameters()), fused=True)
    train_mpfp16(model, opt, batches(2))
    before = [t.clone() for s in opt.state.values() for t in s.values()] + [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    model[0].weight.grad[0, 0] = float("nan")
    assert opt.step() is False
    after = [t.clone() for s in opt.state.values() for t in s.values()] + [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("first_fused", [True, False])
def test_state_dicts_move_between_fused_and_unfused(first_fused):
    """The fused path keeps torch's per-parameter state format: a checkpoint from
    either path resumes on the other, bit-identically (SGD)."""
    data = batches(6)

    def fresh(fused):
        model = mpfp16.to_half(tiny_mlp(0))
        return model, mpfp16.FP16Optimizer(make_inner("nesterov", model.parameters()), loss_scale=64.0, fused=fused)

    straight, s_opt = fresh(first_fused)
    train_mpfp16(straight, s_opt, data)
    model, opt = fresh(first_fused)
    train_mpfp16(model, opt, data[:3])
    model2, opt2 = fresh(not first_fused)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(opt.state_dict())
    train_mpfp16(model2, opt2, data[3:])
    assert_same_params(straight, model2)


def test_no_fp32_gradient_buffer_with_the_fused_step():
    model = mpfp16.to_half(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_scale=8.0, fused=True)
    opt.zero_grad()
    opt.backward(model(torch.randn(4, 32)).float().mean())
    assert opt.step()
    assert opt.memory_bytes_per_param() == {"model_weights": 2.0, "model_grads": 2.0, "master_weights": 4.0,
                                            "master_grads": 0.0, "optimizer_state": 4.0, "compensation": 0.0,
                                            "master_remainder": 0.0, "total": 12.0}


def test_the_compile_is_said_once_with_its_time(caplog):
    """The first step waits for the kernels to compile: one line says so before, one
    after with the time; later steps say nothing; unscale_()'s fp32 variants, compiled
    at its first call, get their own pair."""
    model = mpfp16.to_half(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)))
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), loss_scale=8.0, fused=True)
    with caplog.at_level(logging.INFO, logger="mpfp16"):
        for unscale in (False, False, True, True):
            opt.zero_grad()
            opt.backward(model(torch.randn(4, 32)).float().mean())
            if unscale:
                opt.unscale_()
            assert opt.step()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fused step")]
    assert said[0] == "fused step: compiling its kernels (they are kept on disk, so a later run starts sooner)"
    assert said[1].startswith("fused step: kernels ready in ") and said[1].endswith(" s")
    assert said[2].startswith("fused step: compiling its kernels for unscale_()'s fp32 gradients")
    assert said[3].startswith("fused step: kernels ready in ") and len(said) == 4


def test_the_norms_kernels_are_prepared_when_a_step_first_clips(caplog):
    """The overflow check that also sums the squares compiles only when a step needs the
    norm: not for a step that does not clip, and before the first step that does (as
    the Lightning plugin asks, per step), agreed across ranks like every compile."""
    model = mpfp16.to_half(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)))
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), loss_scale=8.0, fused=True)
    with caplog.at_level(logging.INFO, logger="mpfp16"):
        for clip in (None, None, 1e-3, 1e-3):
            opt.max_grad_norm = clip
            opt.zero_grad()
            opt.backward(model(torch.randn(4, 32)).float().mean())
            assert opt.step()
            assert (opt.last_grad_norm is not None) == (clip is not None)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fused step: compiling")]
    assert len(said) == 2  # the first step's kernels, then the norm's at the first clipped step
    assert 0 < opt.last_grad_norm < float("inf")


def _break_compiler(monkeypatch, error):
    def broken(fn, **static):
        raise error

    monkeypatch.setattr(F, "compiled", broken)


def test_compile_failure_under_auto_takes_the_unfused_step_with_one_warning(monkeypatch, caplog):
    _break_compiler(monkeypatch, torch._inductor.exc.InvalidCxxCompiler())
    monkeypatch.setattr(mpfp16.stores.fused, "FUSED_MIN_NUMEL", 0)  # auto picks the fused step for this small model
    model, ref_model = mpfp16.to_half(tiny_mlp(0)), mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=64.0)
    assert opt.fused
    data = batches(3)
    with caplog.at_level(logging.WARNING, logger="mpfp16"):
        train_mpfp16(model, opt, data)
    train_reference(ref_model, "sgd", data, scale=64.0)
    assert not opt.fused
    assert [r.getMessage() for r in caplog.records] == [
        "fused optimizer step unavailable: compiling failed on rank 0 (InvalidCxxCompiler: No working C++ "
        "compiler found in torch._inductor.config.cpp.cxx: (None, 'g++')); every rank uses the unfused step"]
    assert_same_params(model, ref_model)


def test_compile_failure_with_fused_true_is_an_error(monkeypatch):
    _break_compiler(monkeypatch, torch._inductor.exc.InvalidCxxCompiler())
    model = mpfp16.to_half(tiny_mlp(0))
    before = [p.detach().clone() for p in model.parameters()]
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=64.0, fused=True)
    x, y = batches(1)[0]
    opt.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match=r"^fused=True cannot be honoured: compiling the fused step failed on "
                                           r"rank 0 \(InvalidCxxCompiler: No working C\+\+ compiler"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was written


def _break_fp32_gradient_kernels(monkeypatch):
    """The kernel variants that read unscale_()'s fp32 gradients fail to compile; the
    others still work."""
    real = F.compiled

    def compiled(fn, **static):
        call = real(fn, **static)

        def guarded(*args):
            if fn in (F.sgd_update, F.adam_update) and args[0].dtype != torch.float32 and \
                    args[1].dtype == torch.float32:
                raise torch._inductor.exc.InvalidCxxCompiler()
            return call(*args)

        return guarded

    monkeypatch.setattr(F, "compiled", compiled)


@pytest.mark.parametrize("fused", [True, None], ids=["fused=True", "auto"])
def test_a_compile_failure_at_the_first_unscale_after_step_one_is_agreed_before_anything_steps(monkeypatch, fused):
    """unscale_() needs kernels that read fp32 gradients, compiled when it is first called,
    which may be after other steps. A failure there is agreed across ranks before any
    segment is stepped or any Adam counter advances: fused=True raises at unscale_(),
    auto moves to the unfused step for good. (Kahan rounding, so that AdamW takes
    inductor's kernels: the native ones are one library, built at the first step.)"""
    monkeypatch.setattr(mpfp16.stores.fused, "FUSED_MIN_NUMEL", 0)
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), loss_scale=64.0, fused=fused,
                               master_weights=False, rounding="kahan")
    data = batches(3)
    train_mpfp16(model, opt, data[:1])  # step 1 reads the 16-bit gradients
    assert opt.fused
    _break_fp32_gradient_kernels(monkeypatch)
    before = [p.detach().clone() for p in model.parameters()]
    counters = [float(s["step"]) for s in opt.state.values()]
    x, y = data[1]
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    if fused:
        with pytest.raises(RuntimeError, match=r"^fused=True cannot be honoured: compiling the fused step failed"):
            opt.unscale_()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert [float(s["step"]) for s in opt.state.values()] == counters == [1.0] * len(counters)
        return
    opt.unscale_()
    assert not opt.fused and opt.step()
    assert [float(s["step"]) for s in opt.state.values()] == [2.0] * len(counters)


def test_an_error_that_is_not_a_compile_error_is_not_swallowed(monkeypatch):
    _break_compiler(monkeypatch, KeyError("a bug"))
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=64.0, fused=True)
    x, y = batches(1)[0]
    opt.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(KeyError, match="a bug"):
        opt.step()


def test_which_optimizers_are_fused():
    small = mpfp16.to_half(tiny_mlp(0))
    assert not mpfp16.FP16Optimizer(torch.optim.SGD(small.parameters(), lr=0.1)).fused  # under 1M: no compile
    big = mpfp16.to_half(nn.Linear(1024, 1024))
    assert mpfp16.FP16Optimizer(torch.optim.SGD(big.parameters(), lr=0.1)).fused
    for inner, reason in [(torch.optim.RMSprop(small.parameters()), "not SGD, Adam or AdamW"),
                          (torch.optim.Adam(small.parameters(), amsgrad=True), "amsgrad")]:
        with pytest.raises(ValueError, match=reason):
            mpfp16.FP16Optimizer(inner, fused=True)
        assert not mpfp16.FP16Optimizer(type(inner)(small.parameters(), **{
            k: v for k, v in inner.defaults.items() if k == "amsgrad"})).fused


@pytest.mark.parametrize("kind,flag", [("sgd", "foreach"), ("sgd", "fused"), ("adam", "foreach"),
                                       ("adamw", "fused")])
def test_an_inner_optimizer_built_for_speed_takes_the_fused_step(kind, flag, caplog):
    """AdamW(params, fused=True), as torch users write it, asks for the fast step: it
    gets mpfp16's fused one, even below the size from which the default picks it,
    with the same result as the fused step over an inner optimizer without the flag."""
    model, plain_model = mpfp16.to_half(tiny_mlp(0)), mpfp16.to_half(tiny_mlp(0))
    with caplog.at_level(logging.INFO, logger="mpfp16"):
        opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters(), **{flag: True}), loss_scale=256.0)
    assert opt.fused and caplog.records == []
    plain = mpfp16.FP16Optimizer(make_inner(kind, plain_model.parameters()), loss_scale=256.0, fused=True)
    data = batches(4)
    train_mpfp16(model, opt, data)
    train_mpfp16(plain_model, plain, data)
    assert opt.fused
    assert_same_params(model, plain_model)


@pytest.mark.parametrize("inner,fused,level,line", [
    (lambda ps: torch.optim.RMSprop(ps, lr=0.01, foreach=True), None, logging.WARNING,
     "RMSprop(foreach=True): mpfp16's fused step cannot take it (RMSprop is not SGD, Adam or AdamW); torch's own "
     "foreach step runs over the fp32 masters"),
    (lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, fused=True), None, logging.WARNING,
     "Adam(fused=True): mpfp16's fused step cannot take it (amsgrad=True); torch's own fused step runs over the "
     "fp32 masters"),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True), False, logging.INFO,
     "AdamW(fused=True) under FP16Optimizer(fused=False): torch's own fused step runs over the fp32 masters, not "
     "mpfp16's fused step"),
], ids=["rmsprop-foreach", "amsgrad-fused", "fused-false"])
def test_a_fast_inner_step_mpfp16_cannot_take_says_why_and_still_runs(inner, fused, level, line, caplog):
    """No silent slow path: one line names the reason, and the inner optimizer's own
    fast step runs over the fp32 masters, exactly as it would over fp32 copies."""
    model, ref_model = mpfp16.to_half(tiny_mlp(0)), mpfp16.to_half(tiny_mlp(0))
    with caplog.at_level(logging.INFO, logger="mpfp16"):
        opt = mpfp16.FP16Optimizer(inner(model.parameters()), loss_scale=256.0, fused=fused)
    assert not opt.fused
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(level, line)]
    ref = ReferenceTrainer(ref_model, "sgd", scale=256.0)
    ref.opt = inner(ref.masters)
    for x, y in batches(3):
        assert step_both(model, opt, ref_model, ref, x, y)
    assert_same_params(model, ref_model)


def test_every_kernel_is_compiled_on_one_size_class_for_its_thread_count(monkeypatch):
    """inductor decides from the size of the example it compiles on whether a CPU loop
    runs on several threads, and generates the kernel for the thread count of the
    moment. So each kernel is compiled on examples of COMPILE_NUMEL elements, whatever
    it is first called on, and once per thread count: then inductor's on-disk cache
    (keyed by the thread count, not the example's size) gives back the right kernel."""
    calls = []
    real = F._compile_variant

    def recording(fn, flags, serial):
        kernel = real(fn, flags, serial)

        def run(*args, **static):
            calls.append((torch.get_num_threads(), [a.numel() for a in args]))
            return kernel(*args, **static)

        return run

    monkeypatch.setattr(F, "_compile_variant", recording)
    monkeypatch.setattr(F, "_COMPILED", {})
    grads = torch.tensor([1.0, float("inf"), 2.0], dtype=torch.float16)
    kernel = F.compiled(F.grad_stats, with_norm=False)
    threads = torch.get_num_threads()
    try:
        assert kernel(grads, F.scalar(0.5, grads.device))[0] == 1.0
        assert kernel(grads[::2], F.scalar(0.5, grads.device))[0] == 0.0  # compiled once per thread count
        other = 1 if threads > 1 else 2  # a thread count other than the one it started on
        torch.set_num_threads(other)
        assert kernel(grads, F.scalar(0.5, grads.device))[0] == 1.0
    finally:
        torch.set_num_threads(threads)
    big = F.COMPILE_NUMEL
    assert calls == [(threads, [big, 1]), (threads, [3, 1]), (threads, [2, 1]), (other, [big, 1]), (other, [3, 1])]


def test_a_scalar_passed_twice_does_not_recompile(monkeypatch):
    """The same 1.0 for the inverse scale and the clip coefficient, or two different
    ones: one compiled kernel serves both (dynamo would guard on the aliasing)."""
    monkeypatch.setattr(F, "_COMPILED", {})
    weights = torch.zeros(100, dtype=torch.float16)
    grad = torch.ones(100, dtype=torch.float16)
    kernel = F.compiled(F.sgd_update, has_master=False, has_weight_decay=False, has_momentum=False,
                        first_step=False, nesterov=False, maximize=False, rounding="nearest")
    one = F.scalar(1.0, weights.device)
    torch._dynamo.utils.counters.clear()
    kernel(weights, grad, None, None, None, None, one, one, F.scalar(0.5, one.device), one, one, one)
    kernel(weights, grad, None, None, None, None, F.scalar(1.0, one.device), one, F.scalar(0.5, one.device),
           F.scalar(0.0, one.device), F.scalar(0.0, one.device), F.scalar(1.0, one.device))
    assert torch.equal(weights, torch.full((100,), -1.0, dtype=torch.float16))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_amsgrad_loaded_into_the_fused_step_of_auto_moves_every_rank_to_the_unfused_step(monkeypatch, caplog):
    """A checkpoint of an AdamW built with amsgrad=True, loaded into one built without
    it, turns amsgrad on in its groups. Under fused=None the next step finds it before
    anything moves, says so in one warning and takes the unfused step from then on: bit
    for bit the unfused step's continuation of amsgrad (fused=True refuses it in one line:
    tests/test_store_conformance.py, its amsgrad phase)."""
    monkeypatch.setattr(mpfp16.stores.fused, "FUSED_MIN_NUMEL", 0)  # auto takes the fused step for this small model
    saved_model = mpfp16.to_half(tiny_mlp(0))
    saved = mpfp16.FP16Optimizer(torch.optim.AdamW(saved_model.parameters(), lr=5e-3, amsgrad=True), loss_scale=256.0)
    train_mpfp16(saved_model, saved, batches(2))
    runs = []
    for fused in (None, False):
        model = mpfp16.to_half(tiny_mlp(1))
        opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=5e-3), loss_scale=256.0, fused=fused)
        assert opt.fused is (fused is None)
        model.load_state_dict(saved_model.state_dict())
        opt.load_state_dict(copy.deepcopy(saved.state_dict()))  # torch's load shares the tensors it is given
        with caplog.at_level(logging.WARNING, logger="mpfp16"):
            caplog.clear()
            assert all(train_mpfp16(model, opt, batches(3, seed=4)))
        assert not opt.fused
        runs.append(([p.detach().clone() for p in model.parameters()], [r.getMessage() for r in caplog.records]))
    (fused_params, lines), (unfused_params, unfused_lines) = runs
    assert lines == ["AdamW now has amsgrad=True, which mpfp16's fused step cannot step: every rank takes the unfused "
                     "step (the inner optimizer's own) from here on"] and unfused_lines == []
    assert all(torch.equal(a, b) for a, b in zip(fused_params, unfused_params))
