"""The C++ kernels of the fused step on CPU (mpfp16/stores/native.cpp): Adam/AdamW bit
for bit against torch's own sequence of eager operations, in every mode, dtype and
size; the overflow check; the build, its cache, a damaged cache, $CXX, and a build or a
load that fails."""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mpfp16
import mpfp16.stores.fused
from mpfp16.errors import one_line
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


BF16 = torch.bfloat16
MOMENTS = [(torch.float32, BF16), (BF16, torch.float32), (BF16, BF16)]


@pytest.mark.parametrize("weights,grads,has_master", [(torch.float16, torch.float16, True),
                                                      (BF16, torch.float32, True), (BF16, BF16, False)],
                         ids=["fp16-masters", "bf16-fp32-grads-masters", "bf16-no-masters"])
@pytest.mark.parametrize("m_dtype,v_dtype", MOMENTS, ids=[f"{str(m)[6:]}-{str(v)[6:]}" for m, v in MOMENTS])
def test_bf16_moments_are_the_fp32_step_rounded_once_bit_for_bit(m_dtype, v_dtype, weights, grads, has_master):
    """issue 39: the moments widened, the step of torch's arithmetic from them in fp32
    (the new parameter from the new moments unrounded), each new moment then rounded
    once to nearest-even with .to(): every buffer's bits, at sizes that take the tail,
    the vector loop and two threads."""
    g = torch.Generator().manual_seed(1)
    assert native.handles_states(m_dtype, v_dtype)
    for (wd_mode, beta1), n in itertools.product([("decoupled", 0.9), ("coupled", 0.3)], SIZES):
        inv_scale = 1.0 if grads == torch.float32 else 1 / 1024
        p0 = torch.randn(n, generator=g)
        grad = (torch.randn(n, generator=g) * (1 / inv_scale)).to(grads)
        m0 = (torch.randn(n, generator=g) * 0.1).to(m_dtype)
        v0 = (torch.rand(n, generator=g) * 1e-2).to(v_dtype)
        master = p0 + 1e-4 * torch.randn(n, generator=g) if has_master else None
        mine = [p0.to(weights), None if master is None else master.clone(), m0.clone(), v0.clone()]
        ref = [p0.to(weights), None if master is None else master.clone(), m0.float().clone(), v0.float().clone()]
        native.adam_update(mine[0], grad, mine[1], mine[2], mine[3], **_scalars(beta1, 1.0, inv_scale),
                           has_weight_decay=True, decoupled=wd_mode == "decoupled", maximize=False,
                           lerp_low=abs(1 - beta1) < 0.5)
        _by_eager_ops(ref[0], grad, ref[1], ref[2], ref[3], beta1=beta1, clip=1.0, inv_scale=inv_scale,
                      wd_mode=wd_mode, maximize=False)
        ref[2], ref[3] = ref[2].to(m_dtype), ref[3].to(v_dtype)
        for name, a, b in zip(("weights", "master", "exp_avg", "exp_avg_sq"), mine, ref):
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), (name, wd_mode, beta1, n)
        assert not torch.equal(mine[2], m0)  # it stepped


def _awkward_fp32(n: int, g: torch.Generator) -> torch.Tensor:
    """fp32 values whose rounding to bf16 tells conversions apart: random bit patterns
    (every exponent: zeros, denormals, infinities, NaNs of any payload and sign), exact
    ties between two bf16 values with an even and an odd last bit, a bit either side of a
    tie, and values that round up to infinity."""
    bits = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64)
    bf16_bits = torch.randint(0, 2**16, (n,), generator=g, dtype=torch.int64) << 16
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF])[torch.randint(0, 5, (n,), generator=g)]
    ties = bf16_bits | low
    mixed = torch.where(torch.rand(n, generator=g) < 0.5, bits, ties)
    mixed[:4] = torch.tensor([0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x007FFFFF])  # up to inf; denormals
    return ((mixed + 2**31) % 2**32 - 2**31).to(torch.int32).view(torch.float32)


@pytest.mark.skipif(native.build_isa() != "AVX512_BF16", reason="the CPU has no AVX512-BF16")
@pytest.mark.parametrize("offset", [0, 1], ids=["streamed-weights", "ordinary-weight-stores"])
def test_the_bf16_conversion_instruction_gives_the_bits_of_to(offset):
    """issue 39: with AVX512-BF16, bf16 values are stored with VCVTNE2PS2BF16, which
    reads denormals as zero and quiets NaNs its own way; native.cpp's narrow takes
    at::vec's conversion for the vectors that hold either. bf16 weights rounded from fp32
    masters (a step of size 0 leaves each master as it was) show every rounding: each
    is .to(torch.bfloat16)'s bits, and the build without the instruction gives the same
    bits, NaNs among them. The moments keep a denormal exp_avg_sq as .to() does."""
    g = torch.Generator().manual_seed(11)
    n = 2 * (1 << 15) + 1037
    masters = _awkward_fp32(n, g)
    zero_step = {**_scalars(0.9, 1.0, 1.0), "neg_step_size": 0.0}
    results = []
    for library in (native.build("AVX512"), native.build("AVX512_BF16")):
        weights = torch.empty(n + offset, dtype=BF16)[offset:]
        weights.fill_(1.0)
        state = [weights, masters.clone(), torch.zeros(n, dtype=BF16), torch.ones(n, dtype=BF16)]
        native.adam_update(state[0], torch.zeros(n), *state[1:], library=library, **zero_step,
                           has_weight_decay=False, decoupled=False, maximize=False, lerp_low=True)
        results.append(state[0])
    expected = masters.to(BF16)
    finite = ~masters.isnan()
    assert torch.equal(_bits(results[1])[finite], _bits(expected)[finite])
    assert torch.equal(results[1].isnan(), masters.isnan())
    assert torch.equal(_bits(results[1]), _bits(results[0]))  # NaNs too
    # exp_avg_sq decaying through bf16's denormals (zero gradients): stored as .to() rounds
    v0 = (torch.rand(n, generator=g) * 2e-38).to(BF16)
    assert (v0.float().abs() < torch.finfo(torch.float32).tiny).sum() > n // 4
    state = [torch.zeros(n, dtype=BF16), torch.zeros(n), torch.zeros(n, dtype=BF16), v0.clone()]
    native.adam_update(state[0], torch.zeros(n), *state[1:], **_scalars(0.9, 1.0, 1.0), has_weight_decay=False,
                       decoupled=False, maximize=False, lerp_low=True)
    assert torch.equal(_bits(state[3]), _bits((v0.float() * BETA2).to(BF16)))
    assert (state[3] != 0).sum() > n // 4


def test_moments_of_another_dtype_are_refused_by_the_kernel():
    """fp16 moments (refused by FP16Optimizer: exp_avg_sq underflows) have no kernel:
    the library says so, it steps nothing."""
    assert not native.handles_states(torch.float16, torch.float32)
    w, grad = torch.zeros(8, dtype=torch.float16), torch.ones(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16 exp_avg and torch.float32 exp_avg_sq"):
        native.adam_update(w, grad, torch.zeros(8), torch.zeros(8, dtype=torch.float16), torch.zeros(8),
                           **_scalars(0.9, 1.0, 1.0), has_weight_decay=False, decoupled=False, maximize=False,
                           lerp_low=False)
    assert torch.equal(w, torch.zeros(8, dtype=torch.float16))


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
    """AVX2 steps exactly as AVX-512 does, and AVX-512 with AVX512-BF16's conversion
    where the CPU has it: the ISA changes the speed, never a bit, with fp32 moments and
    bf16 ones. A CPU with neither takes inductor's kernels (at::vec's portable fmadd
    rounds twice)."""
    if native.isa() not in native.ISA_FLAGS:
        assert not native.handles(torch.device("cpu"), torch.float16, torch.float16, "nearest")
        return
    isas = ["AVX2", native.isa(), native.build_isa()]
    g = torch.Generator().manual_seed(3)
    n = 2 * (1 << 15) + 1037
    grad = (torch.randn(n, generator=g) * 1024).half()
    p0 = torch.randn(n, generator=g)
    results = []
    for name in dict.fromkeys(isas):
        library = native.build(name)
        state = [p0.half(), p0.clone(), torch.zeros(n), torch.zeros(n),
                 p0.half(), p0.clone(), torch.zeros(n, dtype=BF16), torch.zeros(n, dtype=BF16)]
        for (wd_mode, beta1), at in itertools.product((("decoupled", 0.9), ("coupled", 0.3)), (0, 4)):
            native.adam_update(state[at], grad, *state[at + 1:at + 4], library=library,
                               **_scalars(beta1, 0.5, 1 / 1024), has_weight_decay=True,
                               decoupled=wd_mode == "decoupled", maximize=False, lerp_low=abs(1 - beta1) < 0.5)
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
    ("false", "OSError: building the fused step's C++ kernels in {folder} failed: false exited with status 1"),
], ids=["no-compiler", "compiler-fails"])
def test_a_build_that_fails_is_a_compile_error_of_the_fused_step(tmp_path, monkeypatch, caplog, compiler, error):
    """Under fused=True, one line naming the rank and the reason, with nothing written;
    under auto, the unfused step with one warning, and torch's numbers."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setattr(native, "_LIBRARY", None)
    error = error.format(folder=tmp_path / "mpfp16")
    monkeypatch.setattr(mpfp16.stores.fused, "FUSED_MIN_NUMEL", 0)
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


# The damaged caches, the $CXX and the failed builds below take a stand-in compiler: a
# shell script that copies a real build of native.cpp (the default cache's, built once per
# machine and shared with the tests above) to its output, or writes what a case needs, in
# milliseconds where a build takes seconds. What the library does with the cache is real.


@pytest.fixture(scope="module")
def real_library() -> Path:
    """A whole build of native.cpp, from the default cache (built there if it is not)."""
    return Path(native.build()._name)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """The ``mpfp16`` folder of an inductor cache of this test's own (not yet created),
    with no library loaded in this process yet, as in a new run."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(native, "_LIBRARY", None)
    return tmp_path / "inductor" / "mpfp16"


def _fake_compiler(folder: Path, *, copies: Path | None = None, writes: str = "", prints: str = "",
                   status: int = 0) -> Path:
    """A stand-in for ``$CXX`` at ``folder/fake-c++``: it records its arguments, one a line,
    in ``folder/argv``, copies ``copies`` (or writes ``writes``) to the file after ``-o``,
    prints ``prints`` on stderr (``$out`` there is that file) and exits with ``status``."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "fake-c++"
    output = f'cp "{copies}" "$out"' if copies else f"printf '%s' '{writes}' > \"$out\"" if writes else ""
    script.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > "$(dirname "$0")/argv"
out=
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then out=$2; fi; shift; done
{output}
cat >&2 <<EOF
{prints}
EOF
exit {status}
""")
    script.chmod(0o755)
    return script


def _manifest(cache: Path) -> tuple[Path, dict]:
    (path,) = cache.glob("native-*.json")
    return path, json.loads(path.read_text())


def _steps(library: ctypes.CDLL) -> bool:
    """Whether ``library`` runs native.cpp's kernels: it finds a NaN in a gradient."""
    grad = torch.zeros(100, dtype=torch.float16)
    grad[37] = float("nan")
    return native.nonfinite(grad, 1.0, library) and not native.nonfinite(grad[:37], 1.0, library)


@pytest.fixture(scope="module")
def foreign_library(tmp_path_factory) -> Path:
    """A valid shared object without native.cpp's symbols."""
    path = tmp_path_factory.mktemp("foreign") / "libforeign.so"
    subprocess.run([*shlex.split(os.environ.get("CXX", "c++")), "-shared", "-fPIC", "-x", "c++", "-", "-o", str(path)],
                   input='extern "C" int other(void) { return 1; }\n', text=True, check=True)
    return path


def _replace(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` as a new file: this process mapped the whole library there
    and keeps it mapped (truncating that file would be this test's own SIGBUS)."""
    partial = path.with_name("replacement")
    partial.write_bytes(data)
    os.replace(partial, path)


@pytest.fixture
def mapped(monkeypatch, real_library) -> list[Path]:
    """Every library ctypes maps in the test; one that is not a whole build of
    native.cpp fails the test before the loader reads it."""
    whole = real_library.read_bytes()
    seen, cdll = [], ctypes.CDLL

    def checked(name, *args, **kwargs):
        seen.append(Path(name))
        assert Path(name).read_bytes() == whole, f"mapped {name}, which is not a whole build"
        return cdll(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", checked)
    return seen


@pytest.mark.parametrize("damage", ["truncated", "foreign", "same-size", "no-manifest", "cut-manifest"])
def test_a_damaged_library_in_the_cache_is_rebuilt_before_it_is_mapped(cache, monkeypatch, caplog, real_library,
                                                                      foreign_library, mapped, damage):
    """A library cut to 30,000 bytes (its ELF header whole: mapped, it killed the run with
    SIGBUS), another shared object in its place (its symbols missing: a traceback), one
    flipped byte, a manifest missing or cut short: the next run rebuilds it, says so in one
    INFO line naming the file, and steps with the new build; nothing damaged is mapped."""
    monkeypatch.setenv("CXX", str(_fake_compiler(cache.parent.parent / "bin", copies=real_library)))
    native.load()
    (library,) = cache.glob("native-*.so")
    size = real_library.stat().st_size
    if damage == "truncated":
        _replace(library, real_library.read_bytes()[:30000])
        why = f"{library} is 30000 bytes, not the {size} it was built with"
    elif damage == "foreign":
        _replace(library, foreign_library.read_bytes())
        why = f"{library} is {foreign_library.stat().st_size} bytes, not the {size} it was built with"
    elif damage == "same-size":
        data = bytearray(real_library.read_bytes())
        data[size // 2] ^= 0xFF
        _replace(library, bytes(data))
        why = f"{library} does not match the digest it was built with"
    else:
        manifest, _ = _manifest(cache)
        if damage == "no-manifest":
            manifest.unlink()
            why = f"{library} has no manifest ({manifest.name}) to check it against"
        else:
            manifest.write_text(manifest.read_text()[:20])
            why = f"its manifest {manifest} is not one that mpfp16 wrote"
    monkeypatch.setattr(native, "_LIBRARY", None)  # a new run
    with caplog.at_level(logging.DEBUG, logger="mpfp16"):
        assert _steps(native.load())
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO] == [
        ("INFO", f"fused step: rebuilding its C++ kernels: {why}")]
    assert library.read_bytes() == real_library.read_bytes() and _manifest(cache)[1]["library"] == library.name
    assert mapped == [library, library]
    assert sorted(p.name for p in cache.iterdir()) == sorted([library.name, _manifest(cache)[0].name])


def test_a_library_that_does_not_load_is_one_oserror_naming_it(cache, monkeypatch, foreign_library):
    """Another shared object in the cache with a manifest that vouches for it (its
    digest is right, so rebuilding would give no other): one line, naming the file,
    where a missing symbol was a traceback."""
    monkeypatch.setenv("CXX", str(_fake_compiler(cache.parent.parent / "bin", copies=foreign_library)))
    with pytest.raises(OSError) as raised:
        native.load()
    (library,) = cache.glob("native-*.so")
    assert one_line(raised.value) == (f"loading the fused step's C++ kernels failed: {library}: undefined symbol: "
                                      "mpfp16_adam (built just now)")
    with pytest.raises(OSError) as raised:
        native.load()  # the next run loads it from the cache, and says which file to delete
    assert one_line(raised.value) == (f"loading the fused step's C++ kernels failed: {library}: undefined symbol: "
                                      "mpfp16_adam (delete the file to rebuild it)")


def test_a_library_that_does_not_load_is_said_once_in_each_run(cache, monkeypatch, caplog):
    """The unfused step, and each run's one warning naming the file: a later run does
    not stay on the slower step without a word."""
    monkeypatch.setenv("CXX", str(_fake_compiler(cache.parent.parent / "bin", writes="not a library\n" * 8)))
    monkeypatch.setattr(mpfp16.stores.fused, "FUSED_MIN_NUMEL", 0)
    said = []
    for run in range(2):
        monkeypatch.setattr(native, "_LIBRARY", None)
        model = mpfp16.to_half(tiny_mlp(0))
        opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), loss_scale=64.0)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mpfp16"):
            train_mpfp16(model, opt, batches(2))
        assert not opt.fused
        said += [r.getMessage() for r in caplog.records]
    (library,) = cache.glob("native-*.so")
    assert said == [f"fused optimizer step unavailable: compiling failed on rank 0 (OSError: loading the fused "
                    f"step's C++ kernels failed: {library}: invalid ELF header ({when})); every rank uses the "
                    f"unfused step" for when in ("built just now", "delete the file to rebuild it")]


def test_cxx_is_split_as_a_shell_splits_it(cache, monkeypatch, real_library):
    """``ccache g++``, ``g++ -O2``, a quoted path with a space: the program, then its
    arguments before the project's flags; the whole command is in the cache key."""
    compiler = _fake_compiler(cache.parent.parent / "bin dir", copies=real_library)
    monkeypatch.setenv("CXX", f"{shlex.quote(str(compiler))} -DFROM_CXX=1")
    assert _steps(native.load())
    argv = (compiler.parent / "argv").read_text().splitlines()
    assert argv[:2] == ["-DFROM_CXX=1", "-O3"]
    monkeypatch.setenv("CXX", shlex.quote(str(compiler)))
    assert _steps(native.build())
    assert (compiler.parent / "argv").read_text().splitlines()[0] == "-O3"
    assert len(list(cache.glob("native-*.json"))) == 2  # two commands, two keys


@pytest.mark.parametrize("cxx,error", [
    ("'c++", "OSError: CXX=\"'c++\" does not parse as a command line: No closing quotation"),
    ("  ", "FileNotFoundError: no C++ compiler: CXX='  ' names none (unset it for c++)"),
], ids=["unclosed-quote", "blank"])
def test_a_cxx_that_names_no_command_is_refused_in_one_line(cache, monkeypatch, cxx, error):
    monkeypatch.setenv("CXX", cxx)
    with pytest.raises(OSError) as raised:
        native.load()
    assert f"{type(raised.value).__name__}: {one_line(raised.value)}" == error


# What GNU ld printed here into a full tmpfs and a read-only one (mounted for the trial;
# a test cannot mount, and root writes through chmod), and what a user without write
# permission gets; then its summary line, which was all the error said.
LD_REFUSALS = {
    "full": "/usr/bin/ld: final link failed: No space left on device",
    "read-only": "/usr/bin/ld: cannot open output file $out: Read-only file system",
    "not-writable": "/usr/bin/ld: cannot open output file $out: Permission denied",
}


@pytest.mark.parametrize("refusal", list(LD_REFUSALS))
def test_a_build_the_file_system_refuses_says_why_and_where(cache, monkeypatch, refusal):
    compiler = _fake_compiler(cache.parent.parent / "bin", status=1, prints=(
        f"{LD_REFUSALS[refusal]}\ncollect2: error: ld returned 1 exit status"))
    monkeypatch.setenv("CXX", str(compiler))
    with pytest.raises(OSError) as raised:
        native.load()
    out = (compiler.parent / "argv").read_text().splitlines()[-1]
    assert one_line(raised.value) == (f"building the fused step's C++ kernels in {cache} failed: fake-c++ exited "
                                      f"with status 1: {LD_REFUSALS[refusal].replace('$out', out)}")
    assert not any(cache.iterdir())  # nothing left behind


def test_a_cache_folder_that_cannot_be_made_is_named(tmp_path, monkeypatch):
    """Where the folder cannot be made (here a file stands where a folder must be), the
    line names it: the reason alone ("Not a directory") named no path."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a-file" / "inductor"))
    monkeypatch.setattr(native, "_LIBRARY", None)
    with pytest.raises(OSError) as raised:
        native.load()
    assert one_line(raised.value) == (f"the fused step's C++ kernels cannot be cached in "
                                      f"{tmp_path / 'a-file' / 'inductor' / 'mpfp16'}: Not a directory")


@pytest.mark.parametrize("precision", [torch.float16, torch.bfloat16])
def test_an_adamw_step_on_cpu_compiles_nothing_with_inductor(monkeypatch, precision):
    """The native kernels cover a CPU AdamW step that does not clip: 16-bit and fp32
    (LayerNorm) groups, with masters or without, before and after unscale_()."""
    from mpfp16.stores import kernels

    def refused(fn, **static):
        raise AssertionError(f"inductor kernel {fn.__name__} asked for")

    monkeypatch.setattr(kernels, "compiled", refused)
    monkeypatch.setattr(mpfp16.stores.fused, "FUSED_MIN_NUMEL", 0)
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
