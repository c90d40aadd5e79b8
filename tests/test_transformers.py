"""MPFP16Trainer (mpfp16.integrations.transformers): a tiny GPT-2 and a tiny BERT, built
from configs with random weights, trained bit for bit as mpfp16's own loop trains them
(an inf batch skips a step and leaves the lr schedule where it was), close to
transformers' own fp32 Trainer; checkpoints and a bit-for-bit resume; each refusal in
one line; two processes under torchrun; the benchmark against ``fp16=True``."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: every model is built from its config

import pytest  # noqa: E402
import torch  # noqa: E402

_MISSING = "the transformers extra is not installed (pip install 'mpfp16[transformers]')"
pytest.importorskip("transformers", reason=_MISSING)
pytest.importorskip("accelerate", reason=_MISSING)

import transformers_workers as W  # noqa: E402
from transformers import Trainer  # noqa: E402

import dist_helpers  # noqa: E402
from mpfp16 import DynamicLossScaler, FP16Optimizer  # noqa: E402
from mpfp16.bench.transformers import one_thread  # noqa: E402
from mpfp16.integrations.transformers import MPFP16Options, MPFP16Trainer  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as the benchmark runs (bench.transformers.one_thread): on a
    loaded 2-core machine two made these tests ten times slower, at one they take a
    second."""
    with one_thread():
        yield


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# ----------------------------------------------------------------- bit for bit the own loop

GPT2_MODES = {
    "fp16": {},
    "fp16-fp32-sums": {"accumulate_dtype": torch.float32},
    "bf16-no-masters-stochastic": {"dtype": torch.bfloat16, "master_weights": False, "rounding": "stochastic"},
    "fp16-bf16-moments-fp32-exp-avg-sq": {"state_dtype": torch.bfloat16, "state_dtypes": {"exp_avg_sq": torch.float32}},
}


@pytest.mark.parametrize("name", GPT2_MODES)
def test_gpt2_is_the_own_loop_bit_for_bit(name, tmp_path):
    """The Trainer's AdamW (``args.optim``, weight decay in one of its two groups), two
    micro-batches per step, ``max_grad_norm`` clipping, and an inf in the third
    micro-batch: the second step is skipped (fp16 backs its scale off; bf16 has none),
    and the linear schedule is stepped 3 times in 4 steps, as the own loop steps it."""
    options = MPFP16Options(**GPT2_MODES[name])
    data = W.make_data("gpt2", 8, inf_batches=(2,))
    trainer = W.fit("gpt2", data, tmp_path, options, gradient_accumulation_steps=2, max_steps=4)
    own = W.own_loop("gpt2", W.batches_of(data), trainer, options)
    assert W.differs(W.state(trainer.model, trainer.fp16_optimizer), W.state(own["model"], own["opt"])) is None
    assert own["stepped"] == [True, False, True, True]
    assert trainer.skipped_steps == 1 and trainer.state.global_step == 4
    assert trainer.loss_scale == (2.0 ** 15 if options.dtype == torch.float16 else 1.0)
    assert trainer.lr_scheduler.last_epoch == own["sched"].last_epoch == 3  # the skipped step left the schedule
    assert trainer.lr_scheduler.get_last_lr() == own["sched"].get_last_lr()
    # grad_norm: the unscaled fp32 gradients' norm before clipping, NaN for the skipped step
    norms = W.logged(trainer, "grad_norm")
    assert norms[1] != norms[1] and norms[:1] + norms[2:] == own["norms"][:1] + own["norms"][2:]
    assert min(own["norms"][:1] + own["norms"][2:]) > trainer.args.max_grad_norm  # every step clipped
    assert W.logged(trainer, "skipped_steps") == [0, 1, 1, 1]
    assert trainer.model.transformer.h[0].attn.c_attn.weight.dtype == options.dtype
    assert trainer.model.transformer.ln_f.weight.dtype == torch.float32  # norm layers stay fp32
    assert [len(g["params"]) for g in trainer.fp16_optimizer.param_groups] == [len(g["params"]) for g in
                                                                              own["opt"].param_groups]
    states = list(trainer.fp16_optimizer.optimizer.state.values())
    assert states and all(s["exp_avg"].dtype == (options.state_dtype or torch.float32)
                          and s["exp_avg_sq"].dtype == torch.float32 for s in states)


BERT_MODES = {
    "fp16-default-scale": {},
    "fp16-from-a-large-scale": {"loss_scale": DynamicLossScaler(init_scale=2.0 ** 20)},
    "bf16": {"dtype": torch.bfloat16},
}


@pytest.mark.parametrize("name", BERT_MODES)
def test_bert_with_the_users_optimizer_is_the_own_loop_bit_for_bit(name, tmp_path):
    """The user's SGD with momentum through ``optimizers=``, built over the fp32 model
    before the Trainer converts it; no clipping (``max_grad_norm=0``: the logged norm is
    measured inside the step). BERT's head computes its loss in fp16, so the loss's own
    gradient is the scale: from the default 2^16 or from 2^20 the scale backs off to
    2^15 before the first backward, and no step is lost (at 2^16 each run skipped its
    first step, and ended its schedule a step short)."""
    options = MPFP16Options(**BERT_MODES[name])
    data = W.make_data("bert", 6)
    model = W.bert()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = W.fit("bert", data, tmp_path, options, model=model, optimizers=(sgd, None), max_grad_norm=0.0,
                    learning_rate=0.05, max_steps=6)
    assert trainer.fp16_optimizer.optimizer is sgd
    own = W.own_loop("bert", W.batches_of(data), trainer, options, inner="sgd", momentum=0.9)
    assert W.differs(W.state(trainer.model, trainer.fp16_optimizer), W.state(own["model"], own["opt"])) is None
    assert trainer.skipped_steps == own["stepped"].count(False) == 0
    assert trainer.loss_scale == (2.0 ** 15 if options.dtype == torch.float16 else 1.0)
    assert trainer.lr_scheduler.last_epoch == 6
    norms = W.logged(trainer, "grad_norm")
    assert [n for n, ok in zip(norms, own["stepped"]) if ok] == [n for n in own["norms"] if n is not None]
    assert trainer.model.bert.embeddings.LayerNorm.weight.dtype == torch.float32


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_close_to_the_fp32_trainer(kind, tmp_path):
    """The same model, data and AdamW through transformers' own Trainer in fp32: the
    per-step losses agree to 2e-3 and the final weights differ by under a tenth of how
    far they moved (AdamW's normalized step moves a weight whose gradient is near zero
    by about the learning rate whichever sign rounding gives it); ``evaluate()`` runs the
    16-bit model. The scale starts at 2^10, so that no step overflows: a skipped step
    would leave the fp32 run a step ahead."""
    data = W.make_data(kind, 8)
    ref = Trainer(model=W.MODELS[kind](), args=W.training_args(tmp_path / "fp32", max_steps=8),
                  train_dataset=data)
    ref.remove_callback(W.PrinterCallback)
    ref.train()
    mine = W.fit(kind, data, tmp_path / "mpfp16", MPFP16Options(loss_scale=DynamicLossScaler(init_scale=2.0 ** 10)),
                 max_steps=8)
    losses, ref_losses = W.logged(mine, "loss"), W.logged(ref, "loss")
    assert len(losses) == len(ref_losses) == 8 and mine.skipped_steps == 0
    assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    init, fp32 = dict(W.MODELS[kind]().named_parameters()), dict(ref.model.named_parameters())
    names = [n for n, _ in mine.model.named_parameters()]
    w0, w32 = (torch.cat([d[n].detach().flatten() for n in names]) for d in (init, fp32))
    w16 = torch.cat([p.detach().float().flatten() for p in mine.model.parameters()])
    assert (w16 - w32).norm() < 0.1 * (w32 - w0).norm()
    evaluation = mine.evaluate(eval_dataset=data[:8])
    ref_loss = ref.evaluate(eval_dataset=data[:8])["eval_loss"]
    assert abs(evaluation["eval_loss"] - ref_loss) < 2e-3 * evaluation["eval_loss"]
    assert mine.model.get_input_embeddings().weight.dtype == torch.float16


# ----------------------------------------------------------------- checkpoints

def test_resume_from_a_checkpoint_is_bit_for_bit(tmp_path):
    """An 8-step run saves checkpoint-4, after a skipped step and with the scaler's growth
    tracker mid-way (growth interval 3). A new MPFP16Trainer over a model built from other
    weights, ``train(resume_from_checkpoint=...)``, ends bit for bit where the
    uninterrupted run ends: weights, FP16Optimizer's state_dict, the lr schedule, the
    step count and the logged norms. The checkpoint's optimizer.pt is FP16Optimizer's
    state (masters, inner state, scaler) and loads with weights_only=True."""
    options = MPFP16Options(loss_scale=DynamicLossScaler(growth_interval=3))
    data = W.make_data("gpt2", 8, inf_batches=(1,))
    steps = dict(max_steps=8, save_strategy="steps", save_steps=4)
    whole = W.fit("gpt2", data, tmp_path / "whole", options, **steps)
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert {"format", "optimizer", "scaler", "master_weights", "skipped_steps"} <= set(saved)
    assert saved["skipped_steps"] == 1 and saved["scaler"]["growth_tracker"] == 2
    assert not (checkpoint / "scaler.pt").exists()  # no torch.amp scaler: the scale is in optimizer.pt
    resumed = W.fit("gpt2", data, tmp_path / "resumed", options, model=W.gpt2(seed=5), resume=str(checkpoint),
                    **steps)
    assert W.differs(W.state(resumed.model, resumed.fp16_optimizer), W.state(whole.model, whole.fp16_optimizer)) is None
    assert resumed.lr_scheduler.state_dict() == whole.lr_scheduler.state_dict()
    assert resumed.state.global_step == whole.state.global_step == 8
    # the log of steps 1-4 comes from the checkpoint; NaN is the skipped step's norm
    assert W.differs(W.logged(resumed, "grad_norm"), W.logged(whole, "grad_norm")) is None
    # halved at step 2, grown after steps 3-5 and 6-8
    assert whole.skipped_steps == resumed.skipped_steps == 1 and resumed.loss_scale == 2.0 ** 17


# ----------------------------------------------------------------- refusals

@pytest.mark.parametrize("kwargs,message", [
    ({"fp16": True}, "drop fp16=True and pass mpfp16=MPFP16Options(dtype=torch.float16)"),
    ({"bf16": True}, "drop bf16=True and pass mpfp16=MPFP16Options(dtype=torch.bfloat16)"),
    ({"fp16_full_eval": True}, "drop fp16_full_eval=True"),
    ({"optim": "lomo"}, "updates each parameter inside the backward pass"),
    ({"optim": "galore_adamw_layerwise"}, "updates each parameter inside the backward pass"),
    ({"optim": "schedule_free_adamw"}, "schedule-free optimizer's train() and eval() swap"),
])
def test_training_arguments_are_refused_in_one_line(kwargs, message, tmp_path):
    with pytest.raises(ValueError) as exc:
        MPFP16Trainer(model=W.gpt2(), args=W.training_args(tmp_path, **kwargs), train_dataset=W.make_data("gpt2", 1))
    assert message in _one_line(exc)


@pytest.mark.parametrize("attribute,value,message", [
    ("deepspeed", "ds_config.json", "MPFP16Trainer does not run under DeepSpeed"),
    ("fsdp", ["full_shard"], "MPFP16Trainer does not run under FSDP"),
    ("_n_gpu", 2, "launch one process per GPU with torchrun"),
])
def test_sharding_and_data_parallel_in_one_process_are_refused(attribute, value, message, tmp_path):
    """DeepSpeed and FSDP cannot be configured on this machine (TrainingArguments
    refuses them without the package, or without torch.distributed), nor several GPUs:
    the arguments are set after they are built, as a launcher would have them."""
    args = W.training_args(tmp_path)
    args.n_gpu  # the devices are set up; then the launcher's view
    setattr(args, attribute, value)
    with pytest.raises(ValueError) as exc:
        MPFP16Trainer(model=W.gpt2(), args=args, train_dataset=W.make_data("gpt2", 1))
    assert message in _one_line(exc)


def test_an_accelerate_config_for_mixed_precision_is_refused(tmp_path, monkeypatch):
    """``accelerate launch`` with an fp16 config sets ACCELERATE_MIXED_PRECISION, which
    TrainingArguments and the Accelerator take: torch.amp over mpfp16's weights."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError) as exc:
        MPFP16Trainer(model=W.gpt2(), args=W.training_args(tmp_path), train_dataset=W.make_data("gpt2", 1))
    assert "the Accelerator runs mixed_precision='fp16'" in _one_line(exc)


def test_an_fp16_optimizer_given_to_the_trainer_is_refused(tmp_path):
    model = W.gpt2()
    import mpfp16

    mpfp16.to_half(model)
    opt = FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError) as exc:
        MPFP16Trainer(model=model, args=W.training_args(tmp_path), train_dataset=W.make_data("gpt2", 1),
                      optimizers=(opt, None))
    assert "give the Trainer the torch optimizer" in _one_line(exc)
    with pytest.raises(TypeError, match="mpfp16= takes an MPFP16Options"):
        MPFP16Trainer(model=W.gpt2(), args=W.training_args(tmp_path), mpfp16={"dtype": torch.float16})


@pytest.mark.parametrize("kwargs,message", [
    ({"dtype": torch.float32}, "dtype must be torch.float16 or torch.bfloat16"),
    ({"rounding": "kahan"}, "needs master_weights=False"),
    ({"master_weights": "remainder"}, "remainder"),
    ({"dtype": torch.bfloat16, "loss_scale": 1024.0}, "bf16 has fp32's exponent range"),
    ({"accumulate_dtype": torch.float16}, "must be None (the model's 16-bit dtype) or torch.float32"),
    ({"allreduce_dtype": torch.int8}, "allreduce_dtype must be None"),
    ({"state_dtype": torch.float16}, "fp16 cannot hold optimizer states"),
    ({"state_dtypes": {"exp_avg": torch.int8}}, "a state is kept in torch.float32 or torch.bfloat16"),
])
def test_options_are_refused_when_built(kwargs, message):
    with pytest.raises((ValueError, TypeError)) as exc:
        MPFP16Options(**kwargs)
    assert message in _one_line(exc)


def test_clipping_a_part_of_the_parameters_is_refused(tmp_path):
    """accelerator.clip_grad_norm_ over some parameters would clip all of them (the
    step clips the global norm of every master gradient): refused; and the Trainer's
    own call, over model.parameters(), returns the tensor the step fills."""
    trainer = W.fit("gpt2", W.make_data("gpt2", 1), tmp_path, max_steps=1)
    some = list(trainer.model.parameters())[:2]
    with pytest.raises(ValueError) as exc:
        trainer.accelerator.clip_grad_norm_(some, 1.0)
    assert "leave out" in _one_line(exc)
    norm = trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), 1.0)
    assert norm.dtype == torch.float32 and norm.isnan()  # filled by the next step


def test_a_model_off_the_trainers_device_is_refused_before_accelerate_moves_it():
    """accelerate's placement, ``model.to(accelerator.device)``, copies every parameter
    out of the FP16Optimizer's flat buffers when the devices differ, even only in
    spelling (torchrun on CPUs: the Accelerator's cpu:0, the parameters' cpu; the
    two-process test trains through that). MPFP16Trainer places nothing itself: cpu is
    cpu:0, and a model elsewhere (here on the meta device) is refused in one line."""
    from mpfp16.integrations.transformers import _check_device

    _check_device(torch.nn.Linear(2, 2), torch.device("cpu", 0))
    with pytest.raises(ValueError) as exc:
        _check_device(torch.nn.Linear(2, 2, device="meta"), torch.device("cpu", 0))
    assert "has weight on meta, not on the Trainer's device cpu:0" in _one_line(exc)


# ----------------------------------------------------------------- two processes

@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("transformers-ddp")
    proc = dist_helpers.torchrun([os.path.join(dist_helpers.REPO, "tests", "transformers_workers.py"), str(out)],
                                 timeout=280)
    dist_helpers.check(proc)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", W.DDP_CASES)
def test_two_processes_under_torchrun_are_the_own_loop(ddp_results, name):
    """MPFP16Trainer under torchrun (accelerate's DistributedDataParallel, gloo) is the
    own loop under mpfp16.distributed.wrap on the batches each rank trained on, bit for
    bit; the replicas agree; each optimizer step sends one exchange (none on the
    accumulating micro-batch); an inf on rank 1 alone skips that step on both ranks."""
    results = [r[name] for r in ddp_results]
    _, overrides, inf_on_1 = W.DDP_CASES[name]
    for rank, r in enumerate(results):
        assert r["is_ddp"] == "DistributedDataParallel"
        assert W.differs(r["mpfp16"], r["own"]) is None, f"rank {rank}"
        assert r["global_step"] == W.DDP_STEPS
        assert r["replicas"] > 0
        assert r["calls"] == r["own_calls"] == [r["buckets"]] * W.DDP_STEPS
        assert r["inf_seen"] == (rank == 1 and bool(inf_on_1))
    assert W.differs(results[0]["mpfp16"], results[1]["mpfp16"]) is None  # one model, on both ranks
    assert results[0]["own_stepped"] == results[1]["own_stepped"]
    assert results[0]["skipped"] == results[1]["skipped"] == len(inf_on_1)


# ----------------------------------------------------------------- the benchmark

@pytest.mark.slow  # a new interpreter, as typed: the fused AdamW step may compile mpfp16's kernels first
def test_the_benchmark_measures_both_side_by_side(tmp_path):
    """``python -m mpfp16.bench.transformers --quick``: the same GPT-2 through
    MPFP16Trainer and through the Trainer's fp16=True and bf16=True, in one run; bytes
    per parameter from the storages, what each Accelerator enabled, step times and
    their ratios."""
    from mpfp16.bench import transformers as bench

    path = tmp_path / "bench.json"
    proc = dist_helpers.python(["-m", "mpfp16.bench.transformers", "--quick", "--json", str(path)], timeout=240)
    dist_helpers.check(proc)
    data = json.loads(path.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == list(bench.METHODS)
    mp, amp, mp_bf16, amp_bf16 = (rows[m] for m in bench.METHODS)
    assert (mp["weights_dtype"], mp_bf16["weights_dtype"], amp["weights_dtype"]) == ("float16", "bfloat16", "float32")
    for r in (mp, mp_bf16):  # 16-bit weights and gradients (the fp32 norm layers add a little), fp32 masters
        b = r["bytes_per_param"]
        assert 2 < b["model_weights"] < 2.1 and 2 < b["model_grads"] < 2.1 and 3.9 < b["master_weights"] < 4
        assert r["bytes_per_param_between_steps"]["total"] == b["total"]  # the flat gradient buffer stays
    for r in (amp, amp_bf16):  # fp32 weights and gradients, no masters; zero_grad(set_to_none) frees the gradients
        b = r["bytes_per_param"]
        assert (b["model_weights"], b["model_grads"], b["master_weights"]) == (4.0, 4.0, 0.0)
        assert r["bytes_per_param_between_steps"]["total"] == b["total"] - 4.0
    assert all(r["bytes_per_param"]["optimizer_state"] == pytest.approx(8.0, abs=0.01) for r in rows.values())
    assert mp["grad_scaler"] and mp["skipped_steps"] == [0] and not mp_bf16["grad_scaler"]
    assert amp_bf16["autocast"] == "bfloat16"
    if amp["device"] == "cpu":  # accelerate enables neither autocast nor a GradScaler for fp16 on a CPU
        assert amp["autocast"] == "-" and not amp["grad_scaler"]
    for r, base in ((mp, amp), (mp_bf16, amp_bf16)):
        assert r["baseline"] == base["method"]
        assert r["step_vs_baseline"] == pytest.approx(r["step_s"] / base["step_s"])
        assert r["bytes_vs_baseline"] == pytest.approx(r["bytes_per_param"]["total"] / base["bytes_per_param"]["total"])
    assert all(r["step_s"] > 0 and len(r["step_s_all"]) == data["config"]["steps"] for r in rows.values())
    for name in bench.METHODS:
        assert f"\n{name} " in proc.stdout
    assert "baseline" in proc.stdout and "fp16=True" in proc.stdout


@pytest.mark.parametrize("argv,message", [
    (["--methods", "fp32"], "--methods: expected a comma-separated list"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "-1"], "--warmup must be 0 or more"),
    (["--width", "33"], "--width 33 is not a multiple of --heads 4"),
    (["--model", "t5"], "--model: invalid choice"),
])
def test_a_bad_benchmark_flag_is_refused_in_one_line(argv, message, capsys):
    from mpfp16.bench import transformers as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in last and message in last
