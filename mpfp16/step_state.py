"""Where an optimizer step is, and the guard that keeps its calls in a legal order.

One :class:`StepState` holds everything that belongs to one step, as torch's
``GradScaler`` keeps one ``OptState`` per optimizer: the phase, the loss scale the
gradients were computed with, whether the losses were finite, what the store's
unscale found (its ``Checked``: the inf/NaN flag, and what the fused check found on
the way), and the fp32 sums that the gradient exchange carried. The first backward of
a step makes it; ``step()`` ends it. :class:`StepGuard` is its one writer: the stores
return what they find as values, which the optimizer hands to the guard, and the
exchange's hooks tell the guard (its ``carried``) what they carried.

The phases, and what moves between them::

    READY ──backward──> ACCUMULATING ──unscale_()──> UNSCALED
      ^                   │    ^ backward                │
      │ zero_grad()       │ step()                       │ step()
      └──────────── STEPPED <────────────────────────────┘

STEPPED is READY with a past: a backward starts the next step (its gradients add to
what is there, as in torch). Every call in a wrong order is refused in one line
(:meth:`StepGuard.check_ready`, :meth:`StepGuard.check_unscaled`): a step with no
backward since the last, a backward after ``unscale_()``, gradients computed outside
``backward()`` while the loss is scaled, an fp32 sum that no exchange carried.

:class:`StepGuard` owns the state and the one autograd hook that sees gradients arrive
(so that ``loss.backward()`` called directly is told from ``opt.backward(loss)``). It is
also what the optimizer registers with :mod:`mpfp16.parallel.accumulation` as the owner
of its fp32 sums: the DDP hooks read ``sum_open`` and set ``carried`` on it, which go to
the step's state.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook

__all__ = ["Phase", "StepState", "StepGuard", "group_params", "check_groups"]


class Phase(enum.Enum):
    READY = "ready"  # no gradient of this step yet (after zero_grad(), or construction)
    ACCUMULATING = "accumulating"  # backward passes are adding gradients
    UNSCALED = "unscaled"  # unscale_() ran: the fp32 gradients are unscaled and checked
    STEPPED = "stepped"  # step() ran; the next backward starts a new step


@dataclasses.dataclass
class StepState:
    """One step's state (module docstring).

    Attributes:
        phase: where the step is.
        scale: the loss scale of the last backward of the step: what its gradients
            are unscaled by, should the scale change before the step (apex's order).
        loss_finite: whether every loss of the step's backward passes was finite, on
            the device (no host sync); None before the first.
        checked: what the store's unscale found (``mpfp16.stores.Checked``: the inf/NaN
            flag; whether the unscaled fp32 gradients were written, which the fused
            step then reads; the sum of squares the fused check found), or None
            before it ran.
        arrived: a gradient reached the parameters in this step (the hook).
        outside: one arrived outside ``backward()``.
        after_unscale: one arrived after ``unscale_()``.
        backward_ran: ``backward()`` ran (for stores whose gradients no hook sees).
        sums_open: the fp32 sums of the micro-batches are open (fp32 accumulation).
        carried: a gradient exchange carried the sums in this step.
        finite: what ``prepare_grads()`` found, agreed across ranks (None before).
    """

    phase: Phase = Phase.READY
    scale: float | None = None
    loss_finite: torch.Tensor | None = None
    checked: object = None
    arrived: bool = False
    outside: bool = False
    after_unscale: bool = False
    backward_ran: bool = False
    sums_open: bool = False
    carried: bool = False
    finite: bool | None = None

    @property
    def started(self) -> bool:
        """Gradients of this step may be there (a backward ran, or the hook saw one)."""
        return self.phase in (Phase.ACCUMULATING, Phase.UNSCALED)


class StepGuard:
    """The step's state and the checks of the call order (module docstring).

    Args:
        params: the parameters the optimizer holds.
        hooked: whether autograd's hooks on ``params`` see their gradients arrive
            (not so for FSDP2's sharded parameters; there ``backward()`` tells).
    """

    def __init__(self, params: list[torch.Tensor], hooked: bool) -> None:
        self.params, self.hooked = params, hooked
        self.state = StepState()
        self.in_backward = False
        self._hook = None
        self._hooked_for: tuple | None = None  # the requires_grad pattern the hook was registered for
        self.watch()

    # ----------------------------------------------------------- the sums' owner

    @property
    def sum_open(self) -> bool:
        """For :mod:`mpfp16.parallel.accumulation`: only open sums are carried."""
        return self.state.sums_open and self.state.started

    @property
    def carried(self) -> bool:
        return self.state.carried

    @carried.setter
    def carried(self, value: bool) -> None:
        self.state.carried = value

    # ----------------------------------------------------------- the calls

    def _begin(self) -> StepState:
        """The state of the step a gradient or a backward belongs to: a new one when
        the last step is over (the first backward makes it)."""
        if not self.state.started:
            self.state = StepState(phase=Phase.ACCUMULATING)
        return self.state

    def begin_backward(self, scale: float, loss: torch.Tensor, sums: bool = False) -> bool:
        """Before ``backward()`` runs the backward pass of ``loss`` at ``scale``; with
        ``sums`` (fp32 accumulation), the step's sums are open from now on. Returns
        whether this is the step's first backward to open them."""
        self.watch()
        state = self._begin()
        state.scale = scale
        finite = torch.isfinite(loss.detach())
        finite = finite.all() if finite.dim() else finite
        state.loss_finite = finite if state.loss_finite is None else state.loss_finite & finite
        self.in_backward = True
        first = sums and not state.sums_open
        state.sums_open |= sums
        return first

    def end_backward(self) -> None:
        self.in_backward = False
        state = self.state
        if not self.hooked:  # the gradients arrive where no hook sees them (FSDP2)
            state.backward_ran = True
            state.after_unscale |= state.phase is Phase.UNSCALED

    def new_step(self) -> None:
        """``zero_grad()``: the gradients are gone, and so is the step."""
        self.state = StepState()
        self.watch()

    def unscaled(self, checked, in_step: bool = False) -> None:
        """The store's unscale found ``checked``: by ``unscale_()``, which moves the step
        to UNSCALED, or inside ``step()`` (``in_step``)."""
        self.state.checked = checked
        if not in_step:
            self.state.phase, self.state.after_unscale = Phase.UNSCALED, False

    def agreed(self, finite: bool) -> None:
        """What ``prepare_grads()`` found, agreed across ranks."""
        self.state.finite = finite

    def finish(self) -> StepState:
        """``step()`` is done with the step's gradients: return its state, and be in
        STEPPED."""
        state, self.state = self.state, StepState(phase=Phase.STEPPED)
        return state

    # ----------------------------------------------------------- the hook

    def watch(self) -> None:
        """(Re-)register the hook that sees gradients arrive, over the parameters that
        require grad now: a parameter unfrozen since is watched from here on."""
        if not self.hooked:
            return
        pattern = tuple(p.requires_grad for p in self.params)
        if pattern == self._hooked_for:
            return
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._hooked_for = pattern
        watched = [p for p in self.params if p.requires_grad]
        if not watched:
            return
        ref = weakref.ref(self)

        def on_backward(_grad):
            guard = ref()
            if guard is not None:
                state = guard._begin()
                state.arrived = True
                state.outside |= not guard.in_backward
                state.after_unscale |= state.phase is Phase.UNSCALED

        self._hook = register_multi_grad_hook(watched, on_backward, mode="any")

    # ----------------------------------------------------------- the checks

    def check_ready(self, *, present: bool | None, no_gradient: str, scale: float, accumulates: bool,
                    needs_carry: bool) -> None:
        """Raise one line unless the step may read its gradients now.

        Args:
            present: whether a gradient is there, where the store can tell by
                looking (None: the hook tells).
            no_gradient: the store's words for a step that no backward reached.
            scale: the loss scale now.
            accumulates: the store sums micro-batches in fp32.
            needs_carry: this rank steps with others, so an exchange must have carried
                the fp32 sums.
        """
        state = self.state
        if present is None:
            # A parameter unfrozen since the hook was registered is not watched: trust it.
            unwatched = tuple(p.requires_grad for p in self.params) != self._hooked_for
            arrived = (state.arrived and state.started) or unwatched
            outside = state.outside and state.started
        else:
            arrived, outside = present, present and not state.backward_ran
        if not arrived:
            raise RuntimeError(no_gradient)
        if accumulates:
            self._check_sums(outside, needs_carry)
        if scale != 1.0 and outside:
            raise RuntimeError(f"gradients were computed outside opt.backward() while the loss scale is {scale:g}; "
                               "they would be unscaled wrongly. Call opt.backward(loss)")

    def _check_sums(self, outside: bool, needs_carry: bool) -> None:
        """With fp32 accumulation: refuse gradients that never reached the fp32 sum
        (computed outside ``backward()``), and, when this rank steps with others, a
        sum that no exchange carried: a stock DistributedDataParallel (or an allreduce
        of ``.grad`` by hand) sent the last micro-batch's gradient, or nothing, so
        the replicas would diverge. Every rank of such a job finds the same."""
        if outside:
            raise RuntimeError("gradients were computed outside opt.backward() with accumulate_dtype=torch.float32: "
                               "only opt.backward(loss) adds them into the fp32 sum, so they would be lost; call "
                               "opt.backward(loss)")
        if needs_carry and not self.state.carried:
            raise RuntimeError(
                "accumulate_dtype=torch.float32 under torch.distributed needs mpfp16's DDP hook: no exchange carried "
                "the fp32 gradient sum in this step (a stock DistributedDataParallel sends the last micro-batch's "
                "16-bit gradient, which is zero by then, or nothing), so the replicas would diverge; wrap the model "
                "with mpfp16.distributed.wrap, or pass reduce_overflow=False if this rank trains alone")

    def check_unscaled(self) -> None:
        """After ``unscale_()``: refuse a step whose gradients a later backward changed
        (fp32 gradients are unscaled in place, so they cannot be unscaled again)."""
        if self.state.after_unscale:
            raise RuntimeError("a backward pass ran after unscale_() in this step, so the gradients are no longer "
                               "unscaled: call unscale_() after the last backward, just before step()")


def group_params(groups: list[dict]) -> list[tuple[int, ...]]:
    """The identities of each param group's parameters, in order."""
    return [tuple(map(id, group["params"])) for group in groups]


def check_groups(groups: list[dict], shared: list[dict], held: list[tuple[int, ...]]) -> None:
    """Refuse, in one line, a change to the inner optimizer's groups (``groups``) since
    it was wrapped (``held``, :func:`group_params` then; ``shared``: the list the
    wrapper shares): a group added through the inner optimizer
    (``inner.add_param_group``, torch's fine-tuning idiom, which the wrapper's own
    ``add_param_group`` refuses), a group removed, parameters added to or taken from a
    group, or the groups replaced (``inner.load_state_dict`` called directly, which
    loads neither the masters nor the scaler, and leaves the wrapper's
    ``param_groups`` on the old list). The store holds the parameters of construction
    alone: a parameter it does not hold has no fp32 master and its gradient is still
    scaled, so it would be stepped 16-bit and loss-scale times too far, or never. Every
    rank runs the same check over the same groups, so every rank refuses at the same
    call."""
    if groups is not shared:
        raise RuntimeError(
            "the inner optimizer's param_groups were replaced after FP16Optimizer wrapped it (its own "
            "load_state_dict, or an assignment), so the masters, the scaler and this wrapper's param_groups no "
            "longer go with them: load checkpoints through FP16Optimizer.load_state_dict")
    now = group_params(groups)
    if now == held:
        return
    if len(now) != len(held):
        i = min(len(now), len(held))
        change = (f"param group {i} ({len(now[i])} parameters) was added, as inner.add_param_group does"
                  if len(now) > len(held) else f"param group {i} was removed")
    else:
        i = next(i for i, (a, b) in enumerate(zip(now, held)) if a != b)
        change = f"the parameters of param group {i} changed ({len(held[i])} -> {len(now[i])})"
    raise RuntimeError(
        f"the inner optimizer's param groups changed after FP16Optimizer wrapped it ({change}): FP16Optimizer "
        "steps only the parameters it was built over (others have no fp32 master, and their gradients are still "
        "loss-scaled); build the inner optimizer with every group first, then wrap it (a layer to unfreeze "
        "later can be in it from the start, with requires_grad=False)")


def check_inner_hooks(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Refuse, in one line, step hooks registered on the inner optimizer itself
    (``inner.register_step_pre_hook`` / ``register_step_post_hook``) where the fused step
    runs: it computes the inner optimizer's update in its kernels and never calls its
    ``step()``, so they would never run. The unfused step calls it once a step, and runs
    them. Every rank runs the same check over the same hooks, so every rank refuses at
    the same call, before anything is stepped."""
    if not fused:
        return
    kinds = [kind for kind, hooks in (("pre", optimizer._optimizer_step_pre_hooks),
                                      ("post", optimizer._optimizer_step_post_hooks)) if hooks]
    if kinds:
        name = type(optimizer).__name__
        raise RuntimeError(
            f"a step {kinds[0]}-hook is registered on the inner {name} ({name}.register_step_{kinds[0]}_hook), and "
            f"the fused step computes its update without calling {name}.step(), so the hook would never run: "
            "register it on the FP16Optimizer, whose step() runs it once a step, or pass fused=False")

