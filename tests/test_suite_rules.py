"""The fast tier's rules (tests/suite_rules.py) catch what they promise: an unmarked test
that launches a Python process, or runs too long, fails with one line; a slow one may."""

import pytest

pytest_plugins = ["pytester"]

INNER = '''
import subprocess, sys, time
import multiprocessing as mp
import pytest

def test_unmarked_launch():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_spawn():
    p = mp.get_context("spawn").Process(target=print)
    p.start(); p.join()

@pytest.mark.slow
def test_marked_launch():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_other_program():
    subprocess.run(["true"], check=True)

def test_unmarked_long():
    time.sleep(0.5)

def test_unmarked_quick():
    pass

def test_unmarked_training(monkeypatch):
    from mpfp16.train import engine
    monkeypatch.setattr(engine.Trainer, "__init__", lambda self: None)
    monkeypatch.setattr(engine.Trainer, "_over", lambda self: True, raising=False)
    try:
        engine.Trainer().fit()
    except Exception:
        pass  # the run itself is not the point: that it started is
'''


@pytest.mark.slow  # its inner tests launch processes, which is what it checks
def test_an_unmarked_test_that_launches_or_runs_long_fails(pytester, monkeypatch):
    monkeypatch.setenv("MPFP16_FAST_LIMIT_S", "0.3")
    pytester.makeini("[pytest]\nmarkers =\n    slow: multi-process or end-to-end runs\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "suite_rules", "-q")
    result.assert_outcomes(passed=3, failed=4)
    out = result.stdout.str()
    for name in ("unmarked_launch", "unmarked_spawn", "unmarked_long", "unmarked_training"):
        assert f"FAILED test_inner.py::test_{name}" in out
    assert out.count("launched a Python process") >= 2 and "over the fast tier's 0.3 s" in out
    assert "trained a script end to end" in out


THREADS = '''
import torch

def test_left_at_another_count():
    torch.set_num_threads(torch.get_num_threads() + 1)

def test_restored():
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    torch.set_num_threads(before)

def test_sees_the_count_it_should():
    assert torch.get_num_threads() == THREADS_AT_START
'''


def test_a_test_that_leaves_the_thread_count_changed_errors_and_the_count_is_restored(pytester):
    import torch

    threads = torch.get_num_threads()
    pytester.makeini("[pytest]\nmarkers =\n    slow: multi-process or end-to-end runs\n")
    pytester.makepyfile(test_inner=THREADS.replace("THREADS_AT_START", str(threads)))
    result = pytester.runpytest_inprocess("-p", "suite_rules", "-q", "-p", "no:randomly")
    result.assert_outcomes(passed=3, errors=1)
    out = result.stdout.str()
    assert "ERROR test_inner.py::test_left_at_another_count" in out
    assert f"left torch's thread count at {threads + 1}, not the {threads} it started with" in out
    assert torch.get_num_threads() == threads
