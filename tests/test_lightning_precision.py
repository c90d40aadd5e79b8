"""The Lightning plugins measured by Lightning's own precision tests, and by what users
do next, in one process (tests/test_lightning.py has the modes, the resumes and the
refusals): the batch cast as Lightning's "16-true" casts it, so that a step calling a
submodule trains as one calling ``self(x)``; the plugin contexts, conversion and casts of
Lightning's ``test_half.py`` and ``test_all.py``; a ``training_step`` that returns None;
the order of the hooks and the checkpoint's keys; ``trainer.predict``; a write into the
weights by a callback (an EMA swap, Lightning's ``EMAWeightAveraging``, a write kept);
``EarlyStopping``; ``val_check_interval``; an epoch that ``accumulate_grad_batches`` does
not divide; a ``torch.compile``d model. Each run is compared bit for bit with mpfp16's
own loop (tests/lightning_workers.py). docs/CLAIMS.md maps each Lightning test to one
here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning", reason="the lightning extra is not installed (pip install 'mpfp16[lightning]')")

import lightning_workers as W  # noqa: E402

import mpfp16  # noqa: E402

from mpfp16.integrations.lightning import MPFP16FabricPrecision, MPFP16Precision  # noqa: E402

PLUGINS = {"trainer": MPFP16Precision, "fabric": MPFP16FabricPrecision}


def _trainer(plugin=None, **kwargs) -> "L.Trainer":
    kwargs = dict(W.QUIET, **{"max_epochs": 1, "devices": 1, "enable_checkpointing": False, **kwargs})
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    return L.Trainer(**kwargs)


def _submodule_step(lit, seen: list):
    """``training_step`` as most LightningModules write it: the submodule called directly,
    the loss computed in fp32 (docs/LIGHTNING.md); ``seen`` gets the dtypes of the input
    and of the submodule's output."""

    def training_step(batch, batch_idx):
        x, y = batch
        logits = lit.net(x)
        seen.append((x.dtype, logits.dtype))
        return F.cross_entropy(logits.float(), y)

    return training_step


# ---------------------------------------------------------------- issue 40.1: a step that calls a submodule


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", PLUGINS)
def test_a_step_that_calls_a_submodule_trains_as_self_x(kind, dtype):
    """The plugin casts the batch's floating-point tensors to the model's dtype, as
    "16-true" does: ``self.net(x)`` gets a 16-bit input and returns 16-bit logits, and
    with the loss on ``logits.float()`` the run is the own loop's (which calls the model,
    as ``self(x)`` does) bit for bit. Before, the fp32 batch met 16-bit weights: "mat1
    and mat2 must have the same dtype". Fabric casts what goes through the module
    that fabric.setup returned; a training_step called on it directly on one device
    does not go through it (under "16-true" neither), so the loop casts its batch
    with the plugin's convert_input, as docs/LIGHTNING.md says."""
    mode = {"dtype": dtype, "optimizer": "adamw"}
    data = W.make_data(8)
    seen = []
    lit = W.lit_module(W.make_net(0), mode)
    lit.training_step = _submodule_step(lit, seen)
    plugin = PLUGINS[kind](loss_scale=W.new_scaler(mode), dtype=dtype)
    if kind == "trainer":
        _trainer(plugin).fit(lit, W.loader(data))
    else:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model, optimizer = fabric.setup(lit, W.OPTIMIZERS["adamw"](lit.parameters()))
        for i, batch in enumerate(data):
            optimizer.zero_grad()
            loss = model.training_step(fabric.strategy.precision.convert_input(batch), i)
            fabric.backward(loss)
            optimizer.step()
    net, opt, _ = W.own_loop(mode, data)
    assert seen == [(dtype, dtype)] * len(data)
    assert W.same(W.state(lit.net, plugin.optimizer), W.state(net, opt))


def test_predict_and_validate_cast_the_batch():
    """Lightning's loops call convert_input for validation and prediction too: a
    predict_step that calls the submodule returns its 16-bit outputs, bit for bit the
    converted model's on the 16-bit input; ``self(x)`` returns them cast to fp32."""
    data = W.make_data(2)
    lit = W.lit_module(W.make_net(0), {})
    lit.predict_step = lambda batch, batch_idx: (lit.net(batch[0]), lit(batch[0]))
    lit.validation_step = lambda batch, batch_idx: lit.log("val_loss", _submodule_step(lit, [])(batch, batch_idx))
    trainer = _trainer(MPFP16Precision())
    assert "val_loss" in trainer.validate(lit, W.loader(data))[0]
    predictions = trainer.predict(lit, W.loader(data))
    ref = mpfp16.to_half(W.make_net(0))
    with torch.no_grad():
        for (sub, whole), (x, _) in zip(predictions, data):
            assert sub.dtype == torch.float16 and whole.dtype == torch.float32
            assert torch.equal(sub, ref(x.half()).half()) and torch.equal(whole, sub.float())


# ---------------------------------------------------------------- Lightning's test_half.py and test_all.py


@pytest.mark.parametrize("kind", PLUGINS)
def test_the_plugin_contexts_and_conversions_as_lightnings_tests_check_them(kind):
    """Lightning's test_half.py (selected dtype, module init, forward context,
    convert_module, convert_input) and test_all.py (the default dtype restored when a
    context raises). Where mpfp16 differs from "16-true", by design: a module is
    initialised and run with fp32 as the default dtype (its init is then the own loop's,
    rounded once by to_half, and a tensor made in a step is fp32, as the loss is), and
    normalization layers stay fp32."""
    for dtype, name in ((torch.float16, "16-true"), (torch.bfloat16, "bf16-true")):
        plugin = PLUGINS[kind](dtype=dtype)
        assert plugin.precision == name
        for context in (plugin.module_init_context, plugin.tensor_init_context, plugin.forward_context):
            with context():
                assert torch.get_default_dtype() == torch.float32
                made = torch.nn.Linear(2, 2)
            assert made.weight.dtype == torch.float32
            with pytest.raises(RuntimeError, match="inside"):
                with context():
                    raise RuntimeError("inside")
            assert torch.get_default_dtype() == torch.float32
        net = plugin.convert_module(W.make_net(0))
        assert net[0].weight.dtype == net[3].bias.dtype == dtype and net[1].weight.dtype == torch.float32
        batch = {"x": torch.ones(2), "pair": (torch.ones(1, dtype=torch.float64), torch.arange(3)), "tag": "a"}
        out = plugin.convert_input(batch)
        assert out["x"].dtype == out["pair"][0].dtype == dtype
        assert out["pair"][1].dtype == torch.int64 and out["tag"] == "a"
        if kind == "fabric":  # Fabric casts a module's outputs back, as to_half's hook does
            back = plugin.convert_output([torch.ones(1, dtype=dtype), torch.arange(2)])
            assert back[0].dtype == torch.float32 and back[1].dtype == torch.int64


# ---------------------------------------------------------------- test_amp_integration: a step that returns None


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_training_step_that_returns_none_skips_the_step(algorithm):
    """Lightning's test_skip_training_step_with_grad_scaler: a training_step that returns
    None has no backward, no step and no scale update, with gradient clipping on. The run
    is the own loop over the other batches, the scale is untouched, global_step counts as
    "32-true" counts, and ``last_step_skipped`` says the step was not taken. Before, a
    clip by value unscaled gradients that no backward had made, and raised."""
    mode = {"clip": 0.05, "clip_algorithm": algorithm, "init_scale": 2.0 ** 10, "growth_interval": 1}
    data = W.make_data(8)

    def skipping(lit):
        taken = lit.training_step

        def training_step(batch, batch_idx):
            return None if batch_idx % 2 else taken(batch, batch_idx)

        lit.training_step = training_step
        return lit

    lit = skipping(W.lit_module(W.make_net(0), mode))
    plugin = MPFP16Precision(loss_scale=W.new_scaler(mode))
    trainer = _trainer(plugin, gradient_clip_val=mode["clip"], gradient_clip_algorithm=algorithm)
    trainer.fit(lit, W.loader(data))
    fp32 = _trainer(precision="32-true")  # which, clipping by value, raises on a None step (torch's clip_grad_value_)
    fp32.fit(skipping(W.lit_module(W.make_net(0), mode)), W.loader(data))
    net, opt, stepped = W.own_loop(mode, data[::2])
    assert W.same(W.state(lit.net, plugin.optimizer), W.state(net, opt))
    assert plugin.loss_scale == 2.0 ** 14  # grown by the 4 steps taken, not by the 4 skipped
    assert lit.stepped == [True, False] * 4 and stepped == [True] * 4
    assert trainer.global_step == fp32.global_step


# ---------------------------------------------------------------- test_hooks.py: the hooks' order, the checkpoint


def test_hooks_run_in_lightnings_order_and_the_checkpoint_has_its_keys(tmp_path):
    """Lightning's test_hooks.py: the callback hooks of a fit (two optimizer steps of two
    micro-batches, a validation, a checkpoint) in the order "16-true" calls them. The
    checkpoint has the keys of a "16-true" checkpoint: the plugin keeps no state of its
    own (no precision-plugin key), the scaler is in the optimizer's state."""
    hooks = [name for name in dir(L.Callback) if name.startswith("on_")]

    def recorder(calls):
        def record(name):
            return lambda self, *args, **kwargs: calls.append(name)

        return type("Record", (L.Callback,), {name: record(name) for name in hooks})()

    runs = {}
    for name, kwargs in (("mpfp16", {"plugins": [MPFP16Precision()]}), ("16-true", {"precision": "16-true"})):
        calls = []
        lit = W.lit_module(W.make_net(0), {})
        lit.validation_step = lambda batch, batch_idx, lit=lit: lit.log("val_loss", lit.training_step(batch, batch_idx))
        trainer = L.Trainer(**dict(W.QUIET, max_epochs=1, devices=1, enable_checkpointing=False, limit_val_batches=1,
                                   accumulate_grad_batches=2, callbacks=[recorder(calls)]), **kwargs)
        trainer.fit(lit, W.loader(W.make_data(4)), W.loader(W.make_data(1)))
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
        saved = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
        runs[name] = (calls, set(saved), saved["optimizer_states"][0])
    (mine, keys, opt_state), (theirs, their_keys, _) = runs["mpfp16"], runs["16-true"]
    assert mine == theirs and mine.count("on_before_optimizer_step") == 2
    assert keys == their_keys and not {"MPFP16Precision", "native_amp_scaling_state"} & keys
    assert {"scaler", "master_weights"} <= set(opt_state)


# ---------------------------------------------------------------- a write into the weights by a callback


class EMASwap(L.Callback):
    """A user's EMA as the guides write it: an fp32 average updated after every step,
    copied into the weights (``param.data.copy_``) for validation, the trained weights
    copied back after."""

    def __init__(self, decay: float = 0.5):
        self.decay, self.ema, self.saved, self.swaps = decay, None, None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = [p.detach().float() for p in pl_module.parameters()]
        if self.ema is None:
            self.ema = [p.clone() for p in params]
        for e, p in zip(self.ema, params):
            e.mul_(self.decay).add_(p, alpha=1 - self.decay)

    def on_validation_start(self, trainer, pl_module):
        if self.ema is None or trainer.sanity_checking:
            return
        self.saved = [p.detach().clone() for p in pl_module.parameters()]
        for p, e in zip(pl_module.parameters(), self.ema):
            p.data.copy_(e)
        self.swaps += 1

    def on_validation_end(self, trainer, pl_module):
        if self.saved is not None:
            for p, s in zip(pl_module.parameters(), self.saved):
                p.data.copy_(s)
            self.saved = None


def _validating(lit):
    lit.validation_step = lambda batch, batch_idx: lit.log("val_loss", lit.training_step(batch, batch_idx))
    return lit


@pytest.mark.parametrize("ema", ["own-callback", "lightning-EMAWeightAveraging"])
def test_an_ema_swapped_in_for_validation_changes_no_step(ema):
    """An EMA copied into the 16-bit weights for each validation (val_check_interval=3:
    five validations in 16 batches) and swapped back: training is the own loop's bit for
    bit. Lightning's EMAWeightAveraging keeps its average in fp32 (it copies the module
    before the plugin converts it) and, at the end of fit, writes the average into the
    weights: the masters are then the own loop's, the weights the average's rounding,
    and the model's export (a checkpoint after fit) that average, as a write since the
    last step counts."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    mode = {"optimizer": "adamw"}
    data = W.make_data(16)
    callback = EMASwap() if ema == "own-callback" else EMAWeightAveraging(decay=0.5)
    lit = _validating(W.lit_module(W.make_net(0), mode))
    plugin = MPFP16Precision()
    trainer = _trainer(plugin, val_check_interval=3, limit_val_batches=1, callbacks=[callback])
    trainer.fit(lit, W.loader(data), W.loader(W.make_data(1)))
    net, opt, _ = W.own_loop(mode, data)
    assert all(torch.equal(a, b) for p, a, b in zip(opt.model_params(), plugin.optimizer.master_params(),
                                                    opt.master_params()) if p.dtype != torch.float32)
    if ema == "own-callback":
        assert callback.swaps == 5
        assert W.same(W.state(lit.net, plugin.optimizer), W.state(net, opt))
    else:
        average = list(callback._average_model.module.parameters())
        assert average[0].dtype == torch.float32
        assert all(torch.equal(p, a.to(p.dtype)) for p, a in zip(lit.parameters(), average))
        # the export (a checkpoint's state_dict) is then the average the weights hold, not the trained masters
        exported = plugin.export_state_dict()
        assert all(exported[n].dtype == torch.float32 and torch.equal(exported[n].to(p.dtype), p)
                   for n, p in lit.named_parameters())


def _halve_first_layer(net, epoch):
    """A write into the 16-bit weights between steps, that nothing swaps back."""
    if epoch == 1:
        for p in net[0].parameters():
            p.data.mul_(0.5)


@pytest.mark.parametrize("kind", PLUGINS)
def test_a_write_into_the_weights_between_steps_is_kept(kind):
    """A callback (Trainer) or the loop (Fabric) halves the first layer's 16-bit weights
    before the second epoch. The Trainer's plugin makes the written weights the masters'
    values before the next step, as fp32 training keeps a write; under Fabric the loop
    calls the plugin's adopt_written_weights() after its write. The run is the own loop
    that writes the same and sets those masters from it. Before, the next step
    overwrote the write from the masters, in silence."""
    mode = {"optimizer": "adamw"}
    data = W.make_data(4)

    class Halve(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            _halve_first_layer(pl_module.net, trainer.current_epoch)

    if kind == "trainer":
        lit, plugin, _ = W.fit_trainer(mode, data, epochs=2, callbacks=[Halve()])
        weights = lit.net
    else:
        def halve_and_adopt(net, epoch, plugin):
            _halve_first_layer(net, epoch)
            plugin.adopt_written_weights()

        weights, plugin, _, _ = W.fit_fabric(mode, data, epochs=2, before_epoch=halve_and_adopt)

    def write_and_adopt(net, opt, epoch):
        _halve_first_layer(net, epoch)
        written = {id(p) for p in net[0].parameters()} if epoch == 1 else set()
        with torch.no_grad():
            for p, m in zip(opt.model_params(), opt.master_params()):
                if id(p) in written:
                    m.copy_(p)

    net, opt, _ = W.own_loop(mode, data, epochs=2, before_epoch=write_and_adopt)
    assert W.same(W.state(weights, plugin.optimizer), W.state(net, opt))


def test_written_weights_are_looked_for_after_the_hooks_that_write_them_not_at_every_step(monkeypatch):
    """The pass that adopts written weights reads every weight and master (longer than
    the step on a CPU): the Trainer's plugin makes it at the first step and after an
    epoch's start or a validation run, not at each of the 4 steps of an epoch."""
    import mpfp16.integrations.lightning as integration

    passes = []
    adopt = integration._adopt_written_weights
    monkeypatch.setattr(integration, "_adopt_written_weights", lambda opt: (passes.append(1), adopt(opt)))
    W.fit_trainer({}, W.make_data(4), epochs=2)
    assert len(passes) == 2  # 8 steps, 2 epochs, no validation


# ---------------------------------------------------------------- EarlyStopping; an epoch accumulation does not divide


def test_early_stopping_stops_where_the_own_loop_is_compared():
    """EarlyStopping (no improvement of at least 1e3 stops it) ends fit after two of
    four epochs; the weights are the own loop's after two epochs."""
    from lightning.pytorch.callbacks import EarlyStopping

    mode = {}
    data = W.make_data(4)
    lit = _validating(W.lit_module(W.make_net(0), mode))
    plugin = MPFP16Precision()
    trainer = _trainer(plugin, max_epochs=4, limit_val_batches=1,
                       callbacks=[EarlyStopping(monitor="val_loss", patience=0, min_delta=1e3)])
    trainer.fit(lit, W.loader(data), W.loader(W.make_data(1)))
    assert trainer.current_epoch == 2 and trainer.should_stop
    net, opt, _ = W.own_loop(mode, data, epochs=2)
    assert W.same(W.state(lit.net, plugin.optimizer), W.state(net, opt))


@pytest.mark.parametrize("kind", PLUGINS)
def test_an_epoch_that_accumulation_does_not_divide(kind):
    """Ten batches with accumulate_grad_batches=4 and fp32 sums: Lightning steps after
    batches 4, 8 and 10 (the epoch's last two micro-batches make a step of their own,
    each loss still divided by 4), and no sum is carried into the next epoch. Fabric's
    loop ends its steps the same way. Both are the own loop's, bit for bit."""
    mode = {"accum": 4, "accumulate_dtype": torch.float32}
    data = W.make_data(10)
    if kind == "trainer":
        lit, plugin, trainer = W.fit_trainer(mode, data, epochs=2)
        weights, stepped = lit.net, None
        assert trainer.global_step == 6
    else:
        weights, plugin, _, stepped = W.fit_fabric(mode, data, epochs=2)
    net, opt, own = W.own_loop(mode, data, epochs=2)
    assert len(own) == 6 and stepped in (None, own)
    assert W.same(W.state(weights, plugin.optimizer), W.state(net, opt))


# ---------------------------------------------------------------- torch.compile


@pytest.mark.slow
@pytest.mark.parametrize("kind", PLUGINS)
def test_a_compiled_model_is_the_compiled_own_loop(kind):
    """The model compiled before fit (``torch.compile`` of the submodule, or of the
    module given to fabric.setup, which Fabric compiles again after converting it):
    the run is the own loop's over the same converted model compiled, bit for bit."""
    mode = {}
    data = W.make_data(4)
    if kind == "trainer":
        lit = W.lit_module(torch.compile(W.make_net(0)), mode)
        plugin = MPFP16Precision()
        _trainer(plugin).fit(lit, W.loader(data))
        weights = lit.net
    else:
        plugin = MPFP16FabricPrecision()
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        weights = W.make_net(0)
        model, optimizer = fabric.setup(torch.compile(weights), W.OPTIMIZERS["sgd"](weights.parameters()))
        W.fabric_epoch(fabric, model, optimizer, data)
    net, opt, _ = W.own_loop(mode, data, compile=True)
    assert W.same(W.state(weights, plugin.optimizer), W.state(net, opt))
