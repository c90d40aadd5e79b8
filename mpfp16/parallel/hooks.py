"""DDP communication hooks for 16-bit gradients, and per-step communication accounting.

DistributedDataParallel groups gradients into buckets and calls a hook per bucket as
soon as its gradients are ready, overlapping communication with the rest of backward.
The hooks here average a bucket across ranks in one of two ways:

``"allreduce"``
    ``all_reduce`` in the bucket's dtype (fp16 for an fp16 model) or in
    ``allreduce_dtype``. ``predivide_factor`` f works as in apex: divide by f before
    the sum and by world_size/f after it. A 16-bit sum saturates at 65504, so f > 1
    trades overflow risk in the sum for underflow risk in the division.

``"fp32_accumulate"``
    16-bit values on the wire, fp32 arithmetic: a reduce-scatter made of point-to-point
    exchanges (each rank receives every rank's copy of its own shard), a local sum in
    fp32 divided by world_size and rounded once to 16 bits, then an all-gather of the
    shards, also point-to-point. Buckets under 64K elements, where latency rules,
    take one fp32 allreduce of the upcast values instead. The wire carries as many bytes as a 16-bit ring
    allreduce, nothing overflows unless the average itself does, and on gloo the slow
    per-element 16-bit arithmetic of its allreduce is replaced by one vectorized pass.
    On CPU the exchanges run on a worker thread, so backward keeps overlapping them.

``"fp16_compress"``, ``"bf16_compress"``, ``"powersgd"``
    torch's own DDP compression hooks (``default_hooks.fp16_compress_hook``,
    ``bf16_compress_hook``, ``powerSGD_hook``), as baselines for an fp32 model: the
    first two cast the fp32 bucket to 16 bits, divide by world_size and allreduce it;
    PowerSGD allreduces low-rank factors P and Q of each matrix, with error feedback
    and warm start (:mod:`mpfp16.parallel.powersgd` keeps its state for checkpoints). torch's
    arithmetic is untouched; mpfp16 only adds the accounting.

:class:`CommStats` counts, for each optimizer step, the logical allreduce calls (one
per bucket), their payload bytes by wire dtype, the span from the first bucket's
hand-over to the last result, and the part of it left exposed after backward had
handed over its last bucket.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import inductor
from ..errors import compile_errors, dtype_name, one_line
from . import accumulation
from .p2p import exchange
from .powersgd import PowerSGDMemory
from .wires import WIRE_STRATEGIES, WireMemory, average_8bit, average_topk

__all__ = ["STRATEGIES", "MPFP16_STRATEGIES", "TORCH_STRATEGIES", "WIRE_STRATEGIES", "CommStats", "HookState",
           "allreduce_hook", "fp32_accumulate_hook", "fp16_compress_hook", "bf16_compress_hook", "powersgd_hook",
           "wire_hook", "HOOKS", "average_fp32_accumulate"]

logger = logging.getLogger("mpfp16")

MPFP16_STRATEGIES = ("allreduce", "fp32_accumulate")
TORCH_STRATEGIES = ("fp16_compress", "bf16_compress", "powersgd")  # torch's compression hooks, for fp32 models
STRATEGIES = MPFP16_STRATEGIES + TORCH_STRATEGIES + WIRE_STRATEGIES  # WIRE_STRATEGIES: 8-bit and top-k




class CommStats:
    """Communication accounting, reset by :meth:`pop_step` once per optimizer step.

    The hooks call :meth:`launched` when a bucket is handed to communication and
    :meth:`finished` when its result is ready (from a communication thread);
    :func:`mpfp16.distributed.wrap` calls :meth:`new_round` before each forward pass,
    since one backward pass makes one round of buckets.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.calls = 0
        self.bytes_by_dtype: Counter[str] = Counter()
        self.time_s = 0.0
        self.wait_s = 0.0
        self._first_launch = self._last_launch = self._last_finish = None

    def launched(self, numel: int, wire_dtype: torch.dtype, at: float | None = None,
                 also: dict[torch.dtype, int] | None = None) -> None:
        """A bucket of ``numel`` elements of ``wire_dtype`` on the wire was handed over
        at ``at`` (``time.perf_counter()``; default now), with ``also``'s elements of
        other dtypes in the same message (the 8-bit wires' scales, top-k's indices).
        A hook that learns its payload only after it has compressed passes the
        hand-over time it took before."""
        now = time.perf_counter() if at is None else at
        with self._lock:
            self.calls += 1
            self.bytes_by_dtype[dtype_name(wire_dtype)] += numel * wire_dtype.itemsize
            for dtype, count in (also or {}).items():
                self.bytes_by_dtype[dtype_name(dtype)] += count * dtype.itemsize
            if self._first_launch is None:
                self._first_launch = now
            self._last_launch = now

    def finished(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._last_finish = now if self._last_finish is None else max(self._last_finish, now)

    def new_round(self) -> None:
        """Close the current backward pass's round of buckets."""
        with self._lock:
            self._close_round()

    def _close_round(self) -> None:
        if self._first_launch is not None and self._last_finish is not None:
            self.time_s += max(0.0, self._last_finish - self._first_launch)
            self.wait_s += max(0.0, self._last_finish - self._last_launch)
        self._first_launch = self._last_launch = self._last_finish = None

    def pop_step(self) -> dict:
        """The figures since the previous call, then reset.

        Returns:
            ``allreduce_calls``: logical allreduces (one per bucket);
            ``allreduce_bytes``: their payload, in the dtype on the wire;
            ``allreduce_bytes_by_dtype``: the same, by dtype name;
            ``allreduce_time_s``: for each backward pass, from its first bucket's
            hand-over to its last result, summed: the time communication was in
            flight, overlapped with backward or not;
            ``allreduce_wait_s``: for each backward pass, from its last bucket's
            hand-over (when backward had no more gradient to produce) to its last
            result, summed: the communication time left exposed. On CUDA these are
            host-side times of enqueued work.
        """
        with self._lock:
            self._close_round()
            out = {
                "allreduce_calls": self.calls,
                "allreduce_bytes": sum(self.bytes_by_dtype.values()),
                "allreduce_bytes_by_dtype": dict(self.bytes_by_dtype),
                "allreduce_time_s": self.time_s,
                "allreduce_wait_s": self.wait_s,
            }
            self._reset()
        return out


@dataclass
class HookState:
    """What a hook needs: the group, the wire dtype, the divisors and the stats."""

    process_group: dist.ProcessGroup | None = None
    allreduce_dtype: torch.dtype | None = None
    predivide_factor: float = 1.0
    chunk_numel: int = 1 << 23
    small_numel: int = 1 << 16  # below this, fp32_accumulate upcasts and allreduces in fp32
    stats: CommStats = field(default_factory=CommStats)
    powersgd: PowerSGDMemory | None = None  # strategy "powersgd" only
    wire: WireMemory | None = None  # WIRE_STRATEGIES only
    compile_reduce: bool = True  # fp32_accumulate's reduction compiled; False once compiling failed
    # fp32_accumulate's own group, of the same ranks: its exchanges run on a worker
    # thread while DDP issues collectives of its own on ``process_group`` (the used-
    # parameter map of find_unused_parameters), and gloo requires one order per group.
    exchange_group: dist.ProcessGroup | None = None
    _worker: _Worker | None = None
    _scratch: torch.Tensor | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def own_group(self) -> dist.ProcessGroup:
        """Where fp32_accumulate's traffic goes: its own group when it has one."""
        return self.exchange_group if self.exchange_group is not None else self.group

    def scratch(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reusable receive buffer (only the communication thread uses it)."""
        numel = shape[0] * shape[1]
        s = self._scratch
        if s is None or s.dtype != dtype or s.device != device or s.numel() < numel:
            s = self._scratch = torch.empty(numel, dtype=dtype, device=device)
        return s[:numel].view(shape)

    def new_round(self) -> None:
        """A forward pass (see :meth:`CommStats.new_round`)."""
        self.stats.new_round()
        if self.powersgd is not None:
            self.powersgd.new_round()
        if self.wire is not None:
            self.wire.abandon_round()

    def close(self) -> None:
        if self.powersgd is not None:
            self.powersgd.new_round()  # drops the last bucket's future, which holds the process group
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def allreduce_hook(state: HookState, bucket):  # DDP rejects string annotations on `bucket`
    """Average a bucket with one ``all_reduce`` in ``state.allreduce_dtype`` (default:
    the bucket's dtype), dividing by ``predivide_factor`` before the sum and by
    ``world_size / predivide_factor`` after it.

    Parameters with an fp32 gradient sum (:mod:`mpfp16.parallel.accumulation`) send
    it: rounded once to 16 bits with this micro-batch added, or, on an fp32 wire, as
    it is, the average then landing in the sums."""
    buf = bucket.buffer()
    world = dist.get_world_size(state.group)
    wire_dtype = state.allreduce_dtype or buf.dtype
    carry = accumulation.Carry.of(bucket)
    if carry is not None and wire_dtype == buf.dtype:
        carry.fold()
    wire = buf if wire_dtype == buf.dtype else buf.to(wire_dtype)
    pieces = carry.fold_into(wire, buf) if carry is not None and wire is not buf else None
    pre = state.predivide_factor
    post = world / pre
    if pre != 1.0:
        wire.div_(pre)
    state.stats.launched(buf.numel(), wire_dtype)
    work = dist.all_reduce(wire, group=state.group, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        result = fut.value()[0]
        if post != 1.0:
            result.div_(post)
        if result is not buf:
            buf.copy_(result)
        if carry is not None:
            carry.land(pieces)
        state.stats.finished()
        return buf

    return work.get_future().then(finish)


def _reduce_shard(mine: torch.Tensor, others: torch.Tensor, world: int) -> None:
    """mine <- (mine + sum(others)) / world, summed in fp32 and rounded once."""
    total = others.float().sum(0) if others.size(0) > 1 else others[0].float()
    mine.copy_(((mine.float() + total) / world).to(mine.dtype))


_COMPILE_MIN_NUMEL = 1 << 15


@functools.cache
def _compiled_reduce_shard():
    return torch.compile(_reduce_shard, dynamic=True)


def _reduce(state: HookState, mine: torch.Tensor, others: torch.Tensor, world: int) -> None:
    """:func:`_reduce_shard`, compiled into one pass for large shards (the eager form
    makes four passes over memory). Small shards use the eager form, and so does a
    hook whose compile failed, with one warning; both compute the same fp32 sum, and
    each shard is reduced by one rank only, so the replicas agree either way."""
    if mine.numel() >= _COMPILE_MIN_NUMEL and state.compile_reduce:
        try:
            with inductor.settings():  # as the fused step's kernels compile (mpfp16/inductor.py)
                _compiled_reduce_shard()(mine, others, world)
            return
        except compile_errors() as exc:  # a missing compiler, an unsupported device
            logger.warning("torch.compile of the fp32-accumulate reduction failed (%s); using eager ops",
                           one_line(exc))
            state.compile_reduce = False
    _reduce_shard(mine, others, world)


def average_fp32_accumulate(state: HookState, buf: torch.Tensor) -> torch.dtype:
    """Average a 16-bit ``buf`` across ranks in place with fp32 sums; return the wire dtype.

    Buffers under ``state.small_numel`` elements are latency-bound: there one fp32
    allreduce of the upcast values beats two rounds of point-to-point exchanges
    (docs/BANDWIDTH.md), and gives the same fp32 sum.
    """
    world = dist.get_world_size(state.own_group)
    if buf.numel() < state.small_numel:
        wide = buf.float()
        dist.all_reduce(wide, group=state.own_group)
        buf.copy_(wide.div_(world))
        return torch.float32
    _fp32_accumulate(state, buf)
    return buf.dtype


def _fp32_accumulate(state: HookState, buf: torch.Tensor) -> None:
    """Average ``buf`` across ranks in place, 16 bits on the wire, fp32 arithmetic.

    The buffer is cut into equal chunks of at most ``state.chunk_numel`` elements, so
    that the scratch space stays small and each exchange is of a size gloo moves
    fast (see docs/BENCHMARKS.md); each chunk is split into world_size shards
    (``torch.tensor_split``: sizes differ by at most one, known to every rank).
    """
    group = state.own_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n_chunks = max(1, -(-buf.numel() // state.chunk_numel))
    for chunk in torch.tensor_split(buf, n_chunks):
        shards = list(torch.tensor_split(chunk, world))
        mine = shards[rank]
        others = state.scratch((world - 1, mine.numel()), buf.dtype, buf.device)
        rows = iter(others)
        recvs = [mine if j == rank else next(rows) for j in range(world)]
        # Reduce-scatter: every other rank's copy of my shard arrives in `others`.
        exchange(group, rank, shards, recvs)
        _reduce(state, mine, others, world)
        # All-gather: my averaged shard goes out, theirs land in place.
        exchange(group, rank, [mine] * world, shards)


class _Worker:
    """One thread that runs blocking exchanges in bucket order, so that on CPU the
    autograd thread goes on computing gradients meanwhile."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="mpfp16-comm", daemon=True)
        self._thread.start()

    def submit(self, fn, fut: torch.futures.Future, result: torch.Tensor) -> None:
        self._jobs.put((fn, fut, result))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut, result = job
            try:
                fn()
            except BaseException as exc:  # handed to DDP, which raises it in backward
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


def fp32_accumulate_hook(state: HookState, bucket):
    """Average a 16-bit bucket with 16-bit traffic and fp32 sums (module docstring).
    fp32 buckets, and a world of one, use :func:`allreduce_hook`."""
    buf = bucket.buffer()
    if buf.dtype == torch.float32 or dist.get_world_size(state.group) == 1:
        return allreduce_hook(state, bucket)
    carry = accumulation.Carry.of(bucket)
    if carry is not None:
        carry.fold()
    state.stats.launched(buf.numel(), torch.float32 if buf.numel() < state.small_numel else buf.dtype)

    def run() -> None:
        average_fp32_accumulate(state, buf)
        if carry is not None:
            carry.land()
        state.stats.finished()

    return _off_thread(state, run, buf)


def _off_thread(state: HookState, run, buf: torch.Tensor) -> torch.futures.Future:
    """A future of ``buf``, set once ``run()`` is done: on the communication thread on
    CPU (so that backward goes on meanwhile), at once on CUDA, where the p2p waits only
    order the current stream and the host does not block."""
    fut: torch.futures.Future = torch.futures.Future()
    if buf.device.type == "cpu":
        if state._worker is None:
            state._worker = _Worker()
        state._worker.submit(run, fut, buf)
    else:
        run()
        fut.set_result(buf)
    return fut


def wire_hook(state: HookState, bucket):
    """Average a bucket through 8-bit codes or top-k (:mod:`mpfp16.parallel.wires`), on
    the wire's own group, one bucket after the other. Parameters with an fp32 gradient
    sum (:mod:`mpfp16.parallel.accumulation`) send its 16-bit rounding with this
    micro-batch added, as on a 16-bit wire. After the last bucket of a backward pass
    the wire keeps its new state only if every result was finite."""
    memory = state.wire
    buf = bucket.buffer()
    group = state.own_group
    layout = memory.layout(bucket, dist.get_world_size(group), buf.device)
    message = memory.message(layout)
    carry = accumulation.Carry.of(bucket)
    if carry is not None:
        carry.fold()
    first, *rest = message.items()
    state.stats.launched(first[1], first[0], also=dict(rest))
    index, last = bucket.index(), bucket.is_last()
    average = average_topk if memory.options.strategy == "topk" else average_8bit

    def run() -> None:
        new_state = average(buf, layout, memory.options, group, memory.state(index, layout, buf.device))
        # Whether to keep the new state needs the result's finiteness; a wire that keeps none skips that pass.
        memory.stage(index, layout, new_state, not memory.options.kinds or bool(torch.isfinite(buf).all()))
        if last:
            memory.end_round()
        if carry is not None:
            carry.land()
        state.stats.finished()

    return _off_thread(state, run, buf)


def _accounted(state: HookState, handed_over: float, numel: int, wire_dtype: torch.dtype,
               fut: torch.futures.Future) -> torch.futures.Future:
    """torch's hook's future, with the bucket counted as handed over at ``handed_over``
    and finished when that future completes. The count comes before the callback is
    attached, so a future that has already completed is never finished before launched."""
    state.stats.launched(numel, wire_dtype, at=handed_over)

    def finish(f: torch.futures.Future) -> torch.Tensor:
        value = f.value()
        state.stats.finished()
        return value

    return fut.then(finish)


def fp16_compress_hook(state: HookState, bucket):
    """torch's ``fp16_compress_hook``, counted: ``numel`` fp16 elements on the wire."""
    handed_over = time.perf_counter()
    fut = default_hooks.fp16_compress_hook(state.process_group, bucket)
    return _accounted(state, handed_over, bucket.buffer().numel(), torch.float16, fut)


def bf16_compress_hook(state: HookState, bucket):
    """torch's ``bf16_compress_hook``, counted: ``numel`` bf16 elements on the wire."""
    handed_over = time.perf_counter()
    fut = default_hooks.bf16_compress_hook(state.process_group, bucket)
    return _accounted(state, handed_over, bucket.buffer().numel(), torch.bfloat16, fut)


def powersgd_hook(state: HookState, bucket):
    """torch's ``powerSGD_hook``, one bucket after the other, counted as torch counts it
    (:meth:`mpfp16.parallel.powersgd.PowerSGDMemory.run` runs it).

    torch's hook issues the P and Q allreduces from its future's callbacks, on a
    communication thread, while the next bucket's hook issues its first allreduce from
    the autograd thread; the ranks can then enqueue them in different orders. With two
    buckets on gloo, plain DDP with ``powerSGD_hook`` hung here; where the sizes match,
    such a mix-up would pair the wrong tensors. So a bucket waits, in the autograd
    thread, for the previous bucket's result before torch's hook runs: every rank
    issues the collectives in one order. A single bucket never waits (on NCCL, whose
    futures torch completes as the work is enqueued, nothing should: not measured).

    Before ``start_powerSGD_iter`` torch allreduces the whole bucket. After it, the
    wire carries the uncompressed tensors, then P, then Q, three allreduces counted as
    this bucket's one call: torch adds exactly those elements to
    ``total_numel_after_compression`` in the hook's body, before it returns, so the
    difference across the call is the payload.
    """
    memory = state.powersgd
    handed_over = time.perf_counter()
    before = memory.state.total_numel_after_compression
    fut, compressed = memory.run(bucket)
    numel = memory.state.total_numel_after_compression - before if compressed else bucket.buffer().numel()
    if bucket.is_last():  # every earlier bucket's result is in: run() waited for it
        fut = fut.then(lambda f: memory.end_round(f.value()))
    return _accounted(state, handed_over, numel, bucket.buffer().dtype, fut)


HOOKS = {"allreduce": allreduce_hook, "fp32_accumulate": fp32_accumulate_hook,
         "fp16_compress": fp16_compress_hook, "bf16_compress": bf16_compress_hook, "powersgd": powersgd_hook,
         **{strategy: wire_hook for strategy in WIRE_STRATEGIES}}
