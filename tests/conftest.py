"""Tests marked `cuda` need a CUDA GPU: skipped on CPU, run by `python -m mpfp16.bench.gpu`."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
