"""The rules of the fast tier, enforced on every test that is not marked ``slow``:

- it launches no Python process (a spawned worker, torchrun, a script run as a child,
  a DataLoader worker): those belong to ``slow`` tests;
- it trains no script end to end (``mpfp16.train.engine.Trainer.fit``, what
  ``train_cifar.main`` runs): a script's flag errors and refusals before training are
  fast, its runs are ``slow``;
- its set-up and call take at most ``FAST_LIMIT_S`` seconds (``MPFP16_FAST_LIMIT_S``
  overrides), not counting the time torch.compile spends compiling: a kernel compiles
  once per machine (12 s for the first one on a cold cache here, nothing once inductor's
  cache holds it), whichever test meets it first. A fixture shared by several tests
  counts for the first that uses it.

A test that breaks a rule fails with one line saying which, so that ``pytest -m "not
slow"`` stays a two-minute loop. Tests marked ``cuda`` are exempt (they run on a GPU
machine only). Programs that are not Python (the C++ compiler inductor runs) are not
counted, nor are inductor's own probes of the machine. Registered by conftest.py;
``tests/test_suite_rules.py`` checks it.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing.process
import os
import subprocess
import sys
import time

import pytest

FAST_LIMIT_S = 10.0
_SEEN = pytest.StashKey[tuple]()


def _compiling_s() -> float:
    """Seconds torch.compile has spent compiling in this process so far (dynamo's own
    account; 0 where this torch keeps none)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(dynamo_utils, "compilation_time_metrics", None) or {}
    return float(sum(metrics.get("_compile.compile_inner", ())))


def _limit_s() -> float:
    return float(os.environ.get("MPFP16_FAST_LIMIT_S", FAST_LIMIT_S))


def _is_python(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return False
    program = os.path.basename(os.fsdecode(argv[0])).split()[0] if argv[0] else ""
    return os.fsdecode(argv[0]) == sys.executable or program.startswith("python") or program == "torchrun"


def _from_the_compiler() -> bool:
    """Whether inductor itself is launching (it probes the machine once, on a cold
    cache, with a ``python -c``): part of compiling, not of the test."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("torch._inductor"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _recording_launches(launches: list):
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def init(self, args, *a, **kw):
        if _is_python(args) and not _from_the_compiler():
            launches.append(" ".join(os.fsdecode(x) for x in (args if not isinstance(args, str) else [args]))[:120])
        return popen_init(self, args, *a, **kw)

    def start(self):
        launches.append(f"multiprocessing {self.name}")
        return process_start(self)

    engine = importlib.import_module("mpfp16.train.engine")
    fit = engine.Trainer.fit

    def recording_fit(self):
        launches.append("a training run (Trainer.fit)")
        return fit(self)

    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = init, start
    engine.Trainer.fit = recording_fit
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen_init, process_start
        engine.Trainer.fit = fit


def _exempt(item) -> bool:
    return bool(item.get_closest_marker("slow") or item.get_closest_marker("cuda"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """The fixtures' part: a fixture that launches (a worker group, say) counts too."""
    if _exempt(item):
        return (yield)
    item.stash[_SEEN] = ([], 0.0)
    start, compiling = time.perf_counter(), _compiling_s()
    with _recording_launches(item.stash[_SEEN][0]):
        result = yield
    item.stash[_SEEN] = (item.stash[_SEEN][0], time.perf_counter() - start - (_compiling_s() - compiling))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if _exempt(item):
        return (yield)
    launches, took = item.stash.get(_SEEN, ([], 0.0))
    start, compiling = time.perf_counter(), _compiling_s()
    with _recording_launches(launches):
        result = yield
    took += time.perf_counter() - start - (_compiling_s() - compiling)
    if launches:
        what = launches[0]
        kind = "trained a script end to end" if what.startswith("a training run") else f"launched a Python process ({what})"
        pytest.fail(f"a test not marked slow {kind}: mark it @pytest.mark.slow, or test the decision as a pure "
                    "function", pytrace=False)
    if took > _limit_s():
        pytest.fail(f"a test not marked slow took {took:.1f} s with its fixtures (compiling aside), over the fast tier's {_limit_s():g} s: "
                    "make it smaller, or mark it @pytest.mark.slow", pytrace=False)
    return result
