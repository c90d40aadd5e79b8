"""The one-command GPU check, in its CPU dry-run mode (what CI can run)."""

import json
import os

import pytest

from mpfp16.bench import gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(900)  # the script's own four parts, each bounded (mpfp16/bench/gpu.py)
def test_dry_run_writes_its_json_and_table(tmp_path, capsys, monkeypatch):
    """The command's main() in this process; its four parts' own children (the CUDA
    tests, the step benchmark, a CIFAR epoch) as it starts them."""
    monkeypatch.chdir(REPO)
    status = gpu.main(["--dry-run", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert status == 0, captured.out[-3000:] + captured.err[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["mode"] for r in report["throughput"]] == list(gpu.MODES)
    assert all(r["img_per_s"] > 0 for r in report["throughput"])
    assert report["cuda_tests"]["returncode"] == 0 and report["cifar_epoch"]["returncode"] == 0
    assert set(report["step_bench"]) == {"sgd", "adamw"}
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| mpfp16 fp16 + masters |" in table and "Targets:" in table


def test_without_a_gpu_it_asks_for_the_dry_run(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu.main(["--out", "unused"]) == 2
    assert "--dry-run" in capsys.readouterr().err
