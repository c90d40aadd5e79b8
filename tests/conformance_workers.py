"""The stores' conformance suite (tests/test_store_conformance.py): how each store is built,
the phases every store runs, and the reference they are held to: the library's per-tensor
definition of the step (mpfp16/reference.py), plain fp32 torch.

The code runs the same way in the test process (the local stores) and in each rank of a
two-rank gloo group (the sharded store, :func:`distributed_case`). A phase does not stop at
the first mismatch: it collects every failed check as one line and returns the list, so
that a rank never leaves its peer waiting in a collective, and a test shows every
mismatch at once.

Besides the step's phases, the suite makes every change torch's optimizer API allows
between two steps (torch's ``optimizer.state`` is the state's one owner): the state
cleared, whole or one parameter's; a state tensor assigned, of the same dtype, another
dtype, another shape; an earlier state_dict loaded into the optimizer that stepped on
(a rollback, with a parameter the checkpoint holds no state for); every hyper-parameter
changed; ``amsgrad`` turned on as a checkpoint that has it would. The store must step
on as plain torch does after the same change, or refuse the next step in one line
before anything moves (the entry's ``refuses``). The rules a store applies that plain
torch leaves open are the reference's too (mpfp16/stores/state_rules.py): a state
assigned in another dtype is converted to the dtype the state is kept in, to nearest.

The reference (:class:`TorchReference`) is the library's definition of the step,
:class:`mpfp16.reference.ReferenceStep`: what a user of plain torch writes, per tensor,
fp32 copies of a 16-bit model's weights, unscaled, checked, clipped, stepped by a
``torch.optim`` optimizer, the updated copies rounded back into the 16-bit model; its
scale is judged against ``torch.amp.GradScaler``'s own update, fed the same overflows. It
takes each batch through its own 16-bit model. After each step's comparison it adopts the store's masters
and inner state (nothing changes where they were bit-identical), so that every step is
judged from the same state: where an entry allows the last bits, one weight whose 16-bit
rounding flipped does not carry a difference into later steps' gradients.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import torch
import torch.nn as nn

import mpfp16
import mpfp16.distributed as mdist
from mpfp16.reference import ReferenceStep
from reference import batches, make_inner, tiny_mlp

# The scale every phase trains with: dynamic, starting low enough that no clean step of
# the tiny model overflows (so the only skips are the ones a phase makes), and growing
# after 3 clean steps, so that growth happens inside the phases (and across a reload).
INIT_SCALE, GROWTH_INTERVAL = 1024.0, 3
# A factor on a loss that makes its 16-bit gradients overflow while the loss itself stays
# finite: the overflow a dynamic scale exists for.
OVERFLOW = 2.0**16
# Below the tiny model's gradient norms (about 0.9), so that clipping changes the step.
CLIP = 0.25

# How far a store's numbers may be from the reference's.
# - "exact": bit for bit (torch's own optimizer over the masters, or a fused kernel doing
#   torch's operations in torch's order: SGD).
# - "sqrt": the fused Adam/AdamW kernels take a correctly rounded fp32 square root and
#   torch's CPU sqrt kernel is accurate to about 1 ulp without being correctly rounded, so
#   the masters and the moments differ in their last bits (tests/test_fused.py,
#   tests/test_native.py: bit for bit against torch's operations with a correctly rounded
#   sqrt); the tolerance is test_fused.py's (updates are ~5e-3 here). Step counters, the
#   scale, the skips and the copy back (16-bit weight == master rounded) stay exact.
TOLERANCES = {"exact": None, "sqrt": dict(rtol=1e-6, atol=1e-8)}
# The gradient norm a store reports (last_grad_norm; or clip_grad_norm_ over its
# master_params(), DTensors for a sharded store) against torch's get_total_norm over the
# reference's gradients: "torch" is the same function over the same tensors, bit for bit;
# "own" sums the squares in another order (a flat buffer's; the shards', then across the
# ranks), so the last bits may differ. The reference then clips with the store's norm, so
# that the update is still compared at the tolerance of its entry.
NORM_RTOL = {"torch": 0.0, "own": 1e-6}

PHASES = ["clean", "overflow", "unscale-clip", "max-grad-norm", "accumulate", "reload", "freeze",
          "clear", "clear-one", "assign", "rollback", "hyper", "amsgrad"]
BF16 = torch.bfloat16


@dataclasses.dataclass
class Built:
    """What a store entry's factory returns: the model (called as it is), the
    FP16Optimizer over it, and what must stay alive beside them."""

    model: nn.Module
    opt: mpfp16.FP16Optimizer
    held: list = dataclasses.field(default_factory=list)  # gradient accumulators kept alive


def _scaler() -> mpfp16.DynamicLossScaler:
    return mpfp16.DynamicLossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


# ---------------------------------------------------------------- the stores' factories
# factory(kind, seed, **options) -> Built; ``kind`` is a name of reference.make_inner,
# ``options`` FP16Optimizer's (max_grad_norm=). Module-level functions (or partials of
# them), so that a worker process can be handed one.


def flat(kind: str, seed: int, fused: bool = False, **options) -> Built:
    """``to_half`` puts the parameters in flat buffers; ``fused`` picks the step."""
    model = mpfp16.to_half(tiny_mlp(seed))
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=_scaler(), fused=fused, model=model,
                               **options)
    return Built(model, opt)


def flat_bf16_states(kind: str, seed: int, fused: bool = False, **options) -> Built:
    """:func:`flat` with every optimizer state kept in bf16, rounded to nearest."""
    return flat(kind, seed, fused=fused, state_dtype=BF16, **options)


def per_tensor_bf16_states(kind: str, seed: int, **options) -> Built:
    """:func:`per_tensor` with every optimizer state kept in bf16, rounded to nearest."""
    return per_tensor(kind, seed, state_dtype=BF16, **options)


def per_tensor(kind: str, seed: int, **options) -> Built:
    """Every 16-bit parameter in a storage of its own, its gradient accumulator held as
    DDP holds it (tests/test_per_tensor_store.py): parameters that can no longer move."""
    model = mpfp16.to_half(tiny_mlp(seed))
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.detach().clone()
    held = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=_scaler(), model=model, **options)
    return Built(model, opt, held)


def sharded(kind: str, seed: int, **options) -> Built:
    """The fp32 model sharded over every rank of the process group (FSDP2): its
    sharded fp32 parameters are the masters, gathered in fp16 for each forward."""
    model = mdist.shard(tiny_mlp(seed))
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=_scaler(), model=model, **options)
    return Built(model, opt)


# ---------------------------------------------------------------- the reference


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a DTensor (a sharded store's) gathered, any other as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class TorchReference(ReferenceStep):
    """The library's definition of the step (:class:`mpfp16.reference.ReferenceStep`:
    plain torch, per tensor) over fp32 copies of a 16-bit model, with the stores' scale
    settings, and ``torch.amp.GradScaler``'s own scale update (its kernel, fed the same
    overflows) as the independent judge of the scale.

    Args:
        model16: the reference's own 16-bit model.
        kind: the inner optimizer (a name of reference.make_inner).
        states: the dtype the store keeps the optimizer states in.
        clip: clip to :data:`CLIP`, with the store's norm (:meth:`step`).
    """

    def __init__(self, model16: nn.Module, kind: str, states: torch.dtype = torch.float32, clip: bool = False):
        self.model = model16
        super().__init__(model16.parameters(), lambda masters: make_inner(kind, masters),
                         scaler=mpfp16.DynamicLossScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL),
                         max_grad_norm=CLIP if clip else None, state_dtype=states)
        self.torch_scale = torch.full((), INIT_SCALE)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)

    def grads(self) -> list[torch.Tensor]:
        """The masters' gradients of this step (none for a frozen parameter)."""
        return [m.grad for m in self.masters if m.grad is not None]

    @torch.no_grad()
    def step(self, clip_norm: torch.Tensor | None = None) -> bool:
        """The reference's step after its :meth:`unscale` (the caller ran it), clipping
        with ``clip_norm`` (the store's norm: NORM_RTOL), and GradScaler's scale update
        beside its own; whether it stepped."""
        finite = all(bool(torch.isfinite(g).all()) for g in self.grads())
        torch._amp_update_scale_(self.torch_scale, self.growth_tracker, torch.tensor([0.0 if finite else 1.0]),
                                 2.0, 0.5, GROWTH_INTERVAL)
        if not finite:
            self.skip()
            return False
        self.clip(clip_norm)
        self.update()
        return True

    @torch.no_grad()
    def adopt(self, opt: mpfp16.FP16Optimizer) -> None:
        """Take the store's masters and inner state (16-bit weights: the masters
        rounded), so that the next step of both starts from the same values."""
        for m, s in zip(self.masters, opt.master_params()):
            m.copy_(full(s))
            mine = self.optimizer.state.get(m, {})
            for key, value in opt.state.get(s, {}).items():
                if torch.is_tensor(value) and torch.is_tensor(mine.get(key)) and value.shape == mine[key].shape:
                    mine[key].copy_(full(value))
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)


# ---------------------------------------------------------------- one store against it


def _state_dict_copy(state_dict: dict) -> dict:
    """What a resume would read back: through torch.save and torch.load(weights_only=True)
    (a sharded store's DTensors, which mpfp16.checkpoint saves as a DCP folder, by a deep
    copy); never the same tensors, which torch's load_state_dict would share."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(t, DTensor) for t in _tensors(state_dict)):
        return copy.deepcopy(state_dict)
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _tensors(obj):
    """Every tensor inside nested dicts, lists and tuples."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class Run:
    """One store (a factory's build) and the reference, stepped together on the same
    batches; every check that fails adds a line to :attr:`failures`."""

    def __init__(self, factory, kind: str, spec: dict, clip: bool = False, **options):
        self.factory, self.kind, self.spec, self.options = factory, kind, spec, options
        self.built = factory(kind, 0, **options)
        self.ref = TorchReference(mpfp16.to_half(tiny_mlp(0)), kind, spec.get("states", torch.float32),
                                  clip=clip)
        self.failures: list[str] = []
        self.tolerance = TOLERANCES[spec["update"]]
        self.norm_rtol = NORM_RTOL[spec["norm"]]
        self.data = iter(batches(12, seed=3))
        self.steps = 0
        self.twin: Built | None = None
        self._names = [name for name, _ in self.built.model.named_parameters()]
        opt = self.built.opt
        self.expect(opt.store.kind == spec["store"], f"the store is {opt.store.kind}, not {spec['store']}")
        self.expect(opt.fused == spec["fused"], f"fused is {opt.fused}, not {spec['fused']}")
        # A local store's masters are its 16-bit weights widened, a sharded store's the
        # fp32 weights themselves: the reference starts from the store's, and its 16-bit
        # model from them rounded, which must be the 16-bit weights of the same seed.
        for i, (p, s) in enumerate(zip(self.ref.params, opt.master_params())):
            self.same(f"initial weight {self._names[i]}", full(s).to(p.dtype), p)
        self.ref.adopt(opt)

    # -- checks

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(f"step {self.steps}: {what}")

    def same(self, what: str, mine: torch.Tensor, theirs: torch.Tensor, tolerance: dict | None = None) -> None:
        mine, theirs = mine.detach(), theirs.detach()
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            self.expect(False, f"{what}: {mine.dtype}{list(mine.shape)} against {theirs.dtype}{list(theirs.shape)}")
        elif tolerance is None:
            if not torch.equal(mine, theirs):
                diff = (mine.double() - theirs.double()).abs().max().item()
                self.expect(False, f"{what}: not bit-identical (largest difference {diff:.3g})")
        elif not torch.allclose(mine, theirs, **tolerance):
            diff = (mine.double() - theirs.double()).abs().max().item()
            self.expect(False, f"{what}: further than {tolerance} (largest difference {diff:.3g})")

    def same_norm(self, what: str, mine: float, theirs: torch.Tensor) -> None:
        theirs = float(theirs)
        if abs(mine - theirs) > self.norm_rtol * abs(theirs):
            self.expect(False, f"{what} {mine!r}, torch's {theirs!r} (rtol {self.norm_rtol})")

    def snapshot(self, built: Built | None = None) -> dict:
        """Every value a step may change, whole: masters, 16-bit weights, inner state."""
        opt = (built or self.built).opt
        out = {}
        for name, p, s in zip(self._names, opt.model_params(), opt.master_params()):
            out[f"master {name}"] = full(s).detach().clone()
            if p is not s:
                out[f"weight {name}"] = full(p).detach().clone()
            for key, value in opt.state.get(s, {}).items():
                out[f"{key} of {name}"] = full(torch.as_tensor(value)).detach().clone()
        return out

    def compare_with_reference(self) -> None:
        opt, ref = self.built.opt, self.ref
        for name, p, s, m in zip(self._names, opt.model_params(), opt.master_params(), ref.masters):
            self.same(f"master {name}", full(s), m, self.tolerance)
            if p is not s:  # the copy back: the 16-bit weight is its master rounded
                self.same(f"weight {name}", full(p), full(s).to(p.dtype))
            mine, theirs = opt.state.get(s, {}), ref.optimizer.state.get(m, {})
            self.expect(sorted(mine) == sorted(theirs), f"inner state of {name}: {sorted(mine)}, torch's "
                                                        f"{sorted(theirs)}")
            for key in set(mine) & set(theirs):
                exact = key == "step" or not torch.is_floating_point(torch.as_tensor(theirs[key]))
                self.same(f"{key} of {name}", full(torch.as_tensor(mine[key])), torch.as_tensor(theirs[key]),
                          None if exact else self.tolerance)
        if self.tolerance is None:
            for name, p, q in zip(self._names, opt.model_params(), ref.params):
                if p.dtype == q.dtype:
                    self.same(f"weight {name} against torch's", full(p), q)
        self.expect(opt.loss_scale == ref.scaler.scale == float(ref.torch_scale),
                    f"loss scale {opt.loss_scale}, the reference's {ref.scaler.scale}, GradScaler's "
                    f"{float(ref.torch_scale)}")

    def compare_twin(self) -> None:
        """The reloaded optimizer against the one that was not: bit for bit, whatever
        the entry's tolerance."""
        a, b = self.snapshot(), self.snapshot(self.twin)
        self.expect(a.keys() == b.keys(), "the reloaded optimizer holds other values")
        for key in a.keys() & b.keys():
            self.same(f"reloaded {key}", b[key], a[key])
        for attr in ("loss_scale", "skipped_steps"):
            mine, theirs = getattr(self.twin.opt, attr), getattr(self.built.opt, attr)
            self.expect(mine == theirs, f"reloaded {attr} {mine}, not reloaded {theirs}")

    # -- steps

    def step(self, *, overflow: bool = False, micro: int = 1, unscale_clip: bool = False) -> bool:
        """One step of the store (and of the reloaded twin, if any) and the reference on
        the next batch: ``micro`` backward calls (gradient accumulation, the loss divided
        by ``micro``; the sync of a sharded model only on the last), the loss scaled up
        by :data:`OVERFLOW` if ``overflow``, ``unscale_()`` and
        ``clip_grad_norm_(master_params(), CLIP)`` before ``step()`` if ``unscale_clip``.
        Then the checks; returns whether the store stepped."""
        x, y = next(self.data)
        self.steps += 1
        factor = OVERFLOW if overflow else 1.0
        stepped, norms = [], []
        for built in [self.built] + ([self.twin] if self.twin else []):
            built.opt.zero_grad()
            for i in range(micro):
                with mdist.sync_gradients(built.model, i == micro - 1):
                    built.opt.backward(nn.functional.cross_entropy(built.model(x), y) * factor / micro)
            if unscale_clip:
                built.opt.unscale_()
                norms.append(full(torch.nn.utils.clip_grad_norm_(built.opt.master_params(), CLIP)))
            stepped.append(built.opt.step())
        opt, ref = self.built.opt, self.ref
        for p in ref.params:
            p.grad = None
        for i in range(micro):
            ref.backward(nn.functional.cross_entropy(ref.model(x), y) * factor / micro)
        ref.unscale()
        ref_norm = torch.nn.utils.get_total_norm(ref.grads())
        clip_norm = None  # the norm the reference clips with: the store's (NORM_RTOL)
        if unscale_clip:
            clip_norm = norms[0].detach().clone()
            if not overflow:
                self.same_norm("clip_grad_norm_ over master_params() gave", float(clip_norm), ref_norm)
        elif self.options.get("max_grad_norm") is not None and stepped[0]:
            self.same_norm("last_grad_norm", opt.last_grad_norm, ref_norm)
            clip_norm = torch.tensor(opt.last_grad_norm, dtype=torch.float32)
        ref_stepped = ref.step(clip_norm)
        self.expect(stepped[0] == ref_stepped == (not overflow),
                    f"step() returned {stepped[0]}, torch stepped: {ref_stepped}, overflow made: {overflow}")
        self.compare_with_reference()
        if self.twin is not None:
            self.expect(stepped[1] == stepped[0], f"the reloaded step() returned {stepped[1]}")
            self.compare_twin()
        self.ref.adopt(opt)
        return stepped[0]

    def refused(self, words: str) -> None:
        """The next step of the store is refused in one line naming ``words``, before
        anything moves (the reference does not step)."""
        x, y = next(self.data)
        opt = self.built.opt
        before, scale = self.snapshot(), opt.loss_scale
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(self.built.model(x), y))
        try:
            opt.step()
        except (RuntimeError, ValueError) as exc:
            message = str(exc)
            self.expect("\n" not in message and words in message,
                        f"the refusal is not one line naming {words!r}: {message!r}")
        else:
            self.expect(False, f"the step was taken, where it must be refused naming {words!r}")
        after = self.snapshot()
        for key in before:
            self.same(f"after the refused step, {key}", after[key], before[key])
        self.expect(opt.loss_scale == scale, f"the refused step moved the scale from {scale} to {opt.loss_scale}")
        opt.zero_grad()

    def pairs(self):
        """``(store's stepped tensor, the reference's master)`` per parameter."""
        return list(zip(self.built.opt.master_params(), self.ref.masters))

    def reload(self) -> None:
        """A fresh build (other initial weights: everything must come from the state)
        that loads this one's model and optimizer state; stepped from now on beside it."""
        twin = self.factory(self.kind, 1, **self.options)
        twin.model.load_state_dict(self.built.model.state_dict())
        twin.opt.load_state_dict(_state_dict_copy(self.built.opt.state_dict()))
        self.twin = twin
        self.compare_twin()


# ---------------------------------------------------------------- the phases


def clean(run: Run) -> None:
    """Clean steps; the scale grows after the third."""
    for _ in range(4):
        run.step()
    run.expect(run.built.opt.loss_scale == 2 * INIT_SCALE, f"the scale is {run.built.opt.loss_scale} after "
                                                           f"{GROWTH_INTERVAL} clean steps")


def overflow(run: Run) -> None:
    """A step whose 16-bit gradients overflow changes no weight, master, inner state or
    step counter; the scale backs off; the step is counted and its culprits named;
    clean steps follow."""
    run.step()
    opt = run.built.opt
    before, scale = run.snapshot(), opt.loss_scale
    run.expect(not run.step(overflow=True), "the overflowing step was taken")
    after = run.snapshot()
    for key in before:
        run.same(f"after the skipped step, {key}", after[key], before[key])
    run.expect(opt.loss_scale == scale / 2, f"the scale went from {scale} to {opt.loss_scale}")
    run.expect(opt.skipped_steps == 1, f"skipped_steps is {opt.skipped_steps}")
    run.expect(bool(opt.last_overflow), "last_overflow names no parameter after the skip")
    run.step()
    run.expect(opt.last_overflow == [], f"last_overflow after a clean step: {opt.last_overflow}")
    run.step()


def unscale_clip(run: Run) -> None:
    """unscale_(), then torch's clip_grad_norm_ over master_params(), then step()."""
    for _ in range(3):
        run.step(unscale_clip=True)


def max_grad_norm(run: Run) -> None:
    """FP16Optimizer(max_grad_norm=CLIP) clips the unscaled gradients as clip_grad_norm_."""
    for _ in range(3):
        run.step()
    run.expect(run.built.opt.last_grad_norm is not None and run.built.opt.last_grad_norm > CLIP,
               f"the last norm {run.built.opt.last_grad_norm} was not clipped")


def accumulate(run: Run) -> None:
    """Two backward calls per step, their gradients summed."""
    for _ in range(3):
        run.step(micro=2)


def reload(run: Run) -> None:
    """state_dict() after a skip, into a fresh optimizer, which then steps bit for bit
    as the one that was not reloaded (the scale's growth count included: it grows at
    the second step after the reload)."""
    run.step()
    run.step(overflow=True)
    run.step()
    run.reload()
    for _ in range(3):
        run.step()
    run.expect(run.twin.opt.loss_scale == INIT_SCALE, f"the reloaded scale is {run.twin.opt.loss_scale}")


def freeze(run: Run) -> None:
    """The first layer frozen (requires_grad=False) after two steps: its masters and
    inner state stop moving, the rest trains on."""
    run.step()
    run.step()
    for model in (run.built.model, run.ref.model):
        for p in model[0].parameters():
            p.requires_grad_(False)
    frozen = {name for name, p in run.built.model.named_parameters() if not p.requires_grad}
    before = {key: value for key, value in run.snapshot().items() if key.rpartition(" ")[2] in frozen}
    run.expect(len(before) >= 2 * len(frozen) > 0, f"no values of the frozen layer: {sorted(before)}")
    run.step()
    run.step()
    after = run.snapshot()
    for key, value in before.items():
        run.same(f"frozen {key}", after[key], value)


def _state_name(run: Run) -> str:
    return "momentum_buffer" if run.kind in ("sgd", "nesterov") else "exp_avg"


def clear(run: Run) -> None:
    """``opt.state.clear()`` (the inner optimizer's own state, which the wrapper shares)
    after two steps: every parameter starts afresh, as in torch; state_dict() holds only
    what steps."""
    run.step()
    run.step()
    run.built.opt.state.clear()
    run.ref.optimizer.state.clear()
    run.expect(not run.built.opt.state_dict()["optimizer"]["state"], "state_dict() holds a state after clear()")
    run.step()
    run.step()


def clear_one(run: Run) -> None:
    """One parameter's state deleted (``del opt.state[p]``) and another's emptied in
    place: those two start afresh, the others go on."""
    run.step()
    run.step()
    (a, ra), (b, rb) = run.pairs()[1], run.pairs()[2]
    del run.built.opt.state[a]
    del run.ref.optimizer.state[ra]
    run.built.opt.state[b].clear()
    run.ref.optimizer.state[rb].clear()
    run.step()
    run.step()


def assign(run: Run) -> None:
    """A state tensor assigned (``opt.state[p][name] = t``): of the dtype the state is
    kept in, of another dtype (converted to the kept one, to nearest), and of another
    shape (the step refused in one line, before anything moves); and one given other
    data in place of its own (``t.data = ...``)."""
    run.step()
    run.step()
    name = _state_name(run)
    pairs = run.pairs()
    for i, dtype in ((0, None), (1, torch.float64), (3, torch.float32)):
        m, r = pairs[i]
        entry = run.built.opt.state[m]
        old = full(entry[name])
        new = (old.double() * 0.5 + 1e-3).to(dtype or old.dtype)
        entry[name] = _like_shard(new, m) if old is not entry[name] else new
        run.ref.optimizer.state[r][name] = new.clone()  # its own tensor: the store steps new in place
    m, r = pairs[4]
    entry = run.built.opt.state[m]
    if full(entry[name]) is entry[name]:  # the same tensor given other data (``.data =``), where not a DTensor
        entry[name].data = entry[name].data * 0.25
        run.ref.optimizer.state[r][name].mul_(0.25)
    run.step()
    run.step()
    m, _ = pairs[2]
    kept = run.built.opt.state[m][name]
    run.built.opt.state[m][name] = torch.zeros(3)
    run.refused("has shape [3]")
    run.built.opt.state[m][name] = kept
    run.step()


def _like_shard(t: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``t`` (whole) as ``target`` (a DTensor) holds it: each rank's shard."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.to(target.device), target.device_mesh, target.placements, src_data_rank=None)


def rollback(run: Run) -> None:
    """The recipe of rolling back on a loss spike: the model's and the optimizer's
    state_dicts taken at a step, training on, then both loaded back into the live
    model and optimizer. The first layer was frozen until the checkpoint, so it has no
    state there: it starts afresh at the rollback, whatever it held by then."""
    models = (run.built.model, run.ref.model)
    for model in models:
        for p in model[0].parameters():
            p.requires_grad_(False)
    run.step()
    run.step()
    saved = (copy.deepcopy(run.built.model.state_dict()), _state_dict_copy(run.built.opt.state_dict()))
    ref = run.ref
    ref_saved = (copy.deepcopy(ref.optimizer.state_dict()), [m.detach().clone() for m in ref.masters],
                 [p.detach().clone() for p in ref.params], copy.deepcopy(ref.scaler.state_dict()),
                 ref.torch_scale.clone(), ref.growth_tracker.clone())
    for model in models:
        for p in model[0].parameters():
            p.requires_grad_(True)
    run.step()
    run.step()
    run.built.model.load_state_dict(saved[0])
    run.built.opt.load_state_dict(_state_dict_copy(saved[1]))
    ref.load_optimizer_state(copy.deepcopy(ref_saved[0]))
    with torch.no_grad():
        for m, v in zip(ref.masters, ref_saved[1]):
            m.copy_(v)
        for p, v in zip(ref.params, ref_saved[2]):
            p.copy_(v)
    ref.scaler.load_state_dict(ref_saved[3])
    ref.torch_scale.copy_(ref_saved[4])
    ref.growth_tracker.copy_(ref_saved[5])
    run.compare_with_reference()
    for _ in range(3):
        run.step()


def hyper(run: Run) -> None:
    """Every hyper-parameter of the groups changed between steps, as a schedule or a
    user changes them: each step reads them all, and a change that switches a part of
    the update on or off (weight decay, momentum, Nesterov, maximize) takes effect."""
    sgd = run.kind in ("sgd", "nesterov")
    changes = ([{"lr": 0.02, "weight_decay": 0.0}, {"momentum": 0.5, "dampening": 0.1},
                {"dampening": 0.0, "nesterov": True}, {"momentum": 0.0, "nesterov": False},
                {"momentum": 0.9, "weight_decay": 1e-3}, {"maximize": True}] if sgd else
               [{"lr": 2e-3, "weight_decay": 0.0}, {"betas": (0.8, 0.99), "eps": 1e-6},
                {"weight_decay": 5e-2}, {"maximize": True}, {"decoupled_weight_decay": False}])
    run.step()
    for change in changes:
        for opt in (run.built.opt.optimizer, run.ref.optimizer):
            for group in opt.param_groups:
                group.update(change)
        run.step()


def amsgrad(run: Run) -> None:
    """``amsgrad`` turned on with a ``max_exp_avg_sq`` for every state, as loading a
    checkpoint of an optimizer built with it does: the unfused step goes on with it as
    torch does; a fused step that cannot take it refuses in one line (``refuses``)."""
    if run.kind in ("sgd", "nesterov"):
        return
    run.step()
    run.step()
    for opt in (run.built.opt.optimizer, run.ref.optimizer):
        for entry in opt.state.values():
            entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()
        for group in opt.param_groups:
            group["amsgrad"] = True
    if "amsgrad" in run.spec.get("refuses", ()):
        run.refused("amsgrad=True")
        return
    run.step()
    run.step()


PHASE_FUNCTIONS = {"clean": clean, "overflow": overflow, "unscale-clip": unscale_clip,
                   "max-grad-norm": max_grad_norm, "accumulate": accumulate, "reload": reload, "freeze": freeze,
                   "clear": clear, "clear-one": clear_one, "assign": assign, "rollback": rollback, "hyper": hyper,
                   "amsgrad": amsgrad}


def run_phase(factory, kind: str, phase: str, spec: dict) -> list[str]:
    """``phase`` on the store ``factory`` builds, over the inner optimizer ``kind``:
    the failed checks, one line each (none: it conforms)."""
    options = {"max_grad_norm": CLIP} if phase == "max-grad-norm" else {}
    run = Run(factory, kind, spec, clip=phase in ("max-grad-norm", "unscale-clip"), **options)
    PHASE_FUNCTIONS[phase](run)
    return run.failures


def distributed_case(rank: int, factory, kinds: tuple[str, ...], spec: dict) -> dict:
    """Every phase over every inner optimizer of ``kinds`` (:func:`run_phase`) on one rank
    of a gloo group (tests/dist_helpers.py Group), in one process group (a group per
    phase would cost more than the phases): ``{(kind, phase): failures}``. A phase that
    raises records its error as its failure, on every rank alike (the ranks compute the
    same), and the next phase runs.

    Both ranks take the same batches, so that the one-process reference applies bit for
    bit: the average of two equal gradients is exact (FSDP2 halves a 16-bit gradient
    before the sum, exact outside fp16's subnormals, which these gradients stay out of at
    these scales; it sums fp32 ones, then halves). tests/test_sharding.py compares
    different batches per rank with DDP."""
    import traceback

    mdist.init(backend="gloo", device="cpu")
    out = {}
    try:
        for kind in kinds:
            for phase in PHASES:
                try:
                    out[kind, phase] = run_phase(factory, kind, phase, spec)
                except Exception:
                    out[kind, phase] = [f"raised: {traceback.format_exc()}"]
    finally:
        mdist.teardown()
    return out
