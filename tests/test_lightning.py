"""The Lightning plugins (mpfp16.integrations.lightning), in one process: the Trainer's
and Fabric's runs bit for bit mpfp16's own loop, skips at the same steps, skipped steps
counted as torch.amp's plugin counts them, clipping, logging, checkpoints and resume,
and each refusal in one line. Two processes: tests/test_lightning_ddp.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

L = pytest.importorskip("lightning", reason="the lightning extra is not installed (pip install 'mpfp16[lightning]')")

import lightning_workers as W  # noqa: E402

from mpfp16.integrations.lightning import (LossScaleMonitor, MPFP16FabricPrecision, MPFP16Precision,  # noqa: E402
                                           _refuse_trainer)

MODES = {
    "fp16-masters-sgd": {},
    "bf16-masters-adamw": {"dtype": torch.bfloat16, "optimizer": "adamw"},
    "fp16-no-masters-stochastic": {"master_weights": False, "rounding": "stochastic"},
    "fp16-no-masters-kahan-adamw": {"master_weights": False, "rounding": "kahan", "optimizer": "adamw"},
    "bf16-remainder": {"dtype": torch.bfloat16, "master_weights": "remainder"},
    "fp16-accumulate-4": {"accum": 4},
    "fp16-accumulate-4-fp32-sums": {"accum": 4, "accumulate_dtype": torch.float32},
    "fp16-clip-norm-adamw-scheduler": {"optimizer": "adamw", "clip": 0.5, "scheduler": True},
    "fp16-clip-value": {"clip": 0.05, "clip_algorithm": "value"},
    "fp16-clip-norm-adamw-skips": {"optimizer": "adamw", "clip": 0.5, "inf_batches": (4,)},
    "fp16-skips": {"init_scale": 2.0 ** 24, "inf_batches": (9,), "optimizer": "adamw"},
    "fp16-adamw-bf16-states-stochastic": {"optimizer": "adamw", "state_dtype": torch.bfloat16,
                                          "state_rounding": "stochastic"},
    # Adagrad fills its state when it is built, over the 16-bit parameters
    "fp16-adagrad": {"optimizer": "adagrad"},
    # the last Linear kept fp32 by name ("3": a whole component of the LightningModule's "net.3" and of the net's "3")
    "fp16-keep-fp32-last-layer": {"keep_fp32": ["3"], "optimizer": "adamw"},
}


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("name", MODES)
def test_trainer_is_the_own_loop_bit_for_bit(name):
    mode = MODES[name]
    data = W.make_data(16, inf_batches=mode.get("inf_batches", ()))
    lit, plugin, trainer = W.fit_trainer(mode, data, epochs=2)
    net, opt, stepped = W.own_loop(mode, data, epochs=2)
    assert W.same(W.state(lit.net, plugin.optimizer), W.state(net, opt))
    assert lit.stepped == stepped  # the same steps skipped
    assert trainer.global_step == len(stepped)
    assert next(lit.net.parameters()).dtype == mode.get("dtype", torch.float16)
    assert lit.net[1].weight.dtype == torch.float32  # LayerNorm stays fp32, as to_half keeps it
    if "keep_fp32" in mode:  # the plugin's keep_fp32 reaches to_half
        assert lit.net[3].weight.dtype == torch.float32 and lit.net[0].weight.dtype == torch.float16
    if "init_scale" in mode:
        assert stepped.count(False) == plugin.skipped_steps > 1
    if "state_dtype" in mode:  # the plugin's option reaches the FP16Optimizer it builds
        states = plugin.optimizer.optimizer.state.values()
        assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in states)


@pytest.mark.parametrize("name", ["fp16-masters-sgd", "bf16-masters-adamw", "fp16-no-masters-kahan-adamw",
                                  "fp16-accumulate-4", "fp16-accumulate-4-fp32-sums", "fp16-skips",
                                  "fp16-clip-norm-adamw-skips", "fp16-clip-value", "fp16-adamw-bf16-states-stochastic",
                                  "fp16-adagrad", "fp16-keep-fp32-last-layer"])
def test_fabric_is_the_own_loop_bit_for_bit(name):
    """Accumulation runs under fabric.no_backward_sync, as Fabric's docs write it (on one
    device it is a no-op); clipping is fabric.clip_gradients, by norm (max_norm=) or by
    value (clip_val=), on the unscaled fp32 gradients."""
    mode = MODES[name]
    data = W.make_data(16, inf_batches=mode.get("inf_batches", ()))
    net, plugin, optimizer, stepped = W.fit_fabric(mode, data, epochs=2)
    ref, opt, own = W.own_loop(mode, data, epochs=2)
    assert W.same(W.state(net, plugin.optimizer), W.state(ref, opt))
    assert stepped == own
    assert optimizer.optimizer is plugin.optimizer  # the Fabric optimizer now steps the FP16Optimizer
    if "keep_fp32" in mode:
        assert net[3].weight.dtype == torch.float32 and net[0].weight.dtype == torch.float16


def test_skipped_steps_count_as_with_torch_amp():
    """A skipped step is an optimizer step to Lightning, with torch.amp's GradScaler
    ("16-mixed") as with the plugin: global_step and a per-step scheduler count it."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    mode = {"scheduler": True}
    data = W.make_data(16, inf_batches=(5,))
    amp = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    lit = W.lit_module(W.make_net(0), mode)
    ref = L.Trainer(**dict(W.QUIET, max_epochs=1, devices=1, enable_checkpointing=False), plugins=[amp])
    ref.fit(lit, W.loader(data))
    mine, plugin, trainer = W.fit_trainer(mode, data)
    assert amp.scaler.get_scale() == 2.0 ** 15 and plugin.loss_scale == 2.0 ** 15  # one skip each, halved once
    assert mine.stepped.count(False) == plugin.skipped_steps == 1
    assert trainer.global_step == ref.global_step == 16
    assert (trainer.lr_scheduler_configs[0].scheduler.last_epoch
            == ref.lr_scheduler_configs[0].scheduler.last_epoch == 16)


def test_loss_scale_monitor_logs_the_scale_and_the_skips():
    mode = {"init_scale": 2.0 ** 24}
    _, plugin, trainer = W.fit_trainer(mode, W.make_data(8), callbacks=[LossScaleMonitor()])
    metrics = trainer.callback_metrics
    assert float(metrics["loss_scale"]) == plugin.loss_scale
    assert float(metrics["skipped_steps"]) == plugin.skipped_steps > 0


@pytest.mark.parametrize("export", ["masters", "weights"])
def test_resume_from_a_lightning_checkpoint_is_bit_identical(tmp_path, export):
    """ModelCheckpoint's last.ckpt after 2 epochs, resumed by fit(ckpt_path=...) into a
    model built from other weights, ends where 4 uninterrupted epochs end; the
    checkpoint holds FP16Optimizer's state (masters, inner state, scaler) and loads
    with weights_only=True. Its state_dict is the fp32 masters (export="masters",
    which the fp32 model, converted, rounds to the weights) or the 16-bit weights
    (export="weights"): either resumes bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    mode = {"optimizer": "adamw", "init_scale": 2.0 ** 20, "scheduler": True, "export": export}
    data = W.make_data(8, inf_batches=(3,))
    whole, plugin, _ = W.fit_trainer(mode, data, epochs=4)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
    W.fit_trainer(mode, data, epochs=2, callbacks=[ckpt], checkpointing=True, default_root_dir=tmp_path)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    opt_state = saved["optimizer_states"][0]
    assert {"format", "optimizer", "scaler", "master_weights"} <= set(opt_state)
    assert saved["state_dict"]["net.0.weight"].dtype == (torch.float32 if export == "masters" else torch.float16)
    resumed, plugin2, trainer = W.fit_trainer(mode, data, epochs=4, net=W.make_net(5), checkpointing=True,
                                              callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                                              ckpt_path=str(tmp_path / "last.ckpt"), default_root_dir=tmp_path)
    assert trainer.global_step == 32 and plugin2.skipped_steps == plugin.skipped_steps > 4
    assert W.same(W.state(resumed.net, plugin2.optimizer), W.state(whole.net, plugin.optimizer))


def _everything(lit, trainer) -> dict:
    """What a resumed run must end with: the weights, FP16Optimizer's whole state_dict
    (masters, the inner state, the scale and its trackers, the skipped steps, the
    rounding generator), the lr schedulers' state and the step count."""
    return {"weights": [p.detach().clone() for p in lit.parameters()], "optimizer": trainer.optimizers[0].state_dict(),
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "global_step": trainer.global_step}


def _equal(a, b, where="") -> str | None:
    """Where ``a`` and ``b`` (nested containers of tensors and values) first differ;
    None when they are bit-identical."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if same else where
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return where
        return next((w for k in a if (w := _equal(a[k], b[k], f"{where}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return where
        return next((w for i, (x, y) in enumerate(zip(a, b)) if (w := _equal(x, y, f"{where}[{i}]")) is not None), None)
    return None if a == b else where


# An inf batch (index 2) skips the third step, before the checkpoint; a growth interval of 3
# grows the scale between skips, so that the checkpoint falls with the growth tracker mid-way.
MID_EPOCH = {"optimizer": "adamw", "init_scale": 2.0 ** 16, "growth_interval": 3, "scheduler": True,
             "inf_batches": (2,)}


def test_resume_mid_epoch_from_last_checkpoint_after_a_crash(tmp_path):
    """ModelCheckpoint(every_n_train_steps=5, save_last=True) saves last.ckpt in the
    middle of the first of two 8-batch epochs; the run then dies. A new Trainer's
    fit(ckpt_path="last"), into a model built from other weights, ends bit for bit where
    the uninterrupted run ends (_everything). The data comes through a loader Lightning
    can resume mid-epoch (W.ResumableLoader)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Crash(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 6:
                raise RuntimeError("the machine went away")

    data = W.make_data(8, inf_batches=MID_EPOCH["inf_batches"])
    whole, _, trainer = W.fit_trainer(MID_EPOCH, data, epochs=2, resumable=True)
    expected = _everything(whole, trainer)

    def checkpoints():
        return ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_last=True)

    with pytest.raises(RuntimeError, match="went away"):
        W.fit_trainer(MID_EPOCH, data, epochs=2, callbacks=[checkpoints(), Crash()], checkpointing=True,
                      default_root_dir=tmp_path, resumable=True)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (0, 5)
    opt_state = saved["optimizer_states"][0]
    assert opt_state["skipped_steps"] >= 1 and opt_state["scaler"]["growth_tracker"] > 0  # MID_EPOCH's comment
    resumed, plugin, trainer = W.fit_trainer(MID_EPOCH, data, epochs=2, net=W.make_net(5), callbacks=[checkpoints()],
                                             checkpointing=True, default_root_dir=tmp_path, ckpt_path="last",
                                             resumable=True)
    assert _equal(_everything(resumed, trainer), expected) is None, _equal(_everything(resumed, trainer), expected)
    assert trainer.global_step == 16 and plugin.skipped_steps == expected["optimizer"]["skipped_steps"]


def test_resume_mid_epoch_with_accumulation_and_fp32_sums(tmp_path):
    """ModelCheckpoint(every_n_train_steps=3) with accumulate_grad_batches=2 and fp32
    sums saves after the third optimizer step, mid-epoch (after batch 6 of 8);
    fit(ckpt_path=that file) ends where the run that saved it ended (checkpoints do not
    change a run: that run is the uninterrupted one)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    mode = dict(MID_EPOCH, accum=2, accumulate_dtype=torch.float32)
    data = W.make_data(8, inf_batches=mode["inf_batches"])
    whole, _, trainer = W.fit_trainer(mode, data, epochs=2, checkpointing=True, default_root_dir=tmp_path,
                                      callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3,
                                                                 save_top_k=-1)], resumable=True)
    expected = _everything(whole, trainer)
    path = str(tmp_path / "epoch=0-step=3.ckpt")
    opt_state = torch.load(path, weights_only=True)["optimizer_states"][0]
    assert opt_state["skipped_steps"] >= 1 and opt_state["scaler"]["growth_tracker"] > 0
    resumed, _, trainer = W.fit_trainer(mode, data, epochs=2, net=W.make_net(5), ckpt_path=path, resumable=True)
    assert _equal(_everything(resumed, trainer), expected) is None, _equal(_everything(resumed, trainer), expected)
    assert trainer.global_step == 8


def test_fabric_save_and_load_carry_the_masters(tmp_path):
    """fabric.save after a step holds FP16Optimizer's state; fabric.load into a freshly
    set-up model and optimizer (before any backward) restores it, and training goes on
    bit for bit as without the interruption."""
    mode = {"optimizer": "adamw", "init_scale": 2.0 ** 20}
    data = W.make_data(8, inf_batches=(2,))
    net, plugin, _, _ = W.fit_fabric(mode, data, epochs=2)
    # the same, stopped after one epoch, saved, loaded into a new set-up, and one more epoch
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MPFP16FabricPrecision(loss_scale=W.new_scaler(mode))])
    first = W.make_net(0)
    model, optimizer = fabric.setup(first, W.OPTIMIZERS["adamw"](first.parameters()))
    W.fabric_epoch(fabric, model, optimizer, data)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    assert {"format", "scaler"} <= set(torch.load(tmp_path / "ckpt.pt", weights_only=True)["optimizer"])
    plugin2 = MPFP16FabricPrecision(loss_scale=W.new_scaler(mode))
    fabric2 = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin2])
    second = W.make_net(3)
    model2, optimizer2 = fabric2.setup(second, W.OPTIMIZERS["adamw"](second.parameters()))
    fabric2.load(tmp_path / "ckpt.pt", {"model": model2, "optimizer": optimizer2})
    assert optimizer2.optimizer is plugin2.optimizer
    # the wrapper is on the groups its inner optimizer (and any lr scheduler) now holds
    assert plugin2.optimizer.param_groups is plugin2.optimizer.optimizer.param_groups
    W.fabric_epoch(fabric2, model2, optimizer2, data)
    assert W.same(W.state(second, plugin2.optimizer), W.state(net, plugin.optimizer))


# ---------------------------------------------------------------- refusals, in one line


def test_options_are_refused_when_the_plugin_is_built():
    for plugin in (MPFP16Precision, MPFP16FabricPrecision):
        for kwargs, words in (({"dtype": torch.float32}, "dtype must be"),
                              ({"rounding": "kahan"}, "needs master_weights=False"),
                              ({"loss_scale": "auto"}, "loss_scale must be"),
                              ({"dtype": torch.bfloat16, "loss_scale": 128.0}, "over a model that computes in bfloat16"),
                              ({"accumulate_dtype": torch.float16}, "accumulate_dtype"),
                              ({"dtype": torch.float16, "master_weights": "remainder"}, "bf16"),
                              ({"state_dtype": torch.float16}, "fp16 cannot hold optimizer states"),
                              ({"state_rounding": "stochastic"}, "every state is fp32")):
            with pytest.raises(ValueError) as exc:
                plugin(**kwargs)
            assert words in _one_line(exc)
    with pytest.raises(ValueError) as exc:
        MPFP16Precision(allreduce_dtype=torch.int8)
    assert "allreduce_dtype" in _one_line(exc)


def _fit(lit, **kwargs):
    trainer = L.Trainer(**dict(W.QUIET, max_epochs=1, devices=1, enable_checkpointing=False),
                        plugins=[MPFP16Precision()], **kwargs)
    trainer.fit(lit, W.loader(W.make_data(2)))


def test_trainer_refusals():
    cases = []
    two = W.lit_module(W.make_net(0), {})
    two.configure_optimizers = lambda: [torch.optim.SGD(two.net[0].parameters(), lr=0.1),
                                        torch.optim.SGD(two.net[3].parameters(), lr=0.1)]
    # Lightning refuses this itself: several optimizers need manual optimization (tests/test_lightning_callbacks.py)
    cases.append((two, "multiple optimizers is only supported with manual optimization"))
    lbfgs = W.lit_module(W.make_net(0), {})
    lbfgs.configure_optimizers = lambda: torch.optim.LBFGS(lbfgs.parameters())
    cases.append((lbfgs, "LBFGS"))
    wrapped = W.lit_module(W.make_net(0), {})
    wrapped.configure_optimizers = lambda: __import__("mpfp16").FP16Optimizer(
        torch.optim.SGD(wrapped.parameters(), lr=0.1))
    cases.append((wrapped, "already an FP16Optimizer"))
    for lit, words in cases:
        with pytest.raises((ValueError, RuntimeError)) as exc:
            _fit(lit)
        assert words in _one_line(exc)


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy"])
def test_sharding_strategies_are_refused(strategy):
    """Lightning refuses FSDP and model parallelism on a CPU itself; what the plugin
    says under them, where a GPU would let them through."""
    import lightning.pytorch.strategies as S

    cls = getattr(S, strategy)
    fake = SimpleNamespace(strategy=cls.__new__(cls))
    with pytest.raises(ValueError) as exc:
        _refuse_trainer(fake, W.lit_module(W.make_net(0), {}))
    assert f"not {strategy}" in _one_line(exc)


def test_fabric_refusals():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MPFP16FabricPrecision()])
    net = W.make_net(0)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError) as exc:
        optimizer.step()  # no backward yet: nothing was wrapped
    assert "run fabric.backward(loss) before" in _one_line(exc)
    with pytest.raises(TypeError) as exc:
        MPFP16FabricPrecision(keep_fp32=[3])
    assert "keep_fp32 takes module classes and module names" in _one_line(exc)
    with pytest.raises(ValueError) as exc:
        MPFP16Precision(export="fp32")
    assert "export='fp32'" in _one_line(exc)


def test_the_guides_fabric_example_runs(tmp_path, monkeypatch):
    """docs/LIGHTNING.md's Fabric example, as written: it trains and saves."""
    import re

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "LIGHTNING.md"), encoding="utf-8").read()
    block = re.search(r"## Fabric\n\n```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(block, "docs/LIGHTNING.md", "exec"), scope)
    assert scope["optimizer"].optimizer is scope["fabric"]._precision.optimizer
    assert {"format", "scaler"} <= set(torch.load(tmp_path / "ckpt.pt", weights_only=True)["optimizer"])


def test_16_true_adamw_goes_non_finite_in_silence_where_the_plugin_does_not():
    """docs/LIGHTNING.md's claim: under Lightning's "16-true", AdamW's eps (1e-8) is 0 in
    fp16, so a weight whose gradient and second moment are 0 is updated by 0/0; the
    run ends with non-finite weights and no error. The plugin's run of the same model,
    data and optimizer stays finite."""
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    data = W.make_data(16)
    true16, _, trainer = W.fit_trainer({"optimizer": "adamw"}, data, precision="16-true")
    assert trainer.global_step == 16
    assert not all(torch.isfinite(p).all() for p in true16.parameters())
    mine, plugin, _ = W.fit_trainer({"optimizer": "adamw"}, data)
    assert all(torch.isfinite(p).all() for p in mine.parameters()) and plugin.skipped_steps == 0


def test_validate_and_test_run_with_the_plugin():
    """Evaluation needs no optimizer: trainer.validate and trainer.test convert the model
    and run, before any fit and after one."""

    def val_and_test(lit):
        lit.validation_step = lambda batch, batch_idx: lit.log("val_loss", lit.training_step(batch, batch_idx))
        lit.test_step = lambda batch, batch_idx: lit.log("test_loss", lit.training_step(batch, batch_idx))
        return lit

    data = W.loader(W.make_data(4))
    fresh = val_and_test(W.lit_module(W.make_net(0), {}))
    trainer = L.Trainer(**dict(W.QUIET, devices=1, enable_checkpointing=False), plugins=[MPFP16Precision()])
    assert "val_loss" in trainer.validate(fresh, data)[0] and "test_loss" in trainer.test(fresh, data)[0]
    assert next(fresh.net.parameters()).dtype == torch.float16
    fitted, plugin, trainer = W.fit_trainer({}, W.make_data(4))
    val_and_test(fitted)
    assert "val_loss" in trainer.validate(fitted, data)[0]
    assert plugin.optimizer is not None
