"""What the inner optimizer's state may hold at a step: the rules every store applies.

torch's optimizer API is the contract, and ``optimizer.state`` is the state's one
owner. Between two steps a user may clear it (whole, or one parameter's), assign or
replace a state tensor, load an earlier state_dict into an optimizer that has stepped
(a parameter absent from it starts fresh), or change a group's hyper-parameters; the
next step honours each, on every store, fused or not. For the optimizers whose states
mpfp16 knows by name (:func:`known_base`: SGD, Adam, AdamW, and subclasses of them
that keep their ``step()``), the stores check before a step, ahead of anything moving:

- :func:`state_problem`: every state tensor of a parameter stepped now has its
  parameter's shape and device, a state is whole (Adam's ``step`` with its moments,
  ``max_exp_avg_sq`` under ``amsgrad``), and ``step`` is a tensor; else one line
  refuses the step. torch's own step raised deep inside its loop, after it had stepped
  the parameters before that one, or broadcast a state of another shape in silence.
- :func:`settle`: a floating state tensor of another dtype than its state is kept in
  (fp32, or ``state_dtypes``') is converted to it, rounded to nearest, as torch's
  ``load_state_dict`` converts a loaded state to its parameter's dtype. It runs when
  the step is taken (a skipped step changes no state).

Other optimizers' states are theirs: torchao's quantized ones, RMSprop's, Adagrad's.
"""

from __future__ import annotations

import torch

__all__ = ["known_base", "has_own_step", "state_names", "state_problem", "settle", "STATE_NAMES"]

# The per-parameter states of the optimizers mpfp16 knows, by the torch class whose step
# runs; every one is a tensor of its parameter's shape. AdamW is an Adam.
STATE_NAMES = {"SGD": ("momentum_buffer",), "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
               "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
_KNOWN = (torch.optim.SGD, torch.optim.AdamW, torch.optim.Adam)


def known_base(optimizer: torch.optim.Optimizer | type) -> type | None:
    """The torch optimizer whose step ``optimizer`` (an optimizer, or its class) runs:
    SGD, AdamW or Adam, itself or a subclass that does not override ``step()`` (its
    states are the base's); None for any other (its states are its own)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for base in _KNOWN:
        if issubclass(cls, base) and cls.step is base.step:
            return base
    return None


def has_own_step(optimizer: torch.optim.Optimizer | type) -> bool:
    """Whether ``optimizer`` (or its class) is a subclass of SGD, Adam or AdamW whose
    ``step()`` is its own: its arithmetic, and maybe its states, are not the base's."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return issubclass(cls, _KNOWN) and known_base(cls) is None


def state_names(optimizer: torch.optim.Optimizer | type) -> tuple[str, ...] | None:
    """The names of ``optimizer``'s per-parameter state tensors (:data:`STATE_NAMES`),
    or None where they are its own."""
    base = known_base(optimizer)
    return None if base is None else STATE_NAMES[base.__name__]


def _required(base: type, group: dict) -> tuple[str, ...]:
    """The states a parameter that has stepped holds under ``group``'s settings."""
    if base is torch.optim.SGD:
        return ()
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())


def state_problem(optimizer: torch.optim.Optimizer, stepped: list[torch.Tensor], params: list[torch.Tensor],
                  labels: list[str]) -> str | None:
    """One line saying why the next step cannot step the state of ``stepped`` (the
    tensors the inner optimizer steps, in its order, keys of its state), or None when it
    can. ``params``: the model's parameters they step (their shapes, their devices, and
    whether they require grad now: only those are stepped); ``labels``: their names."""
    base = known_base(optimizer)
    if base is None:
        return None
    names = STATE_NAMES[base.__name__]
    state = optimizer.state
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for m, p, label in zip(stepped, params, labels):
        entry = state.get(m) if p.requires_grad else None
        if not entry:
            continue
        where = f"opt.state[...] of {label}"
        missing = [name for name in _required(base, group_of[id(m)]) if name not in entry]
        if missing:
            return (f"{where} holds {', '.join(sorted(entry))} but no {missing[0]}: a state is whole or empty (clear it "
                    "to start that parameter afresh)")
        step = entry.get("step")
        if base is not torch.optim.SGD and not torch.is_tensor(step):
            return f"{where} has a step of {type(step).__name__}: torch's {base.__name__} counts its steps in a tensor"
        for name in names:
            t = entry.get(name)
            if t is None and (name == "momentum_buffer" or name not in entry):
                continue  # SGD's buffer before its first step with momentum
            if not torch.is_tensor(t):
                return f"{where}[{name!r}] is {type(t).__name__}, not a tensor"
            if t.shape != p.shape:
                return (f"{where}[{name!r}] has shape {list(t.shape)} and its parameter {list(p.shape)}: the step would "
                        "broadcast it or fail part-way; assign a tensor of the parameter's shape")
            if t.device != p.device:
                return f"{where}[{name!r}] is on {t.device} and its parameter on {p.device}"
            if not t.is_floating_point():
                return f"{where}[{name!r}] is {t.dtype}, not a floating tensor"
    return None


def settle(optimizer: torch.optim.Optimizer, stepped: list[torch.Tensor], params: list[torch.Tensor],
           kept: dict[str, torch.dtype]) -> None:
    """Convert each state tensor of the parameters stepped now whose dtype is not the
    one its state is kept in (``kept``: the 16-bit ones by name; every other fp32) to
    that dtype, rounded to nearest (module docstring)."""
    names = state_names(optimizer)
    if names is None:
        return
    state = optimizer.state
    for m, p in zip(stepped, params):
        entry = state.get(m) if p.requires_grad else None
        if not entry:
            continue
        for name in names:
            t = entry.get(name)
            if t is not None and t.dtype != kept.get(name, torch.float32):
                entry[name] = t.to(kept.get(name, torch.float32))
