"""Every process the suite launches, launched in one place: always on 127.0.0.1 with a
free port, gloo, one thread per process, a timeout, and a failure that shows the child's
last error line.

- :func:`run_workers`: a function on N spawned processes (``torch.multiprocessing``),
  returning what each returned; run several cases in one call where they can share it.
- :class:`Group`: many cases in one spawned worker group (one launch instead of one per
  case; each case gets a port of its own and its own result or traceback).
- :func:`torchrun`: a script or module under ``torch.distributed.run``.
- :func:`python`: a script or module in one plain child process.
- :func:`check`: assert a child exited as expected, else fail with its error line.
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


def _entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
    except BaseException:
        result = {"exception": traceback.format_exc()}
    gc.collect()  # the worker's DDP module and process group go while Python is alive (mdist.teardown)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_workers(fn, out_dir, world_size: int = 2, args: tuple = (), timeout: float = 120.0,
                wait_ranks: list[int] | None = None) -> list:
    """Start ``fn(rank, *args)`` on ``world_size`` spawned processes and return what each
    returned (``torch.save``-able), in rank order.

    A worker that raised fails the test with its traceback; one that does not finish
    within ``timeout`` fails it as a hang. With ``wait_ranks``, only those ranks are
    waited for; the others are then killed and their results are None.
    """
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    ctx = mp.start_processes(_entry, args=(fn, world_size, port, str(out_dir), args), nprocs=world_size,
                             join=False, start_method="spawn")
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
    """Cases that share one spawned worker group, launched once per test module.

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
        ports: list = []
        while len(ports) < len(cases):
            port = free_port()
            if port not in ports:
                ports.append(port)
        per_rank = run_workers(_run_cases, out_dir, self.world_size, args=(cases, ports), timeout=self.timeout)

        def results(key) -> list:
            got = [ranks[key] for ranks in per_rank]
            for rank, result in enumerate(got):
                if isinstance(result, dict) and "exception" in result:
                    raise AssertionError(f"case {key!r}, rank {rank} raised:\n{result['exception']}")
            return got

        return results
