"""The library and the application are apart: ``import mpfp16`` is the library alone."""

import json

import pytest

from dist_helpers import check, python

HEAVY = ["torchvision", "tqdm", "torch._inductor", "torch._dynamo", "mpfp16.train", "mpfp16.stores.kernels", "lightning",
         "transformers", "accelerate", "torchao", "peft", "timm", "mpfp16.integrations"]


def modules_added_by(statement):
    """What ``statement`` imports beyond ``import torch`` (which brings tqdm itself)."""
    code = ("import sys, json, torch; before = set(sys.modules); " + statement +
            "; print(json.dumps(sorted(set(sys.modules) - before)))")
    proc = python(["-c", code], merge=False)  # a new interpreter: nothing imported yet
    check(proc)
    out = proc.stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.slow
def test_import_mpfp16_brings_no_application_and_no_compiler():
    added = modules_added_by("import mpfp16")
    assert "mpfp16.optimizer" in added
    assert not [m for m in added if any(m == h or m.startswith(h + ".") for h in HEAVY)]


@pytest.mark.slow
def test_the_application_brings_what_it_needs():
    added = modules_added_by("import mpfp16.train.engine")
    assert "torchvision" in added and "mpfp16.train.cli" not in added
