"""Timing that is right on both CPU and CUDA: CUDA events around GPU work (the host
returns before the kernels finish), perf_counter on CPU."""

from __future__ import annotations

import time

import torch


class Timer:
    """``with Timer(device) as t: work()`` then ``t.seconds``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = 0.0

    def __enter__(self) -> "Timer":
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0


def time_call(fn, device: torch.device) -> float:
    """Seconds one call of ``fn`` takes on ``device``."""
    with Timer(device) as t:
        fn()
    return t.seconds

