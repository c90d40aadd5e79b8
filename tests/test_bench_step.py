"""The step benchmark runs and reports what it promises (no timing is asserted)."""

import json

import pytest

from mpfp16.bench import step as bench


@pytest.mark.slow  # the benchmark end to end: it compiles the fused step for 1 and 2 threads
def test_step_benchmark_runs(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert bench.main(["--model", "squeezenet1_1", "--rounds", "1", "--warmup", "1", "--threads", "1,2",
                       "--bandwidth-numel", "100000", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["threads"] for r in result["results"]] == [1, 2]
    for per_threads in result["results"]:
        rows = per_threads["rows"]
        methods = [r["method"] for r in rows]
        assert len(methods) == 8 and methods[0].startswith("a. torch fp32 SGD foreach")
        assert methods[6:] == ["g. mpfp16 fused, unscale_()", "n. d's state guard alone"]
        assert rows[0]["ratio"] == 1.0 and all(r["median_ms"] > 0 for r in rows)
        assert 0 < per_threads["state_guard_over_d"] < 1
        limit = per_threads["limit_gb_per_s"]
        assert limit == max(per_threads["bandwidth_gb_per_s"].values()) > 0
        for r in rows:  # the three columns are one measurement seen three ways
            assert r["gb_per_s"] == pytest.approx(r["bytes_per_param"] * result["numel"] / (r["median_ms"] / 1e3) / 1e9)
            assert r["fraction_of_limit"] == pytest.approx(r["gb_per_s"] / limit)
    memory = result["memory_bytes_per_param"]
    assert memory["fp16, no masters (fused)"]["total"] < memory["fp16 + fp32 masters (fused)"]["total"] \
        < memory["fp16 + fp32 masters (unfused)"]["total"]
    assert set(result["results"][0]["bandwidth_gb_per_s"]) == {"copy", "triad", *bench.roofline.SHAPES,
                                                                 "torch fused AdamW (7 streams, 28 B)"}
    assert "vs a" in printed and "bytes per parameter" in printed and "the roofline" in printed
    assert printed.count("<- the limit") == 2  # one per thread count


@pytest.mark.slow  # compiles the fused step
def test_step_benchmark_times_a_skipped_step_and_its_scan(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert bench.main(["--model", "squeezenet1_1", "--rounds", "2", "--warmup", "1", "--threads", "1",
                       "--bandwidth-numel", "100000", "--skipped", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["results"][0]["rows"]
    assert [r["method"] for r in rows][7:] == ["h. d skipped (1 inf), named", "i. h's overflow scan alone",
                                                   "n. d's state guard alone"]
    assert all(r["median_ms"] > 0 for r in rows) and result["loss_flag_us"] > 0
    assert "loss flag for last_overflow" in capsys.readouterr().out


def test_traffic_per_method():
    """The byte counts the table divides by, against the counts stated in the issue
    and the docs: torch's fused AdamW moves 28 bytes per parameter, mpfp16's step 30
    (the kernel's 28 and the overflow check's 2); the fused SGD kernel 20, torch's
    foreach SGD-momentum 44 with weight decay and 32 without."""
    adamw, sgd, nowd = bench.traffic("adamw"), bench.traffic("sgd"), bench.traffic("sgd-nowd")
    assert (adamw["a"], adamw["d"], adamw["f"], adamw["g"]) == (28, 30, 24, 44)
    assert (sgd["a"], sgd["d"], sgd["f"]) == (44, 22, 16)
    assert nowd["a"] == 32 and nowd["d"] == sgd["d"]
    assert bench.traffic("adam")["e"] == 14 + 84 + 6
    assert bench.traffic("adam")["f"] == 2 + 22  # one pass: the native kernel on CPU, inductor's on CUDA


def test_gpt2_shapes_keep_layernorms_fp32():
    params = bench.model_params("gpt2", bench.torch.device("cpu"))
    assert sum(p.numel() for p, _ in params) == 124_439_808 and len(params) == 148
    kept = [p for p, half in params if not half]
    assert len(kept) == 2 * 12 * 2 + 2  # two LayerNorms per block and the final one: weight and bias each


@pytest.mark.parametrize("argv,message", [
    (["--threads", "0"], "--threads must be positive integers"),
    (["--threads", "two"], "--threads must be positive integers"),
    (["--model", "gpt3"], "unknown model 'gpt3'"),
    (["--optimizer", "lamb"], "invalid choice"),
])
def test_bad_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_kernel_variants_benchmark_runs(tmp_path, capsys):
    from mpfp16.bench import kernels as variants

    out = tmp_path / "kernels.json"
    assert variants.main(["--numel", "4099", "--threads", "1", "--rounds", "1", "--warmup", "0",
                          "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"][0]["rows"]
    by = {r["variant"]: r for r in rows}
    assert by["torch fused AdamW (fp32)"]["ratio"] == 1.0 and all(r["median_ms"] > 0 for r in rows)
    assert by["Adam, no masters, 2 passes"]["bytes_per_param"] == 32 and by["AdamW, masters"]["bytes_per_param"] == 28
    assert by["native AdamW, masters"]["bytes_per_param"] == 28 and by["native check, 1 stream"]["median_ms"] > 0
    assert by["native AdamW, masters, bf16 moments"]["bytes_per_param"] == 20
    assert by["torch read-only pass (fp32 sum)"]["bytes_per_param"] == 4
    limits = json.loads(out.read_text())["results"][0]["bound"]
    ms = {name: r["median_ms"] for name, r in by.items()}
    assert limits["measured"] == pytest.approx(
        (ms["native check"] + ms["native AdamW, masters, bf16 moments"]) / ms["torch fused AdamW (fp32)"])
    printed = capsys.readouterr().out
    assert "SIMD 256" in printed and f"measured {limits['measured']:.2f}" in printed


def test_kernel_bound_moves_the_check_at_each_bandwidth():
    from mpfp16.bench import kernels as variants

    # seconds per parameter: torch's AdamW moves 28 B in 28 s (1 B/s), the read-only pass 4 B in 8 s (0.5 B/s)
    medians = {variants.TORCH: 28.0, variants.CHECK: 3.0, variants.KERNEL: 20.0, variants.READ: 8.0}
    moved = {variants.TORCH: 28, variants.CHECK: 2, variants.KERNEL: 20, variants.READ: 4}
    assert variants.bound(medians, moved) == {"measured": 23 / 28, "check": 3 / 28, "read_only_floor": 24 / 28,
                                              "mixed_floor": 22 / 28}
    del medians[variants.READ]
    assert variants.bound(medians, moved) is None
