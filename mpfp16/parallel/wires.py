"""Gradient exchanges below 16 bits: 8-bit codes with a scale per row
(``fp8_compress``, ``int8_compress``) and Deep Gradient Compression's top-k
(``topk``), with the state they keep between steps.

**8-bit wires.** Each parameter's gradient is cut into rows of
:data:`mpfp16.parallel.quantize.ROW` elements (:mod:`mpfp16.parallel.quantize`), and
each row has one owner: a parameter's rows are split into world_size contiguous groups,
group j owned by rank (j + the parameter's index) mod world_size. A bucket's exchange is

1. reduce-scatter: each rank encodes the rows that others own (8-bit codes, an fp32
   scale per row chosen from the row's largest magnitude) and sends them to their
   owners, point-to-point;
2. each owner sums, in fp32 and in rank order, its own rows as they are and the decoded
   rows it received, divides by world_size, and encodes the average;
3. all-gather: every owner sends the encoded average to every rank, and every rank, the
   owner included, writes the decoded average into the bucket. Every rank decodes the
   same bytes, so the replicas stay bit-identical.

With error feedback (``error_feedback=True``) each rank keeps, in fp32, what its
encoding dropped: for the rows it sent, the row minus its decoding; for the rows it
owns, world_size times the average minus its decoding (so that the next average carries
it back whole). The next step adds it to the gradient before encoding.

**Top-k** (Lin et al. 2018, Deep Gradient Compression). Each rank keeps, per element, a
momentum u and an accumulation v, both fp32: u = m u + g, v = v + u (momentum
correction); from each parameter it sends the ceil(ratio x numel) entries of v of
largest magnitude, as fp32 values and int32 indices, to every rank (all-gather), and
zeroes them in v and u (factor masking). Every rank adds the ranks' sparse vectors in
rank order and divides by world_size: the bucket then holds the average of momentum-
corrected updates, so the optimizer must apply no momentum of its own (SGD with
momentum 0; the scripts move ``--momentum`` into the exchange). A rank whose gradient
holds inf or NaN sends NaN values, so every rank skips that step.

**Independent of DDP's buckets.** Rows, owners and top-k selections are per
parameter, so the arithmetic does not depend on how DDP groups parameters into buckets
(it rebuilds them after its first step, and a resumed process starts with one bucket).
The state is kept per bucket while the buckets stay the same, and per parameter when
they change and in checkpoints: a resume continues bit for bit.

**A skipped step changes no state.** A bucket's new state is staged; when the last
bucket of a backward pass is done, it is kept if every bucket's result is finite, and
dropped otherwise: a step with inf or NaN in its gradients (which every rank skips,
since every rank holds the same result) leaves the state as it was before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import quantize
from .p2p import exchange

__all__ = ["WIRE_STRATEGIES", "WireOptions", "WireMemory", "BucketLayout", "average_8bit", "average_topk",
           "DEFAULT_TOPK_RATIO", "DEFAULT_TOPK_MOMENTUM", "DEFAULT_FP8_FORMAT"]

WIRE_STRATEGIES = ("fp8_compress", "int8_compress", "topk")
DEFAULT_FP8_FORMAT = "e4m3"
DEFAULT_TOPK_RATIO = 0.01
DEFAULT_TOPK_MOMENTUM = 0.0


@dataclass(frozen=True)
class WireOptions:
    """What a wire needs beyond the bucket: its kind, the fp8 format, error feedback,
    and top-k's ratio and momentum."""

    strategy: str
    fp8_format: str = DEFAULT_FP8_FORMAT
    error_feedback: bool = False
    topk_ratio: float = DEFAULT_TOPK_RATIO
    topk_momentum: float = DEFAULT_TOPK_MOMENTUM

    @property
    def code_format(self) -> str:
        """The 8-bit format: ``e4m3``, ``e5m2`` or ``int8``."""
        return "int8" if self.strategy == "int8_compress" else self.fp8_format

    @property
    def kinds(self) -> tuple[str, ...]:
        """The names of the tensors kept per element between steps."""
        if self.strategy == "topk":
            return ("momentum", "accumulated")
        return ("residual",) if self.error_feedback else ()

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "fp8_format": self.fp8_format, "error_feedback": self.error_feedback,
                "topk_ratio": self.topk_ratio, "topk_momentum": self.topk_momentum}


@dataclass(frozen=True)
class _Piece:
    name: str
    index: int   # the parameter's place among the model's trainable parameters
    offset: int  # where its gradient starts in the bucket
    numel: int
    row0: int    # its first row (8-bit wires)
    rows: int


class BucketLayout:
    """Where each parameter of a bucket sits: in the bucket, in the rows of the 8-bit
    wires and in the state tensors; which rows each rank owns; top-k's counts."""

    def __init__(self, names: tuple[str, ...], numels: list[int], indices: list[int], world: int,
                 device: torch.device, topk_ratio: float) -> None:
        self.names = names
        pieces, offset, row = [], 0, 0
        for name, numel, index in zip(names, numels, indices):
            rows = -(-numel // quantize.ROW)
            pieces.append(_Piece(name, index, offset, numel, row, rows))
            offset, row = offset + numel, row + rows
        self.pieces, self.numel, self.rows = pieces, offset, row
        owned: list[list[int]] = [[] for _ in range(world)]
        for p in pieces:
            for j, group in enumerate(torch.arange(p.row0, p.row0 + p.rows).tensor_split(world)):
                owned[(j + p.index) % world].extend(group.tolist())
        self.owned = [torch.tensor(rows, dtype=torch.long, device=device) for rows in owned]
        self.topk_counts = [max(1, math.ceil(topk_ratio * p.numel)) for p in pieces]

    def state_numel(self, strategy: str) -> int:
        """Elements of one state tensor of this bucket: rows x ROW (8-bit), or the
        bucket's elements (top-k)."""
        return self.numel if strategy == "topk" else self.rows * quantize.ROW

    def slices(self, strategy: str) -> dict[str, slice]:
        """Each parameter's elements in a flat state tensor of this bucket."""
        start = (lambda p: p.offset) if strategy == "topk" else (lambda p: p.row0 * quantize.ROW)
        return {p.name: slice(start(p), start(p) + p.numel) for p in self.pieces}


class WireMemory:
    """The state of a wire between steps (error feedback's residuals; top-k's momentum
    and accumulation), fp32, one tensor per kind and bucket, staged during a backward
    pass and kept at its end only if the step's results are finite (module docstring).

    Args:
        options: the wire's :class:`WireOptions`.
        params: the model's trainable parameters by name (``named_parameters()``).
    """

    def __init__(self, options: WireOptions, params: dict[str, torch.Tensor]) -> None:
        self.options = options
        self._params = dict(params)
        self._index = {name: i for i, name in enumerate(params)}
        self._names = {id(p): name for name, p in params.items()}
        self._layouts: dict[tuple[str, ...], BucketLayout] = {}
        self._kept: dict[int, tuple[BucketLayout, dict[str, torch.Tensor]]] = {}  # bucket -> its state
        self._loose: dict[str, dict[str, torch.Tensor]] = {}  # kind -> name -> flat state, outside any bucket
        self._staged: dict[int, tuple[BucketLayout, dict[str, torch.Tensor]]] = {}
        self._seen: set[int] = set()  # buckets handed over in this backward pass
        self._round_ok = True

    def layout(self, bucket, world: int, device: torch.device) -> BucketLayout:
        """The layout of DDP's ``bucket`` (built once per set of parameters)."""
        names = tuple(self._names[id(p)] for p in bucket.parameters())
        return self.layout_of(names, world, device)

    def layout_of(self, names: tuple[str, ...], world: int, device: torch.device) -> BucketLayout:
        layout = self._layouts.get(names)
        if layout is None:
            layout = self._layouts[names] = BucketLayout(
                names, [self._params[n].numel() for n in names], [self._index[n] for n in names], world, device,
                self.options.topk_ratio)
        return layout

    # ------------------------------------------------------------------ in the hook

    def state(self, index: int, layout: BucketLayout, device: torch.device) -> dict[str, torch.Tensor]:
        """Bucket ``index``'s kept state (zeros where none was kept), as the wire reads
        it; the wire must not write into it, but :meth:`stage` new tensors."""
        self._seen.add(index)
        kept = self._kept.get(index)
        if kept is not None and kept[0] is layout:
            return kept[1]
        # New, or DDP rebuilt its buckets: every kept bucket that this backward pass has
        # not used yet goes back to per-parameter form (DDP rebuilds between passes).
        for i in [i for i in self._kept if i not in self._seen or i == index]:
            self._unkeep(i)
        strategy = self.options.strategy
        where = layout.slices(strategy)
        state = {}
        for kind in self.options.kinds:
            tensor = torch.zeros(layout.state_numel(strategy), dtype=torch.float32, device=device)
            loose = self._loose.get(kind, {})
            for name, at in where.items():
                if name in loose:
                    tensor[at].copy_(loose.pop(name))
            state[kind] = tensor
        self._kept[index] = (layout, state)
        return state

    def _unkeep(self, index: int) -> None:
        layout, state = self._kept.pop(index)
        where = layout.slices(self.options.strategy)
        for kind, tensor in state.items():
            loose = self._loose.setdefault(kind, {})
            for name, at in where.items():
                loose[name] = tensor[at]

    def stage(self, index: int, layout: BucketLayout, state: dict[str, torch.Tensor], finite: bool) -> None:
        """Bucket ``index``'s new state, and whether its result was finite."""
        self._staged[index] = (layout, state)
        self._round_ok = self._round_ok and finite

    def end_round(self) -> bool:
        """The last bucket of a backward pass is done: keep the staged state if every
        result was finite (returns True), else drop it (False)."""
        ok, self._round_ok = self._round_ok, True
        staged, self._staged = self._staged, {}
        self._seen.clear()
        if ok:
            for index, (layout, state) in staged.items():
                if index in self._kept and self._kept[index][0] is layout:
                    self._kept[index] = (layout, state)
        return ok

    def abandon_round(self) -> None:
        """A forward pass: whatever a backward pass that did not finish staged is dropped."""
        self._staged.clear()
        self._seen.clear()
        self._round_ok = True

    def message(self, layout: BucketLayout) -> dict[torch.dtype, int]:
        """Elements of each dtype in this rank's message for a bucket: the codes and
        scales of every row (8-bit), or the values and indices (top-k)."""
        if self.options.strategy == "topk":
            k = sum(layout.topk_counts)
            return {torch.float32: k, torch.int32: k}
        return {quantize.CODE_DTYPES[self.options.code_format]: layout.rows * quantize.ROW, torch.float32: layout.rows}

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """This rank's state, per parameter, on CPU (it differs between ranks), with
        the options it was computed under. Call it between optimizer steps."""
        per_kind: dict[str, dict[str, torch.Tensor]] = {k: dict(self._loose.get(k, {})) for k in self.options.kinds}
        for layout, state in self._kept.values():
            where = layout.slices(self.options.strategy)
            for kind, tensor in state.items():
                per_kind[kind].update({name: tensor[at] for name, at in where.items()})
        out = {kind: {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
               for kind, tensors in per_kind.items()}
        for kind, tensors in out.items():
            for name, t in tensors.items():
                if not bool(torch.isfinite(t).all()):  # a skipped step never keeps its state
                    raise RuntimeError(f"the {self.options.strategy} {kind} of {name} holds inf or NaN")
        return {"options": self.options.as_dict(), "state": out}

    def load_state_dict(self, saved: dict) -> str | None:
        """Continue from :meth:`state_dict`'s output, before the first step.

        Returns:
            None when the run continues bit for bit; otherwise why not, in a few words.

        Raises:
            ValueError: one line, when the state is of other parameters or malformed.
        """
        try:
            options, state = dict(saved["options"]), dict(saved["state"])
            state = {kind: dict(tensors) for kind, tensors in state.items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the {self.options.strategy} state is malformed ({type(exc).__name__}: {exc})") from None
        if options.get("strategy") != self.options.strategy or set(state) != set(self.options.kinds):
            raise ValueError(f"the saved communication state is of {options.get('strategy')!r} with "
                             f"{', '.join(sorted(state)) or 'no state'}, not of {self.options.strategy} with "
                             f"{', '.join(self.options.kinds)}")
        for kind, tensors in state.items():
            if set(tensors) != set(self._params):
                odd = sorted(set(tensors) ^ set(self._params))
                raise ValueError(f"the {self.options.strategy} {kind} is of other parameters (first: {odd[0]})")
            for name, t in tensors.items():
                if not isinstance(t, torch.Tensor) or t.numel() != self._params[name].numel():
                    raise ValueError(f"the {self.options.strategy} {kind} of {name} has the wrong size")
        self._kept.clear()
        self._staged.clear()
        device = next(iter(self._params.values())).device
        self._loose = {kind: {n: t.to(device, torch.float32).reshape(-1) for n, t in tensors.items()}
                       for kind, tensors in state.items()}
        changed = [k for k in ("fp8_format", "topk_ratio", "topk_momentum")
                   if options.get(k) != getattr(self.options, k)]
        if changed:
            return f"the {self.options.strategy} settings changed ({', '.join(changed)})"
        return None


# ---------------------------------------------------------------------- the exchanges


def _gradient_rows(buf: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
    """The bucket's gradients as fp32 rows, each parameter's last row padded with zeros."""
    rows = torch.zeros(layout.rows, quantize.ROW, dtype=torch.float32, device=buf.device)
    flat = rows.view(-1)
    for p in layout.pieces:
        start = p.row0 * quantize.ROW
        flat[start:start + p.numel].copy_(buf[p.offset:p.offset + p.numel])
    return rows


def _write_rows(buf: torch.Tensor, rows: torch.Tensor, layout: BucketLayout) -> None:
    flat = rows.view(-1)
    for p in layout.pieces:
        start = p.row0 * quantize.ROW
        buf[p.offset:p.offset + p.numel].copy_(flat[start:start + p.numel])


def average_8bit(buf: torch.Tensor, layout: BucketLayout, options: WireOptions, group,
                 state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Average ``buf`` (a bucket, any float dtype) across ``group`` through 8-bit codes
    (module docstring), in place. Returns the new state (``{"residual": ...}`` with
    error feedback, else empty)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    fmt = options.code_format
    code_dtype = quantize.CODE_DTYPES[fmt]
    x = _gradient_rows(buf, layout)
    if options.error_feedback:
        x.view(-1).add_(state["residual"])
    owned = layout.owned
    mine = owned[rank]
    sent_codes, sent_scales, recv_codes, recv_scales = [], [], [], []
    for j in range(world):
        if j == rank:
            sent_codes.append(None), sent_scales.append(None)
            recv_codes.append(None), recv_scales.append(None)
            continue
        codes, scales = quantize.encode(x.index_select(0, owned[j]), fmt)
        sent_codes.append(codes), sent_scales.append(scales)
        recv_codes.append(torch.empty(mine.numel(), quantize.ROW, dtype=code_dtype, device=buf.device))
        recv_scales.append(torch.empty(mine.numel(), dtype=torch.float32, device=buf.device))
    empty = torch.empty(0, device=buf.device)
    exchange(group, rank, [[empty, empty] if c is None else [c.view(torch.uint8), s]
                           for c, s in zip(sent_codes, sent_scales)],
             [[empty, empty] if c is None else [c.view(torch.uint8), s] for c, s in zip(recv_codes, recv_scales)])
    own = x.index_select(0, mine)
    total = None
    for j in range(world):  # in rank order, so that the sum is the same whoever owns the row
        part = own if j == rank else quantize.decode(recv_codes[j], recv_scales[j])
        total = part.clone() if total is None else total.add_(part)
    average = total.div_(world)
    codes, scales = quantize.encode(average, fmt)
    decoded = quantize.decode(codes, scales)
    out_codes = [codes if j == rank else torch.empty(owned[j].numel(), quantize.ROW, dtype=code_dtype,
                                                     device=buf.device) for j in range(world)]
    out_scales = [scales if j == rank else torch.empty(owned[j].numel(), dtype=torch.float32, device=buf.device)
                  for j in range(world)]
    exchange(group, rank, [[codes.view(torch.uint8), scales]] * world,
             [[c.view(torch.uint8), s] for c, s in zip(out_codes, out_scales)])
    result = torch.empty_like(x)
    for j in range(world):
        result.index_copy_(0, owned[j], decoded if j == rank else quantize.decode(out_codes[j], out_scales[j]))
    new_state = {}
    if options.error_feedback:
        residual = torch.zeros_like(x)
        for j in range(world):
            if j != rank:
                residual.index_copy_(0, owned[j], x.index_select(0, owned[j]).sub_(
                    quantize.decode(sent_codes[j], sent_scales[j])))
        residual.index_copy_(0, mine, (average - decoded).mul_(world))
        new_state["residual"] = residual.view(-1)
    _write_rows(buf, result, layout)
    return new_state


def average_topk(buf: torch.Tensor, layout: BucketLayout, options: WireOptions, group,
                 state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Average ``buf`` across ``group`` by DGC's top-k with momentum correction and
    factor masking (module docstring), in place. Returns the new momentum and
    accumulation."""
    world = dist.get_world_size(group)
    grad = buf.float()
    momentum = state["momentum"].mul(options.topk_momentum).add_(grad)
    accumulated = state["accumulated"].add(momentum)
    picks = []
    for p, k in zip(layout.pieces, layout.topk_counts):
        part = accumulated[p.offset:p.offset + p.numel]
        picks.append(part.abs().topk(k, sorted=False).indices.add_(p.offset))
    indices = torch.cat(picks)
    values = accumulated.index_select(0, indices)
    if not bool(torch.isfinite(grad).all()):  # so that every rank sees it and skips the step
        values.fill_(float("nan"))
    accumulated.index_fill_(0, indices, 0.0)
    momentum.index_fill_(0, indices, 0.0)
    all_values = [torch.empty_like(values) for _ in range(world)]
    all_indices = [torch.empty_like(indices, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(all_values, values, group=group)
    dist.all_gather(all_indices, indices.to(torch.int32), group=group)
    total = torch.zeros(layout.numel, dtype=torch.float32, device=buf.device)
    for v, i in zip(all_values, all_indices):  # rank order
        total.index_add_(0, i.long(), v)
    buf.copy_(total.div_(world))
    return {"momentum": momentum, "accumulated": accumulated}
