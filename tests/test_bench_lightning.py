"""The ImageGPT benchmark through lightning.Trainer: it runs at 1 and 2 processes, reports
every precision, and shows mpfp16's one exchange per optimizer step (no timing is
asserted beyond being positive)."""

import json

import pytest

import dist_helpers
from mpfp16.bench import lightning as bench

pytestmark = pytest.mark.slow  # the --quick run starts an interpreter and its three workers


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run as typed (its own 1-process and 2-process workers): the JSON
    and what it printed."""
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning") / "quick.json"
    proc = dist_helpers.python(["-m", "mpfp16.bench.lightning", "--quick", "--json", str(out)], timeout=240)
    dist_helpers.check(proc)
    return json.loads(out.read_text()), proc.stdout


def _rows(data):
    return {(r["precision"], r["processes"]): r for r in data["rows"]}


def test_quick_runs_every_precision_at_1_and_2_processes(quick):
    data, stdout = quick
    rows = _rows(data)
    assert sorted(rows) == sorted((p, n) for p in bench.PRECISIONS for n in (1, 2))
    assert len(data["rows"]) == 6
    config = data["config"]
    for r in data["rows"]:
        assert r["its_per_s"] > 0 and all(x > 0 for ranks in r["its_per_s_by_rank"] for x in ranks)
        assert len(r["its_per_s_by_rank"][0]) == r["processes"]
        assert r["micro_batches_timed"] == config["steps"]
        assert r["vs_32_true"] == pytest.approx(r["its_per_s"] / rows[("32-true", r["processes"])]["its_per_s"])
        # every fit trained warm-up + timed micro-batches, one optimizer step per accumulate_grad_batches
        assert r["global_step"] == (config["warmup"] + config["steps"]) // config["accumulate_grad_batches"]
    assert rows[("mpfp16", 2)]["skipped_steps"] == [0]
    for precision in bench.PRECISIONS:
        assert f"{precision} " in stdout
    assert "vs 32-true" in stdout


def test_mpfp16_under_ddp_exchanges_once_per_optimizer_step(quick):
    """accumulate_grad_batches 4 and 8 timed micro-batches: two optimizer steps, each with
    one allreduce per DDP bucket and none on the 3 accumulating micro-batches. The tiny
    model's fp16 weights fit one bucket and its fp32 LayerNorms another (DDP buckets by
    dtype), and each step carries every gradient once."""
    import torch

    from mpfp16 import to_half
    from mpfp16.train.gpt import build_gpt

    data, _ = quick
    config = data["config"]
    assert config["accumulate_grad_batches"] > 1
    row = _rows(data)[("mpfp16", 2)]
    assert row["optimizer_steps_timed"] == config["steps"] // config["accumulate_grad_batches"] == 2
    assert row["buckets"] == 2
    assert row["allreduce_calls_per_step"] == row["buckets"]  # one exchange per optimizer step
    assert row["accumulating_calls"] == 0
    model = to_half(build_gpt("imagegpt-s", **bench.QUICK_MODEL), torch.float16)
    assert row["allreduce_bytes_per_step"] == sum(p.numel() * p.element_size() for p in model.parameters())
    for precision in ("16-true", "32-true"):  # no mpfp16 hook counts Lightning's own DDP exchanges
        assert _rows(data)[(precision, 2)]["allreduce_calls_per_step"] is None
    assert all(_rows(data)[(p, 1)]["allreduce_calls_per_step"] == 0 for p in bench.PRECISIONS)


def test_the_fp16_runs_are_explained(quick):
    _, stdout = quick
    assert '"16-true": fp16 weights only; no loss scale and no master weights' in stdout
    assert "fp32 master weights, dynamic loss scale" in stdout


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for action in bench.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
        assert action.option_strings[-1] in text


@pytest.mark.parametrize("argv,message", [
    (["--precisions", "16-mixed"], "--precisions: expected a comma-separated list"),
    (["--processes", "4"], "--processes: expected a comma-separated list"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "-1"], "--warmup must be 0 or more"),
    (["--seq-len", "2048"], "--seq-len 2048: the model has 1024 positions"),
    (["--quick", "--seq-len", "17"], "--seq-len 17: the model has 16 positions"),
    (["--optimizer", "lbfgs"], "--optimizer: invalid choice"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_flag_is_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in last and message in last


def test_refuses_to_run_under_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick"])
    assert exc.value.code == 2
    assert "run it as python -m mpfp16.bench.lightning" in capsys.readouterr().err


def test_the_rounds_alternate():
    assert bench.orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_a_row_is_the_median_round_of_the_slowest_rank():
    def fit(rates, calls):
        return [{"its_per_s": x, "micro_batches": 8, "buckets": 2, "global_step": 3, "final_loss": 1.0,
                 "skipped_steps": 0, "hooked": True, "accumulating_calls": 0,
                 "steps": [{"micro_batches": 4, "calls": calls, "bytes": 100}] * 2} for x in rates]

    row = bench.summarize("mpfp16", 2, [fit([3.0, 2.0], 2), fit([5.0, 4.0], 2), fit([1.0, 9.0], 2)])
    assert row["its_per_s_rounds"] == [2.0, 4.0, 1.0] and row["its_per_s"] == 2.0
    assert row["allreduce_calls_per_step"] == 2 and row["allreduce_bytes_per_step"] == 100
    assert row["optimizer_steps_timed"] == 2  # per fit
    uneven = bench.summarize("mpfp16", 2, [fit([1.0, 1.0], 2), fit([1.0, 1.0], 64)])
    assert uneven["allreduce_calls_per_step"] == [2, 64]  # shown, not hidden in a median
