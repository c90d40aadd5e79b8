"""The interface every parameter store implements, and the arithmetic they share.

A store is where the parameters an :class:`mpfp16.FP16Optimizer` steps live, with
their gradients and fp32 masters. The optimizer runs the step's phases in its fixed
order and asks the store for each one that depends on the layout:

Each phase is handed the step's state (:class:`mpfp16.step_state.StepState`), where a
store keeps what it learns in one phase for a later one.

``check_ready()``
    phase 1, the store's part: raise if a parameter left its storage; re-read the
    master of a weight written from outside; reattach replaced gradients.
``unscale(state, scale, materialize, with_norm) -> found_inf``
    phase 2: fp32 gradients = 16-bit gradients / scale, and a float tensor whose
    first element is 1.0 when a gradient holds inf or NaN. ``materialize`` asks for
    the unscaled fp32 gradients in the masters' ``.grad`` (``unscale_()`` does).
``grad_norm(state) -> Tensor``
    phase 4: the global 2-norm of the unscaled gradients of the parameters stepped
    this step, reduced over ``group``.
``update(state, scale, clip_coef, rng)`` and ``copy_back()``
    phases 5 and 6: the inner optimizer's arithmetic on the fp32 values, then the
    new 16-bit weights.
``nonfinite_grads(state, limit, before_unscale)``
    after a step found an overflow, and only then: which parameters' gradients, as
    the step read them, hold inf or NaN (:func:`find_nonfinite`, the one scan every
    store uses), for ``FP16Optimizer.last_overflow``.
``zero_grad(set_to_none)``, ``skip()``, ``copy_masters_to_model()``,
``memory()``, ``state()`` / ``check_state()`` / ``load_state()``
    the rest of the optimizer's surface that depends on where the tensors are.

Every parameter the inner optimizer holds belongs to the store, frozen or not. A
parameter is stepped in a step when it requires grad at that step, as torch's
optimizers step a parameter whose ``.grad`` is set: a layer unfrozen after the
optimizer was built is stepped through its master from then on, and a layer frozen
mid-run stops moving (its momentum is not applied).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..parallel.fsdp_shim import is_sharded

__all__ = ["ParamStore", "inv_scale_tensor", "unscale_and_check", "find_nonfinite", "total_norm", "storage_bytes",
           "whole"]


def inv_scale_tensor(scale: float, device: torch.device) -> torch.Tensor:
    """1/scale as GradScaler computes it: the reciprocal in double, rounded to fp32;
    ``torch.full`` fills on the device, where ``torch.tensor`` would copy and wait."""
    return torch.full((), 1.0 / scale, dtype=torch.float32, device=device)


def _by_device(items, tensor_of) -> dict:
    """``items`` by the device of ``tensor_of(item)``, each list in the given order."""
    by_device: dict[torch.device, list] = defaultdict(list)
    for item in items:
        by_device[tensor_of(item).device].append(item)
    return by_device


def unscale_and_check(grads: list[torch.Tensor], scale: float) -> torch.Tensor:
    """``grads /= scale`` in place, and whether any value is inf/NaN, in one pass per
    tensor (GradScaler's own kernel). Returns [flag] as an fp32 tensor on the first
    tensor's device (1.0: found)."""
    found = []
    for device, tensors in _by_device(grads, lambda t: t).items():
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale_tensor(scale, device).view(1))
        found.append(found_inf)
    if not found:
        return torch.zeros(1, dtype=torch.float32)
    first = found[0]
    for other in found[1:]:
        first += other.to(first.device)
    return first


def find_nonfinite(pairs, limit: int) -> list[tuple[int, int, int]]:
    """``(index, NaN count, inf count)`` for the ``limit`` smallest indices of ``pairs``
    (``(index, gradient tensor)``; None or empty tensors are passed over) whose tensor
    holds NaN or inf, in increasing index order. Meant for a step already found to
    overflow: one read of every tensor (its minimum and maximum, which are NaN, -inf
    or inf where it holds any: no temporary, unlike ``abs().max()``) and one host read
    per device find which hold non-finite values; only those reported are then
    counted, with one more host read per device."""
    items = sorted(((i, t) for i, t in pairs if t is not None and t.numel()), key=lambda item: item[0])
    flagged = []
    for device_items in _by_device(items, lambda item: item[1]).values():
        ends = torch.stack([torch.stack(torch.aminmax(t)).float() for _, t in device_items])
        bad = (~torch.isfinite(ends).all(dim=1)).tolist()
        flagged += [item for item, b in zip(device_items, bad) if b]
    flagged = sorted(flagged, key=lambda item: item[0])[:limit]
    found = []
    for device_items in _by_device(flagged, lambda item: item[1]).values():
        counts = torch.stack([torch.stack([torch.count_nonzero(t.isnan()), torch.count_nonzero(t.isinf())])
                              for _, t in device_items]).tolist()
        found += [(i, nans, infs) for (i, _), (nans, infs) in zip(device_items, counts)]
    return sorted(found)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` as ``clip_grad_norm_`` computes it (per-tensor norms,
    then their norm), so that clipping matches it bit for bit."""
    return torch.nn.utils.get_total_norm(grads, 2.0)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor gathered (a collective over its mesh), a tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


def _plain_parts(t: torch.Tensor):
    """The plain tensors that hold ``t``'s data: ``t`` itself, or, for a tensor
    subclass that wraps others (torch's ``__tensor_flatten__`` protocol: torchao's
    quantized optimizer states, codes plus scales plus a lookup table; a DTensor's local
    shard), its inner tensors, recursively. A wrapper has no storage of its own: its
    ``untyped_storage()`` cannot be read."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _plain_parts(getattr(t, name))
    else:
        yield t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count
    once; a tensor subclass counts by the plain tensors it wraps, :func:`_plain_parts`)."""
    seen, total = set(), 0
    for t in tensors:
        for part in _plain_parts(t):
            storage = part.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class ParamStore:
    """The interface (module docstring): every member that the optimizer, the
    gradient exchange and the checkpoints use is declared here, so that a store is
    whole without probing. Subclasses set the attributes below.

    Attributes:
        kind: ``"flat"``, ``"per-tensor"`` or ``"sharded"``.
        params: every parameter the inner optimizer holds, in its order.
        stepped: what the inner optimizer steps in their place (a master, or the
            parameter itself), in the same order.
        group: the process group over which the overflow flag and the norm are
            reduced (None: the optimizer's ``process_group``).
        has_fp16: whether any computation is in fp16 (``loss_scale="dynamic"``
            scales only then).
        compute_dtype: the 16-bit dtype the model computes in: float16 where any
            parameter is fp16, else bfloat16 where any is, else float32 (a sharded
            model's: FSDP2's ``param_dtype``).
        has_half: whether any parameter is 16-bit (so masters mean anything).
        accumulates: the store sums the micro-batches' 16-bit gradients in fp32
            (``accumulate_dtype=torch.float32``).
        device: where the optimizer's small tensors (its rounding generator) live.
    """

    kind = "abstract"
    group = None
    shards_gradients = False  # each rank holds a part of every gradient (their counts add up across ranks)
    hooks_gradients = True  # autograd's hooks on ``params`` see their gradients arrive
    accumulates = False

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.stepped: list[torch.Tensor] = []
        self.has_fp16 = False
        self.has_half = False
        self.compute_dtype = torch.float32
        self.device = torch.device("cpu")

    # ---------------------------------------------------------------- what it refuses

    @classmethod
    def refusal(cls, *, process_group, model) -> str | None:
        """Why an optimizer cannot be built over this kind of store with this model and
        group, in one line, or None (mpfp16.options.check_options says what the
        options alone refuse)."""
        return None

    def fused_unsupported(self) -> str | None:
        """Why mpfp16's fused step cannot run over this store, or None."""
        return "this store has no fused step"

    @property
    def fused(self) -> bool:
        return False

    def use_fused(self, requested: bool) -> None:
        """Step with mpfp16's fused kernels (only where :meth:`fused_unsupported` is None)."""
        raise NotImplementedError

    def explain(self) -> str:
        """One line for the log: which store, and why."""
        return self.kind

    # ---------------------------------------------------------------- the phases

    def check_ready(self) -> None:
        raise NotImplementedError

    def gradients_present(self) -> bool | None:
        """Whether a gradient reached the parameters, when the store can tell by
        looking (None: the optimizer's backward hooks tell)."""
        return None

    def no_gradient_message(self) -> str:
        return ("step() was called but no backward pass reached the parameters since the last step(): call "
                "opt.backward(loss) first")

    def prepare(self, fp32_grads: bool, with_norm: bool = False, group=None, agree: bool = True) -> None:
        """Make ready what the step needs before it writes anything (compile, agreed
        across the ranks of ``group`` unless ``agree`` is False); with ``with_norm``,
        what a step that computes the gradient norm needs too."""

    def use_unfused(self) -> None:
        """After a failed compile: take the unfused step from now on."""

    def zero_grad(self, set_to_none: bool) -> None:
        raise NotImplementedError

    # fp32 accumulation (``accumulates``): the optimizer opens the sums at the first
    # backward of a step and adds each backward's gradients in; the gradient exchange
    # finds them by parameter (mpfp16.parallel.accumulation), registered by the optimizer.

    def sum_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, its fp32 sum)`` for every parameter whose gradients are summed."""
        return []

    def open_sums(self) -> None:
        """The first backward of a step: the fp32 sums start at zero."""

    def accumulate(self) -> None:
        """After a backward: the fresh 16-bit gradients into the fp32 sums, and zeroed."""

    def unscale(self, state, scale: float, materialize: bool, with_norm: bool) -> torch.Tensor:
        """Phase 2: fp32 gradients = gradients / ``scale`` and [found_inf]; what the
        store learns on the way goes into ``state`` (a :class:`mpfp16.step_state.StepState`)."""
        raise NotImplementedError

    def grad_norm(self, state) -> torch.Tensor:
        raise NotImplementedError

    def update(self, state, scale: float, clip_coef: torch.Tensor | None, rng: torch.Generator) -> None:
        raise NotImplementedError

    def copy_back(self) -> None:
        raise NotImplementedError

    def nonfinite_grads(self, state, limit: int, before_unscale: bool = False) -> list[tuple[int, int, int]]:
        """``(index in params, NaN count, inf count)`` of the first ``limit``
        parameters (in ``params`` order) whose gradient holds inf or NaN, as the step's
        :meth:`unscale` read it (:func:`find_nonfinite`); with ``before_unscale``, as
        an unscale would read it now (mpfp16.compat.apex finds overflows before it
        unscales). Called only once a step was found to overflow, before the gradients
        are zeroed; this rank's gradients alone (a sharded store's: its shards)."""
        raise NotImplementedError

    def skip(self) -> None:
        """After a skipped step (the gradients were zeroed): free what a step holds."""

    def copy_masters_to_model(self) -> None:
        """Round the fp32 masters into the 16-bit model now."""

    def invalidate(self) -> None:
        """The inner optimizer's state was replaced (``load_state_dict``)."""

    # ---------------------------------------------------------------- memory and state

    def memory(self) -> dict[str, float]:
        raise NotImplementedError

    def param_state(self) -> list[dict]:
        """Per parameter, in ``params`` order, its part of the state_dict
        (mpfp16/state_format.py): ``{"master": its fp32 value or None}``, and
        ``"compensation"`` where Kahan rounding keeps one."""
        raise NotImplementedError

    def saved_dtypes(self) -> list[str | None]:
        """Per parameter, the dtype the model holds it in, as the state_dict records
        it (``"float16"``); None where the model holds another than it computes in (a
        sharded model's fp32 shards)."""
        return [str(p.dtype).replace("torch.", "") for p in self.params]

    def check_state(self, entries: list[dict], legacy: dict) -> None:
        """Raise ValueError (one line) where the saved per-parameter ``entries`` (in
        ``params`` order) do not fit this store; ``legacy``: what a state of an earlier
        form kept per store (a Kahan compensation buffer per group)."""

    def like_stepped(self, index: int, t: torch.Tensor) -> torch.Tensor:
        """A saved tensor of parameter ``index``'s shape (the inner optimizer's state),
        plain or a DTensor, as this store steps it."""
        raise NotImplementedError

    def load_state(self, entries: list[dict], legacy: dict) -> None:
        """Take the saved masters, whichever store saved them, and make the model's
        weights agree with them."""
        raise NotImplementedError
