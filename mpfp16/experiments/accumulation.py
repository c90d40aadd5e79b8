"""fp32 accumulation of micro-batch gradients: how far each way of summing a step's
micro-batch gradients lands from their exact sum.

``python -m mpfp16.experiments accumulation [--models resnet18,imagegpt-s,gpt2] [--quick]``
writes its section of docs/ACCUMULATION.md: a common part, then one block per model
(a run replaces the blocks of the models it measured).

For each model and each count N of micro-batches, a fresh model (``to_half``, seed 0)
and ``FP16Optimizer(SGD, loss_scale=1024, accumulate_dtype=torch.float32)`` run
``opt.backward(loss_i / N)`` for the first N micro-batches of a fixed stream, then
``opt.unscale_()``. A tensor hook on every 16-bit parameter sees each micro-batch's
fresh 16-bit gradient as autograd delivers it and adds it into:

- an fp64 sum, the reference: the exact sum of those 16-bit gradients (what fp16 loses
  inside each micro-batch's backward is in every column alike, and not counted);
- an fp16 sum, one in-place fp16 addition per micro-batch, the addition autograd's
  ``.grad += new`` makes under ``accumulate_dtype=None`` (checked against
  FP16Optimizer itself where a model's plan asks: :func:`check_fp16_library`);
- an fp32 sum, the same additions in fp32 (checked to be bit for bit the optimizer's
  own fp32 sum, in rows up to ``CHECKED_UP_TO`` micro-batches).

The three columns, each ``||sum - fp64 sum|| / ||fp64 sum||`` over the 16-bit
parameters (normalization layers stay fp32 under ``to_half`` and are summed in fp32
either way): the fp16 sum; the optimizer's fp32 sum (``opt.master_params()``' ``.grad``
after ``unscale_()``, the 1/1024 multiplication exact); and that fp32 sum rounded once
to fp16, what mpfp16's DDP hook puts on a 16-bit wire on the last micro-batch
(mpfp16/parallel/accumulation.py ``Carry.fold``: the last micro-batch is added
in fp32, then the total rounded once).

**Kernels.** This CPU's fp16 convolutions and matrix products are 4-7x slower than the
same products computed by fp32 kernels; they too accumulate in fp32 and round each
result once to fp16 (measured: their error against an fp64 product is that of rounding
the exact product). So by default every fp16 convolution and matrix product
(``GEMMS``) runs as an fp32 kernel on the exactly widened fp16 inputs, its result
rounded once to fp16, as a GPU's fp16 tensor cores compute (:class:`Fp16ByFp32Gemm`);
every other operation (the additions autograd makes, elementwise ops, attention,
embeddings) is the CPU's own fp16. One row runs the CPU's own fp16 kernels
throughout, for comparison. The run uses one torch thread.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..convert import to_half
from ..optimizer import FP16Optimizer

NAME = "accumulation"
DOC = "docs/ACCUMULATION.md"
TITLE = "# fp32 accumulation of micro-batch gradients"
LOSS_SCALE = 1024.0
COUNTS = (4, 32, 128)
QUICK_COUNTS = (2, 4)
CHECKED_UP_TO = 32  # rows with N up to this also check the fp32 sum against the hooks' (one more fp32 add)

_aten = torch.ops.aten
GEMMS = frozenset({_aten.convolution.default, _aten.convolution_backward.default, _aten.mm.default,
                   _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


class Fp16ByFp32Gemm(TorchDispatchMode):
    """Inside it, each fp16 convolution or matrix product (``GEMMS``, forward and
    backward) runs as the fp32 kernel on its fp16 inputs widened (exactly), and each
    fp32 result is rounded once to fp16: fp16 tensor-core arithmetic (fp32
    accumulation), on fp32 CPU kernels. Every other operation runs as it is.

    ``weights``: tensors that stay unchanged while the mode is on (the model's fp16
    parameters; nothing steps them here): each is widened once, and the widened copy
    reused for as long as its version counter says it was not written."""

    def __init__(self, weights=()) -> None:
        super().__init__()
        self._weights = {w.data_ptr(): w.numel() for w in weights if w.dtype == torch.float16}
        self._widened: dict = {}

    def _widen(self, a):
        if not (isinstance(a, torch.Tensor) and a.dtype == torch.float16):
            return a
        if self._weights.get(a.data_ptr()) != a.numel():
            return a.float()
        key = (a.data_ptr(), tuple(a.shape), a.stride())
        version, wide = self._widened.get(key, (None, None))
        if version != a._version:
            wide = a.float()
            self._widened[key] = (a._version, wide)
        return wide

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS and any(isinstance(a, torch.Tensor) and a.dtype == torch.float16 for a in args):
            def narrow(o):
                return o.half() if isinstance(o, torch.Tensor) and o.dtype == torch.float32 else o

            out = func(*[self._widen(a) for a in args], **{k: self._widen(v) for k, v in kwargs.items()})
            return tuple(narrow(o) for o in out) if isinstance(out, (tuple, list)) else narrow(out)
        return func(*args, **kwargs)


@dataclass
class Workload:
    """A model and its stream of micro-batches: ``build()`` makes the fp32 model,
    ``loss(model, i)`` is micro-batch i's loss (fp32, mean over its samples)."""

    key: str
    label: str
    micro_batch: str
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int], torch.Tensor]
    params: int = 0  # 16-bit parameters, filled in by measure()


def cifar_workload(arch: str, count: int, per_micro: int = 2, label: str | None = None) -> Workload:
    """A CIFAR model of the training script (mpfp16.train.models.build_cifar_model: the
    CIFAR ResNet-18 has a 3x3 stride-1 first convolution and no max-pool) on the
    embedded synthetic CIFAR-shaped set (the training split's seed, 1), normalized as
    the script normalizes it, ``per_micro`` images per micro-batch, BatchNorm in
    training mode."""
    from ..train.data import synthetic_images
    from ..train.models import build_cifar_model
    from .common import normalize

    images, labels = synthetic_images(count * per_micro, 32, 10, seed=1)
    x = normalize(images)

    def loss(model, i):
        s = slice(i * per_micro, (i + 1) * per_micro)
        return nn.functional.cross_entropy(model(x[s]), labels[s])

    return Workload(arch, label or arch, f"{per_micro} images 32x32", lambda: build_cifar_model(arch, 10), loss)


def gpt_workload(size: str, count: int, seq_len: int = 16, label: str | None = None, **overrides) -> Workload:
    """A GPT size of mpfp16.train.gpt (all its positions kept) on random tokens: one
    sequence of ``seq_len`` tokens per micro-batch, the next-token loss."""
    from ..train.gpt import GPT_SIZES, build_gpt, next_token_loss

    vocab = overrides.get("vocab_size", GPT_SIZES[size]["vocab_size"])
    tokens = torch.randint(0, vocab, (count, 1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    return Workload(size, label or size, f"1 x {seq_len} tokens", lambda: build_gpt(size, **overrides),
                    lambda model, i: next_token_loss(model, tokens[i]))


@dataclass
class Row:
    workload: str
    params: int
    micro_batch: str
    n: int
    kernels: str
    fp16: float
    fp32: float
    wire: float
    fp32_is_library: bool | None  # the hooks' sequential fp32 sum == the optimizer's, bit for bit (None: not checked)
    seconds: float
    extra: dict = field(default_factory=dict)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def _build(w: Workload, accumulate_dtype):
    torch.manual_seed(0)
    model = to_half(w.build())
    model.train()
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), loss_scale=LOSS_SCALE, fused=False,
                        accumulate_dtype=accumulate_dtype)
    pairs = [(p, m) for p, m in zip(opt.model_params(), opt.master_params()) if p.dtype == torch.float16]
    return model, opt, pairs


def _hook_sums(pairs, with_fp32: bool):
    """Tensor hooks on the 16-bit parameters that add each fresh gradient (as autograd
    delivers it, before it reaches ``.grad``) into an fp64, an fp16 and (with
    ``with_fp32``) an fp32 sum. Returns (sums, handles)."""
    sums = {"fp64": [torch.zeros(p.shape, dtype=torch.float64) for p, _ in pairs],
            "fp16": [torch.zeros(p.shape, dtype=torch.float16) for p, _ in pairs]}
    if with_fp32:
        sums["fp32"] = [torch.zeros(p.shape, dtype=torch.float32) for p, _ in pairs]

    def hook(i):
        def add(g):
            with torch.no_grad():
                for buffers in sums.values():
                    buffers[i].add_(g)  # fp16 += fp16: autograd's in-place accumulation; fp32/fp64: exact widening
        return add

    return sums, [p.register_hook(hook(i)) for i, (p, _) in enumerate(pairs)]


def _micro_batches(model, opt, w: Workload, n: int, native: bool) -> None:
    opt.zero_grad()
    gemms = Fp16ByFp32Gemm(weights=list(model.parameters()))
    for i in range(n):
        if native:
            opt.backward(w.loss(model, i) / n)
        else:
            with gemms:
                opt.backward(w.loss(model, i) / n)
    opt.unscale_()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def measure(w: Workload, n: int, native: bool = False) -> Row:
    """One row: N micro-batches through ``FP16Optimizer(accumulate_dtype=torch.float32)``."""
    started = time.perf_counter()
    model, opt, pairs = _build(w, torch.float32)
    w.params = sum(p.numel() for p, _ in pairs)
    checked = n <= CHECKED_UP_TO
    sums, handles = _hook_sums(pairs, with_fp32=checked)
    try:
        _micro_batches(model, opt, w, n, native)
    finally:
        for h in handles:
            h.remove()
    ref = _flat(sums["fp64"])
    library = _flat([m.grad for _, m in pairs]).double() * LOSS_SCALE  # exact: a power of two, fp32 normal range
    library32 = library.float()
    row = Row(w.label, w.params, w.micro_batch, n, "CPU's own fp16" if native else "fp32 GEMMs, fp16 results",
              fp16=_rel(_flat(sums["fp16"]), ref), fp32=_rel(library32, ref), wire=_rel(library32.half(), ref),
              fp32_is_library=torch.equal(library32, _flat(sums["fp32"])) if checked else None, seconds=0.0)
    row.extra["flushed_fp16"] = float(((_flat(sums["fp16"]) == 0) & (ref != 0)).double().mean())
    row.extra["flushed_wire"] = float(((library32.half() == 0) & (ref != 0)).double().mean())
    del model, opt, pairs, sums
    row.seconds = time.perf_counter() - started
    return row


def check_fp16_library(w: Workload, n: int) -> dict:
    """``FP16Optimizer(accumulate_dtype=None)`` itself: its masters' ``.grad`` after
    ``unscale_()`` against the fp64 sum of the same hooked 16-bit gradients, and whether
    it is, bit for bit, the hooks' sequential fp16 sum (the table's fp16 column)."""
    started = time.perf_counter()
    model, opt, pairs = _build(w, None)
    sums, handles = _hook_sums(pairs, with_fp32=False)
    try:
        _micro_batches(model, opt, w, n, native=False)
    finally:
        for h in handles:
            h.remove()
    ref, fp16 = _flat(sums["fp64"]), _flat(sums["fp16"])
    library = _flat([m.grad for _, m in pairs]).double() * LOSS_SCALE
    differ = int((library != fp16.double()).sum())
    return {"workload": w.label, "n": n, "library": _rel(library, ref), "fp16": _rel(fp16, ref),
            "differ": differ, "elements": library.numel(), "seconds": time.perf_counter() - started}


MODELS = ("resnet18", "imagegpt-s", "gpt2")  # --models, in table order


@dataclass
class Plan:
    """One model's block of the section: its rows (``counts`` with the default kernels,
    ``native_counts`` with the CPU's own fp16 kernels) and, at ``check_n``, the check
    of ``accumulate_dtype=None`` through FP16Optimizer itself."""

    key: str
    workload: Workload
    counts: tuple
    native_counts: tuple = ()
    check_n: int | None = None


def plans(quick: bool, models) -> list[Plan]:
    if quick:
        top, tiny = max(QUICK_COUNTS), dict(seq_len=8, layers=1, width=64, heads=2)
        made = {"resnet18": lambda: Plan("resnet18", cifar_workload(
                    "resnet9-w4", top, label="resnet9-w4 (--quick, for ResNet-18)"), QUICK_COUNTS, check_n=top),
                "imagegpt-s": lambda: Plan("imagegpt-s", gpt_workload(
                    "imagegpt-s", top, label="imagegpt-s, 1 block of width 64 (--quick)", **tiny), QUICK_COUNTS,
                    native_counts=(top,)),
                "gpt2": lambda: Plan("gpt2", gpt_workload(
                    "gpt2", top, label="gpt2, 1 block of width 64 (--quick)", **tiny), QUICK_COUNTS)}
    else:
        top = max(COUNTS)
        made = {"resnet18": lambda: Plan("resnet18", cifar_workload("resnet18", top, label="ResNet-18 (CIFAR)"),
                                         COUNTS, check_n=32),
                "imagegpt-s": lambda: Plan("imagegpt-s", gpt_workload("imagegpt-s", top), COUNTS,
                                           native_counts=(32,), check_n=32),
                "gpt2": lambda: Plan("gpt2", gpt_workload("gpt2", top), COUNTS)}
    return [made[key]() for key in MODELS if key in models]


def parse_models(text: str | None) -> tuple[str, ...]:
    """``--models``: comma-separated names of ``MODELS`` (None: all of them)."""
    if text is None:
        return MODELS
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in MODELS]
    if not names or bad:
        raise ValueError(f"--models takes a comma-separated list of {', '.join(MODELS)}, got {text!r}")
    return names


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n > 1 else ''}"


def _e(v: float) -> str:
    return f"{v:.2e}"


def table(rows: list[Row]) -> str:
    lines = [("| model | 16-bit params | micro-batch | N | fp16 kernels | fp16 sum (`accumulate_dtype=None`) "
              "| fp32 sum (`accumulate_dtype=torch.float32`) | fp32 sum rounded once to fp16 (the DDP wire) |"),
             "|---|---:|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.workload} | {r.params:,} | {r.micro_batch} | {r.n} | {r.kernels} | {_e(r.fp16)} | "
                     f"{_e(r.fp32)} | {_e(r.wire)} |")
    return "\n".join(lines)


def _print_row(r: Row) -> None:
    print(f"{r.workload:<34} N={r.n:<4} {r.kernels:<25} fp16 {_e(r.fp16)}  fp32 {_e(r.fp32)}  "
          f"wire {_e(r.wire)}  ({r.seconds:.0f}s)", flush=True)


COMMON = f"""## Measured

`python -m mpfp16.experiments {NAME}` measures every model below (`--models resnet18,imagegpt-s,gpt2` picks
some; each block names the command that wrote it, and its date).

What is measured: the relative error `||sum - fp64 sum|| / ||fp64 sum||` of the sum of a step's N micro-batch
gradients, each micro-batch's gradient that of its share of the loss (`loss / N`), over every 16-bit parameter
(the normalization layers, fp32 under `to_half`, are summed in fp32 whatever the option). For each model and N, a
fresh model (`mpfp16.to_half`, seed 0, training mode) and `FP16Optimizer(SGD, loss_scale=1024,
accumulate_dtype=torch.float32)` run `opt.backward(loss_i / N)` over the first N micro-batches of one fixed
stream, then `opt.unscale_()`. A tensor hook on each 16-bit parameter receives each micro-batch's fresh fp16
gradient as autograd delivers it and adds it into an fp64 sum, an fp16 sum and an fp32 sum. The fp64 sum is the
reference, and it is exact: fp16 values lie on a grid from 2^-24 to below 2^16, so a sum of up to 128 of them
needs at most 47 significant bits of fp64's 53. What fp16 loses inside each micro-batch's backward is in every
column alike and is not counted.

- **fp16 sum**: one in-place fp16 addition per micro-batch, the one autograd's `.grad += new` makes under
  `accumulate_dtype=None` (as apex sums); checked, in the blocks that report it, against
  `FP16Optimizer(accumulate_dtype=None)` itself on the same micro-batches (its masters' `.grad` after
  `unscale_()`).
- **fp32 sum**: the optimizer's own, `opt.master_params()`' `.grad` after `unscale_()` (times 1024, exact),
  checked, in every row with N up to {CHECKED_UP_TO}, against the hooks' sequential fp32 sum of the same
  gradients, bit for bit.
- **fp32 sum rounded once to fp16**: the optimizer's fp32 sum (still scaled by 1024) rounded to fp16: what
  mpfp16's DDP hook sends on a 16-bit wire on the last micro-batch (`Carry.fold` in
  mpfp16/parallel/accumulation.py adds that micro-batch into the fp32 sum, then rounds the total once); computed
  here from the sum, not sent through DDP.

Data: CIFAR models are the training script's architecture (`mpfp16.train.models.build_cifar_model`) on the
embedded synthetic CIFAR-shaped set (`mpfp16.train.data.synthetic_images`, seed 1, normalized as the script does
for it); GPT sizes are `mpfp16.train.gpt`'s `GPT_SIZES` (every position kept) on random tokens, the next-token
loss.

Kernels: "fp32 GEMMs, fp16 results" runs each fp16 convolution and matrix product, forward and backward, as an fp32
kernel on its exactly widened fp16 inputs and rounds the result once to fp16, as fp16 tensor cores do
(`Fp16ByFp32Gemm` in mpfp16/experiments/accumulation.py); everything else, the gradient additions included, is the
CPU's own fp16. This CPU's own fp16 kernels also accumulate in fp32 and round once, but are 4-7x slower; rows
marked "CPU's own fp16" run them throughout. The run uses one torch thread (reductions in one order, whatever
the machine).
"""


def block(plan: Plan, rows: list[Row], check: dict | None, quick: bool, seconds: float) -> str:
    w = plan.workload
    command = f"python -m mpfp16.experiments {NAME} --models {plan.key}" + (" --quick" if quick else "")
    lines = [f"### {w.label}", "",
             (f"`{command}`, {datetime.date.today().isoformat()}, torch {torch.__version__}, CPU, "
              f"{_threads()}, {seconds / 60:.1f} minutes; {w.params:,} 16-bit parameters, "
              f"micro-batches of {w.micro_batch}."), "", table(rows), ""]
    bad = [r for r in rows if r.fp32_is_library is False]
    checked = sorted({r.n for r in rows if r.fp32_is_library is not None})
    lines.append(f"The fp32 column equals the hooks' sequential fp32 sum bit for bit at N = "
                 f"{', '.join(map(str, checked))}." if not bad else
                 "The fp32 column differs from the hooks' sequential fp32 sum in: "
                 + ", ".join(f"N = {r.n} ({r.kernels})" for r in bad) + ".")
    if check is not None:
        lines.append(
            f"`FP16Optimizer(accumulate_dtype=None)` itself, N = {check['n']}: relative error "
            f"{_e(check['library'])}; {check['differ']:,} of its {check['elements']:,} elements differ from the "
            f"hooks' sequential fp16 sum ({_e(check['fp16'])}) of its own micro-batch gradients"
            + (": the fp16 column is the library's behaviour, bit for bit." if check["differ"] == 0 else "."))
    top = max(rows, key=lambda r: r.n)
    lines.append(f"Elements whose exact sum is not zero but which read zero, N = {top.n}: fp16 sum "
                 f"{100 * top.extra['flushed_fp16']:.3f}%, fp32 sum rounded to fp16 "
                 f"{100 * top.extra['flushed_wire']:.3f}%.")
    return "\n".join(lines) + "\n"


def run(quick: bool, doc: str, models=None) -> dict:
    """Measure ``models`` (names of ``MODELS``; None: all), print each row, and write the
    common part of the section and each model's block into ``doc``."""
    models = parse_models(models) if models is None or isinstance(models, str) else tuple(models)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reproducible reductions, and no 2-thread stalls on a busy machine
    try:
        return _run(quick, doc, models)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool, doc: str, models) -> dict:
    from .common import write_section

    if not os.path.exists(doc):
        os.makedirs(os.path.dirname(os.path.abspath(doc)), exist_ok=True)
        with open(doc, "w") as f:
            f.write(TITLE + "\n")
    write_section(doc, NAME, COMMON)
    out = {}
    for plan in plans(quick, models):
        started = time.perf_counter()
        rows, check = [], None
        for n in plan.counts:
            rows.append(measure(plan.workload, n))
            _print_row(rows[-1])
        if plan.check_n is not None:
            check = check_fp16_library(plan.workload, plan.check_n)
            print(f"{plan.workload.label:<34} N={check['n']:<4} FP16Optimizer(accumulate_dtype=None): "
                  f"{_e(check['library'])}; {check['differ']} of {check['elements']:,} elements differ from the "
                  f"sequential fp16 sum ({check['seconds']:.0f}s)", flush=True)
        for n in plan.native_counts:
            rows.append(measure(plan.workload, n, native=True))
            _print_row(rows[-1])
        write_section(doc, f"{NAME}:{plan.key}", block(plan, rows, check, quick, time.perf_counter() - started))
        out[plan.key] = {"rows": rows, "check": check}
    return out
