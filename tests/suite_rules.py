"""The rules of the fast tier, enforced on every test that is not marked ``slow``:

- it launches no Python process (a worker process, torchrun, a script run as a child,
  a DataLoader worker): those belong to ``slow`` tests;
- it trains no script end to end (``mpfp16.train.engine.Trainer.fit``, what
  ``train_cifar.main`` runs): a script's flag errors and refusals before training are
  fast, its runs are ``slow``;
- its set-up and call take at most ``FAST_LIMIT_S`` seconds at the default threads,
  twice that at one thread (``MPFP16_FAST_LIMIT_S`` overrides), not counting the time
  torch.compile spends compiling, or mpfp16 building its C++ kernels: a kernel
  compiles once per machine (12 s for the first one on a cold cache here, nothing
  once inductor's cache holds it), whichever test meets it first. A fixture shared by several tests
  counts for the first that uses it.

Every test, slow ones included, leaves torch's intra-op thread count as it found it: a
test that sets it and does not restore it runs every later test of its process at that
count (a test of a thread count left 2 threads under pytest-xdist's one-thread workers,
and a later fast test went over its bound in CI). The count is restored, and the test
errors at teardown naming both counts.

A test that breaks a rule fails with one line saying which, so that ``pytest -m "not
slow"`` stays a two-minute loop. Tests marked ``cuda`` are exempt (they run on a GPU
machine only). Programs that are not Python (the C++ compiler inductor runs) are not
counted, nor are inductor's own probes of the machine. Registered by conftest.py;
``tests/test_suite_rules.py`` checks it.

Every test's launches are counted, slow ones included: ``pytest --launches`` ends with a
table of the Python processes each file started (a torchrun counts for itself and its
workers), new interpreters apart from forked workers: a new one costs 3-4 s of CPU here
before it does anything, the figure to keep down when a file grows slow. The fork server
(one per test process, tests/dist_helpers.py) is not counted.
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
_THREADS = pytest.StashKey[int]()
_PER_FILE = pytest.StashKey[dict]()


def pytest_addoption(parser):
    parser.addoption("--launches", action="store_true",
                     help="end with the number of Python processes each test file started")


def pytest_configure(config):
    config.stash[_PER_FILE] = {}


def _compiling_s() -> float:
    """Seconds torch.compile has spent compiling in this process so far (dynamo's own
    account; 0 where this torch keeps none), and mpfp16's build of its C++ kernels
    (mpfp16/stores/native.py), which is compiling too."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(dynamo_utils, "compilation_time_metrics", None) or {}
    native = sys.modules.get("mpfp16.stores.native")
    return float(sum(metrics.get("_compile.compile_inner", ()))) + getattr(native, "BUILD_S", 0.0)


def _limit_s() -> float:
    """The bound is for a test at the machine's default threads; at one thread (a
    pytest-xdist worker, OMP_NUM_THREADS=1) the same work takes up to twice as long."""
    if "MPFP16_FAST_LIMIT_S" in os.environ:
        return float(os.environ["MPFP16_FAST_LIMIT_S"])
    import torch

    return FAST_LIMIT_S * (2 if torch.get_num_threads() == 1 and (os.cpu_count() or 1) > 1 else 1)


def _is_python(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return False
    program = os.path.basename(os.fsdecode(argv[0])).split()[0] if argv[0] else ""
    return os.fsdecode(argv[0]) == sys.executable or program.startswith("python") or program == "torchrun"


def _frames():
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _from_the_compiler() -> bool:
    """Whether inductor itself is launching (it probes the machine once, on a cold
    cache, with a ``python -c``): part of compiling, not of the test."""
    return any(f.f_globals.get("__name__", "").startswith("torch._inductor") for f in _frames())


def processes(launch: str, forked: bool = False) -> int:
    """How many Python processes one recorded launch stands for: a torchrun is its agent
    and ``--nproc_per_node`` workers (per restart not counted); anything else is one.
    ``forked``: count only forked ones (no new interpreter, torch already imported),
    else only the others."""
    if launch.startswith("a training run") or launch.startswith("multiprocessing fork") != forked:
        return 0
    argv = launch.split()
    if "torch.distributed.run" in argv or (argv and os.path.basename(argv[0]) == "torchrun"):
        nproc = argv[argv.index("--nproc_per_node") + 1] if "--nproc_per_node" in argv else "1"
        return 1 + (int(nproc) if nproc.isdigit() else 1)
    return 1


@contextlib.contextmanager
def _recording_launches(launches: list):
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def init(self, args, *a, **kw):
        if _is_python(args) and not _from_the_compiler():
            launches.append(" ".join(os.fsdecode(x) for x in (args if not isinstance(args, str) else [args]))[:400])
        return popen_init(self, args, *a, **kw)

    def start(self):
        launches.append(f"multiprocessing {getattr(self, '_start_method', None) or 'spawn'} {self.name}")
        return process_start(self)

    engine = importlib.import_module("mpfp16.train.engine")
    fit = engine.Trainer.fit

    def recording_fit(self):
        launches.append("a training run (Trainer.fit)")
        return fit(self)

    fork = os.fork

    def recording_fork():
        if not any(f.f_globals.get("__name__", "").startswith("multiprocessing") for f in _frames()):
            launches.append("multiprocessing fork (os.fork)")
        return fork()

    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = init, start
    engine.Trainer.fit, os.fork = recording_fit, recording_fork
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen_init, process_start
        engine.Trainer.fit, os.fork = fit, fork


def _exempt(item) -> bool:
    return bool(item.get_closest_marker("slow") or item.get_closest_marker("cuda"))


def _count(item, launches: list) -> None:
    per_file = item.config.stash[_PER_FILE]
    name = item.nodeid.split("::")[0]
    fresh, forked = per_file.get(name, (0, 0))
    per_file[name] = (fresh + sum(processes(launch) for launch in launches),
                      forked + sum(processes(launch, forked=True) for launch in launches))


def _counted(item):
    """A slow or cuda test's phase, its launches counted and nothing else checked."""
    launches: list = []
    try:
        with _recording_launches(launches):
            return (yield)
    finally:
        _count(item, launches)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """The fixtures' part: a fixture that launches (a worker group, say) counts too."""
    import torch

    item.stash[_THREADS] = torch.get_num_threads()
    if _exempt(item):
        return (yield from _counted(item))
    item.stash[_SEEN] = ([], 0.0)
    start, compiling = time.perf_counter(), _compiling_s()
    with _recording_launches(item.stash[_SEEN][0]):
        result = yield
    item.stash[_SEEN] = (item.stash[_SEEN][0], time.perf_counter() - start - (_compiling_s() - compiling))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if _exempt(item):
        return (yield from _counted(item))
    launches, took = item.stash.get(_SEEN, ([], 0.0))
    start, compiling = time.perf_counter(), _compiling_s()
    with _recording_launches(launches):
        result = yield
    took += time.perf_counter() - start - (_compiling_s() - compiling)
    _count(item, launches)
    if launches:
        what = launches[0]
        kind = "trained a script end to end" if what.startswith("a training run") else f"launched a Python process ({what})"
        pytest.fail(f"a test not marked slow {kind}: mark it @pytest.mark.slow, or test the decision as a pure "
                    "function", pytrace=False)
    if took > _limit_s():
        pytest.fail(f"a test not marked slow took {took:.1f} s with its fixtures (compiling aside), over the fast tier's {_limit_s():g} s: "
                    "make it smaller, or mark it @pytest.mark.slow", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    result = yield
    import torch

    started, now = item.stash.get(_THREADS, None), torch.get_num_threads()
    if started is not None and now != started:
        torch.set_num_threads(started)
        pytest.fail(f"the test left torch's thread count at {now}, not the {started} it started with: "
                    "restore it (torch.set_num_threads in a finally)", pytrace=False)
    return result


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its counts to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["mpfp16_launches"] = session.config.stash[_PER_FILE]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: the counts of a worker that finished."""
    counts = getattr(node, "workeroutput", {}).get("mpfp16_launches", {})
    per_file = node.config.stash[_PER_FILE]
    for name, (fresh, forked) in counts.items():
        had = per_file.get(name, (0, 0))
        per_file[name] = (had[0] + fresh, had[1] + forked)


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("launches"):
        return
    per_file = {name: n for name, n in config.stash[_PER_FILE].items() if any(n)}
    terminalreporter.section("Python processes started, per test file")
    terminalreporter.write_line("  new  forked  file (new: an interpreter that imports torch again; forked: from the fork server)")
    for name, (fresh, forked) in sorted(per_file.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0])):
        terminalreporter.write_line(f"{fresh:5d}  {forked:6d}  {name}")
    terminalreporter.write_line(f"{sum(n[0] for n in per_file.values()):5d}  "
                                f"{sum(n[1] for n in per_file.values()):6d}  in all")
