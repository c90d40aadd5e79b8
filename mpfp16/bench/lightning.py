"""The Lightning user's ImageGPT benchmark, through ``lightning.Trainer`` itself.

    python -m mpfp16.bench.lightning [--precisions mpfp16,16-true,32-true] [--processes 1,2]
                                     [--accumulate-grad-batches 32] [--warmup 32] [--steps 32]
                                     [--rounds 2] [--optimizer sgd] [--json PATH] [--quick]

A Lightning user's bug report trained an ImageGPT-sized transformer with
``accumulate_grad_batches=32`` and measured 9.41 / 7.17 / 9.24 iterations per GPU per
second (1 GPU; 2 GPUs syncing every micro-batch; 2 GPUs with ``no_sync``);
docs/BANDWIDTH.md reproduces that table with mpfp16's own loop
(``python -m mpfp16.bench.allreduce --model imagegpt-s``). This runs the same model
inside a LightningModule trained by ``lightning.Trainer``, under three precisions:

``mpfp16``
    the plugin ``MPFP16Precision(dtype=torch.float16)`` (mpfp16.integrations.lightning):
    fp16 weights and gradients (LayerNorms fp32), fp32 master weights, a dynamic loss
    scale, and under DDP mpfp16's communication hook;
``16-true``
    Lightning's own fp16: the weights converted to fp16, the optimizer stepping them
    directly; no loss scale and no master weights;
``32-true``
    fp32 throughout, Lightning's default.

The model is ``imagegpt-s`` of mpfp16.train.gpt (Lightning's sizes: width 512, 6 blocks,
8 heads, 1024 positions, 513 tokens; 19.7M parameters) on random token ids with the
next-token cross-entropy. Only the sequence fed to it is short (``--seq-len``, 8 tokens
by default, as docs/BANDWIDTH.md runs ``bench.allreduce``), so that fp16 matmuls, many
times slower than fp32 on a CPU, fit a run of a few minutes; the parameters, and so
the allreduce volume, stay Lightning's. The optimizer is SGD with momentum 0.9 by
default (bench.allreduce's, so that the rows compare with docs/BANDWIDTH.md; and under
``16-true`` AdamW keeps its second moment in fp16, where eps=1e-8 and the squares of
gradients below about 2e-4 round to zero, so its first step makes those weights inf or
NaN); ``--optimizer adamw`` for AdamW.

Each run is one ``Trainer.fit`` of ``--warmup`` + ``--steps`` micro-batches (logger,
checkpointing, progress bar and model summary off). A Callback times the ``--steps``
micro-batches after the warm-up (set-up and warm-up excluded) and, for ``mpfp16``
under DDP, reads ``mpfp16.distributed.comm_stats`` of the DDP module the plugin
attached its hook to: the allreduce calls and bytes of every micro-batch, summed per
optimizer step (Lightning runs the accumulating micro-batches under ``no_sync``, so
one exchange per optimizer step: one call per DDP bucket).

Processes: 1 (one device, no process group) and 2 (``strategy="ddp"``, gloo on the CPU,
127.0.0.1 and a free port). The benchmark starts its own workers, with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS=1),
so Lightning launches nothing itself; every process runs one thread, the 1-process
runs too. The workers start once; every precision is fitted once per round, the
order reversed in every other round (``--rounds``), and the table gives each row's
median over the rounds of the per-process rate of the slowest rank, with its ratio to
``32-true`` at the same process count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import sys
import time
import traceback
import warnings

import torch

from ..train.gpt import GPT_SIZES, build_gpt, next_token_loss
from .flags import list_of, sized_config

PRECISIONS = ("mpfp16", "16-true", "32-true")
OPTIMIZERS = ("sgd", "adamw")
# Lightning's sizes for the Lightning user's model, and a tiny one of the same shape for --quick
DEFAULTS = dict(model="imagegpt-s", seq_len=8, batch_size=1, accumulate_grad_batches=32, warmup=32, steps=32,
                rounds=2)
QUICK = dict(model="quick", seq_len=8, batch_size=1, accumulate_grad_batches=4, warmup=4, steps=8, rounds=1)
QUICK_MODEL = dict(vocab_size=513, seq_len=16, width=32, layers=1, heads=2)  # 30K parameters: one DDP bucket per dtype
NOTES = {
    "mpfp16": "MPFP16Precision(dtype=torch.float16): fp16 weights, fp32 master weights, dynamic loss scale",
    "16-true": "Lightning's \"16-true\": fp16 weights only; no loss scale and no master weights",
    "32-true": "Lightning's \"32-true\": fp32 weights",
}


def model_config(name: str) -> dict:
    return dict(QUICK_MODEL) if name == "quick" else dict(GPT_SIZES[name])


# ----------------------------------------------------------------- inside a worker


def _quiet_lightning() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available.*")
    warnings.filterwarnings("ignore", message=".*log_every_n_steps.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*is deprecated")  # Lightning 2.6 on torch 2.14


class _Tokens(torch.utils.data.Dataset):
    """``length`` random sequences of ``seq_len + 1`` token ids, item i from seed i."""

    def __init__(self, length: int, seq_len: int, vocab_size: int) -> None:
        self.length, self.seq_len, self.vocab_size = length, seq_len, vocab_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)


def _lightning_module(config: dict):
    import lightning as L

    class ImageGPT(L.LightningModule):
        """The GPT of mpfp16.train.gpt, next-token cross-entropy on the batch's tokens."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = build_gpt("imagegpt-s", **model_config(config["model"]))
            self.last_loss = None

        def training_step(self, batch, batch_idx):
            loss = next_token_loss(self.net, batch)
            self.last_loss = loss.detach()
            return loss

        def configure_optimizers(self):
            if config["optimizer"] == "sgd":
                return torch.optim.SGD(self.parameters(), lr=config["lr"], momentum=0.9)
            return torch.optim.AdamW(self.parameters(), lr=config["lr"])

    return ImageGPT()


def _timer_callback(warmup: int, steps: int):
    from lightning.pytorch.callbacks import Callback

    from .. import distributed as mdist

    class Timer(Callback):
        """Times micro-batches ``warmup`` to ``warmup + steps - 1`` (their start to the
        end of the last, its optimizer step included) and, where mpfp16's hook is on the
        DDP module, the allreduce calls and bytes of each, grouped by optimizer step."""

        def __init__(self) -> None:
            self.stats = None
            self.buckets = None
            self.start = self.end = None
            self.steps = []  # per optimizer step begun and ended inside the window: {"calls", "bytes", ...}
            self.accumulating_calls = 0  # calls on micro-batches that did not end in an optimizer step
            self.skipped_before = self.skipped_after = 0
            self._open = None
            self._partial = False

        def on_train_start(self, trainer, pl_module) -> None:
            self.stats = mdist.comm_stats(trainer.strategy.model)  # the module the plugin attached its hook to

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == warmup:
                if self.stats is not None:
                    self.stats.pop_step()  # the warm-up's figures
                self.skipped_before = _skipped(trainer)
                self._step_at = trainer.global_step
                self._open = {"micro_batches": 0, "calls": 0, "bytes": 0}
                self._partial = warmup % trainer.accumulate_grad_batches != 0  # a step begun in the warm-up
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if not warmup <= batch_idx < warmup + steps:
                return
            last = batch_idx == warmup + steps - 1
            if last:
                self.end = time.perf_counter()
            figures = self.stats.pop_step() if self.stats is not None else None
            stepped = trainer.global_step != self._step_at
            self._step_at = trainer.global_step
            if self._open is not None:
                self._open["micro_batches"] += 1
                if figures is not None:
                    self._open["calls"] += figures["allreduce_calls"]
                    self._open["bytes"] += figures["allreduce_bytes"]
                    if not stepped:
                        self.accumulating_calls += figures["allreduce_calls"]
                if stepped:
                    if not self._partial:
                        self.steps.append(self._open)
                    self._partial = False
                    self._open = {"micro_batches": 0, "calls": 0, "bytes": 0}
            if last:
                self.skipped_after = _skipped(trainer)

        def on_train_end(self, trainer, pl_module) -> None:
            self.buckets = _buckets(trainer.strategy.model)  # before teardown unwraps the DDP module

    return Timer()


def _skipped(trainer) -> int:
    return int(getattr(trainer.precision_plugin, "skipped_steps", 0))


def _buckets(model) -> int | None:
    """The DDP module's bucket count (after its rebuild), None for no DDP module."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    try:
        return len(model.reducer._get_zeros_like_grad_buckets())
    except Exception:  # a private API: the count is for the table only
        return None


def fit_once(config: dict, precision: str, world_size: int) -> dict:
    """One ``Trainer.fit`` in this process (rank ``RANK`` of ``world_size``): what the
    timing callback measured."""
    import lightning as L

    from ..integrations.lightning import MPFP16Precision

    _quiet_lightning()
    warmup, steps = config["warmup"], config["steps"]
    micro = warmup + steps
    vocab_size = model_config(config["model"])["vocab_size"]
    tokens = _Tokens(micro * world_size * config["batch_size"], config["seq_len"], vocab_size)
    data = torch.utils.data.DataLoader(tokens, batch_size=config["batch_size"], shuffle=False, num_workers=0)
    timer = _timer_callback(warmup, steps)
    if precision == "mpfp16":
        kwargs = {"plugins": [MPFP16Precision(dtype=torch.float16)]}
    else:
        kwargs = {"precision": precision}
    trainer = L.Trainer(accelerator="cpu", devices=world_size, num_nodes=1,
                        strategy="ddp" if world_size > 1 else "auto",
                        max_epochs=1, limit_train_batches=micro,
                        accumulate_grad_batches=config["accumulate_grad_batches"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer], **kwargs)
    module = _lightning_module(config)
    trainer.fit(module, train_dataloaders=data)
    if timer.start is None or timer.end is None:
        raise RuntimeError(f"the timed micro-batches did not all run (fit ended at global step {trainer.global_step})")
    seconds = timer.end - timer.start
    loss = module.last_loss
    return {"seconds": seconds, "micro_batches": steps, "its_per_s": steps / seconds,
            "steps": timer.steps, "accumulating_calls": timer.accumulating_calls if timer.stats is not None else None,
            "hooked": timer.stats is not None, "buckets": timer.buckets,
            "skipped_steps": timer.skipped_after - timer.skipped_before if precision == "mpfp16" else None,
            "final_loss": float(loss) if loss is not None else None, "global_step": trainer.global_step}


def _worker(rank: int, world_size: int, port: int, conn) -> None:
    """A worker: the environment torchrun gives rank ``rank`` (for ``world_size`` > 1),
    one thread; then one fit per command received, until None."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if world_size > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    try:
        import lightning  # noqa: F401  (imported before the first timing)

        from ..integrations import lightning as plugin  # noqa: F401
        conn.send({"ready": True})
        while True:
            command = conn.recv()
            if command is None:
                break
            config, precision = command
            try:
                result = fit_once(config, precision, world_size)
            except BaseException:
                result = {"error": traceback.format_exc()}
            conn.send(result)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        conn.close()


# ----------------------------------------------------------------- the launcher


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _child_environment():
    """OMP_NUM_THREADS=1 in the environment spawned workers start with."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


class WorkerGroup:
    """``world_size`` spawned worker processes (:func:`_worker`), each fitting one
    precision per :meth:`fit` call, together."""

    def __init__(self, world_size: int, timeout: float) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.world_size, self.timeout = world_size, timeout
        port = free_port()
        self.conns, self.procs = [], []
        with _child_environment():
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(rank, world_size, port, child), daemon=True,
                                   name=f"lightning-bench-{world_size}p-rank{rank}")
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)

    def _receive(self) -> list[dict]:
        deadline = time.monotonic() + self.timeout
        out = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"{self.world_size}-process worker {rank} died (exit status {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.world_size}-process worker {rank} did not answer within "
                                       f"{self.timeout:.0f}s (a hang?)")
            result = conn.recv()
            if "error" in result:
                raise RuntimeError(f"{self.world_size}-process worker {rank} failed:\n{result['error']}")
            out.append(result)
        return out

    def wait_ready(self) -> None:
        self._receive()

    def fit(self, config: dict, precision: str) -> list[dict]:
        for conn in self.conns:
            conn.send((config, precision))
        return self._receive()

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()


def orders(precisions: list[str], rounds: int) -> list[list[str]]:
    """The fit order of each round: as given, reversed in every other round."""
    return [list(precisions) if r % 2 == 0 else list(reversed(precisions)) for r in range(rounds)]


def summarize(precision: str, processes: int, fits: list[list[dict]]) -> dict:
    """One table row from the fits of one precision at one process count: ``fits`` is,
    per round, every rank's result."""
    rates = [min(r["its_per_s"] for r in ranks) for ranks in fits]  # the slowest rank sets the pace
    steps = [s for ranks in fits for r in ranks for s in r["steps"]]
    hooked = all(r["hooked"] for ranks in fits for r in ranks)
    row = {"precision": precision, "processes": processes, "its_per_s": statistics.median(rates),
           "its_per_s_rounds": rates, "its_per_s_by_rank": [[r["its_per_s"] for r in ranks] for ranks in fits],
           "optimizer_steps_timed": len(steps) // (processes * len(fits)),  # per fit
           "micro_batches_timed": fits[0][0]["micro_batches"],
           "buckets": fits[0][0]["buckets"], "global_step": fits[0][0]["global_step"],
           "final_loss": [ranks[0]["final_loss"] for ranks in fits]}
    if precision == "mpfp16":
        row["skipped_steps"] = [ranks[0]["skipped_steps"] for ranks in fits]
    if processes == 1:
        row.update(allreduce_calls_per_step=0, allreduce_bytes_per_step=0, accumulating_calls=0)
    elif hooked:
        calls = sorted({s["calls"] for s in steps})
        nbytes = sorted({s["bytes"] for s in steps})
        row.update(allreduce_calls_per_step=calls[0] if len(calls) == 1 else calls,
                   allreduce_bytes_per_step=nbytes[0] if len(nbytes) == 1 else nbytes,
                   accumulating_calls=sum(r["accumulating_calls"] for ranks in fits for r in ranks))
    else:
        row.update(allreduce_calls_per_step=None, allreduce_bytes_per_step=None, accumulating_calls=None)
    return row


def add_ratios(rows: list[dict]) -> None:
    base = {r["processes"]: r["its_per_s"] for r in rows if r["precision"] == "32-true"}
    for r in rows:
        r["vs_32_true"] = r["its_per_s"] / base[r["processes"]] if r["processes"] in base else None


def _cell(value, fmt) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(fmt.format(v) for v in value)
    return fmt.format(value)


def table(rows: list[dict]) -> str:
    lines = [(f"{'precision':<10}{'procs':>6}{'it/s/proc':>11}{'vs 32-true':>12}{'calls/step':>12}"
              f"{'MB/step':>10}{'buckets':>9}{'skipped':>9}{'last loss':>11}")]
    for r in rows:
        skipped = r.get("skipped_steps")
        lines.append(f"{r['precision']:<10}{r['processes']:>6}{r['its_per_s']:>11.2f}"
                     f"{_cell(r['vs_32_true'], '{:.2f}'):>12}{_cell(r['allreduce_calls_per_step'], '{}'):>12}"
                     f"{_cell(_mb(r['allreduce_bytes_per_step']), '{:.2f}'):>10}{_cell(r['buckets'], '{}'):>9}"
                     f"{_cell(sum(skipped) if skipped else skipped, '{}'):>9}"
                     f"{_cell(r['final_loss'][-1], '{:.3f}'):>11}")
    return "\n".join(lines)


def _mb(nbytes):
    if isinstance(nbytes, list):
        return [b / 1e6 for b in nbytes]
    return None if nbytes is None else nbytes / 1e6


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpfp16.bench.lightning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precisions", type=list_of(PRECISIONS), default=",".join(PRECISIONS),
                   help=f"comma-separated, of {', '.join(PRECISIONS)} (default: all, in that order)")
    p.add_argument("--processes", type=list_of(("1", "2")), default="1,2",
                   help="process counts: 1 (one device) and/or 2 (strategy='ddp', gloo) (default: 1,2)")
    p.add_argument("--accumulate-grad-batches", type=int, default=None,
                   help=f"the Trainer's accumulate_grad_batches (default: {DEFAULTS['accumulate_grad_batches']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed micro-batches at the start of each fit (default: {DEFAULTS['warmup']}, one "
                        "optimizer step: the first step makes the optimizer state, DDP rebuilds its buckets)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed micro-batches per fit, after the warm-up (default: {DEFAULTS['steps']})")
    p.add_argument("--rounds", type=int, default=None,
                   help="fits of each precision, alternating (the order reversed every other round); the table "
                        f"gives the median (default: {DEFAULTS['rounds']})")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence fed to the model (default: {DEFAULTS['seq_len']}; the model keeps "
                        "its 1024 positions)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"sequences per micro-batch (default: {DEFAULTS['batch_size']}, the Lightning user's)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="sgd (momentum 0.9, as bench.allreduce) or adamw (default: sgd)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: 1e-3)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one fit (or the workers' start) may take before the run fails as a hang "
                        "(default: 900)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the configuration and rows as JSON "
                                                                 "(default: none)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny configuration for tests, seconds: an ImageGPT-shaped model of width 32, 1 block, "
                        "2 heads, 16 positions, sequences of 8, accumulate 4, warm-up 4, 8 timed micro-batches, 1 "
                        "round (flags given explicitly still apply)")
    return p



def parse_config(argv=None) -> tuple[dict, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = sized_config(parser, args, QUICK, DEFAULTS, ("seq_len", "batch_size", "accumulate_grad_batches", "steps", "rounds"))
    positions = model_config(config["model"])["seq_len"]
    if config["seq_len"] > positions:
        parser.error(f"--seq-len {config['seq_len']}: the model has {positions} positions")
    if args.lr <= 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    present = [v for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if v in os.environ]
    if present:
        parser.error(f"{present[0]} is set (torchrun?): run it as python -m mpfp16.bench.lightning; it starts "
                     "its own workers")
    config.update(precisions=args.precisions, processes=[int(n) for n in args.processes], optimizer=args.optimizer,
                  lr=args.lr, model_shape=model_config(config["model"]))
    return config, args


def run(config: dict, timeout: float, log=print) -> list[dict]:
    """Every precision at every process count, ``config["rounds"]`` times, alternating:
    the table's rows."""
    groups = {n: WorkerGroup(n, timeout) for n in config["processes"]}
    fits = {(p, n): [] for n in config["processes"] for p in config["precisions"]}
    try:
        for group in groups.values():
            group.wait_ready()  # every interpreter has imported before the first timing
        for r, order in enumerate(orders(config["precisions"], config["rounds"])):
            for n, group in groups.items():
                for precision in order:
                    ranks = group.fit(config, precision)
                    fits[(precision, n)].append(ranks)
                    log(f"round {r + 1}/{config['rounds']}, {n} process{'es' if n > 1 else ''}, {precision}: "
                        + ", ".join(f"{x['its_per_s']:.2f}" for x in ranks) + " it/s")
    finally:
        for group in groups.values():
            group.close()
    rows = [summarize(p, n, fits[(p, n)]) for n in config["processes"] for p in config["precisions"]]
    add_ratios(rows)
    return rows


def main(argv=None) -> int:
    config, args = parse_config(argv)
    import lightning

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        rows = run(config, args.timeout, progress)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    shape = config["model_shape"]
    print(f"# {config['model']} (width {shape['width']}, {shape['layers']} blocks, {shape['heads']} heads, "
          f"{shape['seq_len']} positions) through lightning.Trainer {lightning.__version__}, "
          f"torch {torch.__version__}, CPU, one thread per process; "
          f"batch {config['batch_size']} x {config['seq_len']} tokens, "
          f"accumulate_grad_batches {config['accumulate_grad_batches']}, {config['optimizer']}; per fit "
          f"{config['warmup']} warm-up + {config['steps']} timed micro-batches; median of {config['rounds']} "
          f"alternating round{'s' if config['rounds'] > 1 else ''} (slowest rank)")
    print(table(rows))
    for p in config["precisions"]:
        print(f"# {p}: {NOTES[p]}")
    print("# calls/step, MB/step: allreduce calls and payload per optimizer step, from mpfp16's hook "
          "(comm_stats); '-' where no mpfp16 hook counts them; 1 process: no exchange. buckets: the DDP "
          "module's; skipped: mpfp16's skipped steps in the timed micro-batches; last loss: rank 0's, last round")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "lightning": lightning.__version__, "torch": torch.__version__,
                       "notes": {p: NOTES[p] for p in config["precisions"]}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
