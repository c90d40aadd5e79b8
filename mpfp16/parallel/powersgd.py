"""torch's PowerSGD hook, run so that a checkpoint can hold its state and a resume can
continue it bit for bit.

torch's ``powerSGD_hook`` keeps its state in a ``PowerSGDState``: per bucket, the local
error feedback (``error_dict``) and the P and Q warm-start memory (``p_memory_dict``,
``q_memory_dict``); for the whole model, a step counter (``iter``) and a numpy
``RandomState`` that seeds each bucket's first Q's. That state is keyed by bucket
index, and its arithmetic depends on the bucket layout beyond the values: the
products of each gradient matrix with P and Q come out different in the last bits
when the matrix sits at another offset in the bucket's buffer (the CPU GEMM's
vectorization follows the memory alignment; measured here). DDP's layout changes: a
new DDP module puts every parameter in one bucket, in definition order, and rebuilds
the buckets before its second forward pass, in the order the gradients became ready.
An uninterrupted run compresses in the rebuilt layout; a resumed one would compress
its first step in the initial layout.

So :class:`PowerSGDMemory`

- records the final (rebuilt) layout, and a checkpoint keeps it;
- until a resumed process's DDP has rebuilt its buckets, runs torch's hook on
  stand-in buckets laid out as recorded (the initial single bucket holds every
  parameter), with the same offsets and so the same arithmetic, and copies the
  results back;
- keeps the state per parameter (by name) wherever a layout change or a checkpoint
  needs it, and places a bucket's share into torch's dicts just before torch's hook
  reads them.

Steps before ``start_powerSGD_iter`` are a plain allreduce, elementwise, and never
depend on the layout.

A skipped step must leave the state as it was. torch's hook folds each bucket's
gradient into the error feedback and the P and Q memories, so one rank's NaN (which
the allreduce hands every rank) would stay in them, and every later step would be
skipped too. So the state is copied when a backward pass hands over its first bucket,
and put back when its last bucket's result holds inf or NaN anywhere in the pass: the
step every rank then skips changes none of it, not even torch's step count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook

__all__ = ["PowerSGDMemory", "RANDOM_SEED"]

logger = logging.getLogger("mpfp16")

RANDOM_SEED = 0  # PowerSGDState's seed for the first Q's: fixed, as in torch, so every rank draws the same


class PowerSGDMemory:
    """A ``PowerSGDState``, the layout it is computed in, and its state per parameter
    (module docstring).

    Args:
        state: the ``PowerSGDState`` that torch's hook uses.
        params: the model's trainable parameters by name (``named_parameters()``).
        layout_is_final: True once the DDP module has its final buckets (it has rebuilt
            them, or never will).
    """

    def __init__(self, state: PowerSGDState, params: dict[str, torch.Tensor],
                 layout_is_final: Callable[[], bool]) -> None:
        self.state = state
        self._layout_is_final = layout_is_final
        self._params = dict(params)
        self._names = {id(p): name for name, p in params.items()}
        self.layout: dict[int, tuple[str, ...]] = {}  # the final buckets: index -> parameter names
        self._placed: dict[int, tuple[str, ...]] = {}  # buckets whose entries sit in torch's dicts
        self._seen: set[int] = set()  # buckets handed to torch since the last forward pass
        self._error: dict[str, torch.Tensor] = {}  # per parameter, outside torch's dicts
        self._q: dict[str, torch.Tensor] = {}
        self._warm = False  # Q's drawn earlier wait outside torch's dicts, to be placed
        self._previous: torch.futures.Future | None = None  # the last bucket's result
        self._warned = False
        self._before = None  # the state as it was before this backward pass (module docstring)
        self._round: list[torch.Tensor] = []  # this pass's bucket buffers, which hold their results

    # ------------------------------------------------------------------ in the hook

    def new_round(self) -> None:
        """A forward pass: the next backward hands every bucket over again. A backward
        pass that did not finish leaves the state as it was before it."""
        if self._before is not None:
            self._restore()
        self._round.clear()
        self._seen.clear()
        self._previous = None

    def end_round(self, value):
        """The last bucket's result is in (every earlier one's too): if any of the
        pass's results holds inf or NaN, the state goes back to what it was before the
        pass. Returns ``value``, the last result."""
        if not all(bool(torch.isfinite(buf).all()) for buf in self._round):
            self._restore()
        self._before = None
        self._round.clear()
        return value

    def _capture(self) -> None:
        s = self.state
        # torch's hook (and this class) replaces an error-feedback tensor and never writes
        # into one, so holding the tensors is enough; it writes into P and Q: those are copied.
        self._before = (s.iter, s.rng.get_state(),
                        [dict(s.error_dict), *({i: t.clone() for i, t in memory.items()}
                                               for memory in (s.p_memory_dict, s.q_memory_dict))],
                        dict(self._placed), dict(self._error), dict(self._q), self._warm)

    def _restore(self) -> None:
        s = self.state
        s.iter, rng, memories, placed, error, q, self._warm = self._before
        s.rng.set_state(rng)
        for memory, saved in zip((s.error_dict, s.p_memory_dict, s.q_memory_dict), memories):
            memory.clear()
            memory.update(saved)
        self._placed, self._error, self._q = placed, error, q
        self._before = None

    def run(self, bucket) -> tuple[torch.futures.Future, bool]:
        """torch's ``powerSGD_hook`` on DDP's ``bucket``, once the previous bucket's
        result is in (see :func:`mpfp16.parallel.hooks.powersgd_hook`). Returns its future and
        whether it compressed (False: a plain allreduce, before ``start_powerSGD_iter``)."""
        if self._previous is not None:
            self._previous.wait()
        if self._before is None:
            self._capture()
        self._round.append(bucket.buffer())
        names = tuple(self._names[id(p)] for p in bucket.parameters())
        if self._layout_is_final():
            self.layout[bucket.index()] = names
            if bucket.is_last():  # a rebuild may have left fewer buckets
                self.layout = {i: n for i, n in self.layout.items() if i <= bucket.index()}
        compressed = self.state.iter >= self.state.start_powerSGD_iter
        recorded = self._recorded_buckets(bucket.index(), names) if compressed else None
        if recorded is not None:
            fut = self._run_as_recorded(bucket, names, recorded)
        else:
            if compressed:
                self._prepare(bucket.index(), names)
            fut = powerSGD_hook(self.state, bucket)
        self._previous = fut
        return fut, compressed

    def _recorded_buckets(self, index: int, names: tuple[str, ...]) -> list[int] | None:
        """The recorded buckets that make up DDP's ``bucket``, while DDP's buckets are not
        final yet and differ from the recorded ones; None when torch can take DDP's."""
        if self._layout_is_final() or not self.layout or self.layout.get(index) == names:
            return None
        mine = set(names)
        parts = [i for i in sorted(self.layout) if mine.intersection(self.layout[i])]
        if sum(len(self.layout[i]) for i in parts) == len(mine) and all(mine.issuperset(self.layout[i])
                                                                         for i in parts):
            return parts
        if not self._warned:  # not seen with torch 2.14, whose first bucket holds every parameter
            logger.warning("PowerSGD: DDP's first buckets do not contain the recorded ones; until DDP rebuilds "
                           "them, the last bits may differ from an uninterrupted run")
            self._warned = True
        return None

    def _run_as_recorded(self, bucket, names: tuple[str, ...], parts: list[int]) -> torch.futures.Future:
        """torch's hook on stand-ins for the recorded buckets ``parts``, one after the
        other, their gradients copied from DDP's bucket and the results copied back."""
        buf = bucket.buffer()
        where, offset = {}, 0
        for name in names:
            where[name] = slice(offset, offset + self._params[name].numel())
            offset += self._params[name].numel()
        for index in parts:
            stand_in = _Bucket(index, len(self.layout), [self._params[n] for n in self.layout[index]],
                               torch.cat([buf[where[n]] for n in self.layout[index]]))
            self._prepare(index, self.layout[index])
            powerSGD_hook(self.state, stand_in).wait()
            at = 0
            for name in self.layout[index]:
                numel = self._params[name].numel()
                buf[where[name]].copy_(stand_in.buffer()[at:at + numel])
                at += numel
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    def _prepare(self, index: int, names: tuple[str, ...]) -> None:
        """Before torch's hook compresses bucket ``index``: its entries in torch's dicts
        must be of this layout."""
        if self._placed.get(index) != names:
            # New to torch's dicts, or DDP rebuilt its buckets: take back every entry that
            # this backward pass has not used yet (the used ones fit: DDP rebuilds before
            # a forward pass, never within a backward one).
            for i in [i for i in self._placed if i not in self._seen]:
                self._unplace(i)
        if index not in self._placed:
            self._place(index, names)
        self._placed[index] = names
        self._seen.add(index)

    def _compressed(self, names) -> list[tuple[str, int, int, int]]:
        """(name, rows, cols, rank) of the matrices torch compresses, in the order of its
        P and Q memory: grouped by shape, in order of each shape's first appearance."""
        groups: dict[tuple[int, int], list] = {}
        for name in names:
            rows, cols = _matrix_shape(self._params[name])
            rank = min(rows, cols, self.state.matrix_approximation_rank)
            if _should_compress(rows, cols, rank, self.state.min_compression_rate)[0]:
                groups.setdefault((rows, cols), []).append((name, rows, cols, rank))
        return [entry for group in groups.values() for entry in group]

    def _split(self, index: int) -> tuple[dict, dict]:
        """A placed bucket's error feedback and Q's, per parameter (views)."""
        names = self._placed[index]
        errors, qs = {}, {}
        error = self.state.error_dict.get(index)
        if error is not None:
            errors = dict(zip(names, error.split([self._params[n].numel() for n in names])))
        q = self.state.q_memory_dict.get(index)
        if q is not None:
            compressed = self._compressed(names)
            pieces = q.split([cols * rank for _, _, cols, rank in compressed])
            qs = {name: piece.view(1, cols, rank) for (name, _, cols, rank), piece in zip(compressed, pieces)}
        return errors, qs

    def _unplace(self, index: int) -> None:
        errors, qs = self._split(index)
        self._error.update(errors)
        self._q.update(qs)
        self._warm = self._warm or index in self.state.q_memory_dict
        del self._placed[index]
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.pop(index, None)

    def _place(self, index: int, names: tuple[str, ...]) -> None:
        """Give torch bucket ``index``'s entries from the per-parameter state. With the
        P memory present, torch takes the Q's as they are (warm start) instead of
        drawing new ones, and overwrites P before reading it."""
        if not names:
            return
        like = self._params[names[0]]
        dtype, device = like.dtype, like.device
        if any(n in self._error for n in names):
            self.state.error_dict[index] = torch.cat([self._error.pop(n).to(device, dtype) for n in names])
        if self._warm:
            compressed = self._compressed(names)
            qs = [self._q.pop(n).to(device, dtype).reshape(-1) for n, _, _, _ in compressed]
            self.state.q_memory_dict[index] = torch.cat(qs) if qs else torch.empty(0, dtype=dtype, device=device)
            self.state.p_memory_dict[index] = torch.zeros(sum(rows * rank for _, rows, _, rank in compressed),
                                                          dtype=dtype, device=device)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """This rank's state as plain tensors (on CPU) and values: the error feedback
        differs between ranks, the rest is the same on every rank."""
        errors, qs = dict(self._error), dict(self._q)
        for index in self._placed:
            e, q = self._split(index)
            errors.update(e)
            qs.update(q)
        s = self.state
        _, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            "iter": s.iter, "matrix_approximation_rank": s.matrix_approximation_rank,
            "warm": self._warm or bool(s.q_memory_dict),
            "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                    "cached_gaussian": float(cached)},
            "total_numel_before_compression": s.total_numel_before_compression,
            "total_numel_after_compression": s.total_numel_after_compression,
            "next_stats_report": s.next_stats_report,
            "layout": [list(self.layout[i]) for i in sorted(self.layout)],
            "error": {n: t.detach().to("cpu", copy=True) for n, t in errors.items()},
            "q": {n: t.detach().to("cpu", copy=True) for n, t in qs.items()},
        }

    def load_state_dict(self, saved: dict) -> str | None:
        """Continue from :meth:`state_dict`'s output, before the first step.

        Returns:
            None when the run continues bit-identically; otherwise why not, in a few words.

        Raises:
            ValueError: one line, when the state is of other parameters or malformed.
        """
        try:
            errors, qs, layout = dict(saved["error"]), dict(saved["q"]), [tuple(b) for b in saved["layout"]]
            rng = saved["rng"]
            iteration, rank, warm = int(saved["iter"]), int(saved["matrix_approximation_rank"]), bool(saved["warm"])
            counters = [int(saved[k]) for k in ("total_numel_before_compression", "total_numel_after_compression",
                                                 "next_stats_report")]
            rng_state = ("MT19937", rng["keys"].numpy().astype(np.uint32), int(rng["pos"]), int(rng["has_gauss"]),
                         float(rng["cached_gaussian"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"the PowerSGD state is malformed ({type(exc).__name__}: {exc})") from None
        names = set(self._params)
        saved_names = set(errors) | set(qs) | {n for bucket in layout for n in bucket}
        if saved_names - names or (errors and set(errors) != names):
            odd = sorted(saved_names - names) or sorted(names - set(errors))
            raise ValueError(f"the PowerSGD state is of other parameters (first: {odd[0]})")
        s = self.state
        s.iter = iteration
        s.total_numel_before_compression, s.total_numel_after_compression, s.next_stats_report = counters
        s.rng.set_state(rng_state)
        for memory in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
            memory.clear()
        self._placed.clear()
        self._seen.clear()
        self.layout = dict(enumerate(layout))
        self._error = errors
        if rank != s.matrix_approximation_rank:
            self._q, self._warm = {}, False
            return f"the PowerSGD rank changed from {rank} to {s.matrix_approximation_rank}, so new Q's are drawn"
        self._q, self._warm = qs, warm
        if s.iter >= s.start_powerSGD_iter and not layout:
            return ("PowerSGD had started and the process that saved it had not yet rebuilt its DDP buckets, so "
                    "the bucket layout that torch's arithmetic depends on is unknown")
        return None


class _Bucket:
    """A stand-in for DDP's ``GradBucket``, as torch's hook reads one: the gradients of
    a recorded bucket's parameters in one flat buffer, in bucket order, as DDP lays them
    out (a fresh allocation is aligned as DDP's buffers are)."""

    def __init__(self, index: int, count: int, params: list[torch.Tensor], buffer: torch.Tensor) -> None:
        self._index, self._count, self._params, self._buffer = index, count, params, buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in self._params:  # contiguous, as DDP's (a channels_last weight's gradient too)
            views.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views


def _matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """The matrix torch's hook sees a parameter as: ``view(shape[0], -1)``."""
    rows = p.shape[0] if p.dim() else 1
    return rows, p.numel() // max(rows, 1)
