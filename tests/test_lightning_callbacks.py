"""The Lightning plugins with what users add to a run, in one process: Lightning's
callbacks that write the weights or run steps without a backward
(``StochasticWeightAveraging``, ``ModelPruning``), the learning-rate finder, hooks
that read the gradients before the step, ``LightningModule.dtype``, several models
and optimizers (a GAN under Fabric, and under the Trainer's manual optimization),
checkpoints' ``state_dict`` as ``export=`` says, and a PEFT LoRA model. Each run is
compared with Lightning's ``"32-true"`` (close) and, where the numbers must agree
bit for bit, with mpfp16's own loop (tests/lightning_workers.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning", reason="the lightning extra is not installed (pip install 'mpfp16[lightning]')")

import lightning_workers as W  # noqa: E402

import mpfp16  # noqa: E402

from mpfp16.integrations.lightning import MPFP16FabricPrecision, MPFP16Precision  # noqa: E402


def _trainer(plugin=None, **kwargs) -> "L.Trainer":
    kwargs = dict(W.QUIET, **{"max_epochs": 1, "devices": 1, "enable_checkpointing": False, **kwargs})
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    return L.Trainer(**kwargs)


def _close(a, b, atol: float) -> bool:
    return all(x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=0, atol=atol) for x, y in zip(a, b))


# ---------------------------------------------------------------- StochasticWeightAveraging


def _bn_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def test_swa_with_batch_norm_runs_its_statistics_epoch_and_keeps_the_average():
    """StochasticWeightAveraging over a BatchNorm model adds an epoch of forward passes
    only (no backward), to recompute the BN statistics of the averaged weights, and
    still calls the optimizer step at its end. Before, FP16Optimizer raised there: "no
    backward pass reached the parameters". That step is now not taken, as a step with
    no backward: the run ends with the average in the weights (its 16-bit rounding),
    the masters rounding to it. SWA copies the module before the plugin converts it,
    so its average is fp32 (the mean of the 16-bit weights of each epoch). Against
    "32-true": the same global_step, the averages and the BN statistics close. (Under
    "32-true" that step applies the last epoch's stale gradients to the average.)"""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    data = W.make_data(8)
    runs = {}
    for name, plugin in (("32-true", None), ("mpfp16", MPFP16Precision())):
        lit = W.lit_module(_bn_net(), {})
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
        trainer = _trainer(plugin, max_epochs=3, callbacks=[swa], **({} if plugin else {"precision": "32-true"}))
        trainer.fit(lit, W.loader(data))
        runs[name] = (lit, trainer, list(swa._average_model.parameters()))
    (ref, ref_trainer, ref_average), (lit, trainer, average) = runs["32-true"], runs["mpfp16"]
    assert trainer.global_step == ref_trainer.global_step == 3 * 8 + 1  # the statistics epoch's one step
    assert all(a.dtype == torch.float32 for a in average) and _close(average, ref_average, atol=2e-3)
    assert all(torch.equal(p, a.to(p.dtype)) for p, a in zip(lit.parameters(), average))
    opt = trainer.precision_plugin.optimizer
    assert all(torch.equal(m.to(p.dtype), p) for p, m in zip(opt.model_params(), opt.master_params()))
    assert trainer.precision_plugin.last_step_skipped and opt.skipped_steps == 0  # not taken; not an overflow
    bn, ref_bn = lit.net[1], ref.net[1]
    assert torch.allclose(bn.running_mean, ref_bn.running_mean, atol=5e-3)
    assert torch.allclose(bn.running_var, ref_bn.running_var, rtol=2e-2)


# ---------------------------------------------------------------- ModelPruning


def test_model_pruning_with_its_defaults_prunes_as_32_true_and_trains_on():
    """ModelPruning("l1_unstructured") with its defaults: global L1 pruning of every
    weight and bias at each epoch's end, the lottery-ticket reset of what is left to
    the initial values (a ``param.data = ...``), pruning made permanent at the end
    (``param.data = weight * mask``). Before, the step after the reset raised: the
    parameter "no longer lives in the FP16Optimizer's flat buffer". Now each replaced
    parameter is put back in place, its master taking the new value exactly. Against
    "32-true": the same masks. The epoch between the prunings trains. At the end the
    weights are the initial weights rounded, times the mask, and the masters (what a
    checkpoint holds) the initial fp32 values times the mask. (Under "32-true" only
    the first reset restores the initial values: Lightning's reset shares the storage
    of its saved copy, which training then changes.)"""
    from lightning.pytorch.callbacks import ModelPruning

    class Trained(L.Callback):  # before ModelPruning's hook: the second epoch's weights, before its pruning
        def on_train_epoch_start(self, trainer, pl_module):
            self.start = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_epoch_end(self, trainer, pl_module):
            self.changed = [not torch.equal(a, p) for a, p in zip(self.start, pl_module.parameters())]

    data = W.make_data(8)
    runs = {}
    for name, plugin in (("32-true", None), ("mpfp16", MPFP16Precision())):
        lit = W.lit_module(W.make_net(0), {})
        trained = Trained()
        trainer = _trainer(plugin, max_epochs=2, callbacks=[trained, ModelPruning("l1_unstructured")],
                           **({} if plugin else {"precision": "32-true"}))
        trainer.fit(lit, W.loader(data))
        runs[name] = (lit, trainer, trained)
    (ref, _, _), (lit, trainer, trained) = runs["32-true"], runs["mpfp16"]
    masks = [p != 0 for p in lit.parameters()]
    assert all(torch.equal(m, r != 0) for m, r in zip(masks, ref.parameters()))
    zeros = sum(int((~m).sum()) for m in masks)
    assert zeros == sum(int((r == 0).sum()) for r in ref.parameters()) and zeros > 0.7 * sum(m.numel() for m in masks)
    assert trained.changed[0] and trained.changed[3]  # the first and last Linear weights trained after the pruning
    initial, rounded = W.make_net(0), mpfp16.to_half(W.make_net(0))
    assert all(torch.equal(p, r * m) and p.dtype == r.dtype for p, r, m in zip(lit.parameters(), rounded.parameters(),
                                                                               masks))
    exported = trainer.precision_plugin.export_state_dict()
    assert all(torch.equal(exported[f"net.{n}"], i * m)
               for (n, i), m in zip(initial.named_parameters(), masks))


# ---------------------------------------------------------------- the learning-rate finder


def test_lr_find_restores_the_run_and_a_fit_after_it_is_the_own_loop(tmp_path):
    """Tuner(trainer).lr_find saves a checkpoint, adds ``initial_lr`` to the optimizer's
    param groups, runs its steps, and restores the checkpoint. Before, the restore
    raised: "param group 0 has no initial_lr: it was saved by another kind of
    optimizer". Now the weights, the masters, the inner optimizer's state and the scale
    are back as before it, its suggestion is "32-true"'s, and the fit that follows on
    the same Trainer is the own loop's, bit for bit."""
    from lightning.pytorch.tuner import Tuner

    data = W.make_data(16)
    suggestions = {}
    for name, plugin in (("32-true", None), ("mpfp16", MPFP16Precision())):
        lit = W.lit_module(W.make_net(0), {})
        trainer = _trainer(plugin, default_root_dir=tmp_path / name, **({} if plugin else {"precision": "32-true"}))
        finder = Tuner(trainer).lr_find(lit, W.loader(data), num_training=12, update_attr=False)
        suggestions[name] = finder.suggestion(skip_begin=2)
        assert not list((tmp_path / name).glob(".lr_find*"))  # its checkpoint removed
    opt = plugin.optimizer
    rounded = mpfp16.to_half(W.make_net(0))
    assert all(torch.equal(p, r) for p, r in zip(lit.parameters(), rounded.parameters()))
    assert all(torch.equal(m, p.float()) for p, m in zip(opt.model_params(), opt.master_params()))
    assert not opt.optimizer.state and opt.skipped_steps == 0 and opt.loss_scale == 2.0 ** 16
    assert all("initial_lr" not in g for g in opt.param_groups)
    assert suggestions["mpfp16"] is not None and 0.5 < suggestions["mpfp16"] / suggestions["32-true"] < 2
    trainer.fit(lit, W.loader(data))
    net, own, _ = W.own_loop({}, data)
    assert W.same(W.state(lit.net, plugin.optimizer), W.state(net, own))


# ---------------------------------------------------------------- hooks that read the gradients


class GradNorms(L.Callback):
    """Lightning's ``grad_norm`` of the model's ``.grad`` where Lightning shows them."""

    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.norms.append(float(grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"]))


def test_a_hook_before_the_step_sees_unscaled_gradients_and_the_step_is_unchanged():
    """``on_before_optimizer_step`` (a callback's, with Lightning's ``grad_norm``) sees
    the unscaled gradients in the model's ``.grad``, as under "16-mixed": the norms are
    "32-true"'s (before, they were that times the loss scale, 2^16). Clipping by norm
    follows the hook, and the run is still the own loop's bit for bit."""
    mode = {"optimizer": "adamw", "clip": 0.5, "scheduler": True}
    data = W.make_data(8)
    mine, ref = GradNorms(), GradNorms()
    lit, plugin, _ = W.fit_trainer(mode, data, callbacks=[mine])
    W.fit_trainer(mode, data, callbacks=[ref], precision="32-true")
    assert len(mine.norms) == len(ref.norms) == 8
    assert all(math.isclose(a, b, rel_tol=3e-2) for a, b in zip(mine.norms, ref.norms)), (mine.norms, ref.norms)
    net, opt, _ = W.own_loop(mode, data)
    assert W.same(W.state(lit.net, plugin.optimizer), W.state(net, opt))


class ZeroGrads(L.Callback):
    """Zeroes the model's gradients where Lightning shows them (a callback that drops
    a step's update), after recording the weights the run started from."""

    def on_train_start(self, trainer, pl_module):
        self.start = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.zero_()


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_what_a_hook_writes_into_the_gradients_is_stepped(clip):
    """``on_before_optimizer_step`` zeroes the gradients, as "32-true" would obey:
    Adagrad then moves no weight, with clipping by norm (in the step) or by value
    (after the hook). Before, the step read the fp32 gradients unscaled before the hook
    and the write was lost."""
    zero = ZeroGrads()
    lit, plugin, _ = W.fit_trainer({"optimizer": "adagrad", "clip": 0.5, "clip_algorithm": clip}, W.make_data(4),
                                   callbacks=[zero])
    assert plugin.skipped_steps == 0
    assert all(torch.equal(p, zero.start[n]) for n, p in lit.named_parameters())


# ---------------------------------------------------------------- LightningModule.dtype


@pytest.mark.parametrize("kind", ["trainer", "fabric"])
def test_the_module_dtype_is_the_16_bit_dtype(kind):
    """``LightningModule.dtype`` after the conversion is the weights' 16-bit dtype, as
    "16-true" reports it (before: float32), so a tensor made in a step with
    ``dtype=self.dtype`` meets the 16-bit weights (before: "mat1 and mat2 must have the
    same dtype"). Adding zeros made so, the run is the own loop's bit for bit."""
    data = W.make_data(4)
    seen = []
    lit = W.lit_module(W.make_net(0), {})

    def training_step(batch, batch_idx):
        x, y = batch
        seen.append(lit.dtype)
        return F.cross_entropy(lit.net(x + torch.zeros(x.shape, dtype=lit.dtype)).float(), y)

    lit.training_step = training_step
    if kind == "trainer":
        plugin = MPFP16Precision()
        _trainer(plugin).fit(lit, W.loader(data))
        true16 = W.lit_module(W.make_net(0), {})
        _trainer(precision="16-true", max_steps=1).fit(true16, W.loader(data))
        assert seen == [true16.dtype] * len(data) == [torch.float16] * len(data)
    else:
        plugin = MPFP16FabricPrecision()
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model, optimizer = fabric.setup(lit, W.OPTIMIZERS["sgd"](lit.parameters()))
        for i, batch in enumerate(data):
            optimizer.zero_grad()
            fabric.backward(model.training_step(plugin.convert_input(batch), i))
            optimizer.step()
        assert seen == [torch.float16] * len(data)
    net, opt, _ = W.own_loop({}, data)
    assert W.same(W.state(lit.net, plugin.optimizer), W.state(net, opt))


# ---------------------------------------------------------------- several models and optimizers: a GAN


def _gan_nets(seed: int = 0):
    torch.manual_seed(seed)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return gen, disc


def _gan_data(batches: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 8, generator=g) + 2, torch.randn(8, 4, generator=g)) for _ in range(batches)]


def _bce(logits, target: float):
    return F.binary_cross_entropy_with_logits(logits.float(), torch.full_like(logits.float(), target))


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2, betas=(0.5, 0.999))


def _gan_loop(backward, gen, disc, opt_g, opt_d, data) -> None:
    """The DCGAN recipe: the discriminator's step, then the generator's, whose loss
    goes through the discriminator too (its gradients there are zeroed by the
    discriminator's next zero_grad)."""
    for real, z in data:
        opt_d.zero_grad()
        fake = gen(z)
        backward(_bce(disc(real), 1.0) + _bce(disc(fake.detach()), 0.0), opt_d)
        opt_d.step()
        opt_g.zero_grad()
        backward(_bce(disc(fake), 1.0), opt_g)
        opt_g.step()


def _own_gan(scaler, data, manual: bool = False):
    """mpfp16's own loop: two FP16Optimizers on one scaler. ``manual``: the Trainer GAN's
    order, each model frozen while the other steps (what toggle_optimizer does)."""
    gen, disc = _gan_nets()
    mpfp16.to_half(gen)
    mpfp16.to_half(disc)
    opt_g = mpfp16.FP16Optimizer(_adam(gen.parameters()), loss_scale=scaler, model=gen)
    opt_d = mpfp16.FP16Optimizer(_adam(disc.parameters()), loss_scale=scaler, model=disc)
    if not manual:
        _gan_loop(lambda loss, opt: opt.backward(loss), gen, disc, opt_g, opt_d, data)
        return gen, disc, opt_g, opt_d
    for real, z in data:
        disc.requires_grad_(False)
        fake = gen(z.half())
        opt_g.backward(_bce(disc(fake), 1.0))
        opt_g.step()
        opt_g.zero_grad()
        disc.requires_grad_(True)
        gen.requires_grad_(False)
        opt_d.backward(_bce(disc(real.half()), 1.0) + _bce(disc(fake.detach()), 0.0))
        opt_d.step()
        opt_d.zero_grad()
        gen.requires_grad_(True)
    return gen, disc, opt_g, opt_d


def _params(*modules) -> list[torch.Tensor]:
    return [p for m in modules for p in m.parameters()]


def _fabric_gan(plugin=None, precision=None):
    fabric = L.Fabric(accelerator="cpu", devices=1, **({"plugins": [plugin]} if plugin else {"precision": precision}))
    gen, disc = _gan_nets()
    g, opt_g = fabric.setup(gen, _adam(gen.parameters()))
    d, opt_d = fabric.setup(disc, _adam(disc.parameters()))
    _gan_loop(lambda loss, opt: fabric.backward(loss), g, d, opt_g, opt_d, _gan_data())
    return gen, disc, opt_g, opt_d


def test_fabric_with_two_models_and_an_optimizer_each():
    """A GAN under Fabric: fabric.setup(gen, opt_g), fabric.setup(disc, opt_d). Before,
    the first backward was refused ("2 optimizers ... hold its parameters"). Each
    optimizer is now an FP16Optimizer of its own, both on one loss scaler (as torch.amp
    shares one GradScaler among optimizers); ``fabric.backward(loss)`` needs no model:
    the generator's loss, which reaches both models, gives both its gradients at the
    one scale. With the default scale (one skipped step) the run is the own loop with
    two FP16Optimizers on one scaler, bit for bit; from a scale that skips nothing, it
    is close to "32-true"."""
    plugin = MPFP16FabricPrecision()
    gen, disc, opt_g, opt_d = _fabric_gan(plugin)
    assert len(plugin.optimizers) == 2
    assert opt_g.optimizer is plugin.optimizers[0] and opt_d.optimizer is plugin.optimizers[1]
    assert plugin.optimizers[0].scaler is plugin.optimizers[1].scaler
    ref_gen, ref_disc, own_g, own_d = _own_gan(mpfp16.DynamicLossScaler(), _gan_data())
    assert all(torch.equal(a, b) for a, b in zip(_params(gen, disc), _params(ref_gen, ref_disc)))
    masters = plugin.optimizers[0].master_params() + plugin.optimizers[1].master_params()
    assert all(torch.equal(a, b) for a, b in zip(masters, own_g.master_params() + own_d.master_params()))
    assert plugin.skipped_steps == own_g.skipped_steps + own_d.skipped_steps >= 1
    assert plugin.loss_scale == own_g.loss_scale
    gen, disc, _, _ = _fabric_gan(MPFP16FabricPrecision(loss_scale=mpfp16.DynamicLossScaler(init_scale=2.0 ** 10)))
    fp32_gen, fp32_disc, _, _ = _fabric_gan(precision="32-true")
    assert _close(_params(gen, disc), _params(fp32_gen, fp32_disc), atol=2e-2)


class ManualGAN(L.LightningModule):
    """Lightning's GAN with manual optimization, as its docs write it: toggle the
    optimizer, manual_backward, step, zero_grad, untoggle; the generator first."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = _gan_nets()
        self.norms = []

    def training_step(self, batch, batch_idx):
        real, z = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        fake = self.gen(z)
        self.manual_backward(_bce(self.disc(fake), 1.0))
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        self.manual_backward(_bce(self.disc(real), 1.0) + _bce(self.disc(fake.detach()), 0.0))
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return [_adam(self.gen.parameters()), _adam(self.disc.parameters())]


def test_manual_optimization_with_two_optimizers():
    """The Trainer with ``automatic_optimization = False`` and two optimizers (before:
    refused, "needs automatic optimization"). Each is an FP16Optimizer of its own on
    one loss scaler; ``self.optimizers()``' step and zero_grad reach them;
    ``manual_backward`` scales by the shared scale; ``toggle_optimizer`` freezes the
    other model's parameters (Lightning's own would set the masters' flags). The run is
    the own loop that freezes the same way, bit for bit, and close to "32-true"."""
    batches = _gan_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.cat([r for r, _ in batches]), torch.cat([z for _, z in batches])), batch_size=8)
    plugin = MPFP16Precision(loss_scale=mpfp16.DynamicLossScaler(init_scale=2.0 ** 10))
    gan = ManualGAN()
    trainer = _trainer(plugin)
    trainer.fit(gan, loader)
    assert len(plugin.optimizers) == 2 and all(a is b for a, b in zip(trainer.optimizers, plugin.optimizers))
    assert all(p.requires_grad for p in gan.parameters())  # untoggled
    gen, disc, opt_g, opt_d = _own_gan(mpfp16.DynamicLossScaler(init_scale=2.0 ** 10), batches, manual=True)
    assert all(torch.equal(a, b) for a, b in zip(_params(gan.gen, gan.disc), _params(gen, disc)))
    masters = plugin.optimizers[0].master_params() + plugin.optimizers[1].master_params()
    assert all(torch.equal(a, b) for a, b in zip(masters, opt_g.master_params() + opt_d.master_params()))
    ref = ManualGAN()
    _trainer(precision="32-true").fit(ref, loader)
    assert _close(_params(gan.gen, gan.disc), _params(ref.gen, ref.disc), atol=2e-3)


# ---------------------------------------------------------------- the checkpoint's state_dict


class TinyLit(L.LightningModule):
    """A LightningModule that ``load_from_checkpoint`` can build again."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.net = W.make_net(seed)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return W.OPTIMIZERS["adamw"](self.parameters())


@pytest.mark.parametrize("export", ["masters", "weights"])
def test_a_checkpoint_holds_what_export_says(tmp_path, export):
    """``trainer.save_checkpoint`` and a ``ModelCheckpoint(save_weights_only=True)``:
    with ``export="masters"`` (the default) the ``state_dict`` holds every floating
    tensor in fp32, each 16-bit parameter its master, and
    ``TinyLit.load_from_checkpoint`` gives an fp32 model with exactly the masters' values
    (before: the 16-bit weights). With ``export="weights"`` it holds the tensors as the
    model does, and the loaded model has the 16-bit weights' values."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    plugin = MPFP16Precision(export=export)
    lit = TinyLit()
    trainer = _trainer(plugin, max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=True,
                       callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="weights-only", save_weights_only=True)])
    trainer.fit(lit, W.loader(W.make_data(8)))
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    opt = plugin.optimizer
    values = {id(p): m for p, m in zip(opt.model_params(), opt.master_params())}
    for path in (tmp_path / "full.ckpt", tmp_path / "weights-only.ckpt"):
        saved = torch.load(path, weights_only=True)["state_dict"]
        loaded = TinyLit.load_from_checkpoint(path)
        for (name, p), (_, q) in zip(lit.named_parameters(), loaded.named_parameters()):
            assert q.dtype == torch.float32
            if export == "masters":
                assert saved[name].dtype == torch.float32 and torch.equal(saved[name], values[id(p)])
                assert torch.equal(q, values[id(p)])
            else:
                assert saved[name].dtype == p.dtype and torch.equal(q, p.float())
    if export == "masters":
        assert any(not torch.equal(m, p.float()) for p, m in zip(opt.model_params(), opt.master_params()))


# ---------------------------------------------------------------- PEFT: a LoRA model


def test_a_peft_lora_model_trains_and_saves_its_fp32_adapters(tmp_path, monkeypatch):
    """A LoRA model (peft's get_peft_model over a tiny BERT built from a config, with
    random weights, no dropout) inside a LightningModule whose optimizer holds the trainable
    parameters: the frozen base is 16-bit (its LayerNorms fp32), masters exist only
    for the adapters and the classifier peft trains, and the run is close to
    "32-true". ``save_pretrained(path, state_dict=plugin.export_state_dict(model))``
    saves the adapters as the fp32 masters, and ``PeftModel.from_pretrained`` over a
    new fp32 base gives exactly them."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def base():
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(config)

    class LoRA(L.LightningModule):
        def __init__(self):
            super().__init__()
            model = base()
            torch.manual_seed(1)
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS",
                                     init_lora_weights=False)
            self.model = peft.get_peft_model(model, config)

        def training_step(self, batch, batch_idx):
            ids, y = batch
            return F.cross_entropy(self.model(input_ids=ids).logits.float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (32, 8), generator=g), torch.randint(0, 2, (32,),
                                                                                                      generator=g))
    plugin = MPFP16Precision()
    lit, ref = LoRA(), LoRA()
    _trainer(plugin).fit(lit, torch.utils.data.DataLoader(data, batch_size=8))
    _trainer(precision="32-true").fit(ref, torch.utils.data.DataLoader(data, batch_size=8))
    trainable = {n: p for n, p in lit.named_parameters() if p.requires_grad}
    assert sum(m.numel() for m in plugin.optimizer.master_params()) == sum(p.numel() for p in trainable.values())
    assert all(p.dtype == torch.float16 for n, p in lit.named_parameters()
               if not p.requires_grad and "LayerNorm" not in n)
    fp32 = dict(ref.named_parameters())
    assert all(torch.allclose(p.float(), fp32[n], atol=2e-3) for n, p in trainable.items())
    path = tmp_path / "adapter"
    lit.model.save_pretrained(path, state_dict=plugin.export_state_dict(lit.model))
    back = dict(peft.PeftModel.from_pretrained(base(), path).named_parameters())
    masters = {id(p): m for p, m in zip(plugin.optimizer.model_params(), plugin.optimizer.master_params())}
    for name, p in lit.model.named_parameters():
        if p.requires_grad:
            assert back[name].dtype == torch.float32 and torch.equal(back[name], masters[id(p)])
    assert (path / "adapter_model.safetensors").exists()


# ---------------------------------------------------------------- targets keep their dtype


class Regression(L.LightningModule):
    """A regression head on float targets in [100, 500): MSE in fp32 on the targets the
    step was given, whose dtype each step records."""

    def __init__(self, dict_batch: bool):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.dict_batch, self.target_dtypes, self.losses = dict_batch, [], []

    def training_step(self, batch, i):
        x, y = (batch["x"], batch["labels"]) if self.dict_batch else batch
        self.target_dtypes.append(y.dtype)
        loss = F.mse_loss(self.net(x).float().squeeze(1), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-5)


@pytest.mark.parametrize("batch", ["dict", "tuple"])
def test_a_regression_target_keeps_its_dtype(batch):
    """A dict batch's ``labels`` (by default) and a tuple batch's position 1
    (``keep_inputs=[1]``) reach the step in fp32, where "16-true"'s cast rounded them to
    fp16; the losses are "32-true"'s to 1%."""
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(4, 4, 8, generator=g), torch.rand(4, 4, generator=g) * 400 + 100
    data = [{"x": x, "labels": y} for x, y in zip(xs, ys)] if batch == "dict" else list(zip(xs, ys))
    plugin = MPFP16Precision(loss_scale=2.0 ** 4, **({} if batch == "dict" else {"keep_inputs": [1]}))
    runs = {}
    for name, kwargs in (("mine", {"plugin": plugin}), ("fp32", {"precision": "32-true"})):
        lit = Regression(batch == "dict")
        kwargs = dict(kwargs)
        trainer = _trainer(kwargs.pop("plugin", None), **kwargs)
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=None))
        runs[name] = lit
    assert set(runs["mine"].target_dtypes) == {torch.float32} and len(runs["mine"].losses) == 4
    assert all(abs(a - b) <= 1e-2 * b for a, b in zip(runs["mine"].losses, runs["fp32"].losses))
