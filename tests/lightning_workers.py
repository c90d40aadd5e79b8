"""The Lightning plugins' runs and their references, shared by tests/test_lightning.py
(one process) and tests/test_lightning_ddp.py (worker groups, and a run killed with
SIGKILL: :func:`main`).

One tiny model and its data, trained three ways from the same initial weights:
through ``lightning.Trainer`` with :class:`MPFP16Precision`, through ``Fabric`` with
:class:`MPFP16FabricPrecision`, and by mpfp16's own loop (``to_half``,
``FP16Optimizer``, ``opt.backward``, ``opt.step``) as the README writes it.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

import torch
import torch.nn.functional as F

import mpfp16
import mpfp16.distributed as mdist

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

BATCH = 8
QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
             num_sanity_val_steps=0)


def make_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def make_data(batches: int, rank: int = 0, inf_batches: tuple = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` batches of this rank's data (rank-seeded); in each of ``inf_batches``
    one input is inf, so that the loss and the gradients are not finite there."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for i in range(batches):
        x = torch.randn(BATCH, 8, generator=g) * 3
        y = torch.randint(0, 4, (BATCH,), generator=g)
        if i in inf_batches:
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader that Lightning can resume mid-epoch: its ``state_dict`` is the
    number of batches of this epoch it has handed out (Lightning saves it in the
    checkpoint and does not prefetch from a loader with a length), and after
    ``load_state_dict`` the next epoch's iteration starts past them. With a plain
    DataLoader a resumed epoch starts again from its first batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._given = self._skip = 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self._given = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._given = i + 1
                yield batch
        self._given = 0

    def state_dict(self) -> dict:
        return {"given": self._given}

    def load_state_dict(self, state: dict) -> None:
        self._skip = state["given"]


def loader(data, resumable: bool = False):
    xs = torch.cat([x for x, _ in data])
    ys = torch.cat([y for _, y in data])
    cls = ResumableLoader if resumable else torch.utils.data.DataLoader
    return cls(torch.utils.data.TensorDataset(xs, ys), batch_size=BATCH, shuffle=False)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1),
}


def plugin_kwargs(mode: dict) -> dict:
    """The plugin's options for a test mode, less the scaler."""
    return {k: mode[k] for k in ("dtype", "master_weights", "rounding", "accumulate_dtype", "state_dtype",
                                 "state_rounding", "keep_fp32", "export") if k in mode}


def optimizer_kwargs(mode: dict) -> dict:
    """FP16Optimizer's options for a test mode, less the scaler: the plugin's, less
    to_half's (the dtype, the modules kept fp32) and what the model exports."""
    return {k: v for k, v in plugin_kwargs(mode).items() if k not in ("dtype", "keep_fp32", "export")}


def new_scaler(mode: dict):
    if "init_scale" not in mode:
        return "dynamic"
    return mpfp16.DynamicLossScaler(init_scale=mode["init_scale"], growth_interval=mode.get("growth_interval", 2000))


def _lightning():
    import lightning as L

    return L


def lit_module(net, mode):
    L = _lightning()

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net
            self.stepped = []  # after each optimizer step: was it taken

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            opt = OPTIMIZERS[mode.get("optimizer", "sgd")](self.parameters())
            if not mode.get("scheduler"):
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            plugin = self.trainer.precision_plugin
            if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0 and hasattr(plugin, "last_step_skipped"):
                self.stepped.append(not plugin.last_step_skipped)

    return Lit()


def fit_trainer(mode: dict, data, *, seed: int = 0, epochs: int = 1, ddp: bool = False, callbacks=(),
                default_root_dir=None, ckpt_path=None, checkpointing: bool = False, net=None, precision=None,
                resumable: bool = False):
    """The Lightning Trainer run: (the LightningModule, the plugin, the trainer);
    ``resumable``: the data through :class:`ResumableLoader`."""
    L = _lightning()
    from mpfp16.integrations.lightning import MPFP16Precision

    lit = lit_module(net if net is not None else make_net(seed), mode)
    kwargs = dict(QUIET, max_epochs=epochs, devices=mdist.get_world_size() if ddp else 1,
                  accumulate_grad_batches=mode.get("accum", 1), enable_checkpointing=checkpointing,
                  callbacks=list(callbacks), default_root_dir=default_root_dir)
    if mode.get("clip"):
        kwargs.update(gradient_clip_val=mode["clip"], gradient_clip_algorithm=mode.get("clip_algorithm", "norm"))
    if ddp:
        kwargs.update(strategy="ddp", use_distributed_sampler=False)
    if precision is None:
        plugin = MPFP16Precision(loss_scale=new_scaler(mode), **plugin_kwargs(mode))
        kwargs["plugins"] = [plugin]
    else:
        plugin = None
        kwargs["precision"] = precision
    trainer = L.Trainer(**kwargs)
    environ = dict(os.environ)
    try:
        trainer.fit(lit, loader(data, resumable), ckpt_path=ckpt_path)
    finally:  # Lightning's environment removes WORLD_SIZE at teardown; the worker's next case needs it
        os.environ.update(environ)
    return lit, plugin if plugin is not None else trainer.precision_plugin, trainer


def own_loop(mode: dict, data, *, seed: int = 0, epochs: int = 1, ddp: str | None = None,
             calls: list | None = None, before_epoch=None, compile: bool = False):
    """mpfp16's own loop over the same batches, as the README writes it:
    (the 16-bit model, its FP16Optimizer, what each step returned). ``ddp``:
    ``"mpfp16"`` wraps the model with mpfp16.distributed.wrap, ``"torch"`` in torch's
    own DistributedDataParallel; the allreduce calls of each optimizer step are
    appended to ``calls`` (mpfp16's wrap counts them). As Lightning does, an epoch's
    last batch ends an optimizer step whether or not ``accum`` divides the epoch.
    ``before_epoch(net, opt, epoch)`` runs before each epoch; ``compile``: the forward
    runs through ``torch.compile`` of the converted model."""
    net = mpfp16.to_half(make_net(seed), mode.get("dtype", torch.float16), keep_fp32=mode.get("keep_fp32", ()))
    forward = torch.compile(net) if compile else net
    model = {None: lambda m: m, "mpfp16": mdist.wrap,
             "torch": torch.nn.parallel.DistributedDataParallel}[ddp](net)
    opt = mpfp16.FP16Optimizer(OPTIMIZERS[mode.get("optimizer", "sgd")](net.parameters()),
                               loss_scale=new_scaler(mode), model=net,
                               max_grad_norm=mode.get("clip") if mode.get("clip_algorithm", "norm") == "norm" else None,
                               **optimizer_kwargs(mode))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9) if mode.get("scheduler") else None
    accum = mode.get("accum", 1)
    if compile and ddp is None:
        model = forward
    stepped = []
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(net, opt, epoch)
        for i, (x, y) in enumerate(data):
            if i % accum == 0:
                opt.zero_grad()
            last = (i + 1) % accum == 0 or i == len(data) - 1
            with mdist.sync_gradients(model, last):
                opt.backward(F.cross_entropy(model(x), y) / accum)
            if last:
                if calls is not None:
                    calls.append(mdist.comm_stats(model).pop_step()["allreduce_calls"])
                if mode.get("clip") and mode.get("clip_algorithm") == "value":
                    opt.unscale_()
                    torch.nn.utils.clip_grad_value_(opt.master_params(), mode["clip"])
                stepped.append(opt.step())
                if sched is not None:
                    sched.step()
    return net, opt, stepped


def allreduces(fn) -> int:
    """``fn()``, and the allreduce calls it made (torch's profiler sees each DDP bucket
    that a stock DistributedDataParallel sends, which no hook of mpfp16 counts)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.name == "c10d::allreduce_" for event in prof.events())


def fit_fabric(mode: dict, data, *, seed: int = 0, epochs: int = 1, ddp: bool = False, calls: list | None = None,
               before_epoch=None):
    """The Fabric loop, as Fabric's docs write it: (the model, the plugin, the Fabric
    optimizer, what each step returned). The allreduce calls of each optimizer step's
    forward and backward passes (not its step, whose overflow flag is one more) are
    appended to ``calls``. ``before_epoch(net, epoch, plugin)`` runs before each epoch."""
    L = _lightning()
    from mpfp16.integrations.lightning import MPFP16FabricPrecision

    plugin = MPFP16FabricPrecision(loss_scale=new_scaler(mode), **plugin_kwargs(mode))
    fabric = L.Fabric(accelerator="cpu", devices=mdist.get_world_size() if ddp else 1,
                      strategy="ddp" if ddp else "auto", plugins=[plugin])
    if ddp:
        fabric.launch()  # the processes exist (LOCAL_RANK is set): this joins them
    net = make_net(seed)
    optimizer = OPTIMIZERS[mode.get("optimizer", "sgd")](net.parameters())
    model, optimizer = fabric.setup(net, optimizer)
    accum = mode.get("accum", 1)
    stepped = []
    sent = 0
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(net, epoch, plugin)
        for i, (x, y) in enumerate(data):
            if i % accum == 0:
                optimizer.zero_grad()
            last = (i + 1) % accum == 0 or i == len(data) - 1

            def micro_batch():
                with fabric.no_backward_sync(model, enabled=not last):
                    fabric.backward(F.cross_entropy(model(x), y) / accum)

            if calls is None:
                micro_batch()
            else:
                sent += allreduces(micro_batch)
            if last:
                if calls is not None:
                    calls.append(sent)
                    sent = 0
                if mode.get("clip") and mode.get("clip_algorithm") == "value":
                    fabric.clip_gradients(model, optimizer, clip_val=mode["clip"])
                elif mode.get("clip"):  # an overflowed step is skipped, not an error
                    fabric.clip_gradients(model, optimizer, max_norm=mode["clip"], error_if_nonfinite=False)
                stepped.append(optimizer.step())
    return net, plugin, optimizer, stepped


def fabric_epoch(fabric, model, optimizer, data) -> list[bool]:
    """One epoch of the Fabric loop, one optimizer step per batch."""
    stepped = []
    for x, y in data:
        optimizer.zero_grad()
        fabric.backward(F.cross_entropy(model(x), y))
        stepped.append(optimizer.step())
    return stepped


def state(net, opt) -> dict:
    """What must agree bit for bit: the 16-bit weights, the masters and the scaler."""
    return {"weights": [p.detach().clone() for p in net.parameters()],
            "masters": [m.detach().clone() for m in opt.master_params()],
            "scale": opt.loss_scale, "skipped": opt.skipped_steps}


def same(a: dict, b: dict) -> bool:
    return (a["scale"] == b["scale"] and a["skipped"] == b["skipped"]
            and all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
            and all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"])))


# ---------------------------------------------------------------- worker-group cases (2 ranks)


def trainer_vs_own(rank: int, mode: dict, batches: int, epochs: int = 1) -> dict:
    """Under DDP: the Trainer's run and the own loop's (mpfp16.distributed.wrap), with
    this rank's own data; the allreduce calls of the plugin's optimizer steps."""
    mdist.init()
    data = make_data(batches, rank, mode.get("inf_batches", ()) if rank in mode.get("inf_ranks", (rank,)) else ())
    calls = []

    L = _lightning()

    class Count(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                calls.append(mdist.comm_stats(trainer.strategy.model).pop_step()["allreduce_calls"])

    lit, plugin, trainer = fit_trainer(mode, data, epochs=epochs, ddp=True, callbacks=[Count()])
    mdist.check_replicas(trainer.strategy.model, plugin.optimizer, buffers=False)
    mine = state(lit.net, plugin.optimizer)
    own_calls = []
    net, opt, stepped = own_loop(mode, data, epochs=epochs, ddp="mpfp16", calls=own_calls)
    return {"same": same(mine, state(net, opt)), "stepped": lit.stepped, "own_stepped": stepped, "calls": calls,
            "own_calls": own_calls,
            "global_step": trainer.global_step, "skipped": plugin.skipped_steps}


def fabric_vs_own(rank: int, mode: dict, batches: int) -> dict:
    """Under Fabric's DDP and the own loop under the same: torch's
    DistributedDataParallel around the to_half model, or, with fp32 sums (whose
    exchange needs mpfp16's hook, which the plugin attaches to Fabric's),
    mpfp16.distributed.wrap; the allreduce calls of each optimizer step.
    check_replicas raises on every rank unless the replicas are bit-identical."""
    mdist.init()
    data = make_data(batches, rank, mode.get("inf_batches", ()) if rank in mode.get("inf_ranks", (rank,)) else ())
    calls = []
    net, plugin, _, stepped = fit_fabric(mode, data, ddp=True, calls=calls)
    mdist.check_replicas(net, plugin.optimizer, buffers=False)
    mine = state(net, plugin.optimizer)
    ref, opt, own = own_loop(mode, data, ddp="mpfp16" if mode.get("accumulate_dtype") else "torch")
    return {"same": same(mine, state(ref, opt)), "stepped": stepped, "own_stepped": own, "calls": calls,
            "skipped": plugin.skipped_steps}


def refused_comm_hook(rank: int) -> str:
    """A DDP strategy given a communication hook of the user's: the plugin's own cannot
    be registered, so fit() is refused."""
    mdist.init()
    L = _lightning()
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from mpfp16.integrations.lightning import MPFP16Precision

    trainer = L.Trainer(**dict(QUIET, devices=2, max_epochs=1, enable_checkpointing=False,
                               use_distributed_sampler=False),
                        strategy=DDPStrategy(ddp_comm_hook=allreduce_hook), plugins=[MPFP16Precision()])
    try:
        trainer.fit(lit_module(make_net(0), {}), loader(make_data(2, rank)))
    except ValueError as exc:
        return str(exc)
    return "not refused"


# ---------------------------------------------------------------- a run that is killed, and its resume


def main(argv=None) -> int:
    """``--dir D --epochs E``: the Trainer run with a ModelCheckpoint in D (last.ckpt at
    the end of every epoch), resumed from ``D/last.ckpt`` with ``--resume``; its final
    state in ``D/final.pt``. ``--pause-after-epoch K`` sleeps once K epochs are saved,
    so that a test can kill the process there with SIGKILL."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pause-after-epoch", type=int, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    L = _lightning()
    from lightning.pytorch.callbacks import ModelCheckpoint

    mode = {"optimizer": "adamw", "init_scale": 2.0 ** 20, "scheduler": True}

    class Pause(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == args.pause_after_epoch:  # last.ckpt holds epoch K's end
                print("paused", flush=True)
                import time

                time.sleep(600)

    checkpoint = ModelCheckpoint(dirpath=args.dir, save_last=True, every_n_epochs=1)
    ckpt = os.path.join(args.dir, "last.ckpt") if args.resume else None
    lit, plugin, trainer = fit_trainer(mode, make_data(8, 0, inf_batches=(3,)), epochs=args.epochs,
                                       callbacks=[checkpoint, Pause()], checkpointing=True, ckpt_path=ckpt,
                                       default_root_dir=args.dir, net=make_net(7 if args.resume else 0))
    torch.save(state(lit.net, plugin.optimizer), os.path.join(args.dir, "final.pt"))
    return 0

