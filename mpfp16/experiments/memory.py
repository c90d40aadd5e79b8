"""Memory per parameter against quality: optimizer states in 16 bits, and torchao's.

Every mode trains the same two workloads, with AdamW, from the same start, on the same
batches: the small ResNet of the other experiments on the embedded CIFAR-shaped data
(the default CIFAR run's model and data, with AdamW), and a GPT-shaped decoder
(mpfp16/train/gpt.py, the benchmarks' model, at a CPU size) on a learnable synthetic
token stream, for the same number of steps. The modes: fp16 weights with fp32 masters
and fp32 states (the reference); bf16 states rounded to nearest, and stochastically;
torchao's ``AdamW8bit`` and ``AdamW4bit`` over fp32 masters; fp16 weights without
masters, Kahan rounding, fp32 states. For each: the final loss (and the ResNet's
validation accuracy), the distance of the final weights to the reference's, the
bytes per parameter by component (``memory_bytes_per_param()``), and the median time
of ``opt.step()``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn

from ..convert import to_half
from ..optimizer import FP16Optimizer
from ..train.gpt import GPT, next_token_loss
from ..train.models import resnet9
from ..train.schedule import lr_multiplier
from . import common as C

NAME = "memory"
DOC = "docs/MEMORY.md"

MODES = {  # name -> FP16Optimizer options, and the inner optimizer: "torch" (AdamW), or torchao's class name
    "fp32 states": (dict(), "torch"),
    "bf16 states, nearest": (dict(state_dtype=torch.bfloat16), "torch"),
    "bf16 states, stochastic": (dict(state_dtype=torch.bfloat16, state_rounding="stochastic"), "torch"),
    "torchao 8-bit": (dict(), "AdamW8bit"),
    "torchao 4-bit": (dict(), "AdamW4bit"),
    "no masters, Kahan": (dict(master_weights=False, rounding="kahan"), "torch"),
}
GPT_SIZE = dict(vocab_size=256, seq_len=64, width=128, layers=4, heads=4)
GPT_QUICK = dict(vocab_size=64, seq_len=16, width=32, layers=1, heads=2)
# --quick (the suite's check of the experiment) runs the modes that compile nothing:
# torchao's step, stochastic and Kahan rounding each compile kernels per tensor shape,
# minutes on a 2-core CPU (torchao's own modes are tested in tests/test_torchao.py).
QUICK_MODES = ("fp32 states", "bf16 states, nearest")


def _inner(kind: str, params, lr: float, weight_decay: float):
    if kind == "torch":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import torchao.optim

    return getattr(torchao.optim, kind)(params, lr=lr, weight_decay=weight_decay)


def _tokens(n: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """A learnable stream: each next token is a fixed function of the two before it,
    with one token in ten replaced at random."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, vocab), generator=torch.Generator().manual_seed(1))
    out = torch.empty(n, seq_len + 1, dtype=torch.long)
    out[:, :2] = torch.randint(0, vocab, (n, 2), generator=g)
    for t in range(2, seq_len + 1):
        out[:, t] = table[out[:, t - 2], out[:, t - 1]]
        noisy = torch.rand(n, generator=g) < 0.1
        out[noisy, t] = torch.randint(0, vocab, (int(noisy.sum()),), generator=g)
    return out


class _Run:
    """One mode on one workload: the model, its optimizer, its schedule."""

    def __init__(self, workload: str, mode: str, setup: C.Setup, steps: int, seed: int, size: dict = GPT_SIZE) -> None:
        options, kind = MODES[mode]
        torch.manual_seed(seed)
        if workload == "cifar":
            self.model, lr, wd = resnet9(setup.width, 10), 2e-3, 5e-2
        else:
            self.model, lr, wd = GPT(**size), 1e-3, 1e-1
        to_half(self.model, torch.float16)
        self.opt = FP16Optimizer(_inner(kind, self.model.parameters(), lr, wd), loss_scale="dynamic",
                                 rounding_seed=seed, **options)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_multiplier(s, steps, 0, "onecycle"))
        self.step_s: list[float] = []

    def step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad()
        self.opt.backward(loss)
        started = time.perf_counter()
        self.opt.step()
        self.step_s.append(time.perf_counter() - started)
        self.sched.step()


def _cifar(mode: str, setup: C.Setup, seed: int) -> tuple[_Run, dict]:
    (xtr, ytr), (xva, yva) = C.data(setup)
    per_epoch = len(ytr) // setup.batch_size
    run = _Run("cifar", mode, setup, per_epoch * setup.epochs, seed)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(setup.epochs):
        order = torch.randperm(len(ytr), generator=g)
        for i in range(per_epoch):
            idx = order[i * setup.batch_size:(i + 1) * setup.batch_size]
            loss = nn.functional.cross_entropy(run.model(C.normalize(xtr[idx])).float(), ytr[idx])
            run.step(loss)
            losses.append(float(loss.detach()))
    return run, {"loss": statistics.mean(losses[-per_epoch:]), "accuracy": C.accuracy(run.model, xva, yva)}


def _gpt(mode: str, steps: int, batch: int, seed: int, size: dict) -> tuple[_Run, dict]:
    run = _Run("gpt", mode, C.Setup(), steps, seed, size)
    data = _tokens(steps * batch, size["seq_len"], size["vocab_size"], seed=seed)
    held_out = _tokens(64, size["seq_len"], size["vocab_size"], seed=seed + 1000)
    for i in range(steps):
        run.step(next_token_loss(run.model, data[i * batch:(i + 1) * batch]).float())
    with torch.no_grad():
        run.model.eval()
        loss = float(next_token_loss(run.model, held_out).float())
    return run, {"loss": loss}


@torch.no_grad()
def _distance(model: nn.Module, reference: nn.Module) -> float:
    """||w - w_ref|| / ||w_ref|| over every parameter, in fp32."""
    diff = sum(float((p.float() - q.float()).pow(2).sum()) for p, q in zip(model.parameters(), reference.parameters()))
    norm = sum(float(q.float().pow(2).sum()) for q in reference.parameters())
    return (diff / norm) ** 0.5


def _have_torchao() -> bool:
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        return False
    return True


def run(quick: bool, doc: str = DOC, seed: int = 0) -> dict:
    setup = C.quick(C.Setup()) if quick else C.Setup()
    gpt_steps, gpt_batch = (8, 4) if quick else (300, 16)
    size = GPT_QUICK if quick else GPT_SIZE
    modes = [m for m in (QUICK_MODES if quick else MODES) if MODES[m][1] == "torch" or _have_torchao()]
    results: dict = {}
    for workload in ("cifar", "gpt"):
        runs = {}
        for mode in modes:
            started = time.perf_counter()
            runs[mode] = (_cifar(mode, setup, seed) if workload == "cifar" else _gpt(mode, gpt_steps, gpt_batch, seed, size))
            print(f"memory: {workload}, {mode}: loss {runs[mode][1]['loss']:.4f} "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)
        reference = runs["fp32 states"][0].model
        results[workload] = {mode: {**found, "distance": _distance(r.model, reference),
                                    "bytes": r.opt.memory_bytes_per_param(),
                                    "step_ms": 1e3 * statistics.median(r.step_s[len(r.step_s) // 4:])}
                             for mode, (r, found) in runs.items()}
    _write(results, setup, gpt_steps, gpt_batch, size, modes, doc, quick)
    return results


def _table(rows: dict, accuracy: bool) -> list[str]:
    head = "| mode | final loss |" + (" val. accuracy (%) |" if accuracy else "") + \
        " distance to fp32 states | weights | gradients | masters + their gradients | states | total B/param | step ms |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, r in rows.items():
        b = r["bytes"]
        masters = b["master_weights"] + b["master_grads"] + b["master_remainder"]
        out.append(f"| {mode} | {r['loss']:.4f} |" + (f" {r['accuracy']:.1f} |" if accuracy else "")
                   + f" {r['distance']:.2e} | {b['model_weights']:.2f} | {b['model_grads']:.2f} | {masters:.2f} | "
                   f"{b['optimizer_state'] + b['compensation']:.2f} | {b['total']:.2f} | {r['step_ms']:.1f} |")
    return out


def _write(results: dict, setup: C.Setup, gpt_steps: int, gpt_batch: int, size: dict, modes: list, doc: str,
           quick: bool) -> None:
    missing = [m for m in (QUICK_MODES if quick else MODES) if m not in modes]
    note = f"\n\nNot run (torchao is not installed): {', '.join(missing)}." if missing else ""
    if quick:
        note += f"\n\n--quick: the modes that compile no kernel only ({', '.join(QUICK_MODES)})."
    md = f"""## Measured: quality and bytes per parameter by mode

`python -m mpfp16.experiments {NAME}{' --quick' if quick else ''}` — both workloads with AdamW from the same
start on the same batches, one-cycle schedule, fp16 compute, dynamic loss scaling, seed 0:

- **CIFAR**: resnet9-w{setup.width}, {setup.train_images} training and {setup.val_images} validation images of
  the embedded CIFAR-shaped data, {setup.epochs} epochs, batch {setup.batch_size}, lr 2e-3, weight decay 5e-2.
- **GPT**: mpfp16/train/gpt.py at width {size['width']}, {size['layers']} blocks, {size['heads']}
  heads, vocabulary {size['vocab_size']}, {size['seq_len']} positions, on a synthetic token stream
  (each token a fixed function of the two before it, one in ten random), {gpt_steps} steps of batch
  {gpt_batch}, lr 1e-3, weight decay 0.1; the loss is on 64 held-out sequences.

"Distance" is ||w - w_fp32 states|| / ||w_fp32 states|| over the final weights; bytes are
`memory_bytes_per_param()` between steps (states include Kahan's compensation); the step time
is the median of `opt.step()` over the last three quarters of the run, on the 2-core CPU,
unfused for every mode (the models are under the fused step's 1M-parameter threshold; the
fused step's own figures are in BENCHMARKS.md).

CIFAR:

{chr(10).join(_table(results['cifar'], True))}

GPT:

{chr(10).join(_table(results['gpt'], False))}{note}
"""
    C.write_section(doc, NAME, md)
