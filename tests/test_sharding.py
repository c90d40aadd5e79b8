"""Sharded masters on FSDP2 (mpfp16.distributed.shard) against the DDP path, over gloo
with 1, 2 and 4 processes (tests/sharding_workers.py).

The two-rank cases run in one worker group (the ``two`` fixture, launched once
for the module); the one- and four-rank runs get launches of their own."""

import os

import pytest
import torch

import sharding_workers as W
from dist_helpers import Group, run_workers

pytestmark = pytest.mark.slow  # every test launches processes
CLIPS = {"not-clipping": (1.0, "dynamic"), "clipping": (1e-3, "dynamic"), "clipping-static-scale": (1e-3, 512.0)}
RESHARD = {"reshard-after-forward": True, "keep-gathered": False}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every two-rank case, in one launch."""
    root = tmp_path_factory.mktemp("sharding")
    group = Group(world_size=2, timeout=900)
    group.add("trajectory", W.trajectories, 8, {"nan_steps": (3,), "clip": None})
    for name, reshard in RESHARD.items():
        group.add(("accumulation", name), W.trajectories, 4, {"accum": 2, "clip": None,
                                                              "reshard_after_forward": reshard})
    for name, (clip, loss_scale) in CLIPS.items():
        group.add(("clip", name), W.first_step, clip, loss_scale)
    for accum in (1, 4):
        group.add(("comm", accum), W.comm_per_step, accum)
    group.add("save", W.save_sharded, str(root / "saved" / "last.dcp"), 2)
    group.add("failed save", W.failed_save_keeps_previous, str(root / "failed"))
    group.add("tampered", W.unsafe_checkpoints, str(root / "tampered"))
    for optimizer in ("sgd", "adam"):
        group.add(("memory", optimizer), W.memory, optimizer)
    group.add("stuck", W.stuck_scale)
    group.add("culprits", W.culprits)
    group.add("freezing", W.groups_and_freezing)
    results = group.run(root / "workers")
    results.saved = str(root / "saved" / "last.dcp")
    return results


@pytest.fixture(scope="module")
def four(two, tmp_path_factory):
    """Every four-rank case, in one launch (one loads what the two-rank group saved)."""
    group = Group(world_size=4, timeout=900)
    group.add("first step", W.first_step, None)
    group.add("trajectory", W.trajectories, 6, {"nan_steps": (2,), "clip": None})
    group.add("load", W.load_sharded, two.saved)
    return group.run(tmp_path_factory.mktemp("four"))


def test_two_ranks_follow_the_ddp_trajectory_bit_for_bit_with_the_same_skips(two):
    """No clipping: the gradients, the reduction (x/2 + y/2 == (x + y)/2) and the
    step are the same arithmetic, so the masters are bit-identical; one rank's NaN
    batch at step 3 and the first steps' overflows skip the same steps on both."""
    r0, r1 = two("trajectory")
    c = r0["compare"]
    assert 3 in r0["ddp"]["skipped"]
    assert c["same_skips"], (r0["ddp"]["skipped"], r0["sharded"]["skipped"])
    assert c["max_master_diff"] == 0.0, c
    torch.testing.assert_close(torch.tensor(r0["sharded"]["losses"]), torch.tensor(r0["ddp"]["losses"]), rtol=0,
                               atol=0, equal_nan=True)
    assert r0["ddp"]["scales"] == r0["sharded"]["scales"]
    # BatchNorm statistics: rank 0's before each step's first forward, as DDP broadcasts them
    for name, b in r0["ddp"]["buffers"].items():
        assert torch.equal(r0["sharded"]["buffers"][name], b), name


@pytest.mark.parametrize("name", list(RESHARD))
def test_accumulation_without_reduce_scatter_matches_ddp_no_sync(two, name):
    r0, _ = two(("accumulation", name))
    assert r0["compare"]["max_master_diff"] == 0.0, r0["compare"]


def test_four_ranks_differ_only_by_the_order_of_the_sum(four):
    """With 4 ranks the gradients are summed in another order (gloo's reduce-scatter
    against its allreduce; the divisions by 2 and 4 are exact): after one step every
    master is within the rounding of its sum (2^-8 of its update for fp16 sums, 2^-20
    for the fp32 ones of normalization layers); over steps the runs skip together."""
    r0, *_ = four("first step")
    ddp, sharded = r0["ddp"], r0["sharded"]
    assert ddp["fp32"]
    for name, m in ddp["masters"].items():
        diff = (sharded["masters"][name] - m).abs().max().item()
        rounding = 2 ** -20 if name in ddp["fp32"] else 2 ** -8  # of an fp32 or an fp16 sum
        assert diff <= rounding * (m - ddp["initial"][name]).abs().max().item(), name
    r0, *_ = four("trajectory")
    c = r0["compare"]
    assert c["same_skips"] and 2 in r0["ddp"]["skipped"]
    assert c["max_loss_diff"] < 1e-2, c


@pytest.mark.parametrize("name", list(CLIPS))
def test_global_norm_and_clipping_match_clip_grad_norm(two, name):
    r0, r1 = two(("clip", name))
    ddp, sharded = r0["ddp"], r0["sharded"]
    assert r1["sharded"]["norm"] == sharded["norm"]  # every rank the same global norm
    assert sharded["norm"] == pytest.approx(ddp["norm"], rel=1e-6)
    for name, m in ddp["masters"].items():
        torch.testing.assert_close(sharded["masters"][name], m, rtol=1e-6, atol=1e-7)


def test_one_reduce_scatter_per_unit_per_step_whatever_the_accumulation(two):
    one, four = two(("comm", 1))[0], two(("comm", 4))[0]
    for result in (one, four):
        for row in result["rows"]:
            assert row["allreduce_calls"] == 0
            assert row["reduce_scatter_calls"] == result["units"]
            assert row["all_gather_calls"] >= result["units"]
    rs = one["rows"][1]["reduce_scatter_bytes"]
    assert four["rows"][1]["reduce_scatter_bytes"] == rs
    # fp16 gradients (fp32 for the normalization layers), padded to a multiple of the ranks
    assert 2 * one["numel"] <= rs <= 4 * one["numel"] + 4096


@pytest.mark.parametrize("save_ranks,load_ranks", [(2, 1), (2, 4), (1, 2)])
def test_checkpoint_reshards_bit_identically(two, four, tmp_path, save_ranks, load_ranks):
    if save_ranks == 2:  # saved by the two-rank group
        path, saved = two.saved, two("save")[0]
    else:
        path = str(tmp_path / "last.dcp")
        saved = run_workers(W.save_sharded, tmp_path / "save", save_ranks, args=(path, 2), timeout=240)[0]
    if load_ranks == 4:  # loaded by the four-rank group
        loaded = four("load")
    else:
        loaded = run_workers(W.load_sharded, tmp_path / "load", load_ranks, args=(path,), timeout=300)
    for result in loaded:
        assert result["step"] == 2 and result["iteration"] == saved["iteration"] == 2
        assert result["scale"] == saved["scale"]
        assert result["masters"].keys() == saved["masters"].keys()
        for name, m in saved["masters"].items():
            assert torch.equal(result["masters"][name], m), name
        assert result["state"].keys() == saved["state"].keys()
        for key, v in saved["state"].items():
            assert torch.equal(result["state"][key], v), key


def test_a_failed_save_leaves_the_previous_checkpoint(two):
    r0, r1 = two("failed save")
    for r in (r0, r1):
        assert r["error"] and "No space left on device" in r["error"] and "\n" not in r["error"]
        assert r["still"] == r["first"]
        for name, m in r["before"]["masters"].items():
            assert torch.equal(r["loaded"]["masters"][name], m)
    # the failed write's folder is gone: one data folder and the link
    assert [n for n in r0["listing"] if not n.startswith(".mpfp16")] == ["last.dcp", os.path.basename(r0["first"])]


def test_tampered_checkpoints_are_refused_and_never_run(two):
    r0, r1 = two("tampered")
    assert r0["marker_written"] is False
    for r in (r0, r1):
        assert "refusing to load" in r["code"] and "io.open" in r["code"]
        assert "refusing to load" in r["bytes"] and "BytesStorageMetadata" in r["bytes"]
        assert "no .metadata" in r["missing-metadata"]
        assert "corrupt" in r["garbage-meta"]
        assert all("\n" not in r[k] for k in ("code", "bytes", "missing-metadata", "garbage-meta"))


def test_refusals_are_one_line(tmp_path):
    r, = run_workers(W.refusals, tmp_path, 1)
    assert r["type"] == "FP16Optimizer" and r["store"] == "sharded"
    assert "do not call to_half()" in r["to_half first"]
    assert "already sharded" in r["shard twice"]
    assert "is not contiguous (channels_last, say), and FSDP2 shards contiguous parameters only" in r["channels_last"]
    assert "master_weights=False is not possible for a sharded model" in r["no masters"]
    assert "fused=True is not possible" in r["fused"]
    assert "needs model=" in r["no model"]
    assert "no gradient reached" in r["step without backward"]
    assert "outside opt.backward()" in r["backward outside opt"]
    for key, value in r.items():
        assert not isinstance(value, str) or "\n" not in value, key


@pytest.mark.parametrize("optimizer,state", [("sgd", 4), ("adam", 8)])
def test_memory_per_rank_falls_with_the_ranks(two, optimizer, state):
    """Between steps a rank holds its fp32 shards of weights, gradients and state, and
    no 16-bit copy: (4 + 4 + state) / N bytes per parameter, where DDP holds 12 + state
    (unfused) on every rank."""
    rows = two(("memory", optimizer))[0]
    by_path = {r["path"]: r for r in rows}
    sharded, ddp = by_path["sharded"], by_path["ddp (unfused)"]
    assert sharded["model_weights"] == 0 and sharded["model_grads"] == 0
    assert sharded["total"] == pytest.approx((8 + state) / 2, rel=0.02)
    assert ddp["total"] == pytest.approx(12 + state, rel=0.02)


def test_a_scale_stuck_at_its_floor_stops_every_rank_at_the_same_step(two):
    r0, r1 = two("stuck")
    assert r0["step"] is not None and r0["step"] == r1["step"]
    assert r0["scale"] == 1.0 and r0["skipped"] == r1["skipped"] == r0["step"] + 1
    assert "\n" not in r0["error"] and r0["error"] == r1["error"]
    # the layers that kept overflowing, gathered from the shards, and the rank whose batch was NaN
    assert r0["error"].endswith(" At the last step: nan in 0.0.weight (108), nan in 0.1.weight (4), nan in 0.1.bias "
                                "(4) and 5 more, the loss non-finite on rank 1.")


def test_the_culprits_are_named_from_the_shards_on_every_rank(two):
    """tests/sharding_workers.py culprits: each rank's shards are scanned, and the
    union names whole parameters, their counts summed over the shards."""
    r0, r1 = two("culprits")
    assert r0 == r1
    first8 = list(r0["numel"].items())[:8]  # rank 1's NaN batch makes every gradient wholly NaN: the first 8
    assert r0["reports"] == [
        (False, [{"name": "0.0.weight", "kind": "inf", "count": 1, "ranks": []},
                 {"name": "11.weight", "kind": "nan", "count": 2, "ranks": []}]),
        (False, [{"name": name, "kind": "nan", "count": numel, "ranks": [1]} for name, numel in first8]),
        (True, []),
    ]


def test_the_skip_is_agreed_over_the_mesh_and_a_layer_unfrozen_later_trains_as_under_ddp(two):
    r0, r1 = two("freezing")
    for r in (r0, r1):
        assert "process_group is not the group the model is sharded over" in r["world group"]
        assert "reduce_overflow=False is not possible for a sharded model" in r["no reduce"]
        assert "\n" not in r["world group"] + r["no reduce"]
    assert r0["stepped alone"] == [True, True, True]  # rank 1's NaN is rank 1's alone
    assert r1["stepped alone"] == [True, False, True]
    ddp, sharded = r0["runs"]["ddp"], r0["runs"]["sharded"]
    assert ddp["stepped"] == sharded["stepped"] and all(ddp["stepped"])
    assert not ddp["frozen moved"] and not sharded["frozen moved"]
    assert ddp["moved once unfrozen"] and sharded["moved once unfrozen"]
    for name, m in ddp["masters"].items():
        assert torch.equal(sharded["masters"][name], m), name
    for name, m in r1["runs"]["sharded"]["masters"].items():
        assert torch.equal(m, sharded["masters"][name]), name
    for r in (r0, r1):  # DDP fixes the parameters it averages when it is built: unfreezing later is refused
        assert r["unfrozen under ddp"].startswith("parameter 0.0.weight was frozen when the model was wrapped in DDP")
