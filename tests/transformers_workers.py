"""MPFP16Trainer's runs and their references, shared by tests/test_transformers.py (one
process) and its two-process run under torchrun (:func:`main`).

Two transformers models built from configs with random weights (no download): a tiny
GPT-2 (``GPT2LMHeadModel``, tied embeddings, fed ``inputs_embeds`` so that a batch can
hold an inf) and a tiny BERT (``BertForSequenceClassification``, fed token ids). Each
is trained through :class:`MPFP16Trainer` and by mpfp16's own loop (``to_half``,
``FP16Optimizer``, ``opt.backward``, ``opt.step``, and the Trainer's lr schedule stepped
only after a step that was not skipped) on the same batches, from the same weights.

    python -m torch.distributed.run --nproc_per_node 2 tests/transformers_workers.py OUT_DIR

runs the two-process cases (:data:`DDP_CASES`) and writes each rank's results to
``OUT_DIR/rank{R}.pt``.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: every model is built from its config

import torch  # noqa: E402
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          PrinterCallback, TrainerCallback, TrainingArguments, default_data_collator,
                          get_scheduler)
from transformers.utils import logging as hf_logging  # noqa: E402

import mpfp16  # noqa: E402
from mpfp16.integrations.transformers import MPFP16Options, MPFP16Trainer  # noqa: E402

hf_logging.set_verbosity_error()
warnings.filterwarnings("ignore", ".*loss_type=None.*")
logging.getLogger("mpfp16").setLevel(logging.WARNING)

VOCAB, SEQ, WIDTH, BATCH, CLASSES = 64, 16, 32, 4, 3


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32), no
    dropout (the Trainer and the own loop would draw different masks)."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=32,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def bert(seed: int = 0) -> BertForSequenceClassification:
    """A 2-layer BERT of width 32 with a 3-class head, no dropout."""
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=32, num_labels=CLASSES, pad_token_id=0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


MODELS = {"gpt2": gpt2, "bert": bert}


def make_data(kind: str, batches: int, rank: int = 0, inf_batches: tuple = ()) -> list[dict]:
    """``batches * BATCH`` samples of this rank's data (rank-seeded). GPT-2's are
    ``inputs_embeds`` and next-token ``labels``; in each batch of ``inf_batches`` (by
    index, in the order a sequential sampler gives them) one embedding value is inf.
    BERT's are token ids, an attention mask and a class label."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for i in range(batches * BATCH):
        if kind == "gpt2":
            sample = {"inputs_embeds": torch.randn(SEQ, WIDTH, generator=g),
                      "labels": torch.randint(0, VOCAB, (SEQ,), generator=g)}
            if i // BATCH in inf_batches and i % BATCH == 0:
                sample["inputs_embeds"][3, 5] = float("inf")
        else:
            sample = {"input_ids": torch.randint(1, VOCAB, (SEQ,), generator=g),
                      "attention_mask": torch.ones(SEQ, dtype=torch.long),
                      "labels": torch.randint(0, CLASSES, (), generator=g)}
        out.append(sample)
    return out


def batches_of(data: list[dict]) -> list[dict]:
    """What the Trainer's sequential sampler and default collator make of ``data``."""
    return [default_data_collator(data[i:i + BATCH]) for i in range(0, len(data), BATCH)]


class Recorder:
    """A data collator that keeps every batch it makes (the batches a rank trained on,
    whatever accelerate's sharding gave it)."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def __call__(self, features):
        batch = default_data_collator(features)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


def training_args(output_dir, **overrides) -> TrainingArguments:
    """The runs' TrainingArguments: CPU, sequential data, no logging integrations, no
    checkpoints unless asked, AdamW without the fused kernel (mpfp16 would compile its
    fused step for one; the own loop builds the same AdamW)."""
    args = dict(output_dir=str(output_dir), report_to="none", per_device_train_batch_size=BATCH, optim="adamw_torch",
                learning_rate=1e-2, train_sampling_strategy="sequential", save_strategy="no", logging_steps=1,
                disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, max_grad_norm=0.3, weight_decay=0.01)
    args.update(overrides)
    return TrainingArguments(**args)


def fit(kind: str, data: list[dict], output_dir, options: MPFP16Options | None = None, model=None, optimizers=None,
        resume=None, collator=None, callbacks=None, **args) -> MPFP16Trainer:
    """``MPFP16Trainer(...).train()`` over ``data``; returns the Trainer."""
    model = MODELS[kind]() if model is None else model
    trainer = MPFP16Trainer(model=model, args=training_args(output_dir, **args), train_dataset=data,
                            data_collator=collator or default_data_collator, optimizers=optimizers or (None, None),
                            mpfp16=options or MPFP16Options(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # disable_tqdm=True prints every log line instead
    for callback in callbacks or ():
        if isinstance(callback, CallCounter):
            callback.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer


class CallCounter(TrainerCallback):
    """After each optimizer step, the allreduce calls mpfp16's hook on the Trainer's DDP
    module counted since the previous one."""

    def __init__(self) -> None:
        self.trainer: MPFP16Trainer | None = None
        self.calls: list[int] = []

    def on_optimizer_step(self, args, state, control, **kwargs):
        import mpfp16.distributed as mdist

        self.calls.append(mdist.comm_stats(self.trainer.model_wrapped).pop_step()["allreduce_calls"])


def own_loop(kind: str, batches: list[dict], trainer: MPFP16Trainer, options: MPFP16Options | None = None,
             model=None, inner: str = "adamw", momentum: float = 0.0, ddp: bool = False) -> dict:
    """mpfp16's own loop over ``batches``, with the optimizer ``trainer`` was configured
    with (its param groups by name, its hyperparameters, its lr schedule) but none of its
    machinery: the loss the Trainer computes (``num_items_in_batch`` over a step's
    micro-batches, times the number of processes as ``average_tokens_across_devices``
    does), ``FP16Optimizer(max_grad_norm=args.max_grad_norm)``, and the schedule stepped
    only after a step that was not skipped. With ``ddp``, under
    :func:`mpfp16.distributed.wrap`, accumulating under ``sync_gradients(model, False)``."""
    import mpfp16.distributed as mdist

    options = options or MPFP16Options()
    args = trainer.args
    model = MODELS[kind]() if model is None else model
    mpfp16.to_half(model, options.dtype)
    net = mdist.wrap(model) if ddp else model
    named = dict(model.named_parameters())
    fp16 = trainer.fp16_optimizer
    names = iter(fp16.param_names())
    groups = []
    for group in fp16.param_groups:  # the Trainer's groups, by name: decay, and no decay for biases and norms
        groups.append({"params": [named[next(names)] for _ in group["params"]],
                       "weight_decay": group["weight_decay"]})
    if inner == "adamw":
        torch_opt = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_epsilon)
    else:
        torch_opt = torch.optim.SGD(groups, lr=args.learning_rate, momentum=momentum)
    opt = FP16Optimizer(torch_opt, options, max_grad_norm=args.max_grad_norm or None, model=model)
    steps = len(batches) // args.gradient_accumulation_steps
    sched = get_scheduler(args.lr_scheduler_type, torch_opt, num_warmup_steps=0, num_training_steps=steps)
    world = torch.distributed.get_world_size() if ddp else 1
    # The Trainer normalizes a step's loss by the labels of its micro-batches, all of them:
    # it counts a causal LM's shifted labels only for a model whose class name maps to a
    # loss type, and GPT2LMHeadModel's does not (transformers 5.23). The own loop counts
    # what the Trainer counts, and stops where that changes.
    assert not trainer._loss_shifts_labels, "the Trainer now counts shifted labels: count labels[..., 1:]"
    stepped, norms, calls = [], [], []
    gas = args.gradient_accumulation_steps
    for s in range(steps):
        window = batches[s * gas:(s + 1) * gas]
        count = sum(b["labels"].ne(-100).sum() for b in window)
        if ddp:
            count = _all_sum(count)
        count = count / 1  # the Trainer divides by its tensor/context/sequence-parallel sizes: a float tensor
        opt.zero_grad()
        for i, b in enumerate(window):
            with mdist.sync_gradients(net, i == len(window) - 1):
                loss = net(**b, num_items_in_batch=count).loss
                opt.backward(loss * world if world > 1 else loss)
        ok = opt.step()
        stepped.append(ok)
        norms.append(opt.last_grad_norm)
        if ddp:
            calls.append(mdist.comm_stats(net).pop_step()["allreduce_calls"])
        if ok:
            sched.step()
    return {"model": model, "opt": opt, "sched": sched, "stepped": stepped, "norms": norms, "calls": calls}


def FP16Optimizer(torch_opt, options: MPFP16Options, max_grad_norm, model):  # noqa: N802 - the own loop's one call
    loss_scale = copy.deepcopy(options.loss_scale)  # where the Trainer's started, not where it ended
    return mpfp16.FP16Optimizer(torch_opt, loss_scale=loss_scale, master_weights=options.master_weights,
                                max_grad_norm=max_grad_norm, track_grad_norm=True, model=model, fused=options.fused,
                                rounding=options.rounding, rounding_seed=options.rounding_seed,
                                accumulate_dtype=options.accumulate_dtype, state_dtype=options.state_dtype,
                                state_dtypes=options.state_dtypes, state_rounding=options.state_rounding)


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    torch.distributed.all_reduce(t)
    return t


def state(model, opt) -> dict:
    """What two runs must agree on bit for bit: every weight (16-bit and fp32), and the
    FP16Optimizer's whole state_dict (masters, the inner optimizer's state, the scaler
    and its trackers, the skipped steps)."""
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "optimizer": opt.state_dict()}


def differs(a, b, where: str = "") -> str | None:
    """Where ``a`` and ``b`` (nested containers of tensors and values) first differ;
    None when they are bit-identical (NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        same = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan()))
        return None if same else where
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{where} (keys)"
        return next((w for k in a if (w := differs(a[k], b[k], f"{where}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{where} (length)"
        return next((w for i, (x, y) in enumerate(zip(a, b)) if (w := differs(x, y, f"{where}[{i}]")) is not None),
                    None)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return None
    return None if a == b else where


def logged(trainer, key: str) -> list:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "loss" in entry]


# ----------------------------------------------------------------- two processes, under torchrun

# name -> (mpfp16 options, TrainingArguments overrides, batches per rank whose input is inf on rank 1 only)
DDP_CASES = {
    "fp16-accumulate-2-inf-on-rank-1": ({}, {"gradient_accumulation_steps": 2}, (3,)),
    "fp16-accumulate-2-fp32-sums": ({"accumulate_dtype": torch.float32}, {"gradient_accumulation_steps": 2}, ()),
}
DDP_STEPS = 3


def ddp_case(name: str, out_dir: str) -> dict:
    """One case on this rank: MPFP16Trainer under accelerate's DDP, then the own loop
    under mpfp16.distributed.wrap on the batches this rank trained on; both states, the
    steps skipped, the allreduce calls of each optimizer step, DDP's bucket count and a
    replica check (which raises on every rank unless the replicas are bit-identical)."""
    import mpfp16.distributed as mdist

    opts, overrides, inf_on_1 = DDP_CASES[name]
    rank = int(os.environ["RANK"])
    options = MPFP16Options(**opts)
    gas = overrides["gradient_accumulation_steps"]
    data = make_data("gpt2", DDP_STEPS * gas * 2)
    if rank == 1:  # accelerate gives rank r the batches r, r + 2, ... of the sequential order
        for b in inf_on_1:
            data[(2 * b + 1) * BATCH]["inputs_embeds"][3, 5] = float("inf")
    recorder, counter = Recorder(), CallCounter()
    trainer = fit("gpt2", data, os.path.join(out_dir, name), options, collator=recorder, callbacks=[counter],
                  max_steps=DDP_STEPS, **overrides)
    ddp = trainer.model_wrapped
    replicas = mdist.check_replicas(ddp, trainer.fp16_optimizer, buffers=False)
    mine = state(trainer.model, trainer.fp16_optimizer)
    own = own_loop("gpt2", recorder.batches[:DDP_STEPS * gas], trainer, options, ddp=True)
    return {"mpfp16": mine, "own": state(own["model"], own["opt"]), "own_stepped": own["stepped"],
            "skipped": trainer.skipped_steps, "global_step": trainer.state.global_step,
            "is_ddp": type(ddp).__name__, "calls": counter.calls, "own_calls": own["calls"],
            "buckets": len(ddp.reducer._get_zeros_like_grad_buckets()), "replicas": replicas,
            "inf_seen": any(not torch.isfinite(b["inputs_embeds"]).all() for b in recorder.batches)}


def main(argv=None) -> int:
    out_dir = (argv or sys.argv[1:])[0]
    torch.set_num_threads(1)
    results = {}
    for name in DDP_CASES:
        results[name] = ddp_case(name, out_dir)
    rank = int(os.environ["RANK"])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
