"""FP16Optimizer's state_dict: one form for every store, its checks, and the upgrade of
the forms earlier versions wrote.

The form (``mpfp16.FP16Optimizer/3``) is keyed by parameter, as DCP's flattened
optimizer state and torchtitan's optimizer container are: the parameter's name in
``model=`` (else its position, ``"0"``, ``"1"``...), in the optimizer's order. Nothing
in it depends on where the tensors live::

    {"format": "mpfp16.FP16Optimizer/3", "inner_optimizer": "AdamW",
     "params": {"fc.weight": {"shape": [4, 8], "dtype": "float16", "master": <fp32>,
                              "compensation": <fp16 or absent>}, ...},
     "optimizer": {"state": {"fc.weight": {"exp_avg": ..., "step": ...}, ...},
                   "param_groups": [{"lr": ..., "params": ["fc.weight", ...]}, ...]},
     "master_weights": True, "master_mode": "fp32", "rounding": "nearest", "rounding_rng": <uint8>,
     "compute_dtype": "float16", "scaler_type": "DynamicLossScaler", "scaler": {...},
     "skipped_steps": 0, "iteration": 7, "store": "flat"}

``master`` is a parameter's fp32 value: the master of a 16-bit parameter (rebuilt
exactly with ``master_weights="remainder"``), the parameter itself where it is fp32 (a
normalization layer, or every shard of a sharded model), None where none is kept
(``master_weights=False``: the model's 16-bit weight is the value). Its tensors are
plain, or DTensors where the store is sharded; a store takes either, whatever store
wrote them (``ParamStore.load_state``), so a flat, per-tensor or sharded optimizer
loads any other's state directly. ``store`` is a record, never a branch. ``dtype`` is
the dtype the model holds the parameter in (None for a sharded store, whose model
holds fp32 shards and computes in ``compute_dtype``).
"""

from __future__ import annotations

import torch

from .errors import dtype_name

__all__ = ["STATE_FORMAT", "upgrade_state_dict", "check_state_dict", "keyed_by_parameter",
           "keyed_by_index", "state_dtypes_changed"]

STATE_FORMAT = "mpfp16.FP16Optimizer/3"
# Formats written by earlier versions, and the store that wrote them.
_EARLIER_FORMATS = {"mpfp16.FP16Optimizer/1": "flat", "mpfp16.FP16Optimizer/sharded-1": "sharded",
                    "mpfp16.FP16Optimizer/2": None}


# ------------------------------------------------------------------ the form


def keyed_by_parameter(keys: list[str], shapes: list[list[int]], dtypes: list[str | None], entries: list[dict],
                       inner: dict) -> tuple[dict, dict]:
    """The ``params`` and ``optimizer`` parts of the form, from a store's
    per-parameter ``entries`` and the inner optimizer's own (index-keyed) state_dict."""
    params = {key: {"shape": shape, "dtype": dtype, **entry}
              for key, shape, dtype, entry in zip(keys, shapes, dtypes, entries)}
    return params, {"state": {keys[i]: s for i, s in inner["state"].items()},
                    "param_groups": [{**g, "params": [keys[i] for i in g["params"]]} for g in inner["param_groups"]]}


def keyed_by_index(state_dict: dict, shapes: list[list[int]], like) -> dict:
    """The inner optimizer's state_dict (keyed by index, as torch's ``load_state_dict``
    takes it) from the form's ``optimizer`` part, checked (:func:`check_state_dict`):
    each tensor of its parameter's shape made ``like(index, tensor)``, as the store
    steps it (whole, or this rank's shard)."""
    index = {key: i for i, key in enumerate(state_dict["params"])}
    inner = state_dict["optimizer"]
    return {"state": {index[k]: {name: like(index[k], v) if torch.is_tensor(v) and list(v.shape) == shapes[index[k]]
                                 else v for name, v in s.items()} for k, s in inner["state"].items()},
            "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in inner["param_groups"]]}


def state_dtypes_changed(state_dict: dict, mine: dict) -> str | None:
    """The line that says a state saved with other ``state_dtypes`` (its record: the
    16-bit states by name; none in a state of before them) is kept in this optimizer's
    dtypes from now on (``mine``), or None when they are the same."""
    saved, now = state_dict.get("state_dtypes") or {}, {name: dtype_name(d) for name, d in mine.items()}
    if saved == now:
        return None
    return (f"the optimizer states were saved as {saved or 'fp32'} and are kept as {now or 'fp32'} from here on "
            "(converted once, to nearest)")


# ------------------------------------------------------------------ upgrades


def upgrade_state_dict(state_dict, model_state: dict | None = None) -> dict:
    """An FP16Optimizer state_dict in this version's form (module docstring).

    Args:
        model_state: the model's state saved with it, where there is one (a training
            checkpoint): a sharded run of an earlier version kept its fp32 masters
            there alone, as the model's parameters.

    Raises:
        ValueError: it is not an FP16Optimizer state_dict.
    """
    fmt = state_dict.get("format") if isinstance(state_dict, dict) else None
    if fmt == STATE_FORMAT:
        return state_dict
    if fmt not in _EARLIER_FORMATS:
        raise ValueError(f"not an FP16Optimizer state_dict (no 'format': '{STATE_FORMAT}' entry)")
    return _from_2(_to_2(state_dict), model_state)


def _to_2(state_dict: dict) -> dict:
    """The first forms into the second (index-keyed, a list of masters)."""
    fmt = state_dict["format"]
    if fmt == "mpfp16.FP16Optimizer/2":
        return state_dict
    store = _EARLIER_FORMATS[fmt]
    upgraded = {"store": store, "param_names": None, **state_dict}
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


def _from_2(old: dict, model_state: dict | None) -> dict:
    """The second form (index-keyed; a sharded store's masters in the model's state)
    into this one."""
    n = len(old["param_shapes"])
    names = old.get("param_names")
    keys = list(names) if names is not None and None not in names else [str(i) for i in range(n)]
    sharded = old.get("store") == "sharded"
    masters = list(old.get("master_params") or [None] * n)
    if sharded and model_state is not None:
        masters = [model_state.get(k) for k in keys]
    dtypes = old.get("param_dtypes") or [None] * n
    params = {k: {"shape": list(old["param_shapes"][i]), "dtype": None if sharded else dtypes[i],
                  "master": masters[i]} for i, k in enumerate(keys)}
    inner = old["optimizer"]
    new = {key: value for key, value in old.items()
           if key not in ("param_names", "param_shapes", "param_dtypes", "master_params")}
    halves = {d for d in dtypes if d not in (None, "float32")}
    new.update(format=STATE_FORMAT, params=params,
               compute_dtype=old.get("compute_dtype") or (halves.pop() if len(halves) == 1 else "float32"),
               optimizer={"state": {keys[int(i)]: s for i, s in inner["state"].items()},
                          "param_groups": [{**g, "params": [keys[int(i)] for i in g["params"]]}
                                           for g in inner["param_groups"]]})
    if not old.get("kahan_compensation"):
        new.pop("kahan_compensation", None)  # one buffer per group: only the store that wrote it cuts it
    return new


# ------------------------------------------------------------------ checks


def check_state_dict(state_dict: dict, *, keys: list[str], names: list[str] | None, shapes: list[list[int]],
                     dtypes: list[str | None], compute_dtype: str, inner: torch.optim.Optimizer,
                     has_half: bool, master_weights: bool, master_mode: str, rounding: str, scaler_type: str) -> None:
    """Raise one line where ``state_dict`` (this form) was made by an optimizer of
    another shape: other parameters, dtypes, masters, rounding, scaler or inner
    optimizer, or its indices do not name each parameter once.

    Args:
        keys, names, shapes, dtypes, compute_dtype: this optimizer's parameters, in its
            order (``names`` None without ``model=``: the saved ones are then matched by
            position).
    """
    _check_inner_kind(state_dict, inner)
    params = state_dict.get("params")
    if not isinstance(params, dict):
        raise ValueError("the state_dict has no per-parameter record")
    saved_keys = list(params)
    if len(saved_keys) != len(keys):
        raise ValueError(f"optimizer state_dict is for {len(saved_keys)} parameters, this optimizer has {len(keys)}")
    named = names is not None and all(k == str(i) for i, k in enumerate(saved_keys)) is False
    if named and saved_keys != list(names):
        first = next(i for i, (a, b) in enumerate(zip(saved_keys, names)) if a != b)
        raise ValueError(f"optimizer state_dict is for other parameters: parameter {first} is {saved_keys[first]} "
                         f"in the state_dict and {names[first]} here")
    for i, (key, shape, dtype) in enumerate(zip(saved_keys, shapes, dtypes)):
        entry = params[key]
        if not isinstance(entry, dict) or list(entry.get("shape", ())) != list(shape):
            saved = entry.get("shape") if isinstance(entry, dict) else None
            raise ValueError(f"optimizer state_dict does not match the model: parameter {i} has shape {saved} in the "
                             f"state_dict and {shape} here")
        if entry.get("dtype") is not None and dtype is not None and entry["dtype"] != dtype:
            raise ValueError(f"optimizer state_dict does not match the model: parameter {i} is {entry['dtype']} in "
                             f"the state_dict and {dtype} here")
    saved_compute = state_dict.get("compute_dtype")
    if saved_compute is not None and saved_compute != compute_dtype and has_half:
        raise ValueError(f"the state_dict was saved by a model that computes in {saved_compute} and this one "
                         f"computes in {compute_dtype}")
    saved_masters = state_dict.get("master_weights")
    if saved_masters is None:  # written before the flag was saved: masters of 16-bit parameters tell
        saved_masters = any(e.get("master") is not None for e in params.values() if e.get("dtype") != "float32")
    # master_weights=True and "remainder" both keep masters (the state_dict holds them in fp32, rebuilt), so
    # either loads the other's: only masters against none is refused.
    if has_half and bool(saved_masters) != master_weights:
        saved_option = "'remainder'" if state_dict.get("master_mode") == "remainder" else bool(saved_masters)
        option = "'remainder'" if master_mode == "remainder" else master_weights
        raise ValueError(f"the state_dict was saved with master_weights={saved_option} and this optimizer has "
                         f"master_weights={option}")
    if state_dict.get("rounding", "nearest") != rounding:
        raise ValueError(f"the state_dict was saved with rounding={state_dict.get('rounding', 'nearest')!r} and this "
                         f"optimizer uses rounding={rounding!r}")
    if state_dict.get("scaler_type") != scaler_type:
        raise ValueError(f"the state_dict holds a {state_dict.get('scaler_type')} state but this optimizer uses a "
                         f"{scaler_type}: use the same loss_scale setting")
    _check_indices(state_dict["optimizer"], inner, saved_keys, shapes)


def _check_inner_kind(state_dict: dict, inner: torch.optim.Optimizer) -> None:
    """Raise one line where the inner optimizer's state was saved by another kind of
    optimizer: torch's own load_state_dict takes an Adam state into an SGD, and the
    next step fails on a hyperparameter the saved groups lack."""
    mine = type(inner).__name__
    saved = state_dict.get("inner_optimizer")
    if saved is not None and saved != mine:
        raise ValueError(f"the state_dict holds the state of a {saved} optimizer and this FP16Optimizer wraps a "
                         f"{mine}: build it over the same kind of optimizer")
    state = state_dict.get("optimizer")
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError("the state_dict's inner optimizer state has no list of param groups")
    if len(groups) != len(inner.param_groups):
        raise ValueError(f"the state_dict's inner optimizer has {len(groups)} param groups and this one has "
                         f"{len(inner.param_groups)}")
    for i, (theirs, ours) in enumerate(zip(groups, inner.param_groups)):
        # the optimizer's own hyperparameters only: an lr scheduler adds keys to the live
        # groups (initial_lr, max_lr) that a state saved before it lacks, and torch's
        # load drops them with the groups it replaces (Lightning's lr_find restores so)
        missing = sorted(k for k in ours if k != "params" and k in inner.defaults and k not in theirs)
        if missing:
            raise ValueError(f"the state_dict's param group {i} has no {', '.join(missing)}: it was saved by another "
                             f"kind of optimizer than this {mine}")


def _check_indices(state: dict, inner: torch.optim.Optimizer, keys: list[str], shapes: list[list[int]]) -> None:
    """Raise one line unless the inner state's groups name each parameter once, group
    by group as this optimizer's, and its per-parameter state is keyed by parameters
    of its groups with tensors of their shapes. torch's own ``load_state_dict`` maps
    the saved entries to parameters by position: a duplicated entry (one flipped bit)
    gave a parameter another's state, and a shape error deep inside the next step."""
    position = {k: i for i, k in enumerate(keys)}
    seen: set[str] = set()
    for i, (theirs, ours) in enumerate(zip(state["param_groups"], inner.param_groups)):
        members = theirs.get("params")
        if not isinstance(members, list):
            raise ValueError(f"the state_dict's param group {i} has no list of parameters")
        if len(members) != len(ours["params"]):
            raise ValueError(f"the state_dict's param group {i} holds {len(members)} parameters and this optimizer's "
                             f"{len(ours['params'])}")
        for k in members:
            if k not in position or k in seen:
                why = "twice" if k in seen else "that is not one of its parameters"
                raise ValueError(f"the state_dict's param group {i} lists parameter {k!r} {why}: its groups must name "
                                 f"each of the {len(keys)} parameters once")
            seen.add(k)
    per_param = state.get("state")
    if not isinstance(per_param, dict):
        raise ValueError("the state_dict's inner optimizer state has no per-parameter state")
    for key, entry in per_param.items():
        if key not in seen:
            raise ValueError(f"the state_dict's inner optimizer state is keyed {key!r}, which is not a parameter "
                             "of its groups")
        if not isinstance(entry, dict):
            raise ValueError(f"the state_dict's inner optimizer state of parameter {key!r} is not a dict")
        shape = shapes[position[key]]
        for name, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and list(value.shape) != list(shape):
                raise ValueError(f"the state_dict's {name} of parameter {key!r} has shape {list(value.shape)}, and the "
                                 f"parameter {list(shape)}")
