"""MPFP16Trainer against the Trainer's own ``fp16=True`` (and ``bf16=True``), side by side.

    python -m mpfp16.bench.transformers [--model gpt2] [--methods mpfp16,fp16=True,mpfp16-bf16,bf16=True]
                                        [--layers 4] [--width 128] [--seq-len 64] [--batch-size 4]
                                        [--warmup 2] [--steps 8] [--rounds 2] [--optim adamw_torch_fused]
                                        [--use-cpu] [--json PATH] [--quick]

One transformers model, built from its config with random weights (no download): a
GPT-2 (``GPT2LMHeadModel``, next-token loss) or a BERT
(``BertForSequenceClassification``), trained on random token ids by four Trainers in
this process, each from the same weights, on the same batches, with the same optimizer
(``--optim``, the Trainer's default unless given):

``mpfp16``
    ``MPFP16Trainer(mpfp16=MPFP16Options(dtype=torch.float16))``: fp16 weights and
    gradients (norm layers fp32), fp32 master weights, a dynamic loss scale;
``fp16=True``
    ``Trainer(args=TrainingArguments(fp16=True))``: fp32 weights, gradients and
    optimizer state; on a GPU, accelerate runs the forward under ``torch.autocast``
    (fp16) with a ``GradScaler``. On a CPU accelerate enables neither
    (``Accelerator.native_amp`` is False for fp16 on a CPU, transformers 5.23 and
    accelerate 1.15): the run is fp32 throughout. The table reports what the
    Accelerator enabled, read from it, not assumed;
``mpfp16-bf16``
    ``MPFP16Options(dtype=torch.bfloat16)``: bf16 weights and gradients, fp32 masters,
    no loss scale;
``bf16=True``
    ``TrainingArguments(bf16=True)``: fp32 weights under ``torch.autocast`` in bf16, on
    a CPU too.

Memory: the bytes held per parameter right after the first timed optimizer step,
before the Trainer's ``model.zero_grad()`` frees its gradients (the most any step
holds between backward and the next forward): model weights, model gradients, master
weights, master gradients and optimizer state, each the sum of the distinct storages
behind them (``FP16Optimizer.memory_bytes_per_param()`` for mpfp16; the same count over
the model's parameters, their ``.grad`` and the optimizer's state for the Trainer's
own). The ``idle`` column is the same total after the Trainer's ``model.zero_grad()``,
what is held between steps: ``set_to_none`` frees torch's gradients, while mpfp16's
gradients are views of a flat buffer that stays. Activations and autocast's cast
copies of the weights (transient, inside a forward and its backward) are in neither.

Time: each optimizer step from the Trainer's ``on_step_begin`` to its ``on_step_end``
(forward, backward, clipping, the step, ``zero_grad``; on a GPU after a synchronize),
``--warmup`` steps untimed, then ``--steps`` timed; the row gives the median step over
the timed steps of every round. Each round fits every method once, in the order given,
reversed in every other round (``--rounds``). One CPU thread (``torch.set_num_threads(1)``,
restored after). The ratio columns give each row against its baseline, measured in
the same run: ``mpfp16`` against ``fp16=True``, ``mpfp16-bf16`` against ``bf16=True``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

from ..errors import dtype_name
from .flags import list_of, sized_config

METHODS = ("mpfp16", "fp16=True", "mpfp16-bf16", "bf16=True")
BASELINE = {"mpfp16": "fp16=True", "mpfp16-bf16": "bf16=True"}
MODELS = ("gpt2", "bert")
DEFAULTS = dict(model="gpt2", layers=4, width=128, heads=4, vocab_size=1024, seq_len=64, batch_size=4, warmup=2,
                steps=8, rounds=2)
QUICK = dict(model="gpt2", layers=2, width=32, heads=2, vocab_size=64, seq_len=16, batch_size=4, warmup=1, steps=2,
             rounds=1)
NOTES = {
    "mpfp16": "MPFP16Trainer, MPFP16Options(dtype=torch.float16): fp16 weights, fp32 master weights, dynamic loss "
              "scale",
    "fp16=True": "Trainer, TrainingArguments(fp16=True): fp32 weights; autocast fp16 and a GradScaler where "
                 "accelerate enables them (a GPU)",
    "mpfp16-bf16": "MPFP16Trainer, MPFP16Options(dtype=torch.bfloat16): bf16 weights, fp32 master weights",
    "bf16=True": "Trainer, TrainingArguments(bf16=True): fp32 weights under autocast bf16",
}


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", ".*loss_type=None.*")
    logging.getLogger("mpfp16").setLevel(logging.WARNING)


def build_model(config: dict) -> torch.nn.Module:
    """The model of ``config``, from seed 0, without dropout (every method sees the
    same computation)."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if config["model"] == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=config["layers"], n_embd=config["width"], n_head=config["heads"],
                                          vocab_size=config["vocab_size"], n_positions=max(32, config["seq_len"]),
                                          bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0))
    return BertForSequenceClassification(BertConfig(
        hidden_size=config["width"], num_hidden_layers=config["layers"], num_attention_heads=config["heads"],
        intermediate_size=4 * config["width"], vocab_size=config["vocab_size"],
        max_position_embeddings=max(32, config["seq_len"]), num_labels=3, pad_token_id=0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def make_data(config: dict, samples: int) -> list[dict]:
    """``samples`` random samples: GPT-2's token ids are their own next-token labels
    (the model shifts them), BERT's have a class label."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(samples):
        ids = torch.randint(1, config["vocab_size"], (config["seq_len"],), generator=g)
        if config["model"] == "gpt2":
            out.append({"input_ids": ids, "labels": ids.clone()})
        else:
            out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                        "labels": torch.randint(0, 3, (), generator=g)})
    return out


def _inner(optimizer):
    """The torch optimizer under accelerate's wrapper."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _probe(warmup: int, steps: int):
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        """Times every optimizer step and reads the memory after the first timed one."""

        def __init__(self) -> None:
            self.trainer = None
            self.seconds: list[float] = []
            self.memory: dict | None = None  # after the optimizer step
            self.between: dict | None = None  # after zero_grad: what is held between steps
            self._t0 = None

        def _sync(self, args) -> None:
            if args.device.type == "cuda":
                torch.cuda.synchronize(args.device)

        def on_step_begin(self, args, state, control, **kwargs):
            self._sync(args)
            self._t0 = time.perf_counter()

        def _memory(self) -> dict[str, float]:
            fp16 = getattr(self.trainer, "fp16_optimizer", None)
            return dict(fp16.memory_bytes_per_param()) if fp16 is not None else _storage_memory_of(self.trainer)

        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == warmup and self.memory is None:  # the first timed step, before zero_grad
                self.memory = self._memory()

        def on_step_end(self, args, state, control, **kwargs):
            self._sync(args)
            if state.global_step > warmup:  # global_step counts this step already
                self.seconds.append(time.perf_counter() - self._t0)
            if state.global_step == warmup + 1 and self.between is None:  # after the Trainer's model.zero_grad()
                self.between = self._memory()

    return Probe()


def _storage_memory_of(trainer) -> dict[str, float]:
    """The Trainer's own run: the bytes per parameter of its weights, gradients and
    optimizer state (no masters), from the storages, under the keys of
    ``FP16Optimizer.memory_bytes_per_param``, which counts mpfp16's the same way."""
    from ..stores.interface import storage_bytes

    params = list(trainer.model.parameters())
    numel = max(1, sum(p.numel() for p in params))
    opt = _inner(trainer.optimizer)
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    report = {"model_weights": storage_bytes(params) / numel,
              "model_grads": storage_bytes(p.grad for p in params if p.grad is not None) / numel,
              "master_weights": 0.0, "master_grads": 0.0, "optimizer_state": storage_bytes(state) / numel}
    report["total"] = sum(report.values())
    return report


def fit_once(config: dict, method: str, output_dir: str) -> dict:
    """One ``train()`` of ``method``: the step times, the memory, what the Accelerator
    enabled, and the run's figures."""
    from transformers import PrinterCallback, Trainer, TrainingArguments, default_data_collator

    from ..integrations.transformers import MPFP16Options, MPFP16Trainer

    _quiet()
    total = config["warmup"] + config["steps"]
    data = make_data(config, total * config["batch_size"])
    amp = {"fp16=True": {"fp16": True}, "bf16=True": {"bf16": True}}.get(method, {})
    args = TrainingArguments(output_dir=output_dir, report_to="none", per_device_train_batch_size=config["batch_size"],
                             learning_rate=1e-3, max_steps=total, train_sampling_strategy="sequential",
                             save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                             use_cpu=config["use_cpu"] or not torch.accelerator.is_available(), optim=config["optim"],
                             **amp)  # use_cpu: bf16=True on a machine without an accelerator asks for it
    probe = _probe(config["warmup"], config["steps"])
    kwargs = dict(model=build_model(config), args=args, train_dataset=data, data_collator=default_data_collator,
                  callbacks=[probe])
    if method.startswith("mpfp16"):
        dtype = torch.bfloat16 if method == "mpfp16-bf16" else torch.float16
        trainer = MPFP16Trainer(**kwargs, mpfp16=MPFP16Options(dtype=dtype))
    else:
        trainer = Trainer(**kwargs)
    trainer.remove_callback(PrinterCallback)
    probe.trainer = trainer
    accelerator = trainer.accelerator
    autocast = ({"fp16": "float16", "bf16": "bfloat16"}.get(accelerator.mixed_precision, "-")
                if accelerator.native_amp else "-")
    trainer.train()
    if len(probe.seconds) != config["steps"] or probe.memory is None:
        raise RuntimeError(f"{method}: {len(probe.seconds)} of {config['steps']} steps were timed")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    fp16 = getattr(trainer, "fp16_optimizer", None)
    return {"seconds": probe.seconds, "memory": probe.memory, "between": probe.between, "autocast": autocast,
            "grad_scaler": accelerator.scaler is not None or fp16 is not None and fp16.scaler.dynamic,
            "weights_dtype": dtype_name(trainer.model.get_input_embeddings().weight.dtype),
            "device": str(trainer.args.device), "params": sum(p.numel() for p in trainer.model.parameters()),
            "final_loss": losses[-1] if losses else None,
            "skipped_steps": fp16.skipped_steps if fp16 is not None else None}


# ----------------------------------------------------------------- the table


def orders(methods: list[str], rounds: int) -> list[list[str]]:
    """The fit order of each round: as given, reversed in every other round."""
    return [list(methods) if r % 2 == 0 else list(reversed(methods)) for r in range(rounds)]


def summarize(method: str, fits: list[dict]) -> dict:
    """One row from the fits of one method (one per round)."""
    seconds = [s for f in fits for s in f["seconds"]]
    first = fits[0]
    return {"method": method, "step_s": statistics.median(seconds), "step_s_all": seconds,
            "bytes_per_param": first["memory"], "bytes_per_param_between_steps": first["between"],
            "autocast": first["autocast"], "grad_scaler": first["grad_scaler"],
            "weights_dtype": first["weights_dtype"], "device": first["device"], "params": first["params"],
            "final_loss": [f["final_loss"] for f in fits], "skipped_steps": [f["skipped_steps"] for f in fits]}


def add_ratios(rows: list[dict]) -> None:
    """Each row against its baseline of the same run (None where that was not run):
    ``step_vs_baseline`` and ``bytes_vs_baseline`` (total bytes per parameter)."""
    by = {r["method"]: r for r in rows}
    for r in rows:
        base = by.get(BASELINE.get(r["method"]))
        r["baseline"] = base["method"] if base else None
        r["step_vs_baseline"] = r["step_s"] / base["step_s"] if base else None
        r["bytes_vs_baseline"] = (r["bytes_per_param"]["total"] / base["bytes_per_param"]["total"]
                                  if base else None)


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(rows: list[dict]) -> str:
    head = (f"{'method':<13}{'weights':>9}{'autocast':>10}{'scaler':>8}{'w':>6}{'g':>6}{'master':>8}{'m.grad':>8}"
            f"{'state':>7}{'B/param':>9}{'idle':>6}{'step ms':>9}{'baseline':>11}{'bytes vs':>10}{'step vs':>9}"
            f"{'skipped':>9}")
    lines = [head]
    for r in rows:
        m = r["bytes_per_param"]
        scaler = "yes" if r["grad_scaler"] else "no"
        lines.append(f"{r['method']:<13}{r['weights_dtype']:>9}{r['autocast']:>10}{scaler:>8}"
                     f"{m['model_weights']:>6.2f}{m['model_grads']:>6.2f}{m['master_weights']:>8.2f}"
                     f"{m['master_grads']:>8.2f}{m['optimizer_state']:>7.2f}{m['total']:>9.2f}"
                     f"{r['bytes_per_param_between_steps']['total']:>6.2f}"
                     f"{1e3 * r['step_s']:>9.1f}{r['baseline'] or '-':>11}{_cell(r['bytes_vs_baseline'], '{:.2f}'):>10}"
                     f"{_cell(r['step_vs_baseline'], '{:.2f}'):>9}"
                     f"{_cell(None if r['skipped_steps'][0] is None else sum(r['skipped_steps']), '{}'):>9}")
    return "\n".join(lines)


# ----------------------------------------------------------------- the command line



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpfp16.bench.transformers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default=None, help=f"gpt2 or bert (default: {DEFAULTS['model']})")
    p.add_argument("--methods", type=list_of(METHODS), default=",".join(METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)} (default: all, in that order)")
    for name, what in (("layers", "transformer blocks"), ("width", "hidden size"), ("heads", "attention heads"),
                       ("vocab_size", "tokens in the vocabulary"), ("seq_len", "tokens per sample"),
                       ("batch_size", "samples per step"), ("warmup", "untimed optimizer steps at the start of a fit"),
                       ("steps", "timed optimizer steps per fit"),
                       ("rounds", "fits of each method, the order reversed every other round")):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"{what} (default: {DEFAULTS[name]}; --quick: {QUICK[name]})")
    p.add_argument("--optim", default=None,
                   help="TrainingArguments' optim, for every method (default: the Trainer's own default)")
    p.add_argument("--use-cpu", action="store_true",
                   help="TrainingArguments(use_cpu=True): the CPU where a GPU is present (default: the device the "
                        "Trainer picks)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the configuration and rows as JSON")
    p.add_argument("--quick", action="store_true",
                   help="a tiny configuration for tests, seconds: GPT-2 of 2 blocks, width 32, 2 heads, 64 tokens, "
                        "samples of 16, 1 warm-up and 2 timed steps, 1 round (flags given explicitly still apply)")
    return p


def parse_config(argv=None) -> tuple[dict, argparse.Namespace]:
    from transformers import TrainingArguments

    parser = build_parser()
    args = parser.parse_args(argv)
    config = sized_config(parser, args, QUICK, DEFAULTS, ("layers", "width", "heads", "vocab_size", "seq_len", "batch_size", "steps", "rounds"))
    if config["width"] % config["heads"]:
        parser.error(f"--width {config['width']} is not a multiple of --heads {config['heads']}")
    default_optim = TrainingArguments.__dataclass_fields__["optim"].default
    config.update(methods=args.methods, optim=args.optim or getattr(default_optim, "value", default_optim),
                  use_cpu=args.use_cpu)
    return config, args


@contextlib.contextmanager
def one_thread():
    """One intra-op thread while it lasts: these models' matmuls are a few thousand
    elements, which a second thread does not speed up (on a loaded 2-core machine each
    thread waited on the other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(config: dict, log=print) -> list[dict]:
    """Every method, ``config["rounds"]`` times, alternating: the table's rows."""
    fits = {m: [] for m in config["methods"]}
    with tempfile.TemporaryDirectory() as out, one_thread():
        for r, order in enumerate(orders(config["methods"], config["rounds"])):
            for method in order:
                result = fit_once(config, method, os.path.join(out, f"{r}-{method}"))
                fits[method].append(result)
                log(f"round {r + 1}/{config['rounds']}, {method}: median step "
                    f"{1e3 * statistics.median(result['seconds']):.1f} ms")
    rows = [summarize(m, fits[m]) for m in config["methods"]]
    add_ratios(rows)
    return rows


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config, args = parse_config(argv)
    import accelerate
    import transformers

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        rows = run(config, progress)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    device = rows[0]["device"]
    print(f"# {config['model']} ({config['layers']} blocks, width {config['width']}, {config['heads']} heads, "
          f"{config['vocab_size']} tokens; {rows[0]['params']} parameters) through transformers "
          f"{transformers.__version__} / accelerate {accelerate.__version__}, torch {torch.__version__}, {device}"
          f"{', one thread' if device == 'cpu' else ''}; batch {config['batch_size']} x {config['seq_len']} tokens, "
          f"optim {config['optim']}; per fit {config['warmup']} warm-up + {config['steps']} timed steps; median "
          f"step over {config['rounds']} alternating round{'s' if config['rounds'] > 1 else ''}")
    print(table(rows))
    for r in rows:
        print(f"# {r['method']}: {NOTES[r['method']]}")
    print("# w, g, master, m.grad, state, B/param: bytes held per parameter after the first timed optimizer step, "
          "from the storages (weights, their gradients, fp32 masters, their gradients, optimizer state); idle: "
          "B/param after the Trainer's model.zero_grad() (set_to_none frees torch's gradients; mpfp16's flat "
          "gradient buffer stays); autocast, scaler: what the run enabled (scaler: a dynamic loss scale); "
          "skipped: mpfp16's skipped steps, all rounds, warm-up included; "
          "bytes vs (B/param), step vs: against the baseline's row of this run")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
                       "torch": torch.__version__, "notes": {m: NOTES[m] for m in config["methods"]}, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
