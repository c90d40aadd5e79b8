"""Run a function on N local processes over gloo on 127.0.0.1, and collect results."""

from __future__ import annotations

import gc
import os
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp


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
