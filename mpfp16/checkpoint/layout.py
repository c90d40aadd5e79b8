"""A checkpoint in the other layout: a local (flat or per-tensor) run's state into a
sharded run, and a sharded run's into a local one.

The two hold the same numbers in other places. A local run's model state has the
16-bit weights (and fp32 normalization parameters), and its optimizer state has the
fp32 masters of the 16-bit parameters (``master_params``, by index) and the inner
optimizer's state as whole tensors. A sharded run's model state *is* the fp32 masters,
as DTensors, and its optimizer state has the inner state as DTensors and no masters.
:func:`to_layout_of` moves each number to where this run keeps it, exactly: the
masters stay the saved fp32 values (a sharded run's 16-bit weights are rounded from
them at its first forward; a local run's are set from them on load, as a local resume
always does), and the inner optimizer's state and every counter are the saved ones.

Both directions go by parameter name (the optimizer state's ``param_names``, or, for a
checkpoint written before it had them, the names of this run's parameters in the
inner optimizer's order, which the same model and settings give in the same order).
"""

from __future__ import annotations

import torch

from ..optimizer import FP16Optimizer, upgrade_state_dict
from ..parallel.fsdp_shim import is_sharded

__all__ = ["layout_of_state", "to_layout_of"]

_LOCAL = ("flat", "per-tensor")


def layout_of_state(optimizer_state: dict) -> str:
    """``"sharded"`` or ``"local"``: the layout that wrote an FP16Optimizer state_dict."""
    fmt = optimizer_state.get("format", "")
    store = optimizer_state.get("store") or ("sharded" if fmt.endswith("sharded-1") else "flat")
    return "local" if store in _LOCAL else "sharded"


def _layout_of(opt: FP16Optimizer) -> str:
    return "local" if opt.store.kind in _LOCAL else "sharded"


def _full(t):
    return t.full_tensor() if is_sharded(t) else t


def _like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``full`` (a whole tensor) as ``target`` holds it: a DTensor of the same sharding,
    each rank cutting its own shard (no communication), or a plain tensor."""
    if not is_sharded(target):
        return full.to(target.dtype)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(dtype=target.dtype, device=target.device), target.device_mesh,
                             target.placements, src_data_rank=None)


def _names(saved: dict, opt: FP16Optimizer) -> list[str]:
    names = saved.get("param_names") or opt.param_names()
    mine = opt.param_names()
    if names is None or mine is None or None in mine:
        raise ValueError("converting between a sharded and an unsharded checkpoint needs the parameters' names: "
                         "build the FP16Optimizer with model=")
    if list(names) != list(mine):
        raise ValueError(f"the checkpoint's optimizer holds other parameters ({len(names)} saved, {len(mine)} here)")
    return list(names)


def to_layout_of(state: dict, model: torch.nn.Module, opt: FP16Optimizer) -> dict:
    """``state`` (a training checkpoint: ``{"model": ..., "optimizer": ..., ...}``) with its
    model and optimizer parts in the layout of ``model`` and ``opt``; ``state`` itself
    when it is already. The model's and the optimizer's ``load_state_dict`` then take
    it as they take their own.

    Raises:
        ValueError: one line, when the parameters do not match by name and shape.
    """
    saved_opt = upgrade_state_dict(state["optimizer"])
    saved_layout, layout = layout_of_state(saved_opt), _layout_of(opt)
    if saved_layout == layout:
        return state
    names = _names(saved_opt, opt)
    convert = _local_to_sharded if layout == "sharded" else _sharded_to_local
    model_state, opt_state = convert(state["model"], saved_opt, names, model, opt)
    return {**state, "model": model_state, "optimizer": opt_state}


def _inner_state_like(saved_inner: dict, params: list[torch.Tensor]) -> dict:
    """The inner optimizer's state_dict with each per-parameter tensor of its
    parameter's shape made like what the inner optimizer steps (sharded or whole,
    fp32)."""
    state = {}
    for index, entry in saved_inner["state"].items():
        param = params[int(index)]
        state[index] = {k: _like(_full(v), param) if torch.is_tensor(v) and tuple(v.shape) == tuple(param.shape)
                        else v for k, v in entry.items()}
    return {"state": state, "param_groups": saved_inner["param_groups"]}


def _local_to_sharded(model_state: dict, saved: dict, names: list[str], model, opt) -> tuple[dict, dict]:
    targets = model.state_dict()
    masters = dict(zip(names, saved["master_params"]))
    out = {}
    for key, target in targets.items():
        if key not in model_state:
            raise ValueError(f"the checkpoint's model has no {key}")
        master = masters.get(key)
        out[key] = _like(master if master is not None else model_state[key], target)
    store_part = opt.store.state()
    opt_state = {**saved, "store": opt.store.kind,
                 "optimizer": _inner_state_like(saved["optimizer"], opt.store.stepped),
                 "param_dtypes": [str(p.dtype).replace("torch.", "") for p in opt.store.params],
                 "master_params": store_part["master_params"], "kahan_compensation": store_part["kahan_compensation"],
                 "compute_dtype": _compute_dtype(saved)}
    return out, opt_state


def _compute_dtype(saved: dict) -> str:
    """The 16-bit dtype a local run computed in: that of its 16-bit parameters."""
    halves = {d for d in saved["param_dtypes"] if d != "float32"}
    return halves.pop() if len(halves) == 1 else "float32"


def _sharded_to_local(model_state: dict, saved: dict, names: list[str], model, opt) -> tuple[dict, dict]:
    if saved.get("compute_dtype") not in {str(p.dtype).replace("torch.", "") for p in opt.store.params}:
        raise ValueError(f"the checkpoint was saved by a {saved.get('compute_dtype')} sharded run, and no parameter "
                         "of this model is of that dtype")
    mine = model.state_dict()
    out = {key: _full(value).to(mine[key].dtype) if key in mine and torch.is_tensor(value) else value
           for key, value in model_state.items()}
    full = {key: _full(value) for key, value in model_state.items()}
    store_part = opt.store.state()
    masters = [full[name].float() if p.dtype != torch.float32 and store_part["master_params"][i] is not None else None
               for i, (name, p) in enumerate(zip(names, opt.store.params))]
    opt_state = {**saved, "store": opt.store.kind,
                 "optimizer": _inner_state_like(saved["optimizer"], opt.store.stepped),
                 "param_dtypes": [str(p.dtype).replace("torch.", "") for p in opt.store.params],
                 "master_params": masters, "kahan_compensation": store_part["kahan_compensation"]}
    opt_state.pop("compute_dtype", None)
    return out, opt_state
