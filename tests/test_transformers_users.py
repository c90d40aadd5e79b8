"""MPFP16Trainer as Hugging Face users go on from a run: a regression head on float
labels, ``save_model`` then ``from_pretrained``, a callback that reads or writes the
gradients in ``on_pre_optimizer_step``, ``optim="adagrad"``, a loss computed in fp16
at the default scale, the modules transformers keeps in fp32 (Llama's RMSNorm and
rotary ``inv_freq``, T5's ``wo`` and T5LayerNorm) with ``Seq2SeqTrainer``, a LoRA
model of peft, and a checkpoint of the plain Trainer. Each against transformers' own
fp32 Trainer on the same weights, or against mpfp16's own loop."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: every model is built from its config

import pytest  # noqa: E402
import torch  # noqa: E402

_MISSING = "the transformers extra is not installed (pip install 'mpfp16[transformers]')"
pytest.importorskip("transformers", reason=_MISSING)
pytest.importorskip("accelerate", reason=_MISSING)

import transformers_workers as W  # noqa: E402
from transformers import (AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM, Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config,
                          T5ForConditionalGeneration, Trainer, TrainerCallback, default_data_collator)

import mpfp16  # noqa: E402
from mpfp16 import DynamicLossScaler  # noqa: E402
from mpfp16.bench.transformers import one_thread  # noqa: E402
from mpfp16.integrations.transformers import MPFP16Options  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _fp32_trainer(model, data, out, **args) -> Trainer:
    ref = Trainer(model=model, args=W.training_args(out, **args), train_dataset=data,
                  data_collator=default_data_collator)
    ref.remove_callback(W.PrinterCallback)
    return ref


# ----------------------------------------------------------------- labels keep their dtype

def _regression_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(
        hidden_size=W.WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=W.VOCAB,
        max_position_embeddings=32, num_labels=1, pad_token_id=0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def test_float_labels_reach_the_loss_in_fp32(tmp_path):
    """A regression head (num_labels=1) on targets in [100, 500): the labels reach the
    model's MSELoss as given (fp32, not rounded to fp16), ``evaluate()`` is finite and
    within 1% of the fp32 Trainer's on the same weights, and training logs the losses
    the fp32 Trainer logs, to 1%, with no step skipped from a scale of 2^4. Cast with the
    inputs, the fp16 targets made eval_loss inf and every logged loss 0.0."""
    data = W.make_data("bert", 4)
    g = torch.Generator().manual_seed(5)
    for sample in data:
        sample["labels"] = torch.rand((), generator=g) * 400 + 100
    seen = []
    model = _regression_bert()
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["labels"].clone()), with_kwargs=True)
    mine = W.fit("bert", data, tmp_path / "mpfp16", MPFP16Options(loss_scale=DynamicLossScaler(init_scale=2.0 ** 4)),
                 model=model, max_steps=4, learning_rate=1e-3, max_grad_norm=0.0)
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], W.batches_of(data)[0]["labels"])
    ref = _fp32_trainer(_regression_bert(), data, tmp_path / "fp32", max_steps=4, learning_rate=1e-3,
                        max_grad_norm=0.0)
    ref.train()
    losses, ref_losses = W.logged(mine, "loss"), W.logged(ref, "loss")
    assert mine.skipped_steps == 0 and len(losses) == 4
    assert all(abs(a - b) <= 1e-2 * b for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    with torch.no_grad():  # the fp32 Trainer evaluates the same weights: the 16-bit model's, widened
        for p, q in zip(ref.model.parameters(), mine.model.parameters()):
            p.copy_(q)
    got, want = mine.evaluate(data)["eval_loss"], ref.evaluate(data)["eval_loss"]
    assert abs(got - want) <= 1e-2 * want, (got, want)


# ----------------------------------------------------------------- the export

@pytest.mark.parametrize("export", ["masters", "weights"])
def test_save_model_then_from_pretrained_gives_back_the_trained_model(export, tmp_path):
    """``save_model`` writes an fp32 model (config dtype float32): ``from_pretrained``
    then rounds nothing. With ``"masters"`` every parameter is its fp32 master, bit for
    bit; with ``"weights"`` every parameter is the 16-bit model's own (10 of a tiny
    BERT's 41, its LayerNorms, were rounded to fp16 when the export said float16), and
    ``to_half`` of the reloaded model is the trained 16-bit model, bit for bit."""
    data = W.make_data("bert", 2)
    trainer = W.fit("bert", data, tmp_path / "run", MPFP16Options(export=export), max_steps=2)
    trainer.save_model(str(tmp_path / "export"))
    reloaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "export"))
    assert {p.dtype for p in reloaded.parameters()} == {torch.float32}
    got = dict(reloaded.named_parameters())
    opt = trainer.fp16_optimizer
    for name, master, p in zip(opt.param_names(), opt.trained_values(), opt.model_params()):
        want = master if export == "masters" else p.detach().float()
        assert torch.equal(got[name], want), name
    if export == "weights":
        mpfp16.to_half(reloaded)
        assert W.differs({n: p for n, p in reloaded.named_parameters()},
                         {n: p.detach() for n, p in trainer.model.named_parameters()}) is None


def test_an_unknown_export_is_refused_in_one_line():
    with pytest.raises(ValueError, match="export='fp16': choose 'masters'") as exc:
        MPFP16Options(export="fp16")
    assert "\n" not in str(exc.value)


# ----------------------------------------------------------------- what callbacks see

class _GradientReader(TrainerCallback):
    """Records the 2-norm of the model's gradients in ``on_pre_optimizer_step``; with
    ``zero``, zeroes them there (a callback that drops a step's update)."""

    def __init__(self, zero: bool = False) -> None:
        self.norms: list[float] = []
        self.zero = zero

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = [p.grad.float() for p in kwargs["model"].parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item())
        if self.zero:
            for p in kwargs["model"].parameters():
                if p.grad is not None:
                    p.grad.zero_()


def test_a_callback_sees_the_unscaled_clipped_gradients_and_its_writes_are_stepped(tmp_path):
    """What ``on_pre_optimizer_step`` reads is what the fp32 Trainer gives it: the
    gradients unscaled and clipped to ``max_grad_norm`` (2-norm 0.3 to 1e-2, where it
    read about 10^5 scaled), and the logged ``grad_norm`` is the norm before clipping, the
    fp32 Trainer's to 1e-2. A callback that zeroes them there is obeyed: SGD without
    momentum or weight decay then leaves every weight where it was."""
    data = W.make_data("bert", 3)
    reader = _GradientReader()
    mine = W.fit("bert", data, tmp_path / "mpfp16", MPFP16Options(), callbacks=[reader], max_steps=3,
                 max_grad_norm=0.3, optim="sgd", weight_decay=0.0, learning_rate=0.1)
    ref_reader = _GradientReader()
    ref = _fp32_trainer(W.bert(), data, tmp_path / "fp32", max_steps=3, max_grad_norm=0.3, optim="sgd",
                        weight_decay=0.0, learning_rate=0.1)
    ref.add_callback(ref_reader)
    ref.train()
    assert mine.skipped_steps == 0
    assert len(reader.norms) == 3
    assert all(abs(n - 0.3) < 3e-3 for n in reader.norms + ref_reader.norms), (reader.norms, ref_reader.norms)
    norms, ref_norms = W.logged(mine, "grad_norm"), W.logged(ref, "grad_norm")
    assert all(abs(a - b) <= 1e-2 * b for a, b in zip(norms, ref_norms)) and min(norms) > 0.3, (norms, ref_norms)

    zero = W.fit("bert", data, tmp_path / "zero", MPFP16Options(), callbacks=[_GradientReader(zero=True)],
                 max_steps=2, max_grad_norm=1.0, optim="sgd", weight_decay=0.0, learning_rate=0.1)
    assert W.differs({n: p.detach() for n, p in zero.model.named_parameters()},
                     {n: p.detach() for n, p in mpfp16.to_half(W.bert()).named_parameters()}) is None


# ----------------------------------------------------------------- optimizers, the loss's dtype

def test_adagrad_and_a_16_bit_loss_at_the_default_scale(tmp_path):
    """``optim="adagrad"``: torch's Adagrad fills its state when it is built, over the
    16-bit parameters; FP16Optimizer lets Adagrad build it again over the fp32 masters
    (it was refused: "the optimizer already has state"). BERT computes its loss in
    fp16, so at the default scale 2^16 the loss's own gradient was inf and step 1 was
    always skipped; now the scale backs off to 2^15 before it and no step is lost. The
    run is mpfp16's own loop with torch's Adagrad, bit for bit, and close to the fp32
    Trainer's."""
    data = W.make_data("bert", 3)
    mine = W.fit("bert", data, tmp_path / "mpfp16", MPFP16Options(), optim="adagrad", max_steps=3,
                 max_grad_norm=0.0, weight_decay=0.0)
    inner = mine.fp16_optimizer.optimizer
    assert isinstance(inner, torch.optim.Adagrad) and mine.skipped_steps == 0 and mine.loss_scale == 2.0 ** 15
    assert all(s["sum"].dtype == torch.float32 for s in inner.state.values())
    model = W.bert()
    mpfp16.to_half(model)
    own = mpfp16.FP16Optimizer(torch.optim.Adagrad(model.parameters(), lr=mine.args.learning_rate), model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(own.optimizer, lambda s: 1 - s / 3)
    for batch in W.batches_of(data):
        own.zero_grad()
        own.backward(model(**batch).loss)
        assert own.step()
        sched.step()
    assert W.differs({n: p.detach() for n, p in model.named_parameters()},
                     {n: p.detach() for n, p in mine.model.named_parameters()}) is None
    ref = _fp32_trainer(W.bert(), data, tmp_path / "fp32", optim="adagrad", max_steps=3, max_grad_norm=0.0,
                        weight_decay=0.0)
    ref.train()
    losses, ref_losses = W.logged(mine, "loss"), W.logged(ref, "loss")
    assert len(losses) == 3 and all(abs(a - b) <= 5e-3 * b for a, b in zip(losses, ref_losses)), (losses, ref_losses)


# ----------------------------------------------------------------- modules kept in fp32

def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=W.WIDTH, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=W.VOCAB,
                                        max_position_embeddings=32))


def _t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(d_model=W.WIDTH, d_ff=64, d_kv=16, num_layers=2, num_heads=2,
                                               vocab_size=W.VOCAB, decoder_start_token_id=0, dropout_rate=0.0))


def test_transformers_norms_rotary_and_keep_in_fp32_modules_stay_fp32():
    """Llama's RMSNorm (its own class, not torch's) and its rotary ``inv_freq`` buffer,
    T5's T5LayerNorm and its ``_keep_in_fp32_modules`` (``wo``) stay fp32, and a
    ``keep_fp32`` name (Llama's ``lm_head``) too; the rest is fp16, and each model's
    loss is within 2% of its fp32 twin's. A name no module has is refused in one line."""
    llama, fp32 = _llama(), _llama()
    mpfp16.to_half(llama, keep_fp32=["lm_head"])
    kept = {n for n, p in llama.named_parameters() if p.dtype == torch.float32}
    assert kept == {n for n, _ in llama.named_parameters() if "norm" in n or n.startswith("lm_head")}
    assert {b.dtype for n, b in llama.named_buffers() if "inv_freq" in n} == {torch.float32}
    ids = torch.randint(0, W.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    assert abs(llama(input_ids=ids, labels=ids).loss.item() - fp32(input_ids=ids, labels=ids).loss.item()) < 2e-2
    t5, fp32 = _t5(), _t5()
    mpfp16.to_half(t5)
    kept = {n for n, p in t5.named_parameters() if p.dtype == torch.float32}
    assert kept == {n for n, _ in t5.named_parameters() if "layer_norm" in n or ".wo." in n}
    labels = ids[:, :5].contiguous()
    assert abs(t5(input_ids=ids, labels=labels).loss.item() - fp32(input_ids=ids, labels=labels).loss.item()) < 2e-2
    with pytest.raises(ValueError, match="keep_fp32 names 'head', which no module") as exc:
        mpfp16.to_half(_llama(), keep_fp32=["head"])
    assert "\n" not in str(exc.value)


def test_seq2seq_trainer_with_t5_is_close_to_the_fp32_seq2seq_trainer(tmp_path):
    """``Seq2SeqTrainer`` is MPFP16Trainer's too (``class T(MPFP16Trainer,
    Seq2SeqTrainer)``): a tiny T5, with its fp32 ``wo`` and norms, trains 4 steps
    within 1% of the fp32 Seq2SeqTrainer's losses, no step skipped."""
    from mpfp16.integrations.transformers import MPFP16Trainer

    class MPFP16Seq2SeqTrainer(MPFP16Trainer, Seq2SeqTrainer):
        pass

    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": torch.randint(1, W.VOCAB, (8,), generator=g),
             "labels": torch.randint(1, W.VOCAB, (5,), generator=g)} for _ in range(4 * W.BATCH)]
    base = dict(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=W.BATCH, max_steps=4,
                learning_rate=1e-3, train_sampling_strategy="sequential", save_strategy="no", logging_steps=1,
                disable_tqdm=True, use_cpu=True, optim="adamw_torch", max_grad_norm=1.0)
    runs = {}
    for name, cls, extra in (("mine", MPFP16Seq2SeqTrainer, {"mpfp16": MPFP16Options()}),
                             ("fp32", Seq2SeqTrainer, {})):
        trainer = cls(model=_t5(), args=Seq2SeqTrainingArguments(**base), train_dataset=data,
                      data_collator=default_data_collator, **extra)
        trainer.remove_callback(W.PrinterCallback)
        trainer.train()
        runs[name] = trainer
    assert runs["mine"].skipped_steps == 0 and runs["mine"].model.encoder.block[0].layer[1].DenseReluDense.wo \
        .weight.dtype == torch.float32
    losses, ref = W.logged(runs["mine"], "loss"), W.logged(runs["fp32"], "loss")
    assert len(losses) == 4 and all(abs(a - b) <= 1e-2 * b for a, b in zip(losses, ref)), (losses, ref)


# ----------------------------------------------------------------- peft

def test_a_lora_model_trains_its_adapters_over_masters_and_peft_reloads_them(tmp_path):
    """peft's LoRA on a tiny BERT: the frozen base is fp16 with no masters, the
    FP16Optimizer holds masters for the adapters (and the head peft trains) only, the
    losses are within 1% of the fp32 Trainer's over the same LoRA model, and
    ``save_model`` writes what ``PeftModel.from_pretrained`` reloads over a fresh fp32
    base: every adapter its fp32 master, bit for bit."""
    peft = pytest.importorskip("peft", reason="the peft extra is not installed (pip install 'mpfp16[peft]')")

    def lora():
        return peft.get_peft_model(W.bert(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                                                             task_type="SEQ_CLS", lora_dropout=0.0))

    data = W.make_data("bert", 3)
    mine = W.fit("bert", data, tmp_path / "mpfp16", MPFP16Options(), model=lora(), max_steps=3, max_grad_norm=1.0)
    opt = mine.fp16_optimizer
    trainable = {n for n, p in mine.model.named_parameters() if p.requires_grad}
    assert set(opt.param_names()) == trainable and any("lora_A" in n for n in trainable)
    frozen = [p for n, p in mine.model.named_parameters() if not p.requires_grad and p.dim() == 2]
    assert frozen and {p.dtype for p in frozen} == {torch.float16}
    ref = _fp32_trainer(lora(), data, tmp_path / "fp32", max_steps=3, max_grad_norm=1.0)
    ref.train()
    losses, ref_losses = W.logged(mine, "loss"), W.logged(ref, "loss")
    assert mine.skipped_steps == 0 and all(abs(a - b) <= 1e-2 * b for a, b in zip(losses, ref_losses))
    mine.save_model(str(tmp_path / "adapter"))
    reloaded = peft.PeftModel.from_pretrained(W.bert(), str(tmp_path / "adapter"))
    got = {n: p for n, p in reloaded.named_parameters()}
    masters = dict(zip(opt.param_names(), opt.trained_values()))
    lora_names = [n for n in masters if "lora_" in n]
    assert lora_names and all(torch.equal(got[n], masters[n]) for n in lora_names)


# ----------------------------------------------------------------- another Trainer's checkpoint

def test_resuming_a_checkpoint_of_the_plain_trainer_says_what_to_do(tmp_path):
    data = W.make_data("gpt2", 2)
    plain = _fp32_trainer(W.gpt2(), data, tmp_path / "plain", max_steps=2, save_strategy="steps", save_steps=2)
    plain.train()
    checkpoint = str(tmp_path / "plain" / "checkpoint-2")
    with pytest.raises(ValueError, match="was saved by transformers' own Trainer") as exc:
        W.fit("gpt2", data, tmp_path / "mine", MPFP16Options(), max_steps=4, resume=checkpoint)
    assert "\n" not in str(exc.value) and "from_pretrained" in str(exc.value)
