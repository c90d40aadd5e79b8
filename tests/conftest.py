"""Tests marked `cuda` need a CUDA GPU: skipped on CPU, run by `python -m mpfp16.bench.gpu`.
Tests not marked `slow` follow the fast tier's rules (tests/suite_rules.py)."""

import os

# inductor compiles in this process, not in a pool of worker processes it would start
# (a launch per test session, and one the fast tier's rules would count); on 2 cores the
# pool saves nothing here.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest_plugins = ["suite_rules"]

# Under pytest-xdist (-n 2, pyproject.toml) each test process has a core of its own: one
# thread each, as under torchrun, instead of two processes of two threads on two cores.
# `pytest -n 0` runs at the machine's default threads (CI runs the fast tier so too).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_process_group(monkeypatch):
    """A gloo process group of this process alone (an in-memory store), torn down after."""
    import torch.distributed as dist

    import mpfp16.distributed as mdist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        mdist.teardown()


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory):
    """A tiny CIFAR-10 in torchvision's format (tests/fake_data.py)."""
    from fake_data import write_fake_cifar

    return write_fake_cifar(tmp_path_factory.mktemp("cifar"))
