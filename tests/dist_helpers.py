"""Every process the suite launches, launched in one place: always on 127.0.0.1 with a
free port, gloo, one thread per process, a timeout, and a failure that shows the child's
last error line.

- :func:`run_workers`: a function on N worker processes (``torch.multiprocessing``,
  forked from a fork server: :func:`start_method`),
  returning what each returned; run several cases in one call where they can share it.
- :class:`Group`: many cases in one worker group (one launch instead of one per
  case; each case gets a port of its own and its own result or traceback).
- :func:`torchrun`: a script or module under ``torch.distributed.run``.
- :func:`python`: a script or module in one plain child process.
- :func:`check`: assert a child exited as expected, else fail with its error line.
- :func:`scripts`: a script's runs on N workers, as torchrun would start them, in one
  worker group; :class:`Forked`: a script in one child from the fork server.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

from mpfp16.errors import last_error_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports once, so that each worker forked from it starts with them.
PRELOAD = ["torch", "torchvision", "mpfp16", "mpfp16.train.engine", "mpfp16.train.cli", "dist_helpers", "dist_workers",
           "fault_workers", "sharding_workers", "checkpoint_workers", "compression_workers", "wire_workers", "train_cifar",
           "train_imagenet", "lightning_workers", "lightning.pytorch"]  # a module that is not installed is skipped


def start_method() -> str:
    """How :func:`run_workers` and :class:`Forked` start their processes:
    ``forkserver`` where the platform has it, else ``spawn``.

    A spawned worker is a new interpreter that imports torch, torchvision and the
    worker's modules again: 3-4 s of CPU each here. The fork server is one such
    interpreter, started at the first launch of the session with :data:`PRELOAD`
    imported; each worker is then a fork of it, running in milliseconds. Forking this
    process instead would be as quick but not clean: a worker would inherit what
    earlier tests left in it (autograd refuses to run in a fork of a process whose
    backward used its thread pool, as FSDP2's does; patches; environment). A worker
    is given this process's environment and folder as they are at its launch
    (:func:`_as_launched`), as a spawned one would have them. The server never touches
    CUDA, so a worker may."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return "forkserver"


def _as_launched(env: dict, cwd: str) -> None:
    """In a worker: the launching process's environment and folder at launch time (what a
    spawned child would have had), one thread per process."""
    os.environ.clear()
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.chdir(cwd)
    torch.set_num_threads(1)


def _entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple, env: dict, cwd: str) -> None:
    _as_launched(env, cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        result = fn(rank, *args)
    except BaseException:
        result = {"exception": traceback.format_exc()}
    gc.collect()  # the worker's DDP module and process group go while Python is alive (mdist.teardown)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_workers(fn, out_dir, world_size: int = 2, args: tuple = (), timeout: float = 120.0,
                wait_ranks: list[int] | None = None) -> list:
    """Start ``fn(rank, *args)`` on ``world_size`` worker processes and return what each
    returned (``torch.save``-able), in rank order.

    A worker that raised fails the test with its traceback; one that does not finish
    within ``timeout`` fails it as a hang. With ``wait_ranks``, only those ranks are
    waited for; the others are then killed and their results are None.
    """
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    ctx = mp.start_processes(_entry, args=(fn, world_size, port, str(out_dir), args, dict(os.environ), os.getcwd()),
                             nprocs=world_size,
                             join=False, start_method=start_method())
    deadline = time.monotonic() + timeout
    try:
        if wait_ranks is None:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise AssertionError(f"workers did not finish within {timeout:.0f}s (a hang)")
        else:
            for rank in wait_ranks:
                ctx.processes[rank].join(timeout=max(0.1, deadline - time.monotonic()))
                if ctx.processes[rank].is_alive():
                    raise AssertionError(f"rank {rank} did not finish within {timeout:.0f}s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world_size):
        path = os.path.join(str(out_dir), f"rank{rank}.pt")
        if wait_ranks is not None and rank not in wait_ranks:
            results.append(None)
            continue
        if not os.path.exists(path):
            raise AssertionError(f"rank {rank} wrote no result")
        result = torch.load(path, weights_only=False)
        if isinstance(result, dict) and "exception" in result:
            raise AssertionError(f"rank {rank} raised:\n{result['exception']}")
        results.append(result)
    return results


def child_env(**extra) -> dict:
    """The environment of every child: one thread per process (as torchrun sets it),
    the repository importable, and ``extra`` on top."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun_command(target: list[str], nproc: int = 2, max_restarts: int | None = None,
                     standalone: bool = False) -> list[str]:
    """``python -m torch.distributed.run`` on this machine: one node, ``nproc`` workers,
    127.0.0.1 and a free port (or torchrun's ``--standalone`` rendezvous), then
    ``target`` (a script and its arguments, or ``["-m", module, ...]``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc)]
    if standalone:
        cmd += ["--standalone"]
    else:
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    if max_restarts is not None:
        cmd += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.2"]
    return cmd + list(target)


def _launch(cmd: list[str], timeout: float, popen: bool, cwd, env: dict | None, merge: bool):
    env = child_env(**(env or {}))
    if popen:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True)
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"")
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        raise AssertionError(f"{' '.join(cmd[2:6])} ... did not finish within {timeout:.0f}s (a hang); "
                             f"its last line: {last_error_line(out)}") from None


def torchrun(target: list[str], nproc: int = 2, timeout: float = 300, max_restarts: int | None = None,
             popen: bool = False, cwd=REPO, env: dict | None = None, standalone: bool = False, merge: bool = True):
    """Run ``target`` under torchrun (:func:`torchrun_command`) and return the
    ``CompletedProcess`` (output captured as text), or with ``popen=True`` the running
    ``Popen`` (stdout piped, stderr into it unless ``merge=False``). A run past
    ``timeout`` fails the test as a hang, with its last output line."""
    return _launch(torchrun_command(target, nproc, max_restarts, standalone), timeout, popen, cwd, env, merge)


def python(target: list[str], timeout: float = 300, popen: bool = False, cwd=REPO, env: dict | None = None,
           merge: bool = True):
    """Run ``python *target`` (a script and its arguments, or ``["-m", module, ...]``) in
    one child process, as :func:`torchrun` does."""
    return _launch([sys.executable, *target], timeout, popen, cwd, env, merge)


def check(proc, returncode: int = 0) -> None:
    """Fail the test, with the child's last error line and its output's tail, unless
    ``proc`` exited with ``returncode``."""
    if proc.returncode != returncode:
        out = (proc.stdout or "") + "\n" + (proc.stderr or "")
        raise AssertionError(f"exit status {proc.returncode}, not {returncode}: {last_error_line(out)}\n"
                             f"--- output's tail ---\n{out[-3000:]}")


# ----------------------------------------------------------------- the scripts, without new interpreters


def run_captured(module: str, argv: list[str]) -> dict:
    """``module.main(argv)`` in this process (a worker's), what it printed captured:
    ``{"status", "stdout", "stderr"}``."""
    import contextlib
    import importlib
    import io

    main = importlib.import_module(module).main
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            status = main(list(argv))
        except SystemExit as exc:  # argparse
            status = exc.code
    return {"status": status, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def _script_runs(rank: int, module: str, runs: list, ports: list, cwd: str | None) -> list:
    """Inside each worker: ``module.main(argv)`` once per argv in ``runs``, in order,
    each on a process group of its own (a fresh port), as one torchrun launch per run
    would start it; stops at the first run that fails on this rank."""
    if cwd is not None:
        os.chdir(cwd)
    out = []
    for argv, port in zip(runs, ports):
        os.environ["MASTER_PORT"] = str(port)
        out.append(run_captured(module, argv))
        if out[-1]["status"]:
            break
    return out


def scripts(module: str, runs: list[list[str]], out_dir, world_size: int = 2, timeout: float = 300,
            cwd=None) -> list[list[dict]]:
    """A command's ``main(argv)`` (``module``: "train_cifar", "train_imagenet",
    "mpfp16.bench.allreduce", ...) on ``world_size`` processes, once per argv in
    ``runs``, in order: what ``torchrun --nproc_per_node world_size`` would run with
    the same command lines, with the same environment (RANK,
    WORLD_SIZE, MASTER_ADDR, one thread), in one worker group for all the runs. Returns,
    per run, each rank's ``{"status", "stdout", "stderr"}``; a run that failed on a rank
    ends that rank's list (the tests assert on it).

    For what torchrun itself does (its signals, restarts, exit status), use
    :func:`torchrun`."""
    ports = _distinct_ports(len(runs))
    per_rank = run_workers(_script_runs, out_dir, world_size, args=(module, runs, ports, cwd and str(cwd)),
                           timeout=timeout)
    return [[ranks[i] if i < len(ranks) else None for ranks in per_rank] for i in range(len(runs))]


def _distinct_ports(n: int) -> list:
    ports: list = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _forked_main(script: str, argv: list, out_path: str, err_path: str, env: dict, cwd: str,
                 timeout_s: float) -> None:
    """Inside a :class:`Forked` child: the script's main(argv), its exit status the
    process's."""
    import importlib
    import signal

    status = 1
    try:
        for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, path in ((1, out_path), (2, err_path)):
            with open(path, "wb") as f:
                os.dup2(f.fileno(), fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        _as_launched(env, cwd)
        signal.alarm(int(timeout_s))  # a child that hangs ends (SIGALRM), as a run past a timeout
        main = importlib.import_module(os.path.splitext(os.path.basename(script))[0]).main
        try:
            status = main(list(argv))
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(status if isinstance(status, int) else 1)


class Forked:
    """``train_cifar.py`` / ``train_imagenet.py`` (any module of the repository or of
    tests/ with a ``main(argv)``) as a child process forked from the fork server
    (:func:`start_method`): the script's ``main(argv)`` with its own stdout, stderr,
    signal handlers and exit status, one thread, started in milliseconds instead of an
    interpreter's 3-4 s of imports. The part of ``subprocess.Popen`` the tests use:
    ``pid``, ``poll()``, ``wait()``, ``communicate()`` (text), ``returncode`` (``-N``
    when signal N ended it), ``kill()``.

    For the command line as a user types it (argument parsing by Python itself, the
    script's ``__main__``), use :func:`python` once; this is for the many runs whose
    subject is what the script does, as signals and locks."""

    def __init__(self, script: str, argv: list[str], timeout_s: float = 600):
        import multiprocessing
        import tempfile

        self._dir = tempfile.mkdtemp(prefix="forked-")
        self._out, self._err = os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr")
        method = start_method()
        ctx = multiprocessing.get_context(method)
        self._proc = ctx.Process(target=_forked_main, args=(script, list(argv), self._out, self._err,
                                                            dict(os.environ), os.getcwd(), timeout_s))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None):
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout)
        return self.returncode

    def _read(self, path: str) -> str:
        try:
            with open(path, "rb") as f:
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def output_so_far(self) -> str:
        """What the child has written to stdout until now (it may still be running)."""
        return self._read(self._out)

    def communicate(self, timeout: float | None = None):
        self.wait(timeout)
        return self._read(self._out), self._read(self._err)

    def kill(self):
        if self.poll() is None:
            self._proc.kill()


# ----------------------------------------------------------------- many cases, one launch


def _run_cases(rank: int, cases: list, ports: list) -> dict:
    """Inside each worker: every case in turn, on a process group of its own (a fresh
    port), each case's exception kept as its result so that the others still run."""
    import mpfp16.distributed as mdist

    out = {}
    for (key, fn, args), port in zip(cases, ports):
        os.environ["MASTER_PORT"] = str(port)
        try:
            out[key] = fn(rank, *args)
        except BaseException:
            out[key] = {"exception": traceback.format_exc()}
        finally:
            gc.collect()
            mdist.teardown()
    return out


class Group:
    """Cases that share one worker group, launched once per test module.

        GROUP = Group()
        GROUP.add("fp16-wire", W.train_dp, 4, {})        # at import: fn(rank, *args) on each rank

        @pytest.fixture(scope="module")
        def group(tmp_path_factory):
            return GROUP.run(tmp_path_factory.mktemp("group"))

        def test_x(group):
            r0, r1 = group("fp16-wire")                   # that case's per-rank results

    Each case runs on every rank in the order added, on its own process group (a fresh
    port), between ``mpfp16.distributed.teardown()`` calls; it must leave no global
    state behind (a case that patches a module runs in a launch of its own). A case
    that raised fails only the tests that ask for it, with its traceback.
    """

    def __init__(self, world_size: int = 2, timeout: float = 300.0):
        self.world_size, self.timeout, self.cases = world_size, timeout, {}

    def add(self, key, fn, *args):
        if key in self.cases:
            raise KeyError(f"case {key!r} added twice")
        self.cases[key] = (fn, args)
        return key

    def run(self, out_dir):
        cases = [(key, fn, args) for key, (fn, args) in self.cases.items()]
        ports = _distinct_ports(len(cases))
        per_rank = run_workers(_run_cases, out_dir, self.world_size, args=(cases, ports), timeout=self.timeout)

        def results(key) -> list:
            got = [ranks[key] for ranks in per_rank]
            for rank, result in enumerate(got):
                if isinstance(result, dict) and "exception" in result:
                    raise AssertionError(f"case {key!r}, rank {rank} raised:\n{result['exception']}")
            return got

        return results
