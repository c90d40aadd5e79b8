"""fp32 accumulation, measured: the experiment (``python -m mpfp16.experiments
accumulation``), the benchmark (``python -m mpfp16.bench.accumulation``) and the
bandwidth tool's ``--accumulate-dtype`` flag run and report what they promise. No
timing is asserted."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_helpers import scripts
from mpfp16.bench import accumulation as acc_bench
from mpfp16.bench import allreduce
from mpfp16.experiments import EXPERIMENTS
from mpfp16.experiments import __main__ as cli
from mpfp16.experiments import accumulation as exp
from mpfp16.train import models as _models  # noqa: F401  (torchvision, imported at collection: the benchmark needs it)

# ----------------------------------------------------------------- the experiment


def test_the_experiment_is_registered():
    assert "accumulation" in EXPERIMENTS and exp.DOC == "docs/ACCUMULATION.md"


def test_quick_experiment_writes_its_section_and_its_numbers_hold(tmp_path, capsys):
    doc = tmp_path / "ACCUMULATION.md"
    assert cli.main(["accumulation", "--quick", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(exp.TITLE + "\n")
    for marker in ("accumulation", "accumulation:resnet18", "accumulation:imagegpt-s", "accumulation:gpt2"):
        assert text.count(f"<!-- experiment:{marker} -->") == 1
    assert "## Measured" in text and "python -m mpfp16.experiments accumulation --models gpt2 --quick" in text
    assert "section written to" in capsys.readouterr().out

    # Once more for one model: its block is replaced, not appended, and the numbers are the same (one thread).
    before = text
    out = exp.run(True, str(doc), ["resnet18"])["resnet18"]
    text = doc.read_text()
    assert text.count("<!-- experiment:accumulation:resnet18 -->") == 1 and len(text.splitlines()) == len(
        before.splitlines())
    rows = {r.n: r for r in out["rows"]}
    assert sorted(rows) == list(exp.QUICK_COUNTS)
    for r in rows.values():
        assert r.fp32 < 1e-6  # fp32 sums of fp16 values: rounding at 2^-24 relative
        assert 1e-5 < r.wire < 1e-3  # one rounding to fp16: at most 2^-11 relative, subnormals aside
        assert r.fp32_is_library is True  # the optimizer's fp32 sum is the plain sequential fp32 sum
        assert f"| {r.n} | fp32 GEMMs, fp16 results | {exp._e(r.fp16)} | {exp._e(r.fp32)} | {exp._e(r.wire)} |" in text
    # Two micro-batches: fp16's one addition and the fp32 sum rounded once are the same operation.
    assert rows[2].fp16 == rows[2].wire
    assert rows[4].fp16 > rows[4].wire  # three fp16 additions round three times
    check = out["check"]
    assert check["differ"] == 0 and check["library"] == check["fp16"] == rows[4].fp16


def test_an_unknown_model_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["accumulation", "--models", "resnet18,gpt5"])
    assert exc.value.code == 2
    assert "--models takes a comma-separated list of resnet18, imagegpt-s, gpt2, got 'resnet18,gpt5'" in \
        capsys.readouterr().err


def test_fp16_by_fp32_gemm_rounds_the_fp32_product_once():
    """Inside the mode a fp16 convolution or matrix product, forward and backward, is the
    fp32 kernel's result on the widened inputs, rounded to fp16; the widened weight it
    keeps is dropped once the weight is written."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 8, 8, generator=g).half(), torch.randn(4, 3, 3, 3, generator=g).half()
    a, b = torch.randn(5, 7, generator=g).half(), torch.randn(7, 6, generator=g).half()
    mode = exp.Fp16ByFp32Gemm(weights=[w, b])
    with mode:
        conv, mm = F.conv2d(x, w, padding=1), a @ b
    assert conv.dtype == mm.dtype == torch.float16
    assert torch.equal(conv, F.conv2d(x.float(), w.float(), padding=1).half())
    assert torch.equal(mm, (a.float() @ b.float()).half())
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with exp.Fp16ByFp32Gemm():
        F.conv2d(xg, wg, padding=1).float().sum().backward()
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    F.conv2d(x32, w32, padding=1).sum().backward()
    assert torch.equal(xg.grad, x32.grad.half()) and torch.equal(wg.grad, w32.grad.half())
    with torch.no_grad():
        b.mul_(2)
    with mode:
        assert torch.equal(a @ b, (a.float() @ b.float()).half())


# ----------------------------------------------------------------- the benchmark


def test_benchmark_smallest_run(tmp_path, capsys):
    out = tmp_path / "acc.json"
    assert acc_bench.main(["--models", "squeezenet1_1", "--fused", "off", "--rounds", "1", "--warmup", "0",
                           "--accum", "2", "--bandwidth-numel", "65536", "--threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    [times] = result["times"]
    assert times["model"] == "squeezenet1_1" and times["fused_used"] == {"None": False, "fp32": False}
    pieces = {r["piece"]: r for r in times["rows"]}
    assert list(pieces) == ["accumulate (per micro-step)", "backward, no compute (per micro)", "step",
                            "2 micro-steps + step"]
    assert pieces["accumulate (per micro-step)"]["none_ms"] == 0.0 < pieces["accumulate (per micro-step)"]["fp32_ms"]
    for r in pieces.values():
        assert r["diff_ms"] == pytest.approx(r["fp32_ms"] - r["none_ms"])
    memory = {(r["master_weights"], r["accumulate_dtype"]): r for r in result["memory"]["squeezenet1_1"]}
    assert len(memory) == 4

    def grads(key, when):
        return memory[key][when]["master_grads"]

    # Unfused with masters: the fp32 gradient buffer is there either way; the sum lives in it.
    for when in ("after_backward", "between_steps"):
        assert grads((True, "None"), when) == pytest.approx(4, rel=1e-3)
        assert grads((True, "fp32"), when) == pytest.approx(4, rel=1e-3)
    # Without masters the fp32 buffers exist inside a step only: the sum holds 4 bytes while micro-batches accumulate.
    assert grads((False, "None"), "after_backward") == 0 and grads((False, "None"), "between_steps") == 0
    assert grads((False, "fp32"), "after_backward") == pytest.approx(4, rel=1e-3)
    assert grads((False, "fp32"), "between_steps") == 0
    assert "accumulate moves 12 B per fp16 parameter" in printed and "memory_bytes_per_param" in printed
    assert "for reference: the same arithmetic alone" in printed and times["medians_ms"]["scratch reference"] > 0


@pytest.mark.slow  # compiles the fused step
def test_benchmark_fused_memory(tmp_path):
    """With fused=True and None there is no fp32 gradient buffer at all; the fp32 sum
    adds 4 bytes per parameter, kept between steps with masters."""
    out = tmp_path / "acc.json"
    assert acc_bench.main(["--models", "squeezenet1_1", "--fused", "on", "--rounds", "1", "--warmup", "1",
                           "--accum", "2", "--bandwidth-numel", "65536", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["times"][0]["fused_used"] == {"None": True, "fp32": True}
    memory = {(r["master_weights"], r["accumulate_dtype"]): r for r in result["memory"]["squeezenet1_1"]}
    assert all(r["fused_used"] for r in memory.values())
    for when in ("after_backward", "between_steps"):
        assert memory[(True, "None")][when]["master_grads"] == 0
        assert memory[(True, "fp32")][when]["master_grads"] == pytest.approx(4, rel=1e-3)
        assert memory[(True, "fp32")][when]["total"] == pytest.approx(memory[(True, "None")][when]["total"] + 4,
                                                                      rel=1e-3)
    assert memory[(False, "fp32")]["after_backward"]["master_grads"] == pytest.approx(4, rel=1e-3)


def test_benchmark_refuses_an_unknown_model(capsys):
    with pytest.raises(SystemExit) as exc:
        acc_bench.main(["--models", "gpt5"])
    assert exc.value.code == 2 and "unknown model 'gpt5'" in capsys.readouterr().err


# ----------------------------------------------------------------- the bandwidth tool's flag


def test_allreduce_accumulate_dtype_flag_parses():
    parser = allreduce.build_parser()
    assert parser.parse_args(["--model", "imagegpt-s"]).accumulate_dtype is None
    assert parser.parse_args(["--model", "imagegpt-s", "--accumulate-dtype", "fp32"]).accumulate_dtype == "fp32"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "imagegpt-s", "--accumulate-dtype", "fp16"])


def test_allreduce_accumulate_dtype_reaches_the_optimizer():
    for flag, dtype in allreduce.ACCUMULATE_DTYPES.items():
        _, opt = allreduce._build(lambda: nn.Linear(8, 8), "fp16", torch.device("cpu"), accumulate_dtype=dtype)
        assert opt.accumulate_dtype is dtype and opt.store.accumulates == (flag is not None)


def test_allreduce_refuses_accumulate_dtype_with_the_sharded_setup(capsys):
    with pytest.raises(SystemExit) as exc:
        allreduce.main(["--model", "imagegpt-s", "--setups", "fp16,fp16-sharded", "--accumulate-dtype", "fp32"])
    assert exc.value.code == 2
    assert "--accumulate-dtype fp32 is not possible with the fp16-sharded set-up" in capsys.readouterr().err


@pytest.mark.slow  # 2 processes
def test_allreduce_step_view_sends_the_same_bytes_with_fp32_accumulation(tmp_path):
    """The fp32 sum travels in the step's existing exchange: the same bytes and calls per
    step, on a 16-bit and an fp32-sum wire (every wire, bit for bit, in test_accumulate)."""
    base = ["--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "2", "--accum", "2", "--steps", "1",
            "--setups", "fp16,fp16-fp32-accumulate", "--modes", "no_sync"]
    runs = scripts("mpfp16.bench.allreduce", [base + ["--json", "none.json"],
                                              base + ["--accumulate-dtype", "fp32", "--json", "fp32.json"]],
                   tmp_path / ".out", cwd=tmp_path)
    for ranks in runs:
        assert all(r is not None and r["status"] == 0 for r in ranks), [r and r["stderr"][-2000:] for r in ranks]
    assert "accumulate_dtype fp32" in runs[1][0]["stdout"] and "accumulate_dtype" not in runs[0][0]["stdout"]
    none, fp32 = (json.loads((tmp_path / name).read_text()) for name in ("none.json", "fp32.json"))
    assert none["accumulate_dtype"] is None and fp32["accumulate_dtype"] == "fp32"
    key = ("setup", "no_sync")
    a = {tuple(r[k] for k in key): r for r in none["rows"]}
    b = {tuple(r[k] for k in key): r for r in fp32["rows"]}
    assert set(a) == set(b) and len(a) == 2
    for k in a:
        assert b[k]["bytes_per_step"] == a[k]["bytes_per_step"] > 0
        assert b[k]["calls_per_step"] == a[k]["calls_per_step"]
