"""Workers for tests/test_accumulate.py: fp32 accumulation of micro-batch gradients
under DDP, on two gloo processes, against a reference each rank computes alone."""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import mpfp16
import mpfp16.distributed as mdist
from dist_workers import flat_params, global_batches, mlp, shard

SCALE = 1024.0


def micro_grads(model, batches, rank, world):
    """Each micro-batch's 16-bit gradient of ``SCALE * loss / len(batches)``, from a
    plain copy of ``model`` (no DDP, no FP16Optimizer): the reference's inputs."""
    plain = copy.deepcopy(model)
    out = []
    for x, y in batches:
        plain.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(plain(shard(x, rank, world).half()), shard(y, rank, world)) / len(batches)
        (loss.float() * SCALE).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in plain.parameters()]))
    return out


def expected_average(sums: list[torch.Tensor], wire: str) -> torch.Tensor:
    """What one exchange of the ranks' fp32 sums gives, per wire: the fp32 average
    (fp32 wire), the fp32 average of the sums rounded once to 16 bits, rounded again
    (fp32_accumulate), or a 16-bit sum halved (a 16-bit allreduce)."""
    world = len(sums)
    if wire == "fp32":
        return torch.stack(sums).sum(0) / world
    halves = [s.half() for s in sums]
    if wire == "fp32_accumulate":
        return (torch.stack([h.float() for h in halves]).sum(0) / world).half().float()
    total = halves[0]
    for h in halves[1:]:
        total = total + h
    return (total / world).float()


WRAP = {"fp32": {"allreduce_dtype": torch.float32}, "fp32_accumulate": {"strategy": "fp32_accumulate"},
        "fp16": {}}


def accumulate_dp(rank, wire, accum=4, steps=2, fused=False, master_weights=True, per_tensor=False):
    """``steps`` optimizer steps of ``accum`` micro-batches with the fp32 sum, the
    last micro-batch synced; per step, the fp32 sum the step read against the
    reference; the parameters; the communication figures, with and without fp32
    accumulation. ``per_tensor``: a ``.half()`` model wrapped before the optimizer
    is built (the per-tensor store)."""
    info = mdist.init(timeout_s=60)
    results = {}
    for accumulate in (torch.float32, None):
        model = mlp().half() if per_tensor else mpfp16.to_half(mlp())
        ddp = mdist.wrap(model, **WRAP[wire]) if per_tensor else None
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loss_scale=SCALE,
                                   master_weights=master_weights, fused=fused, accumulate_dtype=accumulate)
        assert opt.store.kind == ("per-tensor" if per_tensor else "flat")
        ddp = ddp or mdist.wrap(model, **WRAP[wire])
        data = global_batches(steps * accum)
        errors, stats = [], []
        for step in range(steps):
            batches = data[step * accum:(step + 1) * accum]
            reference = micro_grads(model, batches, rank, info.world_size)
            opt.zero_grad()
            for micro, (x, y) in enumerate(batches):
                with mdist.sync_gradients(ddp, micro == accum - 1):
                    out = ddp(shard(x, rank, info.world_size).half())
                    opt.backward(nn.functional.cross_entropy(out, shard(y, rank, info.world_size)) / accum)
            if accumulate is not None:
                mine = torch.zeros(reference[0].shape)
                for g in reference:  # the fp32 sum, in micro-batch order
                    mine += g.float()
                gathered = [torch.empty_like(mine) for _ in range(info.world_size)]
                dist.all_gather(gathered, mine)
                expected = expected_average(gathered, wire)
                opt.unscale_()
                got = torch.cat([m.grad.reshape(-1) for m in opt.master_params()]) * SCALE
                errors.append((got - expected).abs().max().item())
            assert opt.step()
            stats.append(mdist.comm_stats(ddp).pop_step())
        results["fp32" if accumulate is not None else "model"] = {
            "params": flat_params(model), "stats": stats, "errors": errors}
    mdist.teardown()
    return results


def stock_ddp(rank):
    """fp32 accumulation under torch's own DDP: the step refuses, on every rank."""
    info = mdist.init(timeout_s=60)
    model = mpfp16.to_half(mlp())
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), loss_scale=SCALE,
                               accumulate_dtype=torch.float32)
    ddp = nn.parallel.DistributedDataParallel(model)
    before = flat_params(model)
    (x, y), = global_batches(1)
    opt.backward(nn.functional.cross_entropy(ddp(shard(x, rank, info.world_size)), shard(y, rank, info.world_size)))
    try:
        opt.step()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = None
    out = {"message": message, "unchanged": torch.equal(before, flat_params(model))}
    mdist.teardown()
    return out


class TwoHeads(nn.Module):
    """A head that only some micro-batches use (a conditional branch, as multi-task
    and Lightning models have)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.body(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def unused_in_the_last_micro_batch(rank, accum=3):
    """Head b is used by the first micro-batches only, on every rank, so DDP
    (find_unused_parameters) leaves its gradient untouched in the synced one: its
    fp32 sum must still be exchanged and kept."""
    info = mdist.init(timeout_s=60)
    model = mpfp16.to_half(TwoHeads())
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), loss_scale=SCALE,
                               accumulate_dtype=torch.float32)
    ddp = mdist.wrap(model, strategy="fp32_accumulate", find_unused_parameters=True)
    data = global_batches(accum)
    plain = copy.deepcopy(model)
    mine = None
    for micro, (x, y) in enumerate(data):
        plain.zero_grad(set_to_none=False)
        x, y = shard(x, rank, info.world_size).half(), shard(y, rank, info.world_size)
        use_b = micro < accum - 1
        (nn.functional.cross_entropy(plain(x, use_b), y) / accum * SCALE).backward()
        grads = torch.cat([p.grad.reshape(-1).float() for p in plain.parameters()])
        mine = grads if mine is None else mine + grads
        with mdist.sync_gradients(ddp, micro == accum - 1):
            opt.backward(nn.functional.cross_entropy(ddp(x, use_b), y) / accum)
    gathered = [torch.empty_like(mine) for _ in range(info.world_size)]
    dist.all_gather(gathered, mine)
    expected = expected_average(gathered, "fp32_accumulate")
    opt.unscale_()
    got = torch.cat([m.grad.reshape(-1) for m in opt.master_params()]) * SCALE
    b = slice(sum(p.numel() for p in (model.body.weight, model.body.bias, model.a.weight, model.a.bias)), None)
    out = {"error": (got - expected).abs().max().item(), "b_sum": got[b].abs().sum().item()}
    assert opt.step()
    out["params"] = flat_params(model)
    mdist.teardown()
    return out
