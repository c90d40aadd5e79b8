"""Start and end a process's part in the job: :func:`init` from torchrun's environment
(or as a single process), the ``mpfp16`` logger's handlers, and :func:`teardown`.

:data:`DEFAULT_TIMEOUT_S` is the one default of how long a collective may wait for a
peer; the training configuration takes it from here.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import library_words
from .ranks import is_initialized

__all__ = ["DistInfo", "check_options", "check_environment", "init", "teardown", "close_at_teardown",
           "DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "BACKENDS"]

logger = logging.getLogger("mpfp16")

DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 30 * 24 * 3600.0  # the process group holds its timeout as a timedelta of milliseconds
BACKENDS = ("gloo", "nccl")


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


MAX_PORT = 65535


def _env_set(env, name: str) -> str:
    """Environment variable ``name`` of torchrun's, which a launched process must have."""
    if name not in env:
        raise ValueError(f"environment variable {name} is not set, and WORLD_SIZE is: launch with torchrun, which "
                         "sets both, or unset WORLD_SIZE to run a single process")
    return env[name]


def _env_int(env, name: str, minimum: int, below: tuple[str, int] | None = None, maximum: int | None = None) -> int:
    """Environment variable ``name`` of torchrun's, as an integer from ``minimum`` (and
    less than the variable ``below`` names, or at most ``maximum``)."""
    value = _env_set(env, name)
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    if number < minimum:
        raise ValueError(f"environment variable {name}={number} must be at least {minimum}")
    if below is not None and number >= below[1]:
        raise ValueError(f"environment variable {name}={number} must be less than {below[0]}={below[1]}")
    if maximum is not None and number > maximum:
        raise ValueError(f"environment variable {name}={number} must be at most {maximum}")
    return number


def check_environment(device: str | None = None, environ=None) -> tuple[int, int, int] | None:
    """torchrun's environment, checked whole before anything starts: :func:`init` calls
    it, and so does a front end that wants to refuse before loading data (the scripts).

    ``WORLD_SIZE`` says whether the process was launched (torchrun always sets it);
    without it the process runs alone and nothing else is read. With it, ``RANK``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` must all be there and make
    sense together, checked in that order so that the line names the variable that is
    wrong (``WORLD_SIZE=0`` with no ``RANK`` is WORLD_SIZE's fault, not RANK's). On
    CUDA (``device``, as :func:`init` takes it), ``LOCAL_RANK`` must name a GPU of
    this node.

    Args:
        device: ``"cpu"``, ``"cuda"`` or None (CUDA when available), as :func:`init`.
        environ: the variables to check; default ``os.environ``.

    Returns:
        ``(rank, world_size, local_rank)``, or None when not launched.

    Raises:
        ValueError: one line naming the variable and its value.
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0, below=("WORLD_SIZE", world_size))
    local_rank = _env_int(env, "LOCAL_RANK", 0, below=("WORLD_SIZE", world_size))
    address = _env_set(env, "MASTER_ADDR")
    if not address.strip():
        raise ValueError(f"environment variable MASTER_ADDR={address!r} is empty: it must name the host of rank 0")
    _env_int(env, "MASTER_PORT", 1, maximum=MAX_PORT)
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(f"environment variable LOCAL_RANK={local_rank} names no GPU: this node has "
                         f"{torch.cuda.device_count()}; use --nproc_per_node <= the number of GPUs")
    return rank, world_size, local_rank


def check_options(*, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None,
                  say=library_words) -> None:
    """The rules of :func:`init`'s options, on this machine, in one place: init calls it,
    and so does a front end that wants to refuse before anything starts (the scripts'
    config, before loading data). An NCCL backend without a CUDA device is refused
    whether or not the job is distributed, so that it is never silently unused.

    Raises:
        ValueError: one line, the options worded by ``say`` (default ``name=value``).
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown distributed backend {say('backend', backend)}; choose one of {', '.join(BACKENDS)}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"{say('timeout_s', timeout_s)}: the distributed timeout must be positive and at most "
                         f"{MAX_TIMEOUT_S:.0f} s (30 days)")
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"{say('device', device)}: the device must be cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{say('device', device)} was asked for, but no CUDA GPU is available here")
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if backend == "nccl" and not use_cuda:
        raise ValueError(f"{say('backend', backend)}: the NCCL backend needs CUDA GPUs, and this run is on the CPU: "
                         "use gloo")


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
            alone (an in-memory store, no network): :func:`mpfp16.distributed.shard`
            needs one.

    Returns:
        A :class:`DistInfo`. Without torchrun (no ``WORLD_SIZE`` in the environment)
        no process group is created and ``backend`` is None.

    Raises:
        ValueError: one line, for an option (:func:`check_options`) or a variable of
            torchrun's environment (:func:`check_environment`) that is wrong, before
            any process group is made.
    """
    check_options(backend=backend, timeout_s=timeout_s, device=device)
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"

    launch = check_environment(device)
    launched = launch is not None
    rank, world_size, local_rank = launch if launched else (0, 1, 0)
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    _configure_logging(rank, log_level)
    if not launched and not group_of_one:
        return DistInfo(0, 1, 0, dev, None)

    backend = backend or ("nccl" if use_cuda else "gloo")
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
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # MASTER_*: check_environment's
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts, timeout=timeout, multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"mpfp16/attempt-{attempt}/", store)


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


class _CurrentStream(logging.StreamHandler):
    """A handler on ``sys.stdout`` or ``sys.stderr`` as it is when a record is
    emitted, not as it was when the handler was made: a stream bound at set-up goes
    stale once the program replaces it (``contextlib.redirect_stdout``, pytest's
    capture, a notebook cell), and every later record then fails with "I/O operation
    on closed file"."""

    def __init__(self, name: str):
        self._sys_name = name
        super().__init__()

    @property
    def stream(self):
        return getattr(sys, self._sys_name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns one; the name decides
        pass


def _configure_logging(rank: int, level: int) -> None:
    """Handlers on the ``mpfp16`` logger: progress to stdout, warnings and errors to
    stderr. Rank 0 logs at ``level``, other ranks at WARNING; each line of a rank
    other than 0 is tagged with it."""
    log = logging.getLogger("mpfp16")
    for handler in list(log.handlers):
        if getattr(handler, "_mpfp16", False):
            log.removeHandler(handler)
    tag = f"[rank {rank}] " if rank else ""
    for stream, fmt, only_below_warning in (("stdout", f"{tag}%(message)s", True),
                                            ("stderr", f"{tag}%(levelname)s: %(message)s", False)):
        handler = _CurrentStream(stream)
        handler._mpfp16 = True
        if only_below_warning:
            handler.addFilter(_BelowWarning())
        else:
            handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter(fmt))
        log.addHandler(handler)
    log.setLevel(level if rank == 0 else logging.WARNING)
    log.propagate = False


# The communication-hook states (mpfp16.parallel.hooks.HookState) of the DDP modules
# wrap() made, alive or not, until teardown() closes them.
_HOOK_STATES: list = []


def close_at_teardown(hook_state) -> None:
    """Have :func:`teardown` close ``hook_state`` (a
    :class:`mpfp16.parallel.hooks.HookState`): its communication thread, and
    PowerSGD's last future, which holds the process group."""
    _HOOK_STATES.append(hook_state)


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
