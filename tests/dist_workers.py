"""Functions that run inside the 2-process gloo tests (tests/test_distributed.py)."""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

import mpfp16
import mpfp16.distributed as mdist
from mpfp16.parallel.handles import handle_of


def mlp(seed=0, norm=None):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 32)]
    if norm == "bn":
        layers.append(nn.BatchNorm1d(32))
    elif norm == "ln":  # per sample: the same on a half batch as on the whole one
        layers.append(nn.LayerNorm(32))
    layers += [nn.ReLU(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


def global_batches(steps, batch=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g) * 3, torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def shard(x, rank, world):
    return x.chunk(world)[rank]


def flat_params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def train_dp(rank, steps, wrap_kw, accum=1, dtype="float16", master_weights=True, plain_ddp=False):
    """Data-parallel training on this rank's half of each global batch."""
    info = mdist.init(timeout_s=60)
    model = mpfp16.to_half(mlp(), getattr(torch, dtype))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               loss_scale=1024.0 if dtype == "float16" else None, master_weights=master_weights)
    if plain_ddp:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    else:
        ddp = mdist.wrap(model, **wrap_kw)
    stats = []
    data = global_batches(steps * accum)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y = data[step * accum + micro]
            with mdist.sync_gradients(ddp, micro == accum - 1):
                opt.backward(nn.functional.cross_entropy(ddp(shard(x, rank, info.world_size)),
                                                         shard(y, rank, info.world_size)) / accum)
        assert opt.step()
        if not plain_ddp:
            stats.append(mdist.comm_stats(ddp).pop_step())
    out = {"params": flat_params(model), "stats": stats}
    mdist.teardown()
    return out


def overflow_on_one_rank(rank, steps, where):
    """Rank 1 alone produces inf: in its input ('input', spread by the allreduce) or
    in its gradients after the allreduce ('grad', caught by the flag reduction)."""
    mdist.init(timeout_s=60)
    model = mpfp16.to_half(mlp(norm="bn"))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    ddp = mdist.wrap(model)
    results = []
    for step, (x, y) in enumerate(global_batches(steps)):
        x, y = shard(x, rank, 2), shard(y, rank, 2)
        bad = rank == 1 and step in (2, 5)
        if bad and where == "input":
            x = x.clone()
            x[0, 0] = float("inf")
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(ddp(x), y))
        if bad and where == "grad":
            model[0].weight.grad[0, 0] = float("nan")
        results.append(opt.step())
    ddp.eval()
    with torch.no_grad():
        ddp(torch.zeros(2, 8))  # DDP broadcasts rank 0's buffers at each forward
    out = {"stepped": results, "skipped": opt.skipped_steps, "scale": opt.loss_scale,
           "params": flat_params(model), "buffers": [b.clone() for b in model.buffers()]}
    mdist.teardown()
    return out


def big_gradients(rank, wrap_kw):
    """Both ranks' gradient is 40000: the fp16 sum 80000 overflows, the average does not."""
    mdist.init(timeout_s=60)
    model = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = mdist.wrap(model, **wrap_kw)
    ddp(torch.full((1, 1), 40000.0, dtype=torch.float16)).float().sum().backward()
    out = {"grad": model.weight.grad.float().item(), "stats": mdist.comm_stats(ddp).pop_step()}
    mdist.teardown()
    return out


def fp32_accumulate_exact(rank, chunk_numel, sizes, small_numel):
    """Odd sizes and tiny chunks (empty shards included) against a hand-computed average."""
    import torch.distributed as dist

    mdist.init(timeout_s=60)
    torch.manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.zeros(n, dtype=torch.float16)) for n in sizes])
    ddp = mdist.wrap(params_module(params), strategy="fp32_accumulate")
    handle_of(ddp).hook_state.chunk_numel = chunk_numel
    handle_of(ddp).hook_state.small_numel = small_numel
    g = torch.Generator().manual_seed(123)
    per_rank = [[torch.randn(n, generator=g).mul(30000).half() for n in sizes] for _ in range(2)]
    ddp(per_rank[rank]).backward()
    expected = [((a.float() + b.float()) / 2).half() for a, b in zip(*per_rank)]
    got = [p.grad.clone() for p in params]
    dist.barrier()
    mdist.teardown()
    return {"got": got, "expected": expected}


class params_module(nn.Module):
    """loss = sum(p * g) for given g: the gradient of p is exactly g."""

    def __init__(self, params):
        super().__init__()
        self.params = params

    def forward(self, grads):
        return sum((p.float() * g.float()).sum() for p, g in zip(self.params, grads))


def dead_peer(rank, mode):
    """Rank 1 exits (or hangs) after two steps; rank 0 must fail, not hang."""
    mdist.init(timeout_s=8)
    model = mpfp16.to_half(mlp())
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ddp = mdist.wrap(model)
    started = time.monotonic()
    try:
        for step, (x, y) in enumerate(global_batches(50)):
            if rank == 1 and step == 2:
                if mode == "exit":
                    os._exit(0)
                time.sleep(3600)
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(ddp(shard(x, rank, 2)), shard(y, rank, 2)))
            opt.step()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "elapsed": time.monotonic() - started}
    return {"error": None}


def log_levels(rank):
    import logging

    mdist.init(timeout_s=60)
    level = logging.getLogger("mpfp16").getEffectiveLevel()
    mdist.teardown()
    return level


# ----------------------------------------------------------------- construction orders

ORDER_DTYPES = {"float16": 1024.0, "bfloat16": None, "float32": None}  # dtype -> static loss scale


def order_configs():
    """(dtype, master_weights, accum) for the order matrix; an fp32 model has no masters to drop."""
    return [(dtype, master, accum) for dtype in ORDER_DTYPES for master in (True, False) for accum in (1, 2)
            if master or dtype != "float32"]


def build_in_order(rank, wrapper, order, dtype, master_weights, seed=None, lr=0.05, inner="sgd"):
    """A model and optimizer built the way users write it. ``order``: "ddp_first"
    (apex's: convert, wrap, then the optimizer over ddp.parameters()) or "opt_first".
    Each rank starts from its own random weights (seed = rank): DDP's broadcast from
    rank 0 must reach the fp32 masters in either order."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = mlp(seed=rank if seed is None else seed, norm="ln")
    if dtype == "float32":
        mpfp16.flatten_parameters(model)
    else:
        mpfp16.to_half(model, getattr(torch, dtype))

    def wrap():
        if wrapper == "wrap":
            return mdist.wrap(model)
        return DDP(model, gradient_as_bucket_view=wrapper == "ddp-bucket-view")

    def optimizer(params):
        opt = (torch.optim.SGD(params, lr=lr, momentum=0.9) if inner == "sgd" else
               torch.optim.AdamW(params, lr=lr / 10))
        return mpfp16.FP16Optimizer(opt, loss_scale=ORDER_DTYPES[dtype], master_weights=master_weights)

    if order == "ddp_first":
        ddp = wrap()
        opt = optimizer(ddp.parameters())
    else:
        opt = optimizer(model.parameters())
        ddp = wrap()
    return model, ddp, opt


def train_steps(rank, model, ddp, opt, steps, accum, world=2):
    """``steps`` optimizer steps on this rank's share of each global batch (all of it
    when ``world`` is 1: the single-process reference); returns the comm stats of each
    step for a wrap() model."""
    data = global_batches(steps * accum)
    stats = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y = data[step * accum + micro]
            with mdist.sync_gradients(ddp, micro == accum - 1):
                opt.backward(nn.functional.cross_entropy(ddp(shard(x, rank, world)), shard(y, rank, world)) / accum)
        assert opt.step()
        if mdist.comm_stats(ddp) is not None:
            stats.append(mdist.comm_stats(ddp).pop_step())
    return stats


def order_matrix(rank, wrapper, steps):
    """Every (order, dtype, master_weights, accum) with one DDP flavour; the final
    parameters and masters of each."""
    mdist.init(timeout_s=60)
    out = {}
    for dtype, master, accum in order_configs():
        for order in ("ddp_first", "opt_first"):
            model, ddp, opt = build_in_order(rank, wrapper, order, dtype, master)
            stats = train_steps(rank, model, ddp, opt, steps, accum)
            masters = [m.detach().clone() for m in opt.master_params()] if master else []
            out[(order, dtype, master, accum)] = {"params": flat_params(model), "masters": masters, "stats": stats}
    mdist.teardown()
    return out


def moved_after_ddp(rank, case):
    """Parameters that can no longer move after DDP holds them: converting them is one
    clear error; an optimizer over them keeps them where they are (the per-tensor
    store) and trains with DDP's averaged gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mdist.init(timeout_s=60)
    model = mlp(norm="ln")
    if case == "half":
        model.half()  # converted by hand: not in flat buffers; inputs cast as apex's tofp16 does
        model.register_forward_pre_hook(mpfp16.convert.CastInputs(torch.float16), with_kwargs=True)
        model.register_forward_hook(mpfp16.convert.outputs_to_fp32)
    elif case == "to_half-then-move":
        mpfp16.to_half(model)
        model.to(memory_format=torch.contiguous_format, dtype=torch.float16)  # re-allocates the fp32 norm params
    ddp = DDP(model)
    out = {"error": None, "store": None}
    try:
        if case == "to_half-after-ddp":
            mpfp16.to_half(ddp.module)
        else:
            opt = mpfp16.FP16Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), loss_scale=64.0)
            out["store"] = opt.store.kind
            train_steps(rank, model, ddp, opt, 2, 1)
            mdist.check_replicas(ddp, opt)
    except RuntimeError as exc:
        out["error"] = str(exc)
    mdist.teardown()
    return out


def compile_fails_on_one_rank(rank, fused, kernels="inductor"):
    """Rank 1 has no working C++ compiler; rank 0 compiles (skipped here: its warm-up
    succeeds at once). Auto-fused small model, or fused=True. ``kernels``: inductor's
    (SGD), or the native C++ ones (AdamW), built by rank 1 into an empty cache with a
    compiler that is not there."""
    import logging
    import tempfile

    import torch._inductor.exc

    from mpfp16.stores import fused as FB
    from mpfp16.stores import kernels as F
    from mpfp16.stores import native

    mdist.init(timeout_s=60)
    FB.FUSED_MIN_NUMEL = 0
    if rank == 1 and kernels == "native":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
        os.environ["CXX"] = "no-such-c++"
        native._LIBRARY = None
    elif rank == 1:
        def broken(fn, **static):
            raise torch._inductor.exc.InvalidCxxCompiler("/bin/false")
        F.compiled = broken
    else:
        variants = FB.FusedStep.variants
        FB.FusedStep.variants = lambda self, *a: {key: (lambda: None) for key in variants(self, *a)}
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("mpfp16").addHandler(handler)
    model, ddp, opt = build_in_order(rank, "wrap", "ddp_first", "float16", True,
                                     inner="adamw" if kernels == "native" else "sgd")
    opt.store._fused_requested = fused  # as if built with fused=True
    try:
        train_steps(rank, model, ddp, opt, 2, 1)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    out = {"fused": opt.fused, "params": flat_params(model), "error": error, "messages": messages}
    mdist.teardown()
    return out


def perturb_one_rank(rank, where):
    """Train two steps in sync, then change one value on rank 1 by one ulp (or one
    optimizer number) and check the replicas."""
    mdist.init(timeout_s=60)
    model, ddp, opt = build_in_order(rank, "wrap", "ddp_first", "float16", True, seed=0)
    train_steps(rank, model, ddp, opt, 2, 1)
    out = {"clean": mdist.check_replicas(ddp, opt)}
    if rank == 1:
        with torch.no_grad():
            if where == "weight":
                w = model[0].weight
                w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(float("inf"), dtype=w.dtype))
            elif where == "master":
                m = opt.master_params()[4]
                m.view(-1)[7] = torch.nextafter(m.view(-1)[7], torch.tensor(float("inf")))
            elif where == "momentum":
                buf = opt.state[opt.master_params()[0]]["momentum_buffer"]
                buf.view(-1)[0] = torch.nextafter(buf.view(-1)[0], torch.tensor(float("-inf")))
            elif where == "loss_scale":
                state = opt.scaler.state_dict()
                opt.scaler.load_state_dict({**state, "scale": state["scale"] * 2})
            elif where == "lr":
                opt.param_groups[0]["lr"] = 0.051
    try:
        mdist.check_replicas(ddp, opt, context=" at step 2")
        out["error"] = None
    except mpfp16.ReplicaDivergenceError as exc:
        out["error"] = str(exc)
    mdist.teardown()
    return out


def script_in_own_folder(rank, root, folders, argv, nudge_rank=None, nudge_step=1):
    """train_cifar's command line on this rank, run from its own working directory
    (``root/folders[rank]``): with a relative --checkpoint-dir, the ranks then see
    different files under one path, as nodes without a shared file system do.
    On ``nudge_rank``, step ``nudge_step`` ends by moving one master weight by one ulp.

    A nudge is certain to be there at a replica check only when no optimizer step
    comes between them: the next step's update can round it away (a master that
    grows from 2^-11 to 2^-9 in one step has a coarser ulp; whether it does depends
    on the values, and those on the CPU's convolution kernels). Nudge at the step
    the check follows."""
    if rank == nudge_rank:
        step = mpfp16.FP16Optimizer.step

        def nudged(self, *args, **kwargs):
            stepped = step(self, *args, **kwargs)
            if self.iteration == nudge_step:
                with torch.no_grad():
                    m = self.master_params()[0].view(-1)
                    m[0] = torch.nextafter(m[0], torch.tensor(float("inf")))
            return stepped

        mpfp16.FP16Optimizer.step = nudged
    os.chdir(os.path.join(root, folders[rank]))
    from dist_helpers import run_captured

    return run_captured("train_cifar", argv)


def unscale_under_ddp(rank, fused):
    """Clipping by the constructor's max_grad_norm, and by clip_grad_norm_ after
    unscale_(), under DDP (apex's order): the final parameters of each."""
    mdist.init(timeout_s=120)
    out = {}
    for how in ("max_grad_norm", "unscale"):
        model = mpfp16.to_half(mlp(norm="ln"))
        ddp = mdist.wrap(model)
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), loss_scale=1024.0,
                                   fused=fused, max_grad_norm=0.05 if how == "max_grad_norm" else None)
        for x, y in global_batches(3):
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(ddp(shard(x, rank, 2)), shard(y, rank, 2)))
            if how == "unscale":
                opt.unscale_()
                torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.05)
            assert opt.step()
        out[how] = flat_params(model)
    mdist.teardown()
    return out


def apex_distributed_example(rank, steps):
    """apex's FP16_Optimizer_simple/distributed_pytorch example, in its own order:
    ``model.half()``, torch's DistributedDataParallel, then FP16_Optimizer over
    ``model.parameters()``; and the same with ``mpfp16.to_half`` in place of ``.half()``.
    Each rank trains on its own batch. Returns, per order, the final weights and
    masters, the store the optimizer chose, the first step's averaged gradients, and
    this rank's local gradients of that step (computed without DDP)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpfp16.compat.apex import FP16_Optimizer

    mdist.init(timeout_s=60)
    N, D_in, D_out = 16, 32, 8
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, D_in, generator=g).half()
    y = torch.randn(N, D_out, generator=g).half()
    out = {}
    for order in ("half", "to_half"):
        torch.manual_seed(0)
        net = torch.nn.Linear(D_in, D_out)
        alone = torch.nn.Linear(D_in, D_out).half()
        alone.load_state_dict(net.state_dict())
        model = net.half() if order == "half" else mpfp16.to_half(net)
        model = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=128.0, verbose=False)
        loss_fn = torch.nn.MSELoss()
        (loss_fn(alone(x).float(), y.float()) * 128.0).backward()
        local = [p.grad.float() / 128.0 for p in alone.parameters()]
        averaged = None
        for t in range(steps):
            optimizer.zero_grad()
            y_pred = model(x)
            loss = loss_fn(y_pred.float(), y.float())
            optimizer.backward(loss)
            if t == 0:
                averaged = [p.grad.float() / 128.0 for p in model.parameters()]
            optimizer.step()
        mdist.check_replicas(model, optimizer._opt)  # raises on every rank if the replicas differ
        out[order] = {"params": flat_params(model), "masters": [m.detach().clone() for m in optimizer._opt.master_params()],
                      "store": optimizer._opt.store.kind, "averaged": averaged, "local": local}
    mdist.teardown()
    return out


def fp32_accumulate_with_unused_search(rank, steps):
    """strategy="fp32_accumulate" under DDP with and without find_unused_parameters:
    DDP's own collective for the used-parameter map runs while the hook's exchanges do
    (on its worker thread); the final weights of both runs."""
    mdist.init(timeout_s=60)
    out = {}
    for find_unused in (False, True):
        torch.manual_seed(0)
        model = mpfp16.to_half(nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                                             nn.Linear(256, 4)))
        ddp = mdist.wrap(model, strategy="fp32_accumulate", find_unused_parameters=find_unused, bucket_mb=0.2)
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.01), loss_scale=64.0)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(ddp(x), y))
            assert opt.step()
        mdist.check_replicas(ddp, opt)
        out[find_unused] = flat_params(model)
    mdist.teardown()
    return out


# Per-tensor store cases: a ``.half()`` model that torch's DistributedDataParallel holds
# before the optimizer is built (apex's order), beyond the plain SGD one.
HALF_UNDER_DDP = {
    "adamw": dict(inner="adamw"),
    "no-masters": dict(opt={"master_weights": False}),
    "stochastic": dict(opt={"master_weights": False, "rounding": "stochastic"}),
    "kahan": dict(opt={"master_weights": False, "rounding": "kahan"}),
    "clip": dict(opt={"max_grad_norm": 0.05}),
    "unscale-clip": dict(unscale_clip=0.05),
    "bucket-view": dict(ddp={"gradient_as_bucket_view": True}),
    "static-graph": dict(ddp={"static_graph": True}),
    "find-unused": dict(ddp={"find_unused_parameters": True}),
    "round-trip": dict(round_trip=True),
}


def half_model_steps(model, forward, opt, steps, rank, world, unscale_clip=None, round_trip=False):
    """``steps`` steps of this rank's share of each global batch (the whole batch when
    ``world`` is 1, each rank's half weighted as DDP averages it)."""
    for x, y in global_batches(steps):
        opt.zero_grad()
        for r in ([rank] if world > 1 else range(2)):
            loss = nn.functional.cross_entropy(forward(shard(x, r, 2).half()).float(), shard(y, r, 2))
            opt.backward(loss if world > 1 else loss / 2)
        if unscale_clip is not None:
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_(opt.master_params(), unscale_clip)
        opt.step()
        if round_trip:
            opt.load_state_dict(opt.state_dict())


def half_optimizer(params, inner="sgd", opt=None):
    inner_opt = (torch.optim.AdamW(params, lr=1e-2) if inner == "adamw"
                 else torch.optim.SGD(params, lr=0.05, momentum=0.9))
    return mpfp16.FP16Optimizer(inner_opt, loss_scale=1024.0, **(opt or {}))


def half_model_under_torch_ddp(rank, name, steps):
    """One case of HALF_UNDER_DDP on this rank: the store chosen, the final weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    case = HALF_UNDER_DDP[name]
    info = mdist.init(timeout_s=60)
    model = mlp().half()
    ddp = DDP(model, **case.get("ddp", {}))
    opt = half_optimizer(ddp.parameters(), case.get("inner", "sgd"), case.get("opt"))
    half_model_steps(model, ddp, opt, steps, rank, info.world_size, case.get("unscale_clip"),
                     case.get("round_trip", False))
    return {"store": opt.store.kind, "params": flat_params(model)}
