"""The bandwidth study's 8-bit and top-k wires (mpfp16.parallel.wires) in the bench
tools: the bytes they are counted as sending, the ratios to fp32 within one run, the
tables, the accuracy table's pooling (--from-json) and plot, the refusals; and, slow,
a tiny sweep and step view that run them."""

import json
import math
import types

import pytest

from dist_helpers import scripts, torchrun
from mpfp16.bench import allreduce, compression, netem
from mpfp16.parallel import quantize
from mpfp16.parallel.wires import WireOptions


# ---------------------------------------------------------------------- bytes and ratios


@pytest.mark.parametrize("count", [1, 255, 256, 257, 1000, 65536])
@pytest.mark.parametrize("world", [2, 3])
def test_an_8bit_message_is_a_code_per_padded_element_and_a_scale_per_row(count, world):
    rows = -(-count // quantize.ROW)
    for strategy, fmt in (("fp8_compress", "e4m3"), ("fp8_compress", "e5m2"), ("int8_compress", "e4m3")):
        options = WireOptions(strategy, fp8_format=fmt)
        assert allreduce.wire_message_bytes(options, count, world) == rows * quantize.ROW + 4 * rows
    # error feedback changes what is computed, not what is sent
    fed = WireOptions("int8_compress", error_feedback=True)
    assert allreduce.wire_message_bytes(fed, count, world) == rows * (quantize.ROW + 4)


@pytest.mark.parametrize("count,ratio", [(1, 0.01), (99, 0.01), (1000, 0.01), (1000, 0.001), (123457, 0.001)])
def test_a_topk_message_is_a_value_and_an_index_per_entry_sent(count, ratio):
    options = WireOptions("topk", topk_ratio=ratio)
    k = max(1, math.ceil(ratio * count))
    assert allreduce.wire_message_bytes(options, count, 2) == 8 * k


def test_every_sweep_wire_is_a_valid_wire():
    for name, kw in allreduce.WIRES.items():
        options = WireOptions(**kw)
        assert options.strategy in ("fp8_compress", "int8_compress", "topk"), name
        assert ("+ef" in name) == options.error_feedback


def test_an_all_gather_counts_its_bus_bandwidth_as_nccl_tests_does():
    # 1 GB from each of 4 ranks in 1 s: each rank receives 3 GB
    algbw, busbw = allreduce.bandwidths(1e9, 1.0, 4, "all_gather")
    assert algbw == 1.0 and busbw == 3.0
    assert allreduce.bandwidths(1e9, 1.0, 4)[1] == 1.5  # an allreduce: 2(n-1)/n


def sweep_row(dtype, count, time_us, size_bytes, **extra):
    return {"dtype": dtype, "count": count, "time_us": time_us, "size_bytes": size_bytes,
            "algbw_gbps": size_bytes / time_us / 1e3, "busbw_gbps": size_bytes / time_us / 1e3, **extra}


def test_ratios_are_to_the_fp32_row_of_the_same_count_and_none_without_one():
    rows = [sweep_row("fp32", 1024, 400.0, 4096), sweep_row("fp8-e4m3", 1024, 100.0, 1040),
            sweep_row("fp8-e4m3", 2048, 150.0, 2080)]  # no fp32 row at 2048
    assert allreduce.fp32_ratios(rows) == [1.0, 0.25, None]
    assert allreduce.fp32_ratios(rows, "size_bytes") == [1.0, 1040 / 4096, None]


def test_the_sweep_table_shows_min_max_and_both_ratios():
    rows = [sweep_row("fp32", 1024, 400.0, 4096, time_min_us=390.0, time_max_us=420.0),
            sweep_row("topk-1%", 1024, 300.0, 88, time_min_us=250.0, time_max_us=333.0)]
    text = allreduce.sweep_table(rows)
    header, fp32, topk = text.splitlines()
    assert "min" in header and "max" in header and "bytes vs fp32" in header
    fields = topk.split()
    assert fields[2] == "topk-1%" and fields[4:6] == ["250.0", "333.0"]
    assert fields[-2:] == ["0.75", "0.021"]  # time and bytes over fp32's
    assert fp32.split()[-2:] == ["1.00", "1.000"]


def step_row(key, time_ms, processes=2, no_sync=False, **extra):
    name = allreduce.SETUPS[key][0]
    return {"setup": name, "key": key, "processes": processes, "no_sync": no_sync, "its_per_s": 2.0,
            "bytes_per_step": 1e6 * time_ms, "calls_per_step": 1, "comm_ms": time_ms, "exposed_ms": time_ms / 2,
            "skipped": 0, **extra}


def test_the_step_table_divides_by_the_fp32_model_of_the_same_mode():
    rows = [step_row("fp32", 100.0, processes=1), step_row("fp32", 100.0), step_row("fp32", 40.0, no_sync=True),
            step_row("fp32-int8", 25.0, step_s_min=0.4, step_s_median=0.5, step_s_max=0.7),
            step_row("fp32-int8", 20.0, no_sync=True)]
    assert allreduce.step_ratios(rows, "comm_ms") == [None, 1.0, 1.0, 0.25, 0.5]
    lines = allreduce.model_table(rows).splitlines()
    assert "0.400-0.500-0.700" in lines[4]
    assert lines[4].split().count("0.250") == 1 and "0.25" in lines[4].split()  # bytes x 0.250, comm x 0.25
    assert lines[1].split()[7] == "-"  # the 1-process row has no ratio (after setup, procs, no_sync, it/s, MB)


def test_the_new_setups_are_fp32_models_with_a_valid_wire():
    from mpfp16.parallel.ddp import check_options

    assert set(allreduce.WIRE_SETUPS) <= set(netem.STEP_SETUPS)
    for key in allreduce.WIRE_SETUPS:
        _, precision, kw = allreduce.SETUPS[key]
        assert precision == "fp32"
        kw = dict(kw)
        if kw["strategy"] == "topk":
            kw["topk_momentum"] = allreduce.MOMENTUM  # what model_view adds
        check_options(allreduce_dtype=None, predivide_factor=1.0, bucket_mb=25, powersgd_rank=1,
                      powersgd_start_iter=2, grads_16bit=False, **kw)
        assert netem.ACCURACY_METHOD[key] in compression.METHODS


# ---------------------------------------------------------------------- across the link


def test_the_link_summary_gives_each_wire_against_fp32_at_its_own_rate():
    rows = []
    for rate, slow in ((1.0, 1.0), (10.0, 0.25)):
        rows += [sweep_row("fp32", 1 << 20, 1e5 * slow, 4 << 20, rate_gbps=rate, time_min_us=9e4 * slow,
                           time_max_us=1.2e5 * slow, wire_bytes=4.2e6),
                 sweep_row("int8", 1 << 20, 4e4 * slow, 1064960, rate_gbps=rate, time_min_us=3e4 * slow,
                           time_max_us=5e4 * slow, wire_bytes=1.1e6)]
    ratios = netem.wire_ratios(rows)
    int8 = [r for r in ratios if r["dtype"] == "int8"]
    assert [r["vs_fp32"] for r in int8] == pytest.approx([0.4, 0.4])
    assert int8[0]["min_vs_fp32"] == pytest.approx(3 / 9) and int8[0]["max_vs_fp32"] == pytest.approx(5 / 12)
    assert int8[0]["bytes_vs_fp32"] == pytest.approx(1064960 / (4 << 20))
    assert int8[0]["wire_vs_fp32"] == pytest.approx(1.1 / 4.2)
    text = netem.summary_text(rows, [], accum=1)
    line = next(l for l in text.splitlines() if l.split()[:3] == ["10", str(1 << 20), "int8"])
    assert line.split()[3:6] == ["10.0", "7.5-12.5", "0.400"]


def test_the_link_summary_gives_each_step_against_fp32_and_the_wire_pairs():
    rows = [step_row("fp32", 800.0, rate_gbps=1.0, wire_bytes_per_step=9e8),
            step_row("fp32-fp8-e4m3", 200.0, rate_gbps=1.0, wire_bytes_per_step=2.3e8)]
    rows[1]["its_per_s"] = 4.0  # twice fp32's rate
    text = netem.summary_text([], rows, accum=1)
    line = next(l for l in text.splitlines() if l.startswith("fp32, fp8 e4m3"))
    assert line.split()[-8:] == ["200.0", "0.250", "100.0", "0.250", "200.00", "0.250", "230.00", "0.256"]
    pair = next(p for p in netem.stops_mattering(rows, 1) if p["narrow"] == "fp32-fp8-e4m3")
    assert pair["gain_by_rate"][1.0] == pytest.approx((400 - 100) / 1e3 / 0.5)
    assert "fp32, fp8 e4m3 vs fp32 model" in text


def test_each_rate_is_divided_by_the_fp32_row_of_its_own_rate():
    rows = [step_row("fp32", 800.0, rate_gbps=1.0), step_row("fp32-int8", 400.0, rate_gbps=1.0),
            step_row("fp32", 100.0, rate_gbps=10.0), step_row("fp32-int8", 300.0, rate_gbps=10.0)]
    assert allreduce.step_ratios(rows, "comm_ms") == [1.0, 0.5, 1.0, 3.0]
    lines = netem.summary_text([], rows, accum=1).splitlines()
    assert [l.split()[5] for l in lines[2:6]] == ["1.000", "0.500", "1.000", "3.000"]  # comm x fp32


def test_the_compression_table_gives_the_payload_over_fp32():
    rows = [step_row("fp32", 800.0, rate_gbps=1.0), step_row("fp32-topk-0.01", 16.0, rate_gbps=1.0),
            step_row("fp32", 800.0, processes=1, rate_gbps=1.0)]
    table = netem.compression_rows(rows, {"topk-1%": {"val_acc1": 90.0, "val_acc1_spread": 0.5, "val_loss": 0.3,
                                                      "val_loss_spread": 0.01}}, accum=1)
    assert [r["payload_vs_fp32"] for r in table] == [1.0, 0.02]
    text = netem.compression_text(table).splitlines()
    assert text[2].split()[5] == "0.020" and "90.00 ± 0.50" in text[2]


# ---------------------------------------------------------------------- the accuracy table


def run(method, seed, acc, payload=1000, wall=10.0):
    return {"method": method, "seed": seed, "val_acc1": acc, "val_loss": 1 - acc / 100, "payload_bytes": payload,
            "train_s": wall / 2, "wall_s": wall}


def write(path, steps, runs):
    path.write_text(json.dumps({"steps": steps, "seeds": sorted({r["seed"] for r in runs}), "runs": runs,
                                "methods": []}))
    return str(path)


def test_pooled_runs_give_means_ranges_and_ratios(tmp_path):
    first = write(tmp_path / "a.json", 57, [run("fp32", 0, 94.0, 4000), run("fp32", 1, 95.0, 4000),
                                           run("fp16_compress", 0, 94.5, 2000), run("int8-ef", 0, 90.0, 1100)])
    second = write(tmp_path / "b.json", 57, [run("fp16_compress", 1, 93.5, 2000), run("int8-ef", 1, 91.0, 1100),
                                            run("int8-ef", 0, 92.0, 1100)])  # replaces a.json's seed 0
    steps, seeds, methods, runs = compression.from_json([first, second])
    assert steps == 57 and seeds == [0, 1] and len(runs) == 6
    by = {m["method"]: m for m in methods}
    assert by["int8-ef"]["val_acc1"] == pytest.approx(91.5) and by["int8-ef"]["val_acc1_spread"] == pytest.approx(0.5)
    assert compression.payload_ratios(methods) == {"fp32": 1.0, "fp16_compress": 0.5, "int8-ef": 1100 / 4000}
    beside = compression.against(methods)
    assert beside["int8-ef"] == {"delta": pytest.approx(91.5 - 94.0), "apart": True}  # 91-92 vs 93.5-94.5
    assert beside["fp32"]["apart"] is False  # 94-95 overlaps 93.5-94.5
    text = compression.table(methods, steps, seeds)
    line = next(l for l in text.splitlines() if l.startswith("int8-ef"))
    assert "0.2750" in line and "-2.50*" in line


def test_without_the_reference_nothing_is_compared(tmp_path):
    methods = [compression.aggregate([run("fp32", 0, 94.0)])]
    assert compression.against(methods) == {"fp32": None}
    assert compression.payload_ratios([compression.aggregate([run("int8", 0, 94.0)])]) == {"int8": None}


def test_from_json_prints_the_table_and_draws_the_plot(tmp_path, capsys):
    path = write(tmp_path / "a.json", 5, [run("fp32", 0, 90.0, 4000), run("fp16_compress", 0, 90.0, 2000),
                                         run("topk-1%", 0, 88.0, 90)])
    png, out = tmp_path / "acc.png", tmp_path / "pooled.json"
    assert compression.main(["--from-json", path, "--plot", str(png), "--json", str(out),
                             "--methods", "topk-1%,fp32"]) == 0
    text = capsys.readouterr().out
    shown = [line.split()[0] for line in text.splitlines() if not line.startswith(("#", "method"))]
    assert shown == ["topk-1%", "fp32"]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    pooled = json.loads(out.read_text())
    assert [m["method"] for m in pooled["methods"]] == ["topk-1%", "fp32"]
    assert pooled["methods"][0]["payload_vs_fp32"] == pytest.approx(90 / 4000)
    assert pooled["wall_s"] == pytest.approx(20.0)  # the runs' own time


@pytest.mark.parametrize("content,why", [
    ("not json", "not a compression benchmark output"),
    ('{"steps": 5}', "not a compression benchmark output"),
    ('{"steps": 5, "runs": []}', "no runs"),
    ('{"steps": 5, "runs": [{"method": "fp32", "seed": 0}]}', "lacks what the table needs"),
])
def test_a_bad_json_is_refused_in_one_line(tmp_path, capsys, content, why):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert compression.main(["--from-json", str(bad)]) == 1
    err = capsys.readouterr().err
    assert why in err and err.startswith("error: ") and err.count("\n") == 1


def test_files_of_other_step_counts_or_methods_are_refused(tmp_path, capsys):
    a = write(tmp_path / "a.json", 5, [run("fp32", 0, 90.0)])
    b = write(tmp_path / "b.json", 57, [run("fp32", 1, 90.0)])
    assert compression.main(["--from-json", f"{a},{b}"]) == 1
    assert "different step counts (5, 57)" in capsys.readouterr().err
    assert compression.main(["--from-json", a, "--methods", "int8"]) == 1
    err = capsys.readouterr().err
    assert "--methods int8: not in the --from-json files" in err and err.count("\n") == 1


def test_a_plot_into_a_missing_folder_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        compression.main(["--from-json", "x.json", "--plot", str(tmp_path / "no" / "acc.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("its folder does not exist")


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("argv,words", [
    (["--wires", "fp9"], "unknown 'fp9'"),
    (["--wires", "int8,int8"], "names one twice"),
    (["--setups", "fp32-topk-1%"], "unknown 'fp32-topk-1%'"),
])
def test_the_sweep_refuses_an_unknown_wire_in_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        allreduce.build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and "error:" in err[-1]


def test_none_sends_no_wire_and_the_default_sends_every_one():
    assert allreduce.build_parser().parse_args(["--wires", "none"]).wires == []
    assert allreduce.build_parser().parse_args([]).wires == list(allreduce.WIRES)
    assert netem.build_parser().parse_args([]).wires == list(allreduce.WIRES)


def test_netem_refuses_an_unknown_wire_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        netem.main(["--wires", "fp8"])
    assert exc.value.code == 2
    assert "unknown 'fp8'" in capsys.readouterr().err.strip().splitlines()[-1]


# ---------------------------------------------------------------------- end to end (slow)


@pytest.mark.slow
def test_a_tiny_sweep_times_the_new_wires_beside_fp32(tmp_path):
    proc = torchrun(["-m", "mpfp16.bench.allreduce", "--sizes", "64K", "--iters", "3", "--warmup", "1",
                     "--dtypes", "fp32", "--strategies", "allreduce", "--wires", "fp8-e5m2+ef,int8,topk-0.1%",
                     "--json", "rows.json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["dtype"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert list(rows) == ["fp32", "fp8-e5m2+ef", "int8", "topk-0.1%"]
    count = 16384
    assert rows["int8"]["size_bytes"] == rows["fp8-e5m2+ef"]["size_bytes"] == (count // 256) * 260
    assert rows["topk-0.1%"]["size_bytes"] == 8 * math.ceil(0.001 * count)
    for r in rows.values():
        assert r["repeats"] == 3 and r["time_min_us"] <= r["time_us"] <= r["time_max_us"]
    assert "bytes vs fp32" in proc.stdout and "0.254" in proc.stdout


@pytest.mark.slow
def test_a_tiny_step_view_counts_each_wire_as_its_parameters_rows(tmp_path):
    [[r0, r1]] = scripts("mpfp16.bench.allreduce", [[
        "--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "2", "--accum", "1", "--steps", "3",
        "--modes", "sync", "--setups", "fp32,fp32-fp8-e4m3-ef,fp32-topk-0.01", "--json", "model.json"]],
        tmp_path / ".out", cwd=tmp_path)
    assert r1 is not None and r0["status"] == 0 == r1["status"], (r0["stderr"] + (r1 or {}).get("stderr", ""))[-2000:]
    rows = {r["key"]: r for r in json.loads((tmp_path / "model.json").read_text())["rows"]}
    import torchvision

    numels = [p.numel() for p in torchvision.models.get_model("squeezenet1_1", num_classes=10).parameters()]
    assert rows["fp32"]["bytes_per_step"] == 4 * sum(numels)
    assert rows["fp32-fp8-e4m3-ef"]["bytes_per_step"] == sum(-(-n // 256) * 260 for n in numels)
    assert rows["fp32-topk-0.01"]["bytes_per_step"] == sum(8 * math.ceil(0.01 * n) for n in numels)
    for r in rows.values():
        assert r["skipped"] == 0
        assert r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"]
        assert r["comm_ms_min"] <= r["comm_ms"] <= r["comm_ms_max"]
    assert "x fp32" in r0["stdout"]


def test_a_benchmark_stopped_half_way_keeps_the_runs_it_finished(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(method, seed, steps):
        calls.append((method, seed))
        if len(calls) == 3:
            raise compression.BenchError(f"{method} seed {seed} failed (exit status 1): boom")
        return run(method, seed, 90.0 + seed, 4000 if method == "fp32" else 1100)

    monkeypatch.setattr(compression, "run_one", fake_run)
    out = tmp_path / "acc.json"
    assert compression.main(["--methods", "fp32,int8", "--seeds", "0,1", "--steps", "3", "--json", str(out)]) == 1
    assert capsys.readouterr().err == "error: int8 seed 0 failed (exit status 1): boom\n"
    steps, seeds, methods, runs = compression.from_json([str(out)])
    assert steps == 3 and [(r["method"], r["seed"]) for r in runs] == [("fp32", 0), ("fp32", 1)]
    assert methods[0]["val_acc1"] == pytest.approx(90.5)
    assert not (tmp_path / "acc.json.tmp").exists()
