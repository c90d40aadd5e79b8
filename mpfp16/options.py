"""FP16Optimizer's options: their types, the rules between them, and the scaler that
``loss_scale`` means. One place, which the constructor calls and so do front ends (the
training scripts' config, the Lightning plugins) that want to refuse a combination
before anything is built, in their own words."""

from __future__ import annotations

import numbers

import torch

from .errors import library_words
from .rounding import ROUNDINGS
from .scaler import DynamicLossScaler, LossScaler
from .stores import STATE_NAMES, ParamStore, ShardedStore, has_own_step, state_names

__all__ = ["check_options", "check_types", "check_rounding_seed", "constructor_state", "held_params", "make_scaler", "master_mode",
           "is_number", "state_dtypes_of", "STATE_NAMES", "STATE_DTYPES", "STATE_ROUNDINGS",
           "MASTER_WEIGHTS", "ACCUMULATE_DTYPES"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

ACCUMULATE_DTYPES = (None, torch.float32)  # accumulate_dtype's choices; None: the model's 16-bit dtype, as apex
# master_weights' choices: fp32 masters; none (the 16-bit weights stepped directly); or, for bf16, the fp32 masters
# held exactly as the bf16 weights and an int16 remainder each (docs/REMAINDER.md)
MASTER_WEIGHTS = (True, False, "remainder")


def master_mode(master_weights) -> str:
    """``FP16Optimizer.master_mode`` for a ``master_weights`` option."""
    if isinstance(master_weights, str):
        return master_weights
    return "fp32" if master_weights else "none"


def _check_remainder(*, rounding: str, dtypes, say) -> None:
    """The rules of ``master_weights="remainder"``: bf16 parameters only, rounded to
    nearest (``dtypes``: the parameters' dtypes, where known)."""
    asked = say("master_weights", "remainder")
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


def is_number(value) -> bool:
    """A real number, not a bool (``True`` is an int to Python, and was taken as 1.0)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_types(*, say, **options) -> None:
    """Each option of :func:`check_options` of its type, or one line naming it: a string
    ``max_grad_norm="1.0"`` failed later inside a comparison, ``True`` was taken as 1.0,
    and ``master_weights=None`` as no masters."""
    rules = {
        "master_weights": (lambda v: isinstance(v, (bool, str)), "True, False or 'remainder'"),
        "rounding": (lambda v: isinstance(v, str), f"one of {', '.join(map(repr, ROUNDINGS))}"),
        "max_grad_norm": (lambda v: v is None or is_number(v), "a number or None"),
        "fused": (lambda v: v is None or isinstance(v, bool), "True, False or None"),
        "sharded": (lambda v: isinstance(v, bool), "True or False"),
        "reduce_overflow": (lambda v: isinstance(v, bool), "True or False"),
    }
    for name, value in options.items():
        right, what = rules[name]
        if not right(value):
            raise TypeError(f"{say(name, value)} must be {what}, not {type(value).__name__}")


def _store_kind(store: type[ParamStore] | None, sharded: bool) -> type[ParamStore] | None:
    return ShardedStore if sharded else store


def _refuse_limits(store: type[ParamStore] | None, asked: list[tuple[str, str]], say) -> None:
    """Refuse, in one line, the first option of ``asked`` (``(limit key, the option in the
    caller's words)``) that the kind of ``store`` cannot take (``ParamStore.limits``)."""
    if store is None:
        return
    for key, words in asked:
        why = store.limits.get(key)
        if why is not None:
            raise ValueError(f"{words} is not possible for {store.noun}: {why(say)}")


def check_options(*, master_weights: bool | str = True, rounding: str = "nearest", max_grad_norm: float | None = None,
                  fused: bool | None = None, sharded: bool = False, reduce_overflow: bool = True,
                  accumulate_dtype: torch.dtype | None = None, dtypes=None, say=library_words,
                  store: type[ParamStore] | None = None) -> None:
    """The rules between FP16Optimizer's options, in one place: the constructor calls
    it, and so does a front end (the training scripts' config) that wants to refuse a
    combination before building anything.

    Args:
        store: the kind of store the parameters need (``mpfp16.stores.store_type``),
            where known: the options it cannot take are refused (its ``limits``).
        sharded: the model is sharded (:func:`mpfp16.distributed.shard`): for a front
            end that knows no parameter yet, the sharded store's kind.
        dtypes: the parameters' dtypes, where known (the constructor's; a front end
            passes its compute dtype): ``master_weights="remainder"`` needs bf16
            parameters and no fp16 ones.
        say: ``say(name, value)`` words an option as the caller spells it (default
            ``name=value``; the scripts say ``--no-master-weights``).

    Raises:
        ValueError: one line naming the options in the caller's words.
    """
    check_types(master_weights=master_weights, rounding=rounding, max_grad_norm=max_grad_norm, fused=fused,
                 sharded=sharded, reduce_overflow=reduce_overflow, say=say)
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"{say('max_grad_norm', max_grad_norm)} must be positive or None")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    if isinstance(master_weights, str) and master_weights not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights must be True, False or 'remainder', got {master_weights!r}")
    store = _store_kind(store, sharded)
    if master_weights == "remainder":
        _refuse_limits(store, [("master_weights_remainder", say("master_weights", "remainder"))], say)
        _check_remainder(rounding=rounding, dtypes=dtypes, say=say)
    if rounding != "nearest" and master_weights:
        raise ValueError(f"{say('rounding', rounding)} needs {say('master_weights', False)}: it rounds 16-bit "
                         "weights stepped directly")
    if accumulate_dtype not in ACCUMULATE_DTYPES:
        raise ValueError(f"{say('accumulate_dtype', accumulate_dtype)} must be None (the model's 16-bit dtype) or "
                         "torch.float32")
    asked = [(key, words) for key, words, given in [
        ("accumulate_dtype", say("accumulate_dtype", accumulate_dtype), accumulate_dtype is not None),
        ("master_weights", say("master_weights", False), not master_weights),
        ("fused", say("fused", True), bool(fused)),
        ("reduce_overflow", say("reduce_overflow", False), not reduce_overflow)] if given]
    _refuse_limits(store, asked, say)


def check_rounding_seed(rounding_seed, say=library_words) -> None:
    """``rounding_seed`` an int a torch generator takes (its 64 bits, or a negative one of
    as many), or one line naming it."""
    if not isinstance(rounding_seed, int) or isinstance(rounding_seed, bool):
        raise TypeError(f"{say('rounding_seed', rounding_seed)} must be an int, not {type(rounding_seed).__name__}")
    if not -(2**63) <= rounding_seed < 2**64:
        raise ValueError(f"{say('rounding_seed', rounding_seed)} is out of a generator's range: a seed is an int in "
                         "[-2**63, 2**64)")


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
    elif is_number(loss_scale):
        scaler = LossScaler(float(loss_scale))
    else:
        raise TypeError("loss_scale must be 'dynamic', a number, None or a LossScaler; got "
                        f"{type(loss_scale).__name__}")
    if compute_dtype == torch.bfloat16 and (scaler.dynamic or scaler.scale != 1.0):
        shown = repr(loss_scale) if not isinstance(loss_scale, LossScaler) else repr(scaler)
        raise ValueError(f"loss_scale={shown} over a model that computes in bfloat16: bf16 has fp32's exponent "
                         "range, so its gradients need no loss scaling; pass loss_scale=None (or 'dynamic', which "
                         "means no scaling for bf16)")
    return scaler


def held_params(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, *, track_grad_norm: bool,
                rounding_seed: int) -> list[torch.Tensor]:
    """Every parameter the inner ``optimizer`` holds, in its order, checked, with the
    constructor's arguments that :func:`check_options` does not take.

    Raises:
        TypeError, ValueError: one line.
    """
    from .stores import is_master

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"FP16Optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model= must be the torch.nn.Module the parameters belong to, not {type(model).__name__}")
    if not isinstance(track_grad_norm, bool):
        raise TypeError(f"track_grad_norm={track_grad_norm!r} must be True or False, not "
                        f"{type(track_grad_norm).__name__}")
    check_rounding_seed(rounding_seed)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if getattr(optimizer, "state", None) and any(optimizer.state.values()) and not constructor_state(optimizer):
        raise ValueError("the optimizer already has state: wrap it before its first step, and load checkpoints "
                         "through FP16Optimizer.load_state_dict")
    if model is not None:
        owned = {id(p) for p in model.parameters()}
        foreign = [p for p in params if id(p) not in owned]
        if foreign:
            raise ValueError(f"{len(foreign)} of the optimizer's parameters are not parameters of the model (the first "
                             f"has shape {list(foreign[0].shape)}): build the optimizer over model.parameters()")
    for i, p in enumerate(params):
        if is_master(p):
            raise ValueError("the optimizer holds the masters of another FP16Optimizer")
        if p.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"parameter {i} (shape {list(p.shape)}) is {p.dtype}; FP16Optimizer handles float16, "
                            "bfloat16 and float32 parameters")
        if not p.is_leaf:
            raise ValueError(f"parameter {i} (shape {list(p.shape)}) is not a leaf tensor")
    if not params:
        raise ValueError("the optimizer holds no parameter")
    return params


def constructor_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s state is the one torch's Adagrad fills when it is built
    (every entry at step 0, over the parameters it was given): its ``step()`` makes the
    same state again for a parameter that has none, so FP16Optimizer drops it and
    Adagrad builds it over the fp32 masters at the first step, in fp32, as it would over
    an fp32 model (over the 16-bit parameters, ``initial_accumulator_value`` would be
    rounded to 16 bits)."""
    if not isinstance(optimizer, torch.optim.Adagrad):
        return False
    return all(set(s) == {"step", "sum"} and float(s["step"]) == 0 for s in optimizer.state.values())


STATE_DTYPES = (torch.float32, torch.bfloat16)  # state_dtype's choices
STATE_ROUNDINGS = ("nearest", "stochastic")


def state_dtypes_of(optimizer: torch.optim.Optimizer | type | None, state_dtype: torch.dtype | None = None,
                    state_dtypes: dict | None = None, state_rounding: str = "nearest", *, sharded: bool = False,
                    store: type[ParamStore] | None = None, say=library_words) -> dict[str, torch.dtype]:
    """The dtype each of the inner optimizer's states is kept in between steps, from
    FP16Optimizer's ``state_dtype`` (every floating state) and ``state_dtypes`` (per
    state, Megatron-LM's ``exp_avg_dtype``/``exp_avg_sq_dtype`` by name, over
    ``state_dtype``): ``{name: dtype}`` of the states not kept in fp32 (``{}``: all fp32).
    ``optimizer``: the inner optimizer, or its class for a front end that has not made
    it yet (None: the dtypes alone); ``store``/``sharded``: the kind of store, where known, as
    :func:`check_options` takes it.

    fp16 is refused: its 5-bit exponent cannot hold the second moment (a gradient of
    1e-4 squares to 1e-8, below fp16's smallest subnormal, 6e-8, and v = 0 divides the
    update by eps alone), nor a first moment or momentum of gradients that small.

    Raises:
        ValueError, TypeError: one line naming the option.
    """
    if state_rounding not in STATE_ROUNDINGS:
        raise ValueError(f"{say('state_rounding', state_rounding)} must be one of "
                         f"{', '.join(map(repr, STATE_ROUNDINGS))}")
    if state_dtypes is not None and not isinstance(state_dtypes, dict):
        raise TypeError(f"{say('state_dtypes', state_dtypes)} must be a dict of state name to dtype, not "
                        f"{type(state_dtypes).__name__}")
    asked = {**({"*": state_dtype} if state_dtype is not None else {}), **(state_dtypes or {})}
    for name, dtype in asked.items():
        option = say("state_dtype", dtype) if name == "*" else say("state_dtypes", {name: dtype})
        if dtype == torch.float16:
            raise ValueError(f"{option}: fp16 cannot hold optimizer states: its 5-bit exponent underflows the second "
                             "moment (a gradient of 1e-4 squares to 1e-8, below fp16's smallest subnormal, 6e-8) and "
                             "the moments of gradients that small; use torch.bfloat16, which has fp32's range")
        if dtype not in STATE_DTYPES:
            raise ValueError(f"{option}: a state is kept in torch.float32 or torch.bfloat16")
    wanted = {name: dtype for name, dtype in asked.items() if dtype != torch.float32 or name != "*"}
    if not any(dtype != torch.float32 for dtype in asked.values()):
        if state_rounding != "nearest":
            raise ValueError(f"{say('state_rounding', state_rounding)} rounds 16-bit states, and every state is "
                             f"fp32: pass {say('state_dtype', torch.bfloat16)} too, or drop it")
        return {}
    given = (say("state_dtype", state_dtype) if state_dtype is not None else say("state_dtypes", state_dtypes))
    _refuse_limits(_store_kind(store, sharded), [("state_dtypes", given)], say)
    if optimizer is None:
        return {}
    names = state_names(optimizer)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = cls.__name__
    option = "state_dtype" if state_dtype is not None else "state_dtypes"
    if names is None:
        own = "has a step() of its own" if has_own_step(cls) else "keeps states of its own"
        raise ValueError(f"{option} applies to SGD, Adam and AdamW, whose states are mpfp16's to keep; {name} {own} "
                         f"(torchao's low-bit optimizers quantize theirs already): drop {option}")
    unknown = sorted(set(wanted) - set(names) - {"*"})
    if unknown:
        raise ValueError(f"{say('state_dtypes', {unknown[0]: wanted[unknown[0]]})}: {name} keeps "
                         f"{', '.join(names)}")
    if "max_exp_avg_sq" in wanted and not isinstance(optimizer, type) and not any(
            g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError(f"{say('state_dtypes', {'max_exp_avg_sq': wanted['max_exp_avg_sq']})}: {name} keeps "
                         "max_exp_avg_sq only with amsgrad=True, and no param group has it")
    every = wanted.get("*", torch.float32)
    out = {name: wanted.get(name, every) for name in names}
    return {name: dtype for name, dtype in out.items() if dtype != torch.float32}
