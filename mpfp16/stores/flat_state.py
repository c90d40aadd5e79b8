"""The inner optimizer's state where the fused kernels step it: views of flat buffers,
owned by ``optimizer.state`` alone.

A fused kernel steps a whole segment of a flat group at once, so each state of the
parameters it steps (SGD's ``momentum_buffer``; Adam's ``exp_avg``, ``exp_avg_sq`` and
``step``) must lie in one flat buffer of the group's layout. :meth:`FlatState.adopt`
makes it so: every such tensor in ``optimizer.state`` becomes a view of a flat buffer
(in the dtype the state is kept in), holding the value it held. The kernels then step
those very tensors, so the inner optimizer's ``state``, and every state_dict taken from
it, is the state that steps. A parameter with no state starts fresh: zero moments and
step 0, as torch's first step makes them (whatever an earlier state left in its part of
the buffer). Adam's step counters of a segment are views of one tensor, so that a step
counts them with one add.

Nothing here keeps a copy of the state. What it keeps is a record of the tensors it
made the state, which :meth:`FlatState.holds` checks at every step before anything
moves: when the state is no longer those tensors (cleared, whole or one parameter's; a
tensor assigned; an earlier state_dict loaded; a step counter written in place; a
hyper-parameter that changes which states exist, such as SGD's ``momentum``; a layer
frozen or unfrozen), the step adopts what the state holds now. The check reads no
tensor: it is one identity test per state of each parameter stepped.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter, is_

import torch

from .segments import runs

__all__ = ["FlatState"]

_requires_grad = attrgetter("requires_grad")


class _Record:
    """What :meth:`FlatState.adopt` made the state, as flat lists that :meth:`FlatState.holds`
    compares by identity in C loops: the shape of the step it adopted for; the state's
    keys and entries, in order; the entries of the parameters stepped, and every value
    they hold, in order; the state tensors the kernels step, with their data pointers;
    Adam's step counters with their version."""

    __slots__ = ("shape", "keys", "entries", "stepped", "values", "views", "ptrs", "steps")

    def __init__(self, shape, state: dict, stepped: list, views: list, steps) -> None:
        self.shape, self.keys, self.entries = shape, list(state), list(state.values())
        self.stepped, self.values = stepped, [v for e in stepped for v in e.values()]
        self.views, self.ptrs = views, [v.data_ptr() for v in views]
        self.steps = steps


class FlatState:
    """The state of a flat store's fused step (module docstring).

    Args:
        optimizer: the inner optimizer (SGD, Adam or AdamW).
        groups: the store's flat groups (mpfp16/stores/groups.py).
        state_dtypes: the states kept in 16 bits, by name (the others fp32).
        sgd: whether it steps as SGD (else as Adam).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, groups, state_dtypes: dict, sgd: bool) -> None:
        self.optimizer, self.groups, self.state_dtypes, self.sgd = optimizer, groups, dict(state_dtypes), sgd
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}  # (group index, state name) -> flat buffer
        self._views: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.segments: dict[int, list] = {}  # group index -> the segments stepped
        self.steps: dict[tuple[int, int], torch.Tensor] = {}  # (group, segment) -> Adam's step counters
        self._record: _Record | None = None
        self._params = [p for g in groups for p in g.params]

    def names(self, hyper: dict) -> tuple[str, ...]:
        """The states a parameter of a param group with ``hyper`` has, that the kernels step."""
        if self.sgd:
            return ("momentum_buffer",) if hyper["momentum"] != 0 else ()
        return ("exp_avg", "exp_avg_sq")

    def _shape(self) -> tuple:
        """What the segments depend on besides the state: which parameters require grad,
        and which states each param group has."""
        return (list(map(_requires_grad, self._params)), [self.names(hyper) for hyper in self.optimizer.param_groups])

    def _view(self, gi: int, name: str, i: int) -> torch.Tensor:
        key = (gi, name)
        if key not in self.buffers:
            g = self.groups[gi]
            self.buffers[key] = g.layout.empty(self.state_dtypes.get(name, torch.float32), g.device)
            self._views[key] = g.layout.views(self.buffers[key])
        view, buffer = self._views[key][i], self.buffers[key]
        if view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            # given other data (``view.data = t``, ``view.set_(...)``): a view of the buffer
            # again, which the adoption fills with that data and puts in the state
            view = self._views[key][i] = self.groups[gi].layout.views(buffer)[i]
        return view

    # ------------------------------------------------------------------ the check

    def holds(self) -> bool:
        """Whether the state is still what the last adoption made it (module docstring).
        Every comparison is by identity or of ints, in C loops; what it costs is the
        cache misses on each parameter's state entry and tensors (docs/BENCHMARKS.md,
        ``python -m mpfp16.bench.step`` row n)."""
        record = self._record
        if record is None or record.shape != self._shape():
            return False
        state = self.optimizer.state
        if len(state) != len(record.keys) or not (all(map(is_, state, record.keys))
                                                  and all(map(is_, state.values(), record.entries))):
            return False
        values = list(chain.from_iterable(map(dict.values, record.stepped)))
        return (len(values) == len(record.values) and all(map(is_, values, record.values))
                and list(map(torch.Tensor.data_ptr, record.views)) == record.ptrs
                and all(t._version == version for t, version in record.steps))

    def forget(self) -> None:
        """The next step adopts the state again (SGD's first step made buffers)."""
        self._record = None

    def count_steps(self) -> dict[tuple[int, int], float]:
        """Adam: every segment's step counters incremented, as the step's first act;
        returns each segment's new step, which the record takes with their version."""
        values = {}
        for key, steps in self.steps.items():
            steps += 1
            values[key] = float(steps[0])
        if self._record is not None:
            self._record.steps = self._step_versions()
        return values

    def _step_versions(self) -> list[tuple[torch.Tensor, int]]:
        """Adam's step counters with their versions now (a write by anyone else moves one)."""
        return [(t, t._version) for t in self.steps.values()]

    # ------------------------------------------------------------------ adoption

    @torch.no_grad()
    def adopt(self, fresh_states: bool = True) -> None:
        """Every state tensor of the kernels' names a view of its flat buffer, with its
        value; the segments of the parameters stepped now; the record (module
        docstring). The state is checked first (mpfp16.stores.state_rules): a state
        tensor of another shape is left where it is, for that check to refuse.
        ``fresh_states=False`` (a load, outside a step): a parameter with no state
        gets none yet, as in torch, and the next step adopts again."""
        state, hypers = self.optimizer.state, self.optimizer.param_groups
        copies: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (view, its value; None: zero)
        assign: list[tuple[dict, str, torch.Tensor]] = []
        fresh: list[tuple[torch.Tensor, list]] = []  # Adam parameters stepped now that have no state
        keys_of = {}
        for gi, g in enumerate(self.groups):
            keys = []
            for i, (pg, p, m) in enumerate(zip(g.param_groups, g.params, g.master_views)):
                entry, names = state.get(m), self.names(hypers[pg])
                if not entry and not self.sgd and p.requires_grad:
                    if not fresh_states:
                        keys.append((pg, True, 0.0))
                        continue
                    views = [(name, self._view(gi, name, i)) for name in names]
                    copies += [(view, None) for _, view in views]
                    fresh.append((m, views))
                else:  # SGD's first step with momentum writes the buffer's view
                    for name in names:
                        t, view = entry.get(name) if entry else None, self._view(gi, name, i)
                        if torch.is_tensor(t) and t.shape == p.shape:
                            if t is not view:
                                copies.append((view, t))
                            assign.append((entry, name, view))
                if not p.requires_grad:
                    keys.append((pg, False, None))
                elif self.sgd:
                    keys.append((pg, True, bool(entry) and entry.get("momentum_buffer") is not None))
                else:
                    keys.append((pg, True, float(entry["step"]) if entry else 0.0))
            keys_of[gi] = keys
        # Every value is read before any view is written: a tensor assigned from another
        # parameter's state may be a view of the same buffer.
        ours = {b.untyped_storage().data_ptr() for b in self.buffers.values()}
        for view, t in [(v, t.clone() if t is not None and t.untyped_storage().data_ptr() in ours else t)
                        for v, t in copies]:
            if t is None:
                view.zero_()
            else:
                view.copy_(t)
        for entry, name, view in assign:
            entry[name] = view
        for m, views in fresh:
            state[m] = {"step": None, **dict(views)}  # the step counter is set below, with its segment's
        self.segments.clear()
        self.steps.clear()
        for gi, g in enumerate(self.groups):
            self.segments[gi] = segments = [s for s in runs(keys_of[gi], g.layout) if s.key[1]]
            if self.sgd:
                continue
            for si, segment in enumerate(segments):
                steps = torch.full((len(segment.indices),), float(segment.key[2]), dtype=torch.float32)
                for k, i in enumerate(segment.indices):
                    entry = state.get(g.master_views[i])
                    if entry:
                        entry["step"] = steps[k]
                self.steps[(gi, si)] = steps
        if fresh_states:
            self._seal()
        else:
            self.forget()

    def _seal(self) -> None:
        """Record what the state is now (:class:`_Record`)."""
        state, hypers = self.optimizer.state, self.optimizer.param_groups
        stepped, views = [], []
        for gi, g in enumerate(self.groups):
            for segment in self.segments[gi]:
                names = self.names(hypers[segment.group_index])
                for i in segment.indices:
                    entry = state.get(g.master_views[i])
                    if entry is None:
                        continue  # SGD before its first step: no entry, so one made changes the keys
                    stepped.append(entry)
                    views += [entry[name] for name in names
                              if (gi, name) in self._views and entry.get(name) is self._views[(gi, name)][i]]
                    if not self.sgd:  # the step counter, a view of its segment's
                        views.append(entry["step"])
        self._record = _Record(self._shape(), state, stepped, views, self._step_versions())
