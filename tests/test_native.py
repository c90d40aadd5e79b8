"""The C++ kernels of the fused step on CPU (mpfp16/stores/native.cpp): Adam/AdamW bit
for bit against torch's own sequence of eager operations, in every mode, dtype and
size; the overflow check; the build, its cache, and a build that fails."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import torch.nn as nn

import mpfp16
from mpfp16.stores import native
from reference import adam_by_hand, batches, exact_sqrt, make_inner, tiny_mlp, train_mpfp16, train_reference

# A partial block alone, a block and one more, many blocks with a tail, and two threads' worth.
SIZES = [1, 31, 33, 1037, 2 * (1 << 15) + 77]
PAIRS = sorted(native.PAIRS, key=str)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


LR, BETA2, WD, EPS, STEP = 1e-3, 0.999, 1e-2, 1e-8, 3


def _by_eager_ops(weights, grad, master, exp_avg, exp_avg_sq, *, beta1: float, clip: float, inv_scale: float,
                  wd_mode: str, maximize: bool) -> None:
    """torch's single-tensor Adam, op for op (reference.adam_by_hand), from the 16-bit
    gradient, with a correctly rounded square root (torch's CPU sqrt kernel is not,
    mpfp16's kernels are: test_fused.py)."""
    param = master if master is not None else weights.float()
    g = grad.float() * torch.tensor(inv_scale) * torch.tensor(clip)
    if maximize:
        g = -g
    adam_by_hand(param, g, exp_avg, exp_avg_sq, STEP, LR, (beta1, BETA2), EPS, 0.0 if wd_mode == "none" else WD,
                 wd_mode == "decoupled", exact_sqrt)
    weights.copy_(param)


def _scalars(beta1: float, clip: float, inv_scale: float) -> dict:
    """The same step's scalars as the fused step passes them (FusedStep._adam)."""
    return dict(inv_scale=inv_scale, clip_coef=clip, weight_decay=WD, decay_factor=1 - LR * WD,
                one_minus_beta1=1 - beta1, beta2=BETA2, one_minus_beta2=1 - BETA2,
                bias_correction2_sqrt=(1 - BETA2**STEP) ** 0.5, eps=EPS, neg_step_size=-LR / (1 - beta1**STEP))


# (weight dtype, gradient dtype, masters): an fp32 group has none
CASES = [(w, g, m) for (w, g) in PAIRS for m in (True, False) if not (m and w == torch.float32)]


@pytest.mark.parametrize("weight_dtype,grad_dtype,has_master", CASES,
                         ids=[f"{str(w)[6:]}-weights-{str(g)[6:]}-grads-{'masters' if m else 'no-masters'}"
                              for w, g, m in CASES])
def test_native_adam_is_torchs_arithmetic_bit_for_bit(weight_dtype, grad_dtype, has_master):
    """Every flag (weight decay none/coupled/decoupled, maximize, both formulas of lerp,
    clipping, unscaling) at sizes that take the tail, the vector loop and two threads;
    every buffer is compared by its bits."""
    g = torch.Generator().manual_seed(0)
    modes = itertools.product(["none", "coupled", "decoupled"], [False, True], [0.9, 0.3], [1.0, 0.37])
    for (wd_mode, maximize, beta1, clip), n in itertools.product(modes, SIZES):
        inv_scale = 1.0 if grad_dtype == torch.float32 else 1 / 1024
        p0 = torch.randn(n, generator=g)
        grad = (torch.randn(n, generator=g) * (1 / inv_scale)).to(grad_dtype)
        state = [p0.to(weight_dtype), p0 + 1e-4 * torch.randn(n, generator=g) if has_master else None,
                 torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 1e-2]
        mine = [t if t is None else t.clone() for t in state]
        ref = [t if t is None else t.clone() for t in state]
        s = _scalars(beta1, clip, inv_scale)
        native.adam_update(mine[0], grad, mine[1], mine[2], mine[3], **s, has_weight_decay=wd_mode != "none",
                           decoupled=wd_mode == "decoupled", maximize=maximize, lerp_low=abs(1 - beta1) < 0.5)
        _by_eager_ops(ref[0], grad, ref[1], ref[2], ref[3], beta1=beta1, clip=clip, inv_scale=inv_scale,
                      wd_mode=wd_mode, maximize=maximize)
        for name, a, b in zip(("weights", "master", "exp_avg", "exp_avg_sq"), mine, ref):
            if a is not None:
                assert torch.equal(_bits(a), _bits(b)), (name, wd_mode, maximize, beta1, clip, n)
        assert not torch.equal(mine[2], state[2])  # it stepped


@pytest.mark.parametrize("offset", [0, 1, 7, 32], ids=lambda k: f"weights-at-element-{k}")
def test_streamed_and_ordinary_weight_stores_give_the_same_bits_at_any_alignment(offset):
    """With masters the 16-bit weights are stored around the cache where a segment
    starts aligned to a whole vector (native.cpp's store_streaming), with ordinary stores
    where it does not: segments of a flat buffer start anywhere. Both, and a build with
    ordinary stores only, step as torch's ops do."""
    g = torch.Generator().manual_seed(5)
    n = 2 * (1 << 15) + 1037
    grad = (torch.randn(n, generator=g) * 1024).half()
    p0, v0 = torch.randn(n, generator=g), torch.rand(n, generator=g) * 1e-2
    ref = [p0.half(), p0.clone(), torch.zeros(n), v0.clone()]
    _by_eager_ops(*ref[:1], grad, *ref[1:], beta1=0.9, clip=1.0, inv_scale=1 / 1024, wd_mode="decoupled",
                  maximize=False)
    for library in (None, native.build(defines={"MPFP16_STREAM_WEIGHTS": 0})):
        weights = torch.empty(n + offset, dtype=torch.float16)[offset:]
        weights.copy_(p0)
        state = [weights, p0.clone(), torch.zeros(n), v0.clone()]
        native.adam_update(*state[:1], grad, *state[1:], library=library, **_scalars(0.9, 1.0, 1 / 1024),
                           has_weight_decay=True, decoupled=True, maximize=False, lerp_low=True)
        for name, a, b in zip(("weights", "master", "exp_avg", "exp_avg_sq"), state, ref):
            assert torch.equal(_bits(a), _bits(b)), (name, library)


def test_every_vector_isa_this_cpu_runs_gives_the_same_bits():
    """AVX2 steps exactly as AVX-512 does: the ISA changes the speed, never a bit. A CPU
    with neither takes inductor's kernels (at::vec's portable fmadd rounds twice)."""
    if native.isa() not in native.ISA_FLAGS:
        assert not native.handles(torch.device("cpu"), torch.float16, torch.float16, "nearest")
        return
    isas = ["AVX2", native.isa()]
    g = torch.Generator().manual_seed(3)
    n = 2 * (1 << 15) + 1037
    grad = (torch.randn(n, generator=g) * 1024).half()
    p0 = torch.randn(n, generator=g)
    results = []
    for name in dict.fromkeys(isas):
        library = native.build(name)
        state = [p0.half(), p0.clone(), torch.zeros(n), torch.zeros(n)]
        for wd_mode, beta1 in (("decoupled", 0.9), ("coupled", 0.3)):
            native.adam_update(*state[:1], grad, *state[1:], library=library, **_scalars(beta1, 0.5, 1 / 1024),
                               has_weight_decay=True, decoupled=wd_mode == "decoupled", maximize=False,
                               lerp_low=abs(1 - beta1) < 0.5)
        broken = grad.clone()
        broken[n - 3] = float("nan")
        results.append((state, native.nonfinite(grad, 1 / 1024, library), native.nonfinite(broken, 1.0, library)))
    for state, clean, found in results:
        assert not clean and found
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(state, results[0][0]))


@pytest.mark.parametrize("threads", [1, 2])
def test_native_adam_is_the_same_on_any_thread_count(threads):
    n = 3 * (1 << 15) + 5
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(n, generator=g).half()
    runs, before = [], torch.get_num_threads()
    for count in (1, threads):
        torch.set_num_threads(count)
        try:
            state = [torch.zeros(n, dtype=torch.float16), torch.ones(n), torch.zeros(n), torch.zeros(n)]
            native.adam_update(state[0], grad, state[1], state[2], state[3], **_scalars(0.9, 1.0, 1.0),
                               has_weight_decay=True, decoupled=True, maximize=False, lerp_low=True)
            runs.append(state)
        finally:
            torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_overflow_check_finds_every_inf_and_nan(dtype):
    """At the start, in each of the interleaved streams, in the tail; inf, -inf, NaN;
    and an fp32 value that overflows only once unscaled (inv_scale > 1)."""
    for n in SIZES:
        grad = torch.randn(n).to(dtype)
        assert not native.nonfinite(grad, 1.0)
        for where, bad in itertools.product(sorted({0, n // 5, n // 2, (3 * n) // 4, n - 1}), ["inf", "-inf", "nan"]):
            broken = grad.clone()
            broken[where] = float(bad)
            assert native.nonfinite(broken, 1 / 1024), (n, where, bad)
    big = torch.full((100,), 3e38)
    assert not native.nonfinite(big, 1.0) and native.nonfinite(big, 2.0)


def test_the_library_is_built_once_and_then_loaded_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_LIBRARY", None)
    native.load()
    built = list((tmp_path / "mpfp16").glob("native-*.so"))
    assert len(built) == 1 and not list((tmp_path / "mpfp16").glob("*partial*"))
    monkeypatch.setattr(native, "_LIBRARY", None)
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler now: a second process finds it on disk
    native.load()


@pytest.mark.parametrize("compiler,error", [
    ("no-such-compiler", "FileNotFoundError: no C++ compiler: 'no-such-compiler' is not on PATH (set CXX)"),
    ("false", "OSError: building the fused step's C++ kernels failed: false exited with status 1"),
])
def test_a_build_that_fails_is_a_compile_error_of_the_fused_step(tmp_path, monkeypatch, caplog, compiler, error):
    """Under fused=True, one line naming the rank and the reason, with nothing written;
    under auto, the unfused step with one warning, and torch's numbers."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setattr(native, "_LIBRARY", None)
    monkeypatch.setattr(mpfp16.optimizer, "FUSED_MIN_NUMEL", 0)
    model = mpfp16.to_half(tiny_mlp(0))
    before = [p.detach().clone() for p in model.parameters()]
    opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), loss_scale=64.0, fused=True)
    x, y = batches(1)[0]
    opt.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError) as raised:
        opt.step()
    assert str(raised.value) == f"fused=True cannot be honoured: compiling the fused step failed on rank 0 ({error})"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    model, ref_model = mpfp16.to_half(tiny_mlp(0)), mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), loss_scale=64.0)
    data = batches(3)
    with caplog.at_level(logging.WARNING, logger="mpfp16"):
        train_mpfp16(model, opt, data)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"fused optimizer step unavailable: compiling failed on rank 0 ({error}); every rank uses the unfused step"]
    train_reference(ref_model, "adamw", data, scale=64.0)
    assert not opt.fused
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


@pytest.mark.parametrize("precision", [torch.float16, torch.bfloat16])
def test_an_adamw_step_on_cpu_compiles_nothing_with_inductor(monkeypatch, precision):
    """The native kernels cover a CPU AdamW step that does not clip: 16-bit and fp32
    (LayerNorm) groups, with masters or without, before and after unscale_()."""
    from mpfp16.stores import kernels

    def refused(fn, **static):
        raise AssertionError(f"inductor kernel {fn.__name__} asked for")

    monkeypatch.setattr(kernels, "compiled", refused)
    monkeypatch.setattr(mpfp16.optimizer, "FUSED_MIN_NUMEL", 0)
    for master_weights in (True, False):
        model = mpfp16.to_half(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8)), precision)
        opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), fused=True,
                                   master_weights=master_weights)
        for unscale in (False, True):
            opt.zero_grad()
            opt.backward(model(torch.randn(4, 64, dtype=precision)).float().pow(2).mean())
            if unscale:
                opt.unscale_()
            assert opt.step() and opt.fused
