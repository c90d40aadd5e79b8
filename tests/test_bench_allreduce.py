"""The bandwidth tool: its arithmetic, and that it runs (no timings are asserted)."""

import json
import os
import types

import pytest

from dist_helpers import scripts, torchrun as launch
from mpfp16.bench import allreduce as bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("text,value", [("4K", 4096), ("1M", 1 << 20), ("2G", 2 << 30), ("100", 100),
                                        ("1.5K", 1536)])
def test_sizes_parse_with_binary_suffixes(text, value):
    assert bench.parse_size(text) == value


@pytest.mark.parametrize("text", ["abc", "0", "1.3", "-4K", "3"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(Exception, match="size"):
        bench.parse_size(text)


@pytest.mark.parametrize("world,factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_busbw_factor_is_nccl_tests(world, factor):
    assert bench.busbw_factor(world) == factor


def test_bandwidths():
    algbw, busbw = bench.bandwidths(4_000_000_000, 2.0, 8)
    assert algbw == 2.0 and busbw == 3.5


def torchrun(args, tmp_path):
    return launch(["-m", "mpfp16.bench.allreduce", *args], cwd=tmp_path)


def on_two_processes(args, tmp_path):
    """The benchmark on 2 processes as torchrun starts them (dist_helpers.scripts; under
    torchrun itself: test_sweep_runs_and_its_rows_are_consistent): rank 0's exit status
    and output, as a CompletedProcess has them."""
    [[r0, r1]] = scripts("mpfp16.bench.allreduce", [args], tmp_path / ".out", cwd=tmp_path)
    assert r1 is not None and r1["status"] == r0["status"], (r1 or {}).get("stderr", "")[-2000:]
    return types.SimpleNamespace(returncode=r0["status"], stdout=r0["stdout"], stderr=r0["stderr"])


@pytest.mark.slow
def test_sweep_runs_and_its_rows_are_consistent(tmp_path):
    proc = torchrun(["--sizes", "4K,256K", "--iters", "2", "--warmup", "1", "--json", "rows.json",
                     "--plot", "rows.png"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "rows.json").read_text())
    rows = data["rows"]
    # the 16-bit types and, by default, every 8-bit and top-k wire (tests/test_bench_wires.py)
    assert {r["dtype"] for r in rows} == {"fp32", "fp16", "bf16", "fp16+acc32", "bf16+acc32", *bench.WIRES}
    for r in rows:
        assert set(r) == {"size_bytes", "count", "dtype", "time_us", "time_min_us", "time_max_us", "repeats",
                          "algbw_gbps", "busbw_gbps"}
        assert r["count"] in (1024, 65536)
        if r["dtype"] in bench.WIRES:
            options = bench.WireOptions(**bench.WIRES[r["dtype"]])
            assert r["size_bytes"] == bench.wire_message_bytes(options, r["count"], 2)
        else:
            assert r["size_bytes"] == r["count"] * (4 if r["dtype"] == "fp32" else 2)
        assert r["time_min_us"] <= r["time_us"] <= r["time_max_us"] and r["repeats"] == 2
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert (tmp_path / "rows.png").stat().st_size > 1000
    assert "vs fp32" in proc.stdout and "busbw" in proc.stdout


@pytest.mark.slow
def test_training_step_view_runs(tmp_path):
    proc = on_two_processes(["--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "4", "--accum", "2",
                             "--steps", "1", "--json", "model.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "model.json").read_text())["rows"]
    assert len(rows) == 12  # 4 set-ups x (1 process, 2 processes, 2 processes with no_sync)
    by = {(r["setup"], r["processes"], r["no_sync"]): r for r in rows}
    for setup in ("fp32 model", "fp16, fp16 allreduce", "fp16, fp32 allreduce", "fp16, fp32-accumulate"):
        every, once = by[(setup, 2, False)], by[(setup, 2, True)]
        assert every["calls_per_step"] == 2 * once["calls_per_step"]  # accum 2: no_sync halves the calls
        assert every["bytes_per_step"] == 2 * once["bytes_per_step"]
        assert 0 <= once["exposed_ms"] <= once["comm_ms"] + 1e-9
    # squeezenet has no normalization layer: every fp16 gradient is half its fp32 size
    assert by[("fp32 model", 2, True)]["bytes_per_step"] == 2 * by[("fp16, fp16 allreduce", 2, True)]["bytes_per_step"]
    assert by[("fp16, fp32 allreduce", 2, True)]["bytes_per_step"] == by[("fp32 model", 2, True)]["bytes_per_step"]


@pytest.mark.slow
def test_training_step_view_trains_a_transformer(tmp_path):
    """Lightning's no_sync set-up on its ImageGPT size, with sequences of 2 tokens: the
    model keeps its 1024 positions, and the fp32 model sends each of its 19,702,272
    parameters once per synced micro-batch, 4 bytes each."""
    proc = on_two_processes(["--model", "imagegpt-s", "--seq-len", "2", "--batch-size", "1", "--accum", "2",
                             "--steps", "1", "--setups", "fp32", "--json", "gpt.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "imagegpt-s, batch 1 at 2 tokens" in proc.stdout
    rows = json.loads((tmp_path / "gpt.json").read_text())["rows"]
    assert [(r["setup"], r["processes"], r["no_sync"]) for r in rows] == [
        ("fp32 model", 1, None), ("fp32 model", 2, False), ("fp32 model", 2, True)]
    assert rows[2]["bytes_per_step"] == 4 * 19_702_272
    assert rows[1]["bytes_per_step"] == 2 * rows[2]["bytes_per_step"]
    assert all(r["its_per_s"] > 0 for r in rows)


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--model", "imagegpt-s", "--seq-len", "2048"], "--seq-len 2048: imagegpt-s has 1024 positions"),
])
def test_a_bad_model_flag_is_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_refuses_to_run_alone(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert bench.main(["--sizes", "4K"]) == 2
    assert "torchrun" in capsys.readouterr().err


@pytest.mark.slow
def test_step_view_compares_torch_compression_hooks_and_picks_modes(tmp_path):
    """torch's hooks on the fp32 model beside it, only the modes asked for: the fp16
    and bf16 hooks send half the fp32 bytes; PowerSGD sends less than either once its
    plain-allreduce start (2 steps, inside the warm-up) is over."""
    proc = on_two_processes(["--model", "squeezenet1_1", "--image-size", "32", "--batch-size", "2", "--accum", "1",
                             "--steps", "1", "--modes", "sync", "--setups",
                             "fp32,fp32-fp16-compress,fp32-bf16-compress,fp32-powersgd-r1", "--json", "hooks.json"],
                            tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["key"]: r for r in json.loads((tmp_path / "hooks.json").read_text())["rows"]}
    assert all(r["processes"] == 2 and r["no_sync"] is False for r in rows.values())  # no 1-process row
    fp32 = rows["fp32"]["bytes_per_step"]
    assert rows["fp32-fp16-compress"]["bytes_per_step"] == fp32 / 2
    assert rows["fp32-bf16-compress"]["bytes_per_step"] == fp32 / 2
    assert 0 < rows["fp32-powersgd-r1"]["bytes_per_step"] < fp32 / 2


def test_wire_iface_that_does_not_exist_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--wire-iface", "no-such-nic0"])
    assert exc.value.code == 2
    assert "no network interface 'no-such-nic0'" in capsys.readouterr().err
