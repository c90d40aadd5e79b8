"""torch.distributed for data-parallel training: set-up from torchrun, DDP wrapping,
accumulation without communication, and teardown.

    info = mpfp16.distributed.init()              # reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK
    model = mpfp16.distributed.wrap(model, allreduce_dtype=None, predivide_factor=1.0)
    for micro in range(accum_steps):
        with mpfp16.distributed.sync_gradients(model, micro == accum_steps - 1):
            opt.backward(loss_fn(model(x), y) / accum_steps)
    opt.step(); stats = mpfp16.distributed.comm_stats(model).pop_step()
    mpfp16.distributed.teardown()
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from .comm import HOOKS, STRATEGIES, TORCH_STRATEGIES, CommStats, HookState
from .powersgd import RANDOM_SEED, PowerSGDMemory
from .replicas import ReplicaDivergenceError, check_replicas
from .sharding import is_sharded_model, set_gradient_sync, shard

__all__ = [
    "DistInfo", "init", "teardown", "wrap", "shard", "sync_gradients", "comm_stats", "comm_state_dict",
    "load_comm_state_dict", "check_replicas", "ReplicaDivergenceError", "broadcast_buffers", "broadcast_object",
    "all_gather_object", "gather_object", "get_rank", "get_world_size", "is_main_process", "DEFAULT_TIMEOUT_S",
]

logger = logging.getLogger("mpfp16")

DEFAULT_TIMEOUT_S = 600.0
BACKENDS = ("gloo", "nccl")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0, and in a run that is not distributed."""
    return get_rank() == 0


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: not distributed

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None,
         log_level: int = logging.INFO, group_of_one: bool = False) -> DistInfo:
    """Set up this process from torchrun's environment, or as a single process.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default: NCCL on CUDA, gloo on CPU.
        timeout_s: how long a collective may wait for a peer before it fails, so that
            a dead rank ends the run with an error instead of a hang.
        device: ``"cpu"`` or ``"cuda"``; default: CUDA when available (GPU
            ``LOCAL_RANK`` under torchrun).
        log_level: level of the ``mpfp16`` logger on rank 0; other ranks log warnings
            and errors only.
        group_of_one: without torchrun, still make a process group, of this process
            alone (an in-memory store, no network): :func:`shard` needs one.

    Returns:
        A :class:`DistInfo`. Without torchrun (no ``WORLD_SIZE`` in the environment)
        no process group is created and ``backend`` is None.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown distributed backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not timeout_s > 0:
        raise ValueError(f"the distributed timeout must be positive, got {timeout_s}")
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but no CUDA GPU is available")

    launched = "WORLD_SIZE" in os.environ
    rank = _env_int("RANK") if launched else 0
    world_size = _env_int("WORLD_SIZE") if launched else 1
    local_rank = _env_int("LOCAL_RANK") if launched else 0
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                "use --nproc_per_node <= the number of GPUs"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    _configure_logging(rank, log_level)
    if not launched and not group_of_one:
        return DistInfo(0, 1, 0, dev, None)

    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("the NCCL backend needs CUDA GPUs; use gloo on CPU")
    kwargs = {"device_id": dev} if use_cuda else {}
    timeout = timedelta(seconds=timeout_s)
    store = _attempt_store(rank, world_size, timeout) if launched else dist.HashStore()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    logger.info("distributed: %d process%s, backend %s, device %s, timeout %gs", world_size,
                "" if world_size == 1 else "es", backend, dev.type, timeout_s)
    return DistInfo(rank, world_size, local_rank, dev, backend)


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store of ``env://``, with keys private to this restart attempt.

    When torchrun restarts a failed group (``--max-restarts``), the new workers talk
    through the same store as the old ones. gloo then found the old workers'
    addresses there and failed to connect ("Connection refused"), so the restart
    never trained. A prefix per ``TORCHELASTIC_RESTART_COUNT`` keeps each attempt's
    keys apart.
    """
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(f"{name} is not set: launch with torchrun")
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), world_size,
                          is_master=rank == 0 and not agent_hosts, timeout=timeout, multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"mpfp16/attempt-{attempt}/", store)


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def _configure_logging(rank: int, level: int) -> None:
    """Handlers on the ``mpfp16`` logger: progress to stdout, warnings and errors to
    stderr. Rank 0 logs at ``level``, other ranks at WARNING; each line of a rank
    other than 0 is tagged with it."""
    log = logging.getLogger("mpfp16")
    for handler in list(log.handlers):
        if getattr(handler, "_mpfp16", False):
            log.removeHandler(handler)
    tag = f"[rank {rank}] " if rank else ""
    for stream, fmt, only_below_warning in ((sys.stdout, f"{tag}%(message)s", True),
                                            (sys.stderr, f"{tag}%(levelname)s: %(message)s", False)):
        handler = logging.StreamHandler(stream)
        handler._mpfp16 = True
        if only_below_warning:
            handler.addFilter(_BelowWarning())
        else:
            handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter(fmt))
        log.addHandler(handler)
    log.setLevel(level if rank == 0 else logging.WARNING)
    log.propagate = False


def teardown() -> None:
    """Destroy the process group (if any) and stop the communication threads.

    A DDP module that is already unreachable still holds the process group, and
    DDP's internal reference cycles keep it until the garbage collector runs; if that
    is the interpreter's final collection, gloo's worker threads free the tensors of
    their last collectives after Python is gone, and the process aborts ("terminate
    called without an active exception", seen here in about one exit in ten). So the
    collection runs now. Drop your references to the DDP module before calling this.

    torch's PowerSGD hook has a second way to abort: its future callbacks hold the
    process group, and a gloo thread frees a callback after it ran, once it gets the
    GIL, which can be after the step's result was handed back and after this function
    destroyed the group. That last reference then destroys the group on the gloo
    thread, whose destructor joins the gloo threads, itself included ("Resource
    deadlock avoided", about one exit in ten here). So after a PowerSGD run, the group
    is released here, on this thread, once the gloo threads have let go of it.
    """
    group = dist.group.WORLD if is_initialized() and any(s.powersgd for s in _HOOK_STATES) else None
    for state in _HOOK_STATES:
        state.close()
    _HOOK_STATES.clear()
    if is_initialized():
        dist.destroy_process_group()
    gc.collect()
    _release_last(group)


def _release_last(group, timeout_s: float = 1.0) -> None:
    """Return when ``group`` is referenced only by the caller (and this frame), waiting
    with the GIL released so that a gloo thread can free its references; the caller's
    reference then destroys it on the caller's thread. Gives up after ``timeout_s``
    (the DDP module still alive, say)."""
    deadline = time.monotonic() + timeout_s
    while group is not None and sys.getrefcount(group) > 3 and time.monotonic() < deadline:
        time.sleep(0.001)


_HOOK_STATES: list[HookState] = []


def wrap(model: torch.nn.Module, allreduce_dtype: torch.dtype | None = None, predivide_factor: float = 1.0,
         bucket_mb: float = 25, strategy: str = "allreduce", *, powersgd_rank: int = 1, powersgd_start_iter: int = 2,
         device_ids=None, process_group=None, broadcast_buffers: bool = True, find_unused_parameters: bool = False,
         static_graph: bool = False) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel with an mpfp16 communication hook.

    Args:
        model: the (16-bit) model, already on its device.
        allreduce_dtype: the dtype on the wire for ``strategy="allreduce"``; default
            the gradients' own (fp16 for an fp16 model). ``torch.float32`` upcasts.
        predivide_factor: divide by f before the sum and by world_size/f after it
            (apex's ``gradient_predivide_factor``). 1 sums first; world_size divides
            first, as DDP's default hook does.
        bucket_mb: DDP bucket size in MiB (apex's ``message_size``).
        strategy: ``"allreduce"`` or ``"fp32_accumulate"`` (16-bit wire, fp32 sums);
            or, for an fp32 model, one of torch's compression hooks as a baseline:
            ``"fp16_compress"``, ``"bf16_compress"``, ``"powersgd"`` (see :mod:`mpfp16.comm`).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank``.
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter``: optimizer steps of
            plain allreduce before compression starts; at least 2, torch's minimum with
            error feedback and warm start (both on).
        device_ids, process_group, broadcast_buffers, find_unused_parameters,
        static_graph: passed to DDP. BatchNorm buffers are broadcast from rank 0 at
            each forward when ``broadcast_buffers`` is True, as DDP does.

    Returns:
        The DDP module; its per-step communication figures are
        ``comm_stats(ddp).pop_step()``, and the state a checkpoint must keep for an
        exact resume (PowerSGD's) is ``comm_state_dict(ddp)``.
    """
    if not is_initialized():
        raise RuntimeError("wrap() needs torch.distributed: call mpfp16.distributed.init() under torchrun")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown allreduce strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if allreduce_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"allreduce_dtype must be None, float16, bfloat16 or float32, got {allreduce_dtype}")
    if strategy == "fp32_accumulate" and allreduce_dtype not in (None,):
        raise ValueError("strategy 'fp32_accumulate' sends the gradients' own 16-bit dtype; "
                         "leave allreduce_dtype unset")
    if not predivide_factor > 0:
        raise ValueError(f"predivide_factor must be positive, got {predivide_factor}")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    _check_torch_strategy(model, strategy, allreduce_dtype, predivide_factor, powersgd_rank, powersgd_start_iter)
    param = next(model.parameters(), None)
    if device_ids is None and param is not None and param.device.type == "cuda":
        device_ids = [param.device.index]
    # torch 2.14 renamed broadcast_buffers to forward_sync_buffers.
    sync_kw = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=bucket_mb,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        # The gradients must stay views of FP16Optimizer's flat buffers, so DDP copies
        # bucket results into them instead of re-pointing them at its buckets.
        gradient_as_bucket_view=False,
        **{sync_kw: broadcast_buffers},
    )
    state = HookState(process_group=process_group, allreduce_dtype=allreduce_dtype,
                      predivide_factor=float(predivide_factor))
    if strategy == "powersgd":
        state.powersgd = _powersgd_memory(model, ddp, process_group, powersgd_rank, powersgd_start_iter,
                                          rebuilds=static_graph or not find_unused_parameters)
    ddp.register_comm_hook(state, HOOKS[strategy])
    ddp.register_forward_pre_hook(lambda module, args: state.new_round())
    ddp._mpfp16_hook_state = state
    _HOOK_STATES.append(state)
    return ddp


def _check_torch_strategy(model: torch.nn.Module, strategy: str, allreduce_dtype, predivide_factor: float,
                          powersgd_rank: int, powersgd_start_iter: int) -> None:
    """torch's compression hooks are baselines for an fp32 model, with their own
    wire dtype and division: refuse what they would ignore, in one line."""
    if not (isinstance(powersgd_rank, int) and powersgd_rank >= 1):
        raise ValueError(f"powersgd_rank must be an integer >= 1, got {powersgd_rank!r}")
    if not (isinstance(powersgd_start_iter, int) and powersgd_start_iter >= 2):
        raise ValueError(f"powersgd_start_iter must be an integer >= 2 (torch's minimum with error feedback and "
                         f"warm start), got {powersgd_start_iter!r}")
    if strategy != "powersgd" and (powersgd_rank, powersgd_start_iter) != (1, 2):
        raise ValueError(f"powersgd_rank and powersgd_start_iter apply to strategy 'powersgd' only, not {strategy!r}")
    if strategy not in TORCH_STRATEGIES:
        return
    half = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()
                   if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)})
    if half:
        raise ValueError(f"strategy {strategy!r} is torch's compression hook for an fp32 model, and this model's "
                         f"gradients are already 16-bit ({', '.join(half)}): use strategy 'allreduce' or "
                         "'fp32_accumulate'")
    if allreduce_dtype is not None:
        raise ValueError(f"strategy {strategy!r} decides its own wire dtype; leave allreduce_dtype unset")
    if predivide_factor != 1:
        raise ValueError(f"strategy {strategy!r} divides by world_size itself; leave predivide_factor at 1")


def _powersgd_memory(model: torch.nn.Module, ddp: DistributedDataParallel, process_group, rank: int,
                     start_iter: int, rebuilds: bool) -> PowerSGDMemory:
    """torch's PowerSGDState (error feedback and warm start on, a fixed seed), kept
    per parameter by :class:`mpfp16.powersgd.PowerSGDMemory`. DDP's buckets are final
    once it has rebuilt them (``_has_rebuilt_buckets``, as torch's ZeRO hook reads
    it), or from the start when it never rebuilds (unused parameters, no static graph)."""
    torch_state = PowerSGDState(process_group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
                                use_error_feedback=True, warm_start=True, random_seed=RANDOM_SEED)
    ddp_ref = weakref.ref(ddp)  # the hook state must not keep the DDP module alive (teardown)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    return PowerSGDMemory(torch_state, params,
                          lambda: not rebuilds or bool(getattr(ddp_ref(), "_has_rebuilt_buckets", False)))


def broadcast_object(obj, src: int = 0):
    """``src``'s ``obj`` on every rank (a picklable value); ``obj`` itself when not
    distributed."""
    if not is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj) -> list:
    """Every rank's ``obj``, in rank order; ``[obj]`` when not distributed."""
    if not is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_object(obj, dst: int = 0) -> list | None:
    """Every rank's ``obj`` (picklable), in rank order, on rank ``dst``; None on the
    others; ``[obj]`` when not distributed. Unlike :func:`all_gather_object`, only
    ``dst`` receives, for objects as large as a model (PowerSGD's error feedback)."""
    if not is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst)
    return gathered


@torch.no_grad()
def broadcast_buffers(model: torch.nn.Module, src: int = 0, process_group=None) -> None:
    """Give every rank ``src``'s buffers (BatchNorm statistics), as DDP does at the
    start of each forward pass; nothing when not distributed."""
    if not is_initialized():
        return
    for buf in model.buffers():
        dist.broadcast(buf, src=src, group=process_group)


def comm_stats(model: torch.nn.Module) -> CommStats | None:
    """The :class:`CommStats` of a model made by :func:`wrap` (a
    :class:`mpfp16.sharding.ShardCommStats` for one made by :func:`shard`); None for
    any other."""
    if is_sharded_model(model):
        return model._mpfp16_shard_stats
    state = getattr(model, "_mpfp16_hook_state", None)
    return state.stats if state is not None else None


def comm_state_dict(model: torch.nn.Module) -> dict | None:
    """This rank's communication-hook state that a checkpoint must keep for a resume
    to continue bit-identically, as plain tensors (on CPU) and values: PowerSGD's
    error feedback (which differs between ranks), Q memory, step count and random
    state. None when the hook keeps no state (every other strategy) or ``model`` was
    not made by :func:`wrap`. Call it between optimizer steps."""
    state = getattr(model, "_mpfp16_hook_state", None)
    return state.powersgd.state_dict() if state is not None and state.powersgd is not None else None


def load_comm_state_dict(model: torch.nn.Module, saved: dict) -> str | None:
    """Give ``model`` (made by :func:`wrap`) this rank's :func:`comm_state_dict` back,
    before its first step.

    Returns:
        None when the run continues bit-identically; otherwise why not, in a few words
        (another PowerSGD rank; a checkpoint taken after PowerSGD started, by a process
        whose DDP buckets were not yet final, so that their layout is unknown).

    Raises:
        ValueError: one line, when the state is of other parameters or malformed, or
            the model's hook keeps no state.
    """
    state = getattr(model, "_mpfp16_hook_state", None)
    if state is None or state.powersgd is None:
        raise ValueError("this model's communication hook keeps no state to load (only strategy 'powersgd' does)")
    return state.powersgd.load_state_dict(saved)


def sync_gradients(model: torch.nn.Module, sync: bool):
    """A context for one micro-batch's backward.

    ``sync=False`` runs it under DDP's ``no_sync()`` (for a model made by
    :func:`shard`, with FSDP2's gradient sync off): the gradients accumulate locally
    and nothing is sent. Pass ``sync=True`` only on the last micro-batch before
    ``step()``, so that the allreduce (or reduce-scatter) runs once per optimizer
    step, whatever the number of accumulation steps. For any other model it does
    nothing.
    """
    if is_sharded_model(model):
        return set_gradient_sync(model, sync)
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()
