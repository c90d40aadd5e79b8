"""The Lightning plugins under strategy="ddp" (two CPU processes, gloo): the Trainer's
run is mpfp16's own loop under mpfp16.distributed.wrap bit for bit, the replicas stay
identical, accumulate_grad_batches sends one exchange per optimizer step, and an inf
on one rank skips the step on both; Fabric's run, accumulating under
fabric.no_backward_sync with one exchange per optimizer step, is the own loop under
torch's DDP (with fp32 sums, under mpfp16.distributed.wrap).
And a Trainer run killed with SIGKILL resumes from Lightning's own last.ckpt to the
weights of an uninterrupted run."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("lightning", reason="the lightning extra is not installed (pip install 'mpfp16[lightning]')")

import lightning_workers as W  # noqa: E402
from dist_helpers import Forked, Group  # noqa: E402

pytestmark = pytest.mark.slow

GROUP = Group()
TRAINER = {
    "sgd": ({}, 8),
    "accumulate-4": ({"accum": 4, "optimizer": "adamw"}, 16),
    "accumulate-4-fp32-sums": ({"accum": 4, "accumulate_dtype": torch.float32}, 16),
    "inf-on-rank-1": ({"inf_batches": (3,), "inf_ranks": (1,), "init_scale": 2.0 ** 20}, 8),
    "bf16-clip-norm": ({"dtype": torch.bfloat16, "clip": 0.5, "optimizer": "adamw"}, 8),
}
for _name, (_mode, _batches) in TRAINER.items():
    GROUP.add(f"trainer-{_name}", W.trainer_vs_own, _mode, _batches)
FABRIC = {"sgd": ({}, 8), "accumulate-4": ({"accum": 4}, 16),
          "inf-on-rank-1": ({"inf_batches": (3,), "inf_ranks": (1,)}, 8),
          # the inf in the second micro-batch of the second step, on rank 1 only: both ranks skip that step
          "accumulate-4-fp32-sums-inf-on-rank-1": ({"accum": 4, "accumulate_dtype": torch.float32,
                                                    "inf_batches": (5,), "inf_ranks": (1,)}, 16)}
for _name, (_mode, _batches) in FABRIC.items():
    GROUP.add(f"fabric-{_name}", W.fabric_vs_own, _mode, _batches)
GROUP.add("refused-comm-hook", W.refused_comm_hook)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    return GROUP.run(tmp_path_factory.mktemp("lightning-ddp"))


@pytest.mark.parametrize("name", TRAINER)
def test_trainer_under_ddp_is_the_own_loop(group, name):
    mode, batches = TRAINER[name]
    results = group(f"trainer-{name}")
    for r in results:
        assert r["same"], "the plugin's run differs from mpfp16's own loop"
        assert r["stepped"] == r["own_stepped"] == results[0]["stepped"]  # every rank skips the same steps
        assert r["global_step"] == batches // mode.get("accum", 1)
        # One exchange per optimizer step, whatever the accumulation: an allreduce of each of
        # DDP's two buckets (the 16-bit parameters, the fp32 LayerNorm), as the own loop sends.
        assert r["calls"] == r["own_calls"] == [2] * r["global_step"]
    if "inf_batches" in mode:
        assert results[0]["stepped"].count(False) == results[0]["skipped"] >= 1


@pytest.mark.parametrize("name", FABRIC)
def test_fabric_under_ddp_is_the_own_loop(group, name):
    """fabric.no_backward_sync while accumulating: the run is the own loop's bit for bit,
    the replicas pass check_replicas, and each optimizer step sends exactly one exchange
    (an allreduce of each of DDP's two buckets; none on the accumulating micro-batches).
    With fp32 sums the plugin gives Fabric's DDP mpfp16's hook, whose one exchange
    carries the sum; the own loop runs under mpfp16.distributed.wrap."""
    mode, batches = FABRIC[name]
    results = group(f"fabric-{name}")
    for r in results:
        assert r["same"]
        assert r["stepped"] == r["own_stepped"] == results[0]["stepped"]
        assert r["calls"] == [2] * (batches // mode.get("accum", 1))
    if "inf_batches" in mode:
        assert False in results[0]["stepped"]
        assert results[0]["stepped"].count(False) == results[0]["skipped"] == results[1]["skipped"]
        assert all(not results[0]["stepped"][i // mode.get("accum", 1)] for i in mode["inf_batches"])


def test_a_ddp_comm_hook_of_the_users_is_refused(group):
    for said in group("refused-comm-hook"):
        assert "a ddp_comm_hook given to DDPStrategy cannot run beside it" in said and "\n" not in said


@pytest.mark.timeout(240)
def test_sigkill_and_resume_from_lightning_checkpoint(tmp_path):
    whole = Forked("lightning_workers.py", ["--dir", str(tmp_path / "whole"), "--epochs", "4"])
    killed = Forked("lightning_workers.py", ["--dir", str(tmp_path / "run"), "--epochs", "4",
                                             "--pause-after-epoch", "2"])
    deadline = time.monotonic() + 120
    while "paused" not in killed.output_so_far():
        assert killed.poll() is None, killed.communicate()
        assert time.monotonic() < deadline, "the run never reached its second checkpoint"
        time.sleep(0.2)
    killed.kill()
    assert killed.wait(30) == -9
    assert (tmp_path / "run" / "last.ckpt").exists() and not (tmp_path / "run" / "final.pt").exists()
    resumed = Forked("lightning_workers.py", ["--dir", str(tmp_path / "run"), "--epochs", "4", "--resume"])
    for proc in (whole, resumed):
        assert proc.wait(120) == 0, proc.communicate()
    a = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert W.same(a, b) and a["skipped"] > 0
