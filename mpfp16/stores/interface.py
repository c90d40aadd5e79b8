"""The interface every parameter store implements: the few verbs a step needs.

A store is where the parameters an :class:`mpfp16.FP16Optimizer` steps live, with
their gradients, their fp32 masters and the inner optimizer's state. The optimizer
runs the step's phases in its fixed order (mpfp16/optimizer.py) and asks the store,
through these verbs alone, for each part that depends on the layout:

``check(fp32_grads, with_norm, group, agree) -> bool | None``
    phase 1: raise (one line) where the step may not read its gradients or step its
    state: a parameter left its storage, a state tensor of the inner optimizer is not
    one it can step; re-read the master of a weight written from outside; make ready
    (and agree across ``group``) the kernels the step needs. Returns whether a
    gradient reached the parameters, where the store can tell by looking (None: the
    optimizer's backward hook tells).
``unscale(scale, materialize, with_norm) -> Checked``
    phase 2: the gradients divided by the loss scale, and whether any is inf or NaN;
    ``materialize`` asks for the unscaled fp32 gradients in the masters' ``.grad``
    (``FP16Optimizer.unscale_()``).
``norm(checked) -> Tensor``
    phase 4: the global 2-norm of the unscaled gradients of the parameters stepped.
``update(checked, scale, clip_coef, rng)``, ``copy_back()``
    phases 5 and 6: the inner optimizer's arithmetic on the fp32 values, then the
    16-bit weights from them. ``copy_back()`` outside a step copies the masters into
    the model (code that stepped the inner optimizer itself).
``zero(set_to_none)``
    the gradients zeroed, and what a step holds freed (after a skipped step too).
``overflow(checked, limit, before_unscale) -> [(index, nans, infs)]``
    after a step found an overflow: which parameters' gradients hold inf or NaN.
``accumulate(first)``
    fp32 accumulation: after a backward, its 16-bit gradients into the fp32 sums.
``state_out()``, ``state_in(entries, legacy, load_inner)``, ``memory()``
    the per-parameter state (mpfp16/state_format.py's form) out and in; the bytes held.

It also says what it is, in attributes it sets once (:class:`ParamStore`). A store is
chosen from the parameters (:meth:`ParamStore.claims`) by mpfp16/stores/build.py's
registry: a new store is one file with its subclass and one line there.

Every parameter the inner optimizer holds belongs to the store, frozen or not. A
parameter is stepped in a step when it requires grad at that step, as torch's
optimizers step a parameter whose ``.grad`` is set: a layer unfrozen after the
optimizer was built is stepped through its master from then on, and a layer frozen
mid-run stops moving (its momentum is not applied).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["ParamStore", "StoreOptions", "Checked", "HiddenGradients", "storage_bytes", "total_norm"]


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """What FP16Optimizer asks of its store (its arguments of the same names)."""

    master_weights: bool | str = True
    rounding: str = "nearest"
    accumulate: bool = False
    fused: bool | None = None
    state_dtypes: dict = dataclasses.field(default_factory=dict)
    state_rounding: str = "nearest"
    model: torch.nn.Module | None = None
    process_group: object = None
    reduce_overflow: bool = True
    labels: tuple[str, ...] = ()  # each parameter's name in messages ("fc.weight", "param 3 [64, 32]")


@dataclasses.dataclass(frozen=True)
class Checked:
    """What a store's :meth:`ParamStore.unscale` found, handed back to its later phases.

    Attributes:
        found_inf: [1.0] when a gradient holds inf or NaN, else [0.0] (fp32, on the
            device; the optimizer reduces it across ranks and reads it once).
        materialized: the unscaled fp32 gradients were written into the masters' ``.grad``.
        grad_sumsq: the sum of squares of the unscaled gradients, where the check
            found it in passing (the fused step), else None.
    """

    found_inf: torch.Tensor
    materialized: bool = False
    grad_sumsq: torch.Tensor | None = None


class HiddenGradients:
    """While hidden (``with HiddenGradients(tensors):``, or between :meth:`hide` and
    :meth:`restore`), ``tensors`` have no ``.grad``, so a torch optimizer's step leaves
    them, their momentum and their step counters alone, as it leaves a parameter without
    a gradient: how a store steps only the parameters that require grad now, or a chunk
    of them. Their gradients are back after, whatever the step raised."""

    def __init__(self, tensors) -> None:
        self.tensors = list(tensors)
        self._hidden: list = []

    def hide(self) -> None:
        self._hidden = [(t, t.grad) for t in self.tensors if t.grad is not None]
        for t, _ in self._hidden:
            t.grad = None

    def restore(self) -> None:
        for t, grad in self._hidden:
            t.grad = grad
        self._hidden = []

    def __enter__(self) -> HiddenGradients:
        self.hide()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` as ``clip_grad_norm_`` computes it (per-tensor norms,
    then their norm), so that clipping matches it bit for bit."""
    return torch.nn.utils.get_total_norm(grads, 2.0)


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
    """The interface (module docstring). Subclasses set these attributes when built,
    and implement the verbs.

    Attributes:
        kind: ``"flat"``, ``"per-tensor"`` or ``"sharded"``: a record (logs, the
            state_dict), never a branch.
        description: one line for the log: which store, and why.
        params: every parameter the inner optimizer holds, in its order.
        stepped: what the inner optimizer steps in their place (a master, or the
            parameter itself), in the same order.
        dtypes: per parameter, the dtype the model holds it in as the state_dict
            records it (``"float16"``); None where the model holds another than it
            computes in (a sharded model's fp32 shards).
        compute_dtype: the 16-bit dtype the model computes in: float16 where any
            parameter is fp16, else bfloat16 where any is, else float32 (a sharded
            model's: FSDP2's ``param_dtype``).
        has_half: whether any parameter is 16-bit (so that masters mean anything).
        device: where the optimizer's small tensors (its rounding generator) live.
        group: the process group over which the overflow flag and the norm are
            reduced (None: the optimizer's ``process_group``).
        fused: whether steps run mpfp16's fused kernels now.
        hooks_gradients: autograd's hooks on ``params`` see their gradients arrive.
        shards_gradients: each rank holds a part of every gradient (their counts
            of inf/NaN add up across ranks).
        accumulates: the store sums the micro-batches' 16-bit gradients in fp32.
        sums: ``(parameter, its fp32 sum)`` for each summed gradient (the gradient
            exchange finds them by parameter).
        no_gradient: the store's words for a step that no backward pass reached.
        noun, limits: the options this kind of store cannot take, each with why
            (mpfp16.options.check_options refuses them in one line, in the caller's words).
    """

    kind = "abstract"
    noun = "this store"  # in option refusals: "fused=True is not possible for a sharded model: ..."
    limits: dict = {}  # the options it cannot take ("fused", "accumulate_dtype", ...): why not, given ``say``
    description = ""
    group = None
    fused = False
    hooks_gradients = True
    shards_gradients = False
    accumulates = False
    has_half = False
    compute_dtype = torch.float32
    device = torch.device("cpu")
    no_gradient = ("step() was called but no backward pass reached the parameters since the last step(): call "
                   "opt.backward(loss) first")

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.stepped: list[torch.Tensor] = []
        self.dtypes: list[str | None] = []
        self.sums: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---------------------------------------------------------------- choosing one

    @classmethod
    def claims(cls, params: list[torch.Tensor]) -> bool:
        """Whether this kind of store holds ``params`` (the registry asks the kinds in
        order and takes the first that does)."""
        raise NotImplementedError

    @classmethod
    def refusal(cls, optimizer: torch.optim.Optimizer, options: StoreOptions) -> str | None:
        """Why this kind of store cannot hold ``optimizer``'s parameters with these
        options, in one line, or None (mpfp16.options.check_options says what the
        options alone refuse). Asked before anything is built."""
        return None

    # ---------------------------------------------------------------- the verbs

    def check(self, *, fp32_grads: bool, with_norm: bool, group=None, agree: bool = True) -> bool | None:
        raise NotImplementedError

    def unscale(self, scale: float, *, materialize: bool, with_norm: bool) -> Checked:
        raise NotImplementedError

    def norm(self, checked: Checked) -> torch.Tensor:
        raise NotImplementedError

    def update(self, checked: Checked, scale: float, clip_coef: torch.Tensor | None, rng: torch.Generator) -> None:
        raise NotImplementedError

    def copy_back(self) -> None:
        raise NotImplementedError

    def zero(self, set_to_none: bool) -> None:
        raise NotImplementedError

    def overflow(self, checked: Checked | None, limit: int, before_unscale: bool = False) -> list[tuple[int, int, int]]:
        """``(index in params, NaN count, inf count)`` of the first ``limit``
        parameters (in ``params`` order) whose gradient holds inf or NaN, as the step's
        :meth:`unscale` read it (``checked``); with ``before_unscale``, as an unscale
        would read it now (mpfp16.compat.apex finds overflows before it unscales). This
        rank's gradients alone (a sharded store's: its shards)."""
        raise NotImplementedError

    def accumulate(self, first: bool) -> None:
        """After a backward (``first``: the step's first): its fresh 16-bit gradients
        added into the fp32 sums, which the first opens at zero, and zeroed."""

    def state_out(self) -> list[dict]:
        """Per parameter, in ``params`` order, its part of the state_dict
        (mpfp16/state_format.py): ``{"master": its fp32 value or None}``, and
        ``"compensation"`` where Kahan rounding keeps one."""
        raise NotImplementedError

    def state_in(self, entries: list[dict], legacy: dict, load_inner) -> None:
        """Load a state_dict's per-parameter ``entries`` (in ``params`` order) and,
        through ``load_inner(like)``, the inner optimizer's state, each saved tensor
        made ``like(index, tensor)``, as this store steps it. Raise ValueError (one
        line) before anything is loaded where they do not fit; ``legacy``: what a
        state of an earlier form kept per store (a Kahan compensation per group)."""
        raise NotImplementedError

    def memory(self) -> dict[str, float]:
        raise NotImplementedError
