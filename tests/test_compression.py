"""torch's DDP compression hooks as allreduce strategies (fp16_compress, bf16_compress,
powersgd): the same weights as plain DDP with torch's hook, mpfp16's accounting, the
refusals, exact resume of PowerSGD, and the accuracy benchmark."""

import json
import os

import pytest
import torch

import compression_workers as CW
import mpfp16
import mpfp16.distributed as mdist
import train_cifar
import train_imagenet
from dist_helpers import Group, scripts
from dist_workers import mlp
from mpfp16.bench import compression as bench
from mpfp16.train.config import ConfigError, TrainConfig
from run_helpers import assert_same_final_state, records, run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
# The MLP of dist_workers: Linear(8, 32) and Linear(32, 4), 420 parameters.
NUMEL = 8 * 32 + 32 + 32 * 4 + 4
# PowerSGD's elements on the wire once it compresses, per torch's rule (compress an n x m
# matrix when (n + m) * rank * 2 < n * m). Rank 1: both weights, 40 + 36, and the
# biases as they are, 32 + 4. Rank 2: the 32 x 8 weight, 80; the 4 x 32 one stays
# whole (72 * 2 > 128), 128; the biases, 36.
POWERSGD_NUMEL = {1: 40 + 36 + 32 + 4, 2: 80 + 128 + 32 + 4}
slow = pytest.mark.slow
HOOKS = {"fp16": ("fp16_compress", 1), "bf16": ("bf16_compress", 1), "powersgd-r1": ("powersgd", 1),
         "powersgd-r2": ("powersgd", 2)}
RESUMES = {
    "resnet-one-bucket": ("resnet9-w8", (2, 4), 25),      # at its first compressed step, then warm; one bucket
    "resnet-several-buckets": ("resnet9-w8", (3,), 0.1),  # several buckets after DDP's rebuild
    "mlp": ("mlp", (1, 5), 0.0003),                       # before compression starts, then warm
}
GROUP = Group(timeout=900)
for _name, (_strategy, _rank) in HOOKS.items():
    GROUP.add(("hook", _name), CW.against_torch, _strategy, _rank, STEPS, 25)
GROUP.add("several buckets", CW.against_torch, "powersgd", 1, STEPS, 0.0003, True)
for _name, (_arch, _stops, _bucket_mb) in RESUMES.items():
    GROUP.add(("resume", _name), CW.powersgd_resume, _stops, 7, _arch, _bucket_mb)
GROUP.add("before rebuild", CW.powersgd_resume, (1, 2), 4, "mlp")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """The two-process cases, in one launch."""
    return GROUP.run(tmp_path_factory.mktemp("group"))


# ----------------------------------------------------------------- against torch's own hooks


@slow
@pytest.mark.parametrize("name", list(HOOKS))
def test_the_weights_are_torchs_own_hooks_bit_for_bit(group, name):
    strategy, rank = HOOKS[name]
    r0, r1 = group(("hook", name))
    for r in (r0, r1):
        assert torch.equal(r["mpfp16"], r["reference"])
    assert torch.equal(r0["mpfp16"], r1["mpfp16"])
    assert not torch.equal(r0["mpfp16"], CW.flat_params(mlp()))  # it trained
    if strategy == "powersgd":  # whole fp32 buckets for start_powerSGD_iter (2) steps, then P, Q and the rest
        expected = [NUMEL * 4] * 2 + [POWERSGD_NUMEL[rank] * 4] * (STEPS - 2)
        wire = "float32"
    else:
        expected, wire = [NUMEL * 2] * STEPS, strategy[:4].replace("fp", "float").replace("bf", "bfloat")
    assert [s["allreduce_bytes"] for s in r0["stats"]] == expected
    assert all(s["allreduce_calls"] == 1 and s["allreduce_bytes_by_dtype"] == {wire: b}
               for s, b in zip(r0["stats"], expected))
    assert all(s["allreduce_time_s"] >= s["allreduce_wait_s"] >= 0 for s in r0["stats"])
    assert r0["threads"] == ["MainThread"]  # teardown left no thread behind


@slow
def test_powersgd_with_several_buckets_matches_torchs_hook_one_bucket_at_a_time(group):
    """Two buckets after DDP's rebuild: the reference runs torch's hook with no mpfp16,
    each bucket after the previous one's result (torch's hook alone can hang there)."""
    r0, r1 = group("several buckets")
    assert torch.equal(r0["mpfp16"], r0["reference"]) and torch.equal(r1["mpfp16"], r1["reference"])
    assert [s["allreduce_calls"] for s in r0["stats"]] == [1] + [2] * (STEPS - 1)
    assert [s["allreduce_bytes"] for s in r0["stats"]][2:] == [POWERSGD_NUMEL[1] * 4] * (STEPS - 2)


# ----------------------------------------------------------------- exact resume of PowerSGD


@slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_powersgd_resumes_bit_identically(group, name):
    """A new DDP module puts every parameter in one bucket, in definition order, for its
    first step: the state and the arithmetic must follow the recorded layout."""
    stops = RESUMES[name][1]
    r0, r1 = group(("resume", name))
    for r in (r0, r1):
        assert torch.equal(r["resumed"], r["straight"])
        assert r["reasons"] == [None] * len(stops)
    final = r0["layouts"][-1]
    assert final and [n for bucket in final for n in bucket] != r0["definition_order"]  # the layouts differ


@slow
def test_a_powersgd_state_saved_before_ddp_rebuilt_says_it_cannot_resume_exactly(group):
    """Stopped after 1 step, resumed for 1 (DDP never rebuilt), saved at the first
    compressed step: the layout its Q's are drawn in is unknown."""
    r0, _ = group("before rebuild")
    assert r0["reasons"][0] is None
    assert r0["reasons"][1].startswith("PowerSGD had started and the process that saved it had not yet rebuilt")


# ----------------------------------------------------------------- refusals


@pytest.mark.parametrize("model,kw,message", [
    ("fp16", {"strategy": "fp16_compress"}, "strategy='fp16_compress' is torch's compression hook for an fp32 model, "
     "and this model's gradients are already 16-bit (float16): use strategy='allreduce' or "
     "strategy='fp32_accumulate'"),
    ("bf16", {"strategy": "powersgd"}, "gradients are already 16-bit (bfloat16)"),
    ("fp32", {"strategy": "powersgd", "powersgd_rank": 0}, "powersgd_rank=0 must be an integer >= 1"),
    ("fp32", {"strategy": "powersgd", "powersgd_start_iter": 1}, "powersgd_start_iter=1 must be an integer >= 2"),
    ("fp32", {"strategy": "allreduce", "powersgd_rank": 4},
     "powersgd_rank=4 applies to strategy='powersgd' only, not strategy='allreduce'"),
    ("fp32", {"strategy": "bf16_compress", "allreduce_dtype": torch.float32},
     "strategy='bf16_compress' decides its own wire dtype; leave allreduce_dtype=None"),
    ("fp32", {"strategy": "fp16_compress", "predivide_factor": 2.0},
     "divides by the world size itself; leave predivide_factor=1.0"),
], ids=["fp16-model", "bf16-model", "rank", "start-iter", "rank-without-powersgd", "wire-dtype", "predivide"])
def test_wrap_refuses_in_one_line(one_process_group, model, kw, message):
    net = mlp()
    if model != "fp32":
        mpfp16.to_half(net, torch.float16 if model == "fp16" else torch.bfloat16)
    with pytest.raises(ValueError) as err:
        mdist.wrap(net, **kw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_comm_state_of_other_strategies(one_process_group):
    ddp = mdist.wrap(mlp(), strategy="fp16_compress")
    assert mdist.comm_state_dict(ddp) is None
    with pytest.raises(ValueError, match="keeps no state to load"):
        mdist.load_comm_state_dict(ddp, {})
    ddp = mdist.wrap(mlp(), strategy="powersgd")
    state = mdist.comm_state_dict(ddp)
    assert state["iter"] == 0 and state["error"] == {} and state["rng"]["keys"].dtype == torch.int64
    bad = {**state, "error": {"nope.weight": torch.zeros(1)}}
    with pytest.raises(ValueError, match=r"the PowerSGD state is of other parameters \(first: nope.weight\)"):
        mdist.load_comm_state_dict(ddp, bad)
    del ddp


# ----------------------------------------------------------------- the scripts


@pytest.mark.parametrize("main", [train_cifar.main, train_imagenet.main], ids=["cifar", "imagenet"])
def test_help_lists_the_strategies_and_powersgd_settings(main, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "{allreduce,fp32_accumulate,fp16_compress,bf16_compress,powersgd,fp8_compress,int8_compress,topk}" in text
    assert "fp16_compress, bf16_compress, powersgd: torch's compression hooks, with --precision fp32" in text
    assert "--powersgd-rank N rank of PowerSGD's low-rank approximation (default: 1)" in text
    assert "--powersgd-start-iter N optimizer steps of plain allreduce before PowerSGD compresses (default: 2)" in text
    distributed = text[text.index("distributed:"):text.index("checkpoints and logs:")]
    assert "--powersgd-rank" in distributed and "--powersgd-start-iter" in distributed


@pytest.mark.parametrize("kw,message", [
    (dict(allreduce_strategy="fp16_compress"), "--allreduce-strategy fp16_compress is torch's compression hook for "
     "an fp32 model, and this model's gradients are already 16-bit (--precision fp16): use --allreduce-strategy "
     "allreduce or --allreduce-strategy fp32_accumulate"),
    (dict(allreduce_strategy="powersgd", precision="bf16"), "gradients are already 16-bit (--precision bf16)"),
    (dict(allreduce_strategy="bf16_compress", precision="fp32", allreduce_dtype="fp16"),
     "decides its own wire dtype; leave out --allreduce-dtype"),
    (dict(allreduce_strategy="powersgd", precision="fp32", predivide_factor=2.0),
     "divides by the world size itself; leave --predivide-factor 1"),
    (dict(powersgd_rank=2), "--powersgd-rank 2 applies to --allreduce-strategy powersgd only, not "
     "--allreduce-strategy allreduce"),
    (dict(allreduce_strategy="powersgd", precision="fp32", powersgd_start_iter=1),
     "--powersgd-start-iter 1 must be an integer >= 2"),
], ids=["fp16", "bf16", "wire-dtype", "predivide", "rank-without-powersgd", "start-iter"])
def test_config_refuses_compression_that_does_not_fit(kw, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig(task="cifar", **kw).validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_script_refuses_fp16_compress_of_an_fp16_model_in_one_line(capsys):
    status, err = run_main(train_cifar.main, ["--precision", "fp16", "--allreduce-strategy", "fp16_compress"], capsys)
    assert status == 2
    assert err.count("\n") == 1 and err.endswith(  # one line, no usage block
        ": error: --allreduce-strategy fp16_compress is torch's compression hook for an fp32 model, and this "
        "model's gradients are already 16-bit (--precision fp16): use --allreduce-strategy allreduce or "
        "--allreduce-strategy fp32_accumulate (see --help)\n")


TINY = ["-a", "resnet9-w4", "-b", "16", "--no-progress", "-p", "1", "--precision", "fp32"]


@pytest.mark.slow
@pytest.mark.parametrize("changed,listed", [
    (["--allreduce-strategy", "powersgd", "--powersgd-rank", "2"], "powersgd_rank 1 -> 2"),
    (["--allreduce-strategy", "powersgd", "--powersgd-start-iter", "5"], "powersgd_start_iter 2 -> 5"),
    (["--allreduce-strategy", "fp16_compress"], "allreduce_strategy powersgd -> fp16_compress"),
], ids=["rank", "start-iter", "strategy"])
def test_a_resume_that_changes_the_compression_is_refused(cifar_root, tmp_path, capsys, changed, listed):
    common = [cifar_root, *TINY, "--checkpoint-dir", str(tmp_path)]
    assert run_main(train_cifar.main, common + ["--max-steps", "2", "--allreduce-strategy", "powersgd"],
                    capsys)[0] == 0
    status, err = run_main(train_cifar.main, common + ["--max-steps", "3", "--resume", "auto", *changed], capsys)
    assert status == 2 and err == (f"error: checkpoint {tmp_path / 'last.pt'} was saved with other settings "
                                   f"({listed}): resume with the same ones, or pass --allow-changed-config to "
                                   "continue anyway, no longer bit-identically\n")


@slow
def test_a_powersgd_run_resumed_twice_on_two_processes_is_bit_identical(cifar_root, tmp_path):
    """8 steps straight == 2 (PowerSGD's first compressed step comes next), 3 more, 3
    more; several DDP buckets (--bucket-mb 0.05), an epoch boundary at step 6. Four
    runs of the script on 2 processes, as torchrun starts them (dist_helpers.scripts)."""
    common = [cifar_root, *TINY, "--epochs", "3", "--allreduce-strategy", "powersgd", "--powersgd-rank", "2",
              "--bucket-mb", "0.05"]
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    runs = [common + ["--max-steps", "8", "--checkpoint-dir", str(straight)]]
    runs += [common + ["--max-steps", steps, "--checkpoint-dir", str(parts), *resume]
             for steps, resume in (("2", []), ("5", ["--resume", "auto"]), ("8", ["--resume", "auto"]))]
    for ranks in scripts("train_cifar", runs, tmp_path / "out"):
        assert ranks[0] is not None and ranks[0]["status"] == ranks[1]["status"] == 0, ranks[0]["stderr"][-3000:]
    assert_same_final_state(straight / "last.pt", parts / "last.pt")
    ckpt = torch.load(parts / "last.pt", weights_only=True)
    ranks = ckpt["comm"]
    assert len(ranks) == 2 and len(ranks[0]["layout"]) >= 2 and ranks[0]["iter"] == 8
    assert any(not torch.equal(ranks[0]["error"][name], ranks[1]["error"][name]) for name in ranks[0]["error"])
    sent = [r["allreduce_bytes"] for r in records(straight / "metrics.jsonl") if r["type"] == "train"]
    from mpfp16.train import models

    numel = sum(p.numel() for p in models.build_cifar_model("resnet9-w4", 10).parameters())
    assert sent[:2] == [4 * numel] * 2 and all(b < numel for b in sent[2:])  # fp32, then compressed


# ----------------------------------------------------------------- the benchmark


@slow
def test_the_compression_benchmark_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "compression.json"
    assert bench.main(["--steps", "5", "--seeds", "0", "--methods", "fp32,powersgd-r1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [m["method"] for m in result["methods"]] == ["fp32", "powersgd-r1"]
    assert [(r["method"], r["seed"]) for r in result["runs"]] == [("fp32", 0), ("powersgd-r1", 0)]
    fp32, powersgd = result["methods"]
    assert fp32["payload_bytes"] == 103944 * 4  # resnet9-w8's parameters, in fp32
    assert 0 < powersgd["payload_bytes"] < fp32["payload_bytes"] / 4
    assert all(0 <= m["val_acc1"] <= 100 and m["val_loss"] > 0 and m["val_acc1_spread"] == 0 for m in result["methods"])
    assert "method           payload MB/step      val acc1 %" in printed
    assert "mean ± half the range over seeds, (max - min) / 2" in printed


def test_the_benchmark_refuses_bad_flags_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--methods", "fp32,zip"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "argument --methods: unknown 'zip'; choose from " + ", ".join(bench.METHODS))


@slow
def test_a_failed_run_stops_the_benchmark_with_one_line(capsys, monkeypatch):
    monkeypatch.setitem(bench.METHODS, "fp32", ["--precision", "fp16", "--allreduce-strategy", "bf16_compress"])
    assert bench.main(["--steps", "1", "--seeds", "3", "--methods", "fp32"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: fp32 seed 3 failed (exit status 1): train_cifar.py: error: --allreduce-strategy "
                          "bf16_compress is torch's compression hook for an fp32 model")
