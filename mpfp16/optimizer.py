"""FP16Optimizer: fp32 master weights, loss scaling and one clean optimizer step.

The wrapper takes any ``torch.optim`` optimizer built over a 16-bit model's
parameters. Where the parameters live is a *store* (mpfp16/stores/), chosen from the
parameters: flat buffers (those :func:`mpfp16.to_half` made, adopted as they are, so
the wrapper may be built before or after DDP); per-tensor, for 16-bit parameters that
can no longer move (a ``.half()`` model already held by DDP); or FSDP2's shards, for a
model made by :func:`mpfp16.distributed.shard`. The masters replace the model's
parameters in the inner optimizer's ``param_groups``; fp32 parameters (normalization
layers) are stepped directly.

:meth:`FP16Optimizer.step` runs the project's step, in this order, each phase a
method below or the store's:

1. check ready: a backward pass reached the parameters, through ``backward()``;
2. unscale and find inf: fp32 gradients = 16-bit gradients / scale, and whether any
   is inf/NaN (done already if the user called ``unscale_()``);
3. agree across ranks: the flag is max-reduced, then read: the step's one host sync;
4. skip (scale backs off, nothing changes) or clip (the global norm);
5. update: the inner optimizer's arithmetic on the fp32 masters;
6. copy back: the new 16-bit weights;
7. update the scale.

The flat store runs phases 2, 5 and 6 unfused (the inner optimizer's own ``step()``)
or, for SGD, Adam and AdamW, fused (one compiled kernel per flat segment that does 5
and 6 in one pass, and reads the 16-bit gradients directly in 2).
"""

from __future__ import annotations

import logging
import numbers
import time
import weakref

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook

from .convert import HALF_DTYPES
from .errors import FusedStepUnavailable, compile_errors, library_words, one_line
from .parallel.base import (all_gather_object, any_rank, failures, get_rank, get_world_size, group_ranks,
                            is_main_process)
from .rounding import ROUNDINGS
from .scaler import DynamicLossScaler, LossScaler, LossScaleStuckError
from .stores import ParamStore, build_store, store_type
from .stores.flat import is_master
from .stores.fused import fast_path_flag, unsupported_reason

__all__ = ["FP16Optimizer", "check_options", "make_scaler", "upgrade_state_dict", "describe_overflow", "STATE_FORMAT",
           "OVERFLOW_REPORTED", "MASTER_WEIGHTS"]

logger = logging.getLogger("mpfp16")

_SUPPORTED_DTYPES = HALF_DTYPES + (torch.float32,)
FUSED_MIN_NUMEL = 1 << 20  # below this, fused=None keeps the unfused step (no compile time)
OVERFLOW_REPORTED = 8  # parameters last_overflow names after a skipped step (the first, in parameter order)
OVERFLOW_NAMED = 3  # of those, how many the skip's log line and LossScaleStuckError name
STATE_FORMAT = "mpfp16.FP16Optimizer/2"
# Formats written by earlier versions, and the store that wrote them.
_EARLIER_FORMATS = {"mpfp16.FP16Optimizer/1": "flat", "mpfp16.FP16Optimizer/sharded-1": "sharded"}
_LOCAL_STORES = ("flat", "per-tensor")  # the same state layout: either loads the other's


ACCUMULATE_DTYPES = (None, torch.float32)  # accumulate_dtype's choices; None: the model's 16-bit dtype, as apex
# master_weights' choices: fp32 masters; none (the 16-bit weights stepped directly); or, for bf16, the fp32 masters
# held exactly as the bf16 weights and an int16 remainder each (docs/REMAINDER.md)
MASTER_WEIGHTS = (True, False, "remainder")


def _group_params(groups: list[dict]) -> list[tuple[int, ...]]:
    """The identities of each param group's parameters, in order."""
    return [tuple(map(id, group["params"])) for group in groups]


def _master_mode(master_weights) -> str:
    """``FP16Optimizer.master_mode`` for a ``master_weights`` option."""
    if isinstance(master_weights, str):
        return master_weights
    return "fp32" if master_weights else "none"


def _check_remainder(*, rounding: str, sharded: bool, dtypes, say) -> None:
    """The rules of ``master_weights="remainder"``: bf16 parameters only, unsharded,
    rounded to nearest (``dtypes``: the parameters' dtypes, where known)."""
    asked = say("master_weights", "remainder")
    if sharded:
        raise ValueError(f"{asked} is not possible for a sharded model: its fp32 shards are FSDP2's own parameters, "
                         "from which it makes the bf16 weights at each forward and frees them after, so there is no "
                         f"bf16 weight kept to hold the rest of a master; drop {asked}")
    if rounding != "nearest":
        raise ValueError(f"{say('rounding', rounding)} is for 16-bit weights stepped without masters; {asked} keeps "
                         "exact fp32 masters, whose bf16 weights are their rounding to nearest")
    if dtypes is None:
        return
    if torch.float16 in dtypes:
        raise ValueError(f"{asked} needs bf16 parameters, and these include float16: a bf16 value is the upper half "
                         "of an fp32 one (the same sign and 8-bit exponent), so the lower 16 bits make the master "
                         "exact; fp16 has a 5-bit exponent and 10 mantissa bits, so it is not (every fp32 value above "
                         "65520 rounds to the one fp16 inf, the tiny ones to 0: far more than 16 bits tell apart); "
                         f"keep fp32 masters ({say('master_weights', True)})")
    if torch.bfloat16 not in dtypes:
        raise ValueError(f"{asked} needs bf16 parameters and there are none: fp32 parameters are stepped as they "
                         f"are, with no masters to hold; drop {asked}")


def _is_number(value) -> bool:
    """A real number, not a bool (``True`` is an int to Python, and was taken as 1.0)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_types(*, say, **options) -> None:
    """Each option of :func:`check_options` of its type, or one line naming it: a string
    ``max_grad_norm="1.0"`` failed later inside a comparison, ``True`` was taken as 1.0,
    and ``master_weights=None`` as no masters."""
    rules = {
        "master_weights": (lambda v: isinstance(v, (bool, str)), "True, False or 'remainder'"),
        "rounding": (lambda v: isinstance(v, str), f"one of {', '.join(map(repr, ROUNDINGS))}"),
        "max_grad_norm": (lambda v: v is None or _is_number(v), "a number or None"),
        "fused": (lambda v: v is None or isinstance(v, bool), "True, False or None"),
        "sharded": (lambda v: isinstance(v, bool), "True or False"),
        "reduce_overflow": (lambda v: isinstance(v, bool), "True or False"),
    }
    for name, value in options.items():
        right, what = rules[name]
        if not right(value):
            raise TypeError(f"{say(name, value)} must be {what}, not {type(value).__name__}")


def check_options(*, master_weights: bool | str = True, rounding: str = "nearest", max_grad_norm: float | None = None,
                  fused: bool | None = None, sharded: bool = False, reduce_overflow: bool = True,
                  accumulate_dtype: torch.dtype | None = None, dtypes=None, say=library_words) -> None:
    """The rules between FP16Optimizer's options, in one place: the constructor calls
    it, and so does a front end (the training scripts' config) that wants to refuse a
    combination before building anything.

    Args:
        sharded: the model is sharded (:func:`mpfp16.distributed.shard`).
        dtypes: the parameters' dtypes, where known (the constructor's; a front end
            passes its compute dtype): ``master_weights="remainder"`` needs bf16
            parameters and no fp16 ones.
        say: ``say(name, value)`` words an option as the caller spells it (default
            ``name=value``; the scripts say ``--no-master-weights``).

    Raises:
        ValueError: one line naming the options in the caller's words.
    """
    _check_types(master_weights=master_weights, rounding=rounding, max_grad_norm=max_grad_norm, fused=fused,
                 sharded=sharded, reduce_overflow=reduce_overflow, say=say)
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"{say('max_grad_norm', max_grad_norm)} must be positive or None")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    if isinstance(master_weights, str) and master_weights not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights must be True, False or 'remainder', got {master_weights!r}")
    if master_weights == "remainder":
        _check_remainder(rounding=rounding, sharded=sharded, dtypes=dtypes, say=say)
    if rounding != "nearest" and master_weights:
        raise ValueError(f"{say('rounding', rounding)} needs {say('master_weights', False)}: it rounds 16-bit "
                         "weights stepped directly")
    if accumulate_dtype not in ACCUMULATE_DTYPES:
        raise ValueError(f"{say('accumulate_dtype', accumulate_dtype)} must be None (the model's 16-bit dtype) or "
                         "torch.float32")
    if not sharded:
        return
    where = "a sharded model"
    if accumulate_dtype is not None:
        raise ValueError(f"{say('accumulate_dtype', accumulate_dtype)} is not possible for {where}: FSDP2 sums the "
                         "micro-batches' unsharded gradients itself, in its reduce_dtype: for an fp32 sum, shard with "
                         f"{say('reduce_dtype', torch.float32)} instead")
    if not master_weights:
        raise ValueError(f"{say('master_weights', False)} has no meaning for {where}: its sharded fp32 parameters "
                         "are the master weights, from which FSDP2 makes the 16-bit weights at each forward; drop "
                         f"{say('master_weights', False)}, or train without masters unsharded")
    if fused:
        raise ValueError(f"{say('fused', True)} is not possible for {where}: mpfp16's fused step works on flat "
                         "buffers, and the inner optimizer's own step runs on the shards (build it with fused=True "
                         f"for torch's fused kernel); drop {say('fused', True)}")
    if not reduce_overflow:
        raise ValueError(f"{say('reduce_overflow', False)} is not possible for {where}: each rank sees only its "
                         "own shards' inf/NaN, so the ranks would make different skip decisions")


def make_scaler(loss_scale, compute_dtype: torch.dtype) -> LossScaler:
    """The scaler FP16Optimizer's ``loss_scale`` option means for a model that computes
    in ``compute_dtype``: ``"dynamic"`` is a :class:`DynamicLossScaler` for fp16 and no
    scaling otherwise (bf16 and fp32 have fp32's exponent range); a number is a static
    scale; None is no scaling; a :class:`LossScaler` is used as it is.

    A scale other than 1 over a model that computes in bf16 is refused, as the
    training scripts refuse ``--loss-scale`` with ``--precision bf16``: bf16 gradients
    cannot underflow where fp32 ones would not, so the scale only multiplies and
    divides. An fp32 model may take one: its user may compute in fp16 under
    ``torch.autocast``, whose fp16 activation gradients can underflow.

    Raises:
        ValueError, TypeError: one line naming the option.
    """
    if isinstance(loss_scale, LossScaler):
        scaler = loss_scale
    elif loss_scale is None:
        scaler = LossScaler(1.0)
    elif isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f"loss_scale must be 'dynamic', a number, None or a LossScaler; got {loss_scale!r}")
        scaler = DynamicLossScaler() if compute_dtype == torch.float16 else LossScaler(1.0)
    elif _is_number(loss_scale):
        scaler = LossScaler(float(loss_scale))
    else:
        raise TypeError(f"loss_scale must be 'dynamic', a number, None or a LossScaler; got {type(loss_scale).__name__}")
    if compute_dtype == torch.bfloat16 and (scaler.dynamic or scaler.scale != 1.0):
        shown = repr(loss_scale) if not isinstance(loss_scale, LossScaler) else repr(scaler)
        raise ValueError(f"loss_scale={shown} over a model that computes in bfloat16: bf16 has fp32's exponent "
                         "range, so its gradients need no loss scaling; pass loss_scale=None (or 'dynamic', which "
                         "means no scaling for bf16)")
    return scaler


def describe_overflow(report: list[dict], named: int = OVERFLOW_NAMED) -> str:
    """``last_overflow`` in words: ``nan in fc.weight (12), inf in fc.bias (3) and 2
    more, the loss non-finite on rank 1``; ``""`` for ``[]``."""
    words = ", ".join(f"{e['kind']} in {e['name']} ({e['count']})" for e in report[:named])
    if len(report) > named:
        words += f" and {len(report) - named} more"
    ranks = report[0]["ranks"] if report else []
    if ranks:
        words += f", the loss non-finite on rank{'s' * (len(ranks) > 1)} {', '.join(str(r) for r in ranks)}"
    return words


def upgrade_state_dict(state_dict) -> dict:
    """An FP16Optimizer state_dict in this version's format: one written by an earlier
    version gets the keys it lacked (its store, its parameters' names; the sharded one
    keyed its state by name).

    Raises:
        ValueError: it is not an FP16Optimizer state_dict.
    """
    if not isinstance(state_dict, dict) or (state_dict.get("format") != STATE_FORMAT
                                             and state_dict.get("format") not in _EARLIER_FORMATS):
        raise ValueError(f"not an FP16Optimizer state_dict (no 'format': '{STATE_FORMAT}' entry)")
    if state_dict["format"] == STATE_FORMAT:
        return state_dict
    store = _EARLIER_FORMATS[state_dict["format"]]
    upgraded = {"store": store, "param_names": None, **state_dict, "format": STATE_FORMAT}
    if store == "sharded":
        names = list(state_dict["param_names"])
        index = {name: i for i, name in enumerate(names)}
        saved = state_dict["optimizer"]
        upgraded["optimizer"] = {
            "state": {index[name]: s for name, s in saved["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]],
        }
        upgraded.update(master_params=[None] * len(names), kahan_compensation=[], rounding="nearest",
                        master_weights=True, param_dtypes=["float32"] * len(names))
    return upgraded


class FP16Optimizer(torch.optim.Optimizer):
    """Mixed-precision wrapper around a ``torch.optim`` optimizer.

    The step in the order users write it::

        opt.zero_grad()
        opt.backward(loss)                  # (loss.float() * loss_scale).backward()
        opt.unscale_()                      # optional: unscaled fp32 grads in opt.master_params()
        torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)
        opt.step()                          # False when skipped (inf/NaN gradients)

    Args:
        optimizer: any ``torch.optim.Optimizer`` built over the model's parameters
            (fp16, bf16 or fp32), after :func:`mpfp16.to_half` (or
            :func:`mpfp16.flatten_parameters`) and before or after wrapping the model
            in DDP; or over a model sharded by :func:`mpfp16.distributed.shard`. It
            stays reachable as ``.optimizer``.
        loss_scale: ``"dynamic"`` (a :class:`DynamicLossScaler`; for a model that
            computes in no fp16, bf16 or fp32, it means no scaling), a float (a static
            scale), ``None`` (no scaling; non-finite gradients still skip the step),
            or a :class:`LossScaler` instance.
        master_weights: keep fp32 masters of the 16-bit parameters. ``False`` steps
            the 16-bit weights directly: the update is computed in fp32 inside
            ``step()`` and the new weight is rounded to the parameter's dtype, and no
            fp32 copy of the weights exists between steps. ``"remainder"`` (bf16
            parameters only): the fp32 masters are kept exactly, but as the bf16
            weights and an int16 remainder per parameter, 2 bytes where an fp32
            master takes 4; each step rebuilds them bit for bit, steps them, and
            splits them again, and the bf16 weight is the master rounded to nearest
            with ties away from zero (round-to-nearest-even cannot be exact in 16
            bits: docs/REMAINDER.md). Then ``master_weights`` is True and
            ``master_mode`` is ``"remainder"`` (``"fp32"`` or ``"none"`` otherwise);
            the state_dict holds fp32 masters, and loads with either.
        max_grad_norm: clip the global 2-norm of the unscaled fp32 gradients.
        model: if given, every parameter of ``optimizer`` must belong to it, and the
            state_dict names them. Required for a sharded model.
        track_grad_norm: compute ``last_grad_norm`` even when not clipping.
        process_group: under torch.distributed, the ranks that must agree on skipping
            a step (default: all). The overflow flag is max-reduced across them, so
            every rank skips together even when only one rank's gradients overflowed
            outside the data-parallel allreduce. A sharded model reduces it over the
            group it is sharded over, as it reduces the gradient norm.
        reduce_overflow: set False when this rank steps alone while others run
            (a single-process baseline inside a distributed job); also an attribute.
            Refused for a sharded model, whose ranks each see only their shards.
        fused: run the step of an SGD, Adam or AdamW inner optimizer as one compiled
            kernel per flat buffer segment (mpfp16/stores/fused.py), with no fp32
            gradient buffer: bit-identical for SGD; for Adam the parameters differ in
            the last bits where torch's CPU sqrt is not correctly rounded.
            ``None`` (default): when supported and either the model has at least 1M
            parameters (compiling takes seconds) or the inner optimizer was built
            with ``fused=True`` or ``foreach=True`` (asking for the fast step; where
            it cannot be taken, one log line says why, and the inner optimizer's own
            step runs over the masters); ``True``: always (an error where it is not
            supported); ``False``: never. The kernels compile before the first step
            that needs them; if that fails on any rank, ``fused=True`` raises on every
            rank before anything is stepped, and ``None`` puts every rank on the
            unfused step with one warning, so the ranks never take different paths.
        rounding: how a new weight is rounded to 16 bits without master weights:
            ``"nearest"`` (updates under half an ulp vanish), ``"stochastic"``
            (unbiased: up or down at random, in proportion to the distance; seeded by
            ``rounding_seed``, its generator state is in the state_dict) or
            ``"kahan"`` (a 16-bit compensation buffer carries each rounding's error
            into the next update; 2 more bytes per parameter). With master weights
            only ``"nearest"`` applies.
        accumulate_dtype: how the gradients of a step's micro-batches are summed.
            ``None`` (default): in the model's 16-bit ``.grad``, as apex does (each
            addition rounds to 16 bits). ``torch.float32``: each :meth:`backward` adds
            the fresh 16-bit gradients into fp32 buffers and zeroes them, and
            ``step()`` unscales the fp32 sum (4 bytes per 16-bit parameter, also with
            the fused step). The sum belongs to one step: the first backward after a
            step or ``zero_grad()`` starts it at zero. Under DDP wrapped by
            :func:`mpfp16.distributed.wrap`, the one exchange of a step (the last
            micro-batch, outside ``sync_gradients(model, False)``) carries the sum:
            the 16-bit rounding of (fp32 sum + that micro-batch), or with
            ``allreduce_dtype=torch.float32`` the fp32 sum itself
            (:mod:`mpfp16.parallel.accumulation`). A step whose sum no exchange carried
            while this rank steps with others (a stock DDP) raises; so do gradients
            computed outside :meth:`backward`. Refused for a sharded model (FSDP2 sums
            in its ``reduce_dtype``).

    Every parameter the inner optimizer holds belongs to the store, frozen or not, and
    is stepped in a step where it requires grad: a layer unfrozen after the optimizer
    was built is stepped through its master from then on, and a layer frozen mid-run
    stops moving. In flat buffers the gradients are persistent, so ``zero_grad()``
    zeroes them in place (one fill per buffer) whatever ``set_to_none`` says, and a
    parameter that requires grad but got no gradient in a step is stepped with a zero
    gradient, as torch does after ``zero_grad(set_to_none=False)``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        loss_scale: str | float | LossScaler | None = "dynamic",
        master_weights: bool | str = True,
        max_grad_norm: float | None = None,
        *,
        model: torch.nn.Module | None = None,
        track_grad_norm: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduce_overflow: bool = True,
        fused: bool | None = None,
        rounding: str = "nearest",
        rounding_seed: int = 0,
        accumulate_dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(optimizer, FP16Optimizer):
            raise TypeError("the optimizer is already an FP16Optimizer; wrap the inner optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16Optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model= must be the torch.nn.Module the parameters belong to, not {type(model).__name__}")
        if not isinstance(track_grad_norm, bool):
            raise TypeError(f"track_grad_norm={track_grad_norm!r} must be True or False, not {type(track_grad_norm).__name__}")
        if not isinstance(rounding_seed, int) or isinstance(rounding_seed, bool):
            raise TypeError(f"rounding_seed={rounding_seed!r} must be an int, not {type(rounding_seed).__name__}")
        self.optimizer = optimizer
        params = self._held_params(model)
        kind = store_type(params)
        check_options(master_weights=master_weights, rounding=rounding, max_grad_norm=max_grad_norm, fused=fused,
                      sharded=kind.kind == "sharded", reduce_overflow=reduce_overflow,
                      accumulate_dtype=accumulate_dtype, dtypes={p.dtype for p in params})
        refusal = kind.refusal(process_group=process_group, model=model)
        if refusal:
            raise ValueError(refusal)
        self.rounding = rounding
        self.master_weights = bool(master_weights)  # "remainder" keeps masters too (held otherwise): True
        self.master_mode = _master_mode(master_weights)
        self.max_grad_norm = max_grad_norm
        self.track_grad_norm = bool(track_grad_norm)
        self.reduce_overflow = reduce_overflow
        self.skipped_steps = 0
        self.iteration = 0  # optimizer steps attempted, skipped ones included
        self._last_grad_norm: torch.Tensor | None = None
        self._last_overflow: list[dict] = []
        self._loss_finite: torch.Tensor | None = None  # isfinite(loss) of this step's backward() calls, on device

        reason = unsupported_reason(optimizer)
        if fused and reason:
            raise ValueError(f"fused=True is not possible: {reason}")
        self.accumulate_dtype = accumulate_dtype
        masters = "remainder" if self.master_mode == "remainder" else self.master_weights
        self.store: ParamStore = build_store(optimizer, params, model=model, master_weights=masters,
                                             rounding=rounding, accumulate=accumulate_dtype is not None)
        # The ranks that agree on a skip: those the store reduces its norm over, if it
        # reduces one (a sharded model's mesh), else the caller's group.
        self.process_group = self.store.group if self.store.group is not None else process_group
        reason = reason or self.store.fused_unsupported()
        if fused and reason:
            raise ValueError(f"fused=True is not possible: {reason}")
        if is_main_process():  # flat buffers are the rule; say so only when another store was chosen
            logger.log(logging.DEBUG if self.store.kind == "flat" else logging.INFO, "FP16Optimizer: %s",
                       self.store.explain())
        names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
        self._names = [names.get(id(p)) for p in params] if model is not None else None
        self.scaler = make_scaler(loss_scale, self.store.compute_dtype)
        self._rounding_rng = torch.Generator(device=self.store.device)
        self._rounding_rng.manual_seed(rounding_seed)

        # Replace each 16-bit parameter by its master in the inner optimizer.
        to_master = {id(p): m for p, m in zip(self.store.params, self.store.stepped)}
        for group in optimizer.param_groups:  # in place: LBFGS keeps a reference to its group's list
            group["params"][:] = [to_master.get(id(p), p) for p in group["params"]]
        self._shapes = [list(p.shape) for p in params]
        self._dtypes = [str(p.dtype).replace("torch.", "") for p in params]

        numel = sum(p.numel() for p in params)
        asked = fast_path_flag(optimizer)  # the inner optimizer's fused=True / foreach=True
        use_fused = fused if fused is not None else (reason is None and (numel >= FUSED_MIN_NUMEL or asked is not None))
        if asked and not use_fused and is_main_process():
            self._explain_no_fused_step(asked, unsupported_reason(optimizer), self.store.fused_unsupported())
        if use_fused:
            self.store.use_fused()
        self._fused_requested = fused is True
        self._prepared: set[tuple[bool, bool]] = set()  # (fp32_grads, with_norm) the kernels are compiled for

        # torch.optim.Optimizer's own set-up (hooks, the step patch schedulers rely on),
        # over the inner optimizer's groups; then share its param_groups and state, so
        # that a scheduler that changes lr changes what is stepped.
        self._constructing = True
        # The base gets copies of the group dicts, so that the inner groups' own params lists stay.
        super().__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self._constructing = False
        self._share_inner_state()

        # The misuse guard: which backward passes reached the parameters, and whether
        # they ran inside backward(). A flag, not a count: nested graph tasks
        # (reentrant activation checkpointing) fire the hook more than once per pass.
        self._in_backward = False
        self._grad_hook = None
        self._hooked_for: tuple | None = None  # the requires_grad pattern the hook was registered for
        self._new_step()
        self._watch_gradients()

    def _share_inner_state(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults
        self._held_groups = _group_params(self.param_groups)  # what the store holds, group by group

    def _check_groups(self) -> None:
        """Refuse, in one line, a change to the inner optimizer's groups since it was
        wrapped: a group added through the inner optimizer (``inner.add_param_group``,
        torch's fine-tuning idiom, which :meth:`add_param_group` refuses on the
        wrapper), a group removed, parameters added to or taken from a group, or the
        groups replaced (``inner.load_state_dict`` called directly, which loads neither
        the masters nor the scaler, and leaves this wrapper's ``param_groups`` on the
        old list). The store holds the parameters of construction alone: a parameter
        it does not hold has no fp32 master and its gradient is still scaled, so it
        would be stepped 16-bit and loss-scale times too far, or never. Every rank runs
        the same code over the same groups, so every rank refuses at the same call."""
        groups = self.optimizer.param_groups
        if groups is not self.param_groups:
            raise RuntimeError(
                "the inner optimizer's param_groups were replaced after FP16Optimizer wrapped it (its own "
                "load_state_dict, or an assignment), so the masters, the scaler and this wrapper's param_groups no "
                "longer go with them: load checkpoints through FP16Optimizer.load_state_dict")
        now = _group_params(groups)
        if now == self._held_groups:
            return
        held = self._held_groups
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

    # ----------------------------------------------------------------- construction

    def _held_params(self, model: torch.nn.Module | None) -> list[torch.Tensor]:
        """Every parameter the inner optimizer holds, in its order, checked."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if getattr(self.optimizer, "state", None) and any(self.optimizer.state.values()):
            raise ValueError(
                "the optimizer already has state: wrap it before its first step, and load "
                "checkpoints through FP16Optimizer.load_state_dict"
            )
        if model is not None:
            owned = {id(p) for p in model.parameters()}
            foreign = [p for p in params if id(p) not in owned]
            if foreign:
                raise ValueError(
                    f"{len(foreign)} of the optimizer's parameters are not parameters of the "
                    f"model (the first has shape {list(foreign[0].shape)}): build the optimizer "
                    "over model.parameters()"
                )
        for i, p in enumerate(params):
            if is_master(p):
                raise ValueError("the optimizer holds the masters of another FP16Optimizer")
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(
                    f"parameter {i} (shape {list(p.shape)}) is {p.dtype}; FP16Optimizer "
                    "handles float16, bfloat16 and float32 parameters"
                )
            if not p.is_leaf:
                raise ValueError(f"parameter {i} (shape {list(p.shape)}) is not a leaf tensor")
        if not params:
            raise ValueError("the optimizer holds no parameter")
        return params

    def _explain_no_fused_step(self, asked: str, optimizer_reason: str | None, store_reason: str | None) -> None:
        """One line for an inner optimizer built with fused=True or foreach=True whose
        step is not mpfp16's fused one: its own step then runs over the fp32 masters."""
        name = type(self.optimizer).__name__
        own = f"torch's own {asked.split('=')[0]} step runs over the fp32 masters"
        if optimizer_reason is not None:
            logger.warning("%s(%s): mpfp16's fused step cannot take it (%s); %s", name, asked, optimizer_reason, own)
        elif store_reason is not None:
            logger.info("%s(%s): %s (mpfp16's fused step: %s)", name, asked, own, store_reason)
        else:  # FP16Optimizer(fused=False)
            logger.info("%s(%s) under FP16Optimizer(fused=False): %s, not mpfp16's fused step", name, asked, own)

    # ------------------------------------------------------------ Optimizer surface

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters the inner optimizer holds, in its order (that of
        :meth:`master_params` and of the state_dict's indices)."""
        return list(self.store.params)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the inner optimizer steps, in its parameter order: the
        masters of the 16-bit parameters and the fp32 parameters themselves (the
        shards of a sharded model). After :meth:`unscale_` their ``.grad`` holds the
        unscaled fp32 gradients. Without master weights, and with remainders
        (``master_weights="remainder"``), the masters of 16-bit parameters hold values
        only inside ``step()``; their gradients are there after ``unscale_()``."""
        return list(self.store.stepped)

    def param_names(self) -> list[str | None] | None:
        """The names (in ``model``) of :meth:`model_params`, when ``model=`` was given."""
        return None if self._names is None else list(self._names)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def fused(self) -> bool:
        """Whether steps run the fused kernels (False after a fallback)."""
        return self.store.fused

    @property
    def last_grad_norm(self) -> float | None:
        """Global 2-norm of the unscaled gradients of the last step, before clipping;
        None when neither clipping nor tracking, and after a skipped step."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    @property
    def last_overflow(self) -> list[dict]:
        """After a skipped step, the parameters whose gradient held inf or NaN: the
        first :data:`OVERFLOW_REPORTED` in parameter order, one dict each, plain values
        (JSON-serializable):

        - ``name``: the parameter's name in ``model=``, else ``"param 3 [64, 32]"``
          (its index in :meth:`model_params` and its shape);
        - ``kind``: ``"nan"`` if the gradient holds a NaN, else ``"inf"``;
        - ``count``: how many of its elements are of that kind (NaN wins: a gradient
          with both counts its NaNs);
        - ``ranks``: the ranks whose loss in ``backward()`` was inf or NaN this step
          (the same list in every entry; ``[]`` when every loss was finite: the
          overflow arose inside the backward pass).

        The gradients scanned are those the step read (the 16-bit ones, or the fp32
        ones where the step copied or summed them there), and only once a step was
        found to overflow: a clean step costs nothing more. Under torch.distributed
        the ranks' reports are gathered on the skip (every rank skips together), and
        every rank holds their union: a sharded model's counts add up its shards.
        ``[]`` before any step and after a clean one."""
        return self._last_overflow

    def add_param_group(self, param_group: dict) -> None:
        if self._constructing:  # torch.optim.Optimizer.__init__ registers the inner groups
            return super().add_param_group(param_group)
        raise NotImplementedError(
            "FP16Optimizer cannot add parameter groups after construction: build the inner "
            "optimizer with all of its groups, then wrap it"
        )

    def __repr__(self) -> str:
        return (
            f"FP16Optimizer(master_weights={self.master_weights if self.master_mode != 'remainder' else 'remainder'!r}, "
            f"scaler={self.scaler!r}, "
            f"max_grad_norm={self.max_grad_norm}, store={self.store.kind}, fused={self.fused},\n  {self.optimizer!r})"
        )

    # ------------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Run ``(loss.float() * loss_scale).backward(**kwargs)``; with
        ``accumulate_dtype=torch.float32``, then add the 16-bit gradients into the fp32
        sums and zero them."""
        scale = self.scaler.scale
        scaled_loss = loss.float() if scale == 1.0 else loss.float() * scale
        self._backward_scale = scale  # what the gradients are unscaled by, should the scale change before
        self._watch_gradients()
        if self.accumulate_dtype is not None:
            self.store.open_sums()
        # For last_overflow: whether this rank's loss was finite, on the device (no host sync).
        finite = torch.isfinite(loss.detach())
        finite = finite.all() if finite.dim() else finite
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        self._in_backward = True
        try:
            scaled_loss.backward(**kwargs)
        finally:
            self._in_backward = False
        if self.accumulate_dtype is not None:
            self.store.accumulate()
        if not self.store.hooks_gradients:  # the store's gradients arrive where no hook sees them (FSDP2)
            self._backward_ran = True
            self._grads_after_unscale |= self._unscaled is not None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient and start a new step: in flat buffers, in place, one fill
        per buffer (the gradients are views into persistent buffers), whatever
        ``set_to_none`` says; per tensor, as ``set_to_none`` says; a sharded model's
        gradients are dropped."""
        self.store.zero_grad(set_to_none)
        self._new_step()
        self._watch_gradients()

    def _new_step(self) -> None:
        self._grads_arrived = self._grads_outside_backward = self._grads_after_unscale = False
        self._backward_ran = False
        self._unscaled: torch.Tensor | None = None  # found_inf, once unscale_() ran in this step
        self._backward_scale: float | None = None
        self._loss_finite = None

    def _watch_gradients(self) -> None:
        """(Re-)register the hook that sees gradients arrive, over the parameters that
        require grad now: a parameter unfrozen since is watched from here on."""
        if not self.store.hooks_gradients:
            return
        pattern = tuple(p.requires_grad for p in self.store.params)
        if pattern == self._hooked_for:
            return
        if self._grad_hook is not None:
            self._grad_hook.remove()
            self._grad_hook = None
        self._hooked_for = pattern
        watched = [p for p in self.store.params if p.requires_grad]
        if not watched:
            return
        ref = weakref.ref(self)

        def on_backward(_grad):
            opt = ref()
            if opt is not None:
                opt._grads_arrived = True
                opt._grads_outside_backward |= not opt._in_backward
                opt._grads_after_unscale |= opt._unscaled is not None

        self._grad_hook = register_multi_grad_hook(watched, on_backward, mode="any")

    @property
    def _grads_scale(self) -> float:
        """The scale the current gradients were computed with: that of the last
        backward() (a wrapper such as mpfp16.compat.apex may change the scale between
        backward and step, as apex does), or the scale now."""
        return self._backward_scale if self._backward_scale is not None else self.scaler.scale

    @torch.no_grad()
    def unscale_(self) -> None:
        """Unscale now, so that the gradients can be read or clipped before ``step()``.

        Afterwards ``opt.master_params()`` hold the unscaled fp32 gradients in their
        ``.grad``: ``torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)`` (or any
        clipping of your own) works, and ``step()`` does not unscale again. Calling it
        twice in a step does nothing the second time, as ``GradScaler.unscale_`` is
        meant to be called once. With the fused step it writes the fp32 gradients
        the fused step otherwise never materializes (4 bytes per parameter more).

        Raises:
            RuntimeError: a backward pass ran since the last ``unscale_()`` of this
                step (fp32 gradients are unscaled in place, so they cannot be
                unscaled again; so does ``step()`` then).
        """
        self._check_groups()
        if self._unscaled is not None:
            self._refuse_grads_after_unscale()
            return
        self._check_ready()
        self._prepare_store(fp32_grads=True)
        self._unscaled = self.store.unscale(self._grads_scale, materialize=True, with_norm=False)
        self._grads_after_unscale = False

    def _refuse_grads_after_unscale(self) -> None:
        if self._grads_after_unscale:
            raise RuntimeError("a backward pass ran after unscale_() in this step, so the gradients are no longer "
                               "unscaled: call unscale_() after the last backward, just before step()")

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        """The copy-back phase alone: round the fp32 masters into the 16-bit model now.
        ``step()`` does it; code that steps the inner optimizer itself (a closure-driven
        LBFGS, mpfp16.compat.apex) calls this between its steps. Without master weights
        there is nothing to copy, nor for a sharded model (the next forward gathers)."""
        self.store.copy_masters_to_model()

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """The step, phase by phase (module docstring). Returns False if it was skipped.

        Raises:
            LossScaleStuckError: the gradients kept overflowing at the lowest scale.
            RuntimeError: no backward pass reached the parameters since the last step,
                the gradients were not produced by :meth:`backward` while the loss
                scale is not 1, or a gradient arrived after :meth:`unscale_`.
        """
        if closure is not None:
            raise ValueError("FP16Optimizer.step() takes no closure: call backward() then step()")
        self._check_groups()
        found_inf = self._unscaled
        if found_inf is None:
            self._check_ready()
            self._prepare_store(fp32_grads=False)
            found_inf = self.store.unscale(self._grads_scale, materialize=False, with_norm=self._wants_norm)
        else:
            self._refuse_grads_after_unscale()
        overflow = self._agree_on_overflow(found_inf)
        self.iteration += 1
        loss_finite = self._loss_finite
        self._new_step()
        if overflow:
            self._skip(loss_finite)
            return False
        if self._last_overflow:
            self._last_overflow = []
        clip_coef = self._clip()
        self.store.update(clip_coef, self._rounding_rng)
        self.store.copy_back()
        self.scaler.update(False, step=self.iteration)
        return True

    # Phase 1: check ready.

    def _check_ready(self) -> None:
        self.store.check_ready()
        present = self.store.gradients_present()
        if present is None:  # the backward hook tells
            # A parameter unfrozen since the hook was registered is not watched: trust it.
            unwatched = tuple(p.requires_grad for p in self.store.params) != self._hooked_for
            arrived, outside = self._grads_arrived or unwatched, self._grads_outside_backward
        else:
            arrived, outside = present, present and not self._backward_ran
        if not arrived:
            raise RuntimeError(self.store.no_gradient_message())
        if self.accumulate_dtype is not None:
            self._check_sum_carried(outside)
        if self.scaler.scale != 1.0 and outside:
            raise RuntimeError(
                f"gradients were computed outside opt.backward() while the loss scale is "
                f"{self.scaler.scale:g}; they would be unscaled wrongly. Call opt.backward(loss)"
            )

    def _check_sum_carried(self, outside: bool) -> None:
        """With fp32 accumulation: refuse gradients that never reached the fp32 sum
        (computed outside ``backward()``), and, when this rank steps with others, a
        sum that no exchange carried: a stock DistributedDataParallel (or an allreduce
        of ``.grad`` by hand) sent the last micro-batch's gradient, or nothing, so
        the replicas would diverge. Every rank of such a job finds the same."""
        if outside:
            raise RuntimeError("gradients were computed outside opt.backward() with accumulate_dtype=torch.float32: "
                               "only opt.backward(loss) adds them into the fp32 sum, so they would be lost; call "
                               "opt.backward(loss)")
        if self.store.accumulates and not self.store.carried and self.reduce_overflow and (
                get_world_size(self.process_group) > 1):
            raise RuntimeError(
                "accumulate_dtype=torch.float32 under torch.distributed needs mpfp16's DDP hook: no exchange carried "
                "the fp32 gradient sum in this step (a stock DistributedDataParallel sends the last micro-batch's "
                "16-bit gradient, which is zero by then, or nothing), so the replicas would diverge; wrap the model "
                "with mpfp16.distributed.wrap, or pass reduce_overflow=False if this rank trains alone")

    def _prepare_store(self, fp32_grads: bool) -> None:
        """Before the first step that needs them: let the store compile its kernels
        (those that read the 16-bit gradients, or with ``fp32_grads`` also those that
        read the fp32 gradients ``unscale_()`` makes, whenever ``unscale_()`` is first
        called; the overflow check's variants that also sum the squares for the norm
        when a step first clips or tracks the norm), and make every rank take the same
        path.

        A compile can fail on one rank only (a node without a working compiler, a full
        disk), so the outcome is gathered across the process group, before anything
        is written. If any rank failed, ``fused=True`` raises on every rank, naming
        the ranks and the reason; the default (``fused=None``) moves every rank to the
        unfused step, with one warning. Errors other than compile errors are not caught."""
        with_norm = self._wants_norm  # the norm's variants compile when a step first needs them
        if not self.store.fused or (fp32_grads, with_norm) in self._prepared or (fp32_grads, True) in self._prepared:
            return
        error = None
        started = time.perf_counter()
        if is_main_process():  # the first step waits for this: say why, once per kernel set
            logger.info("fused step: compiling its kernels%s (they are kept on disk, so a later run starts sooner)",
                        " for unscale_()'s fp32 gradients" if fp32_grads else "")
        try:
            self.store.prepare(fp32_grads=fp32_grads, with_norm=with_norm)
        except compile_errors() as exc:  # evaluated only when prepare() raised
            error = f"{type(exc).__name__}: {one_line(exc)}"
        found = failures(error, group=self.process_group) if self.reduce_overflow else (
            {0: error} if error is not None else {})
        if not found:
            if is_main_process():
                logger.info("fused step: kernels ready in %.1f s", time.perf_counter() - started)
            self._prepared.add((fp32_grads, with_norm))
            if fp32_grads:
                self._prepared.add((False, with_norm))  # prepare(fp32_grads=True) compiles the 16-bit variants too
            return
        where = ", ".join(f"rank {rank}" for rank in found)
        reason = next(iter(found.values()))
        if self._fused_requested:
            raise FusedStepUnavailable(f"fused=True cannot be honoured: compiling the fused step failed on {where} "
                                       f"({reason})")
        if is_main_process():
            logger.warning("fused optimizer step unavailable: compiling failed on %s (%s); every rank uses the "
                           "unfused step", where, reason)
        self.store.use_unfused()

    # Phase 2 is the store's unscale(); phase 3: agree across ranks.

    @property
    def _wants_norm(self) -> bool:
        return self.max_grad_norm is not None or self.track_grad_norm

    def _agree_on_overflow(self, found_inf: torch.Tensor) -> bool:
        """Max-reduce the inf/NaN flag over the process group and read it: the step's
        one host synchronization. After DDP's allreduce the gradients already agree;
        this makes the decision agree whatever happened to them since."""
        if self.reduce_overflow:
            return any_rank(found_inf, group=self.process_group)
        return bool(found_inf[0].item())

    # Phase 4: skip, or clip.

    def _skip(self, loss_finite: torch.Tensor | None = None) -> None:
        """An inf/NaN gradient. Nothing is stepped; the scale backs off. First, while
        the gradients the step read are still there, :attr:`last_overflow` names the
        parameters that held it (``loss_finite``: what :meth:`backward` recorded)."""
        self.skipped_steps += 1
        self._last_grad_norm = None
        self._record_overflow(loss_finite)
        self.zero_grad()
        self.store.skip()
        old_scale = self.scaler.scale
        try:
            self.scaler.update(True, step=self.iteration)
        except LossScaleStuckError as exc:
            raise self._naming_culprits(exc) from None
        if is_main_process():
            found = describe_overflow(self._last_overflow)
            logger.info(
                "step %d skipped: inf/NaN in the gradients%s; loss scale %g -> %g (%d skipped so far)",
                self.iteration, f": {found}" if found else "", old_scale, self.scaler.scale, self.skipped_steps,
            )

    def _record_overflow(self, loss_finite: torch.Tensor | None, before_unscale: bool = False) -> None:
        """Set :attr:`last_overflow` from the store's scan of this rank's gradients
        (``before_unscale``: as an unscale would read them now), gathered over the
        process group: on a skip every rank of it is here (the skip was agreed), so
        the one all-gather is safe, and it runs on skipped steps only."""
        local = self.store.nonfinite_grads(OVERFLOW_REPORTED, before_unscale=before_unscale)
        bad_loss = loss_finite is not None and not bool(loss_finite)
        if self.reduce_overflow and get_world_size(self.process_group) > 1:
            reports = all_gather_object((local, bad_loss), group=self.process_group)
            ranks = group_ranks(self.process_group)
        else:
            reports, ranks = [(local, bad_loss)], [get_rank()]
        counts: dict[int, tuple[int, int]] = {}
        for entries, _ in reports:  # a sharded store's ranks count their own shards; replicas, the same gradient
            for index, nans, infs in entries:
                n, i = counts.get(index, (0, 0))
                counts[index] = (n + nans, i + infs) if self.store.shards_gradients else (max(n, nans), max(i, infs))
        loss_ranks = [rank for rank, (_, bad) in zip(ranks, reports) if bad]
        self._last_overflow = [
            {"name": self._param_label(index), "kind": "nan" if nans else "inf", "count": nans or infs,
             "ranks": list(loss_ranks)}
            for index, (nans, infs) in sorted(counts.items())[:OVERFLOW_REPORTED]]

    def _param_label(self, index: int) -> str:
        name = self._names[index] if self._names is not None else None
        return name if name is not None else f"param {index} {self._shapes[index]}"

    def _naming_culprits(self, exc: LossScaleStuckError) -> LossScaleStuckError:
        """``exc`` (the scaler's, which knows no names) with the parameters that held
        inf/NaN at the last step appended, still one line; also as ``.overflow``."""
        found = describe_overflow(self._last_overflow)
        error = LossScaleStuckError(f"{exc} At the last step: {found}." if found else str(exc))
        error.overflow = self._last_overflow
        return error

    def _clip(self) -> torch.Tensor | None:
        """The factor the gradients are multiplied by, as ``clip_grad_norm_`` computes
        it from the global norm of the unscaled gradients (None: no clipping). No host
        synchronization."""
        if not self._wants_norm:
            self._last_grad_norm = None
            return None
        self._last_grad_norm = self.store.grad_norm()
        if self.max_grad_norm is None:
            return None
        return torch.clamp(self.max_grad_norm / (self._last_grad_norm + 1e-6), max=1.0)

    # Phases 5 and 6 are the store's update() and copy_back(); 7 is the scaler's.

    def memory_bytes_per_param(self) -> dict[str, float]:
        """Bytes held between steps per parameter the optimizer holds, by kind of buffer.

        Keys: ``model_weights``, ``model_grads``, ``master_weights``,
        ``master_grads``, ``optimizer_state``, ``compensation`` (Kahan rounding),
        ``master_remainder`` (``master_weights="remainder"``) and ``total``. Measured
        from the storages actually allocated (flat-buffer alignment gaps included), so
        for a large model fp16 with masters and SGD-momentum reads 2 + 2 + 4 + 4 + 4 =
        16 with ``fused=False`` (2 + 2 + 4 + 0 + 4 = 12 fused: no fp32 gradients), and
        without masters 2 + 2 + 0 + 0 + 4 = 8; bf16 with remainders reads
        ``master_weights`` 0 and ``master_remainder`` 2 (10 fused). A sharded model
        reports this rank's shards per parameter of the whole model.
        """
        return self.store.memory()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Masters, inner optimizer state and scaler state, all plain containers of
        tensors and numbers: ``torch.load(path, weights_only=True)`` reads it. A
        sharded model's tensors are DTensors (:mod:`mpfp16.checkpoint` saves them as a
        DCP folder), and its masters are in the model's own state_dict."""
        self._check_groups()
        return {
            "format": STATE_FORMAT,
            "store": self.store.kind,
            "inner_optimizer": type(self.optimizer).__name__,
            "optimizer": self.optimizer.state_dict(),
            "master_weights": self.master_weights,
            "master_mode": self.master_mode,
            "param_names": self.param_names(),
            "param_shapes": self._shapes,
            "param_dtypes": self._dtypes,
            "scaler": self.scaler.state_dict(),
            "scaler_type": type(self.scaler).__name__,
            "skipped_steps": self.skipped_steps,
            "iteration": self.iteration,
            "rounding": self.rounding,
            "rounding_rng": self._rounding_rng.get_state(),
            **self.store.state(),
        }

    def _check_state_dict(self, state_dict: dict) -> None:
        """Raise one line where ``state_dict`` was made by an optimizer of another
        shape: other parameters, dtypes, masters, rounding, scaler or store."""
        saved_store, store = state_dict["store"], self.store.kind
        if saved_store != store and not (saved_store in _LOCAL_STORES and store in _LOCAL_STORES):
            raise ValueError(f"the state_dict was saved by a {saved_store} store and this optimizer's is {store}: "
                             "load it through mpfp16.checkpoint, which converts a checkpoint between the two")
        self._check_inner_state(state_dict)
        shapes = [list(s) for s in state_dict["param_shapes"]]
        if len(shapes) != len(self._shapes):
            raise ValueError(
                f"optimizer state_dict is for {len(shapes)} parameters, this optimizer has {len(self._shapes)}"
            )
        saved_names = state_dict.get("param_names")
        if saved_names is not None and self._names is not None and list(saved_names) != self._names:
            first = next(i for i, (a, b) in enumerate(zip(saved_names, self._names)) if a != b)
            raise ValueError(f"optimizer state_dict is for other parameters: parameter {first} is "
                             f"{saved_names[first]} in the state_dict and {self._names[first]} here")
        for i, (saved, mine) in enumerate(zip(shapes, self._shapes)):
            if saved != mine:
                raise ValueError(
                    f"optimizer state_dict does not match the model: parameter {i} has shape "
                    f"{saved} in the state_dict and {mine} here"
                )
        for i, (saved, mine) in enumerate(zip(state_dict.get("param_dtypes", self._dtypes), self._dtypes)):
            if saved != mine:
                raise ValueError(f"optimizer state_dict does not match the model: parameter {i} is {saved} in the "
                                 f"state_dict and {mine} here")
        saved_masters = state_dict.get("master_weights")
        if saved_masters is None:  # written before the flag was saved: masters of 16-bit parameters tell
            saved_masters = any(m is not None for m, dtype in zip(state_dict["master_params"], self._dtypes)
                                if dtype != "float32")
        # master_weights=True and "remainder" both keep masters (the state_dict holds them in fp32, rebuilt), so
        # either loads the other's: only masters against none is refused.
        if getattr(self.store, "has_half", False) and bool(saved_masters) != self.master_weights:
            saved_option = "'remainder'" if state_dict.get("master_mode") == "remainder" else bool(saved_masters)
            option = "'remainder'" if self.master_mode == "remainder" else self.master_weights
            raise ValueError(f"the state_dict was saved with master_weights={saved_option} and this "
                             f"optimizer has master_weights={option}")
        if state_dict.get("rounding", "nearest") != self.rounding:
            raise ValueError(f"the state_dict was saved with rounding={state_dict.get('rounding', 'nearest')!r} "
                             f"and this optimizer uses rounding={self.rounding!r}")
        self.store.check_state(state_dict)
        saved_scaler = state_dict["scaler_type"]
        if saved_scaler != type(self.scaler).__name__:
            raise ValueError(
                f"the state_dict holds a {saved_scaler} state but this optimizer uses a "
                f"{type(self.scaler).__name__}: use the same loss_scale setting"
            )
        self.scaler.check_state_dict(state_dict["scaler"])  # before anything is loaded

    def _check_inner_state(self, state_dict: dict) -> None:
        """Raise one line where the inner optimizer's state was saved by another kind of
        optimizer: torch's own load_state_dict takes an Adam state into an SGD, and the
        next step fails on a hyperparameter the saved groups lack."""
        mine = type(self.optimizer).__name__
        saved = state_dict.get("inner_optimizer")
        if saved is not None and saved != mine:
            raise ValueError(f"the state_dict holds the state of a {saved} optimizer and this FP16Optimizer wraps "
                             f"a {mine}: build it over the same kind of optimizer")
        inner = state_dict.get("optimizer")
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError("the state_dict's inner optimizer state has no list of param groups")
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the state_dict's inner optimizer has {len(groups)} param groups and this one has "
                             f"{len(self.optimizer.param_groups)}")
        for i, (theirs, ours) in enumerate(zip(groups, self.optimizer.param_groups)):
            missing = sorted(k for k in ours if k != "params" and k not in theirs)
            if missing:
                raise ValueError(f"the state_dict's param group {i} has no {', '.join(missing)}: it was saved by "
                                 f"another kind of optimizer than this {mine}")
        self._check_inner_indices(inner)

    def _check_inner_indices(self, inner: dict) -> None:
        """Raise one line unless the inner state's group indices are a permutation of
        this optimizer's parameters, group by group, and its per-parameter state is
        keyed by those indices with tensors of their parameters' shapes. torch's own
        ``load_state_dict`` maps the saved indices to parameters by position: a
        duplicated index (one flipped bit) gave a parameter another's state, and a
        shape error deep inside the next step."""
        n = len(self._shapes)
        seen: set[int] = set()
        for i, (theirs, ours) in enumerate(zip(inner["param_groups"], self.optimizer.param_groups)):
            indices = theirs.get("params")
            if not isinstance(indices, list) or not all(type(k) is int for k in indices):
                raise ValueError(f"the state_dict's param group {i} has no list of parameter indices")
            if len(indices) != len(ours["params"]):
                raise ValueError(f"the state_dict's param group {i} holds {len(indices)} parameters and this "
                                 f"optimizer's {len(ours['params'])}")
            for k in indices:
                if not 0 <= k < n or k in seen:
                    why = "twice" if k in seen else f"outside 0..{n - 1}"
                    raise ValueError(f"the state_dict's param group {i} lists parameter index {k} {why}: its "
                                     f"indices must name each of the {n} parameters once")
                seen.add(k)
        state = inner.get("state")
        if not isinstance(state, dict):
            raise ValueError("the state_dict's inner optimizer state has no per-parameter state")
        for key, entry in state.items():
            if type(key) is not int or key not in seen:
                raise ValueError(f"the state_dict's inner optimizer state is keyed {key!r}, which is not a parameter "
                                 "index of its groups")
            if not isinstance(entry, dict):
                raise ValueError(f"the state_dict's inner optimizer state of parameter {key} is not a dict")
            for name, value in entry.items():
                if torch.is_tensor(value) and value.dim() > 0 and list(value.shape) != self._shapes[key]:
                    raise ValueError(f"the state_dict's {name} of parameter {key} has shape {list(value.shape)}, and "
                                     f"the parameter {self._shapes[key]}")

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned (this version's, or an earlier one's).
        Load the model's state first: without saved masters (a checkpoint taken with
        ``master_weights=False``) the masters are rebuilt from the model's weights.
        With saved masters the model's 16-bit weights are set from them, so the two
        always agree. A flat store loads a per-tensor store's state and the reverse; a
        sharded store's converts through :mod:`mpfp16.checkpoint`.

        Raises:
            ValueError: one line, before anything is changed, when the state_dict
                does not fit this optimizer.
        """
        state_dict = upgrade_state_dict(state_dict)
        self._check_state_dict(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._share_inner_state()  # the inner optimizer made new param_groups and state
        self.store.invalidate()
        self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.iteration = int(state_dict["iteration"])
        if state_dict.get("rounding_rng") is not None:
            self._rounding_rng.set_state(state_dict["rounding_rng"].cpu())
        self.store.load_state(state_dict)
