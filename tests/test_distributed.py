"""Two-process gloo tests on 127.0.0.1: DDP with 16-bit gradients and FP16Optimizer.

The cases run in one worker group (GROUP, launched once for the module); a
case that patches a module, or kills a rank, gets a launch of its own."""

import logging

import pytest
import torch
import torch.nn as nn

import dist_workers as W
import overflow_workers as OW
import mpfp16
import mpfp16.distributed as mdist
from dist_helpers import Group, run_workers

STEPS = 4
slow = pytest.mark.slow
GROUP = Group(timeout=600)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    return GROUP.run(tmp_path_factory.mktemp("group"))


def single_process_params(steps, accum=1):
    """The reference: one process, the whole (concatenated) batch."""
    model = mpfp16.to_half(W.mlp())
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loss_scale=1024.0)
    W.train_steps(0, model, model, opt, steps, accum, world=1)
    return W.flat_params(model)


@pytest.fixture(scope="module")
def reference():
    return single_process_params(STEPS)


WIRES = {"fp16-wire": {}, "fp32-wire": {"allreduce_dtype": torch.float32}, "predivide": {"predivide_factor": 2.0},
         "fp32-accumulate": {"strategy": "fp32_accumulate"}}
for _name, _kw in WIRES.items():
    GROUP.add(("matches", _name), W.train_dp, STEPS, _kw)


@slow
@pytest.mark.parametrize("name", list(WIRES))
def test_matches_single_process_on_the_concatenated_batch(group, reference, name):
    wrap_kw = WIRES[name]
    r0, r1 = group(("matches", name))
    assert torch.equal(r0["params"], r1["params"])  # ranks bit-identical
    torch.testing.assert_close(r0["params"], reference, rtol=1e-2, atol=2e-3)  # fp16 tolerance
    numel = sum(p.numel() for p in W.mlp().parameters())
    # fp32 on the wire when asked for, and for fp32_accumulate's small buckets (under 64K elements)
    wide = wrap_kw.get("allreduce_dtype") == torch.float32 or wrap_kw.get("strategy") == "fp32_accumulate"
    wire, expected = ("float32", numel * 4) if wide else ("float16", numel * 2)
    assert all(s["allreduce_bytes"] == expected for s in r0["stats"])
    assert r0["stats"][0]["allreduce_bytes_by_dtype"] == {wire: expected}


GROUP.add("plain-ddp", W.train_dp, STEPS, {}, 1, "float16", True, True)


@slow
def test_plain_ddp_of_a_half_model_works_with_the_optimizer(group, reference):
    r0, r1 = group("plain-ddp")
    assert torch.equal(r0["params"], r1["params"])
    torch.testing.assert_close(r0["params"], reference, rtol=1e-2, atol=2e-3)


GROUP.add("accum-1", W.train_dp, 2, {}, 1)
GROUP.add("accum-8", W.train_dp, 2, {}, 8)
GROUP.add("accum-4", W.train_dp, 2, {}, 4)


@slow
def test_accumulation_sends_once_per_optimizer_step(group):
    one = group("accum-1")[0]["stats"]
    eight = group("accum-8")[0]["stats"]
    for a, b in zip(one, eight):
        assert a["allreduce_calls"] == b["allreduce_calls"] >= 1
        assert a["allreduce_bytes"] == b["allreduce_bytes"] > 0
    assert all(s["allreduce_time_s"] >= 0 and s["allreduce_wait_s"] >= 0 for s in one + eight)


@slow
def test_accumulation_matches_single_process(group):
    r0, r1 = group("accum-4")
    assert torch.equal(r0["params"], r1["params"])
    torch.testing.assert_close(r0["params"], single_process_params(2, accum=4), rtol=1e-2, atol=2e-3)


for _where in ("input", "grad"):
    GROUP.add(("overflow", _where), W.overflow_on_one_rank, 8, _where)


@slow
@pytest.mark.parametrize("where", ["input", "grad"])
def test_overflow_on_one_rank_skips_on_every_rank(group, where):
    r0, r1 = group(("overflow", where))
    expected = [step not in (2, 5) for step in range(8)]
    assert r0["stepped"] == r1["stepped"] == expected
    assert r0["skipped"] == r1["skipped"] == 2 and r0["scale"] == r1["scale"] == 2.0**14
    assert torch.equal(r0["params"], r1["params"])
    for a, b in zip(r0["buffers"], r1["buffers"]):  # BatchNorm statistics, synced by DDP
        assert torch.equal(a, b)


CULPRIT_STORES = ("flat", "fused", "per-tensor")
for _store in CULPRIT_STORES:
    GROUP.add(("culprits", _store), OW.culprits_under_ddp, _store)


@slow
@pytest.mark.parametrize("store", CULPRIT_STORES)
def test_every_rank_names_the_same_culprits_and_the_rank_whose_loss_was_nan(group, store):
    """tests/overflow_workers.py says what each step does. Rank 1's NaN input makes
    every gradient wholly NaN after the allreduce (a NaN passes ReLU's backward), and
    its loss NaN; a gradient poisoned on one rank after the allreduce is named on both."""
    r0, r1 = group(("culprits", store))
    assert r0 == r1  # the same report on every rank
    assert r0["store"] == ("per-tensor" if store == "per-tensor" else "flat") and r0["fused"] == (store == "fused")
    shapes = {name: p.numel() for name, p in W.mlp().named_parameters()}
    assert r0["reports"] == [
        (False, [{"name": name, "kind": "nan", "count": numel, "ranks": [1]} for name, numel in shapes.items()]),
        (False, [{"name": "0.weight", "kind": "nan", "count": 1, "ranks": []}]),
        (False, [{"name": "0.weight", "kind": "inf", "count": 2, "ranks": []},
                 {"name": "2.bias", "kind": "inf", "count": 1, "ranks": []}]),
        (True, []),
    ]


BIG = {"fp16": ({}, float("inf")),                                  # fp16 sum: 40000 + 40000 saturates
       "predivide": ({"predivide_factor": 2.0}, 40000.0),            # apex: halve first, sum, no division after
       "fp32-wire": ({"allreduce_dtype": torch.float32}, 40000.0),   # fp32 on the wire
       "fp32-accumulate": ({"strategy": "fp32_accumulate"}, 40000.0)}  # fp16 on the wire, fp32 sum
for _name, (_kw, _) in BIG.items():
    GROUP.add(("big", _name), W.big_gradients, _kw)


@slow
@pytest.mark.parametrize("name", list(BIG))
def test_sixteen_bit_sum_overflow_and_its_remedies(group, name):
    expected = BIG[name][1]
    r0, r1 = group(("big", name))
    assert r0["grad"] == r1["grad"] == expected


ODD = {"point-to-point": 0, "small-bucket-fp32": 1 << 16}
for _name, _numel in ODD.items():
    GROUP.add(("odd", _name), W.fp32_accumulate_exact, 3, [7, 1, 16, 5], _numel)


@slow
@pytest.mark.parametrize("name", list(ODD))
def test_fp32_accumulate_is_exact_on_odd_sizes(group, name):
    r0, r1 = group(("odd", name))
    for r in (r0, r1):
        for got, expected in zip(r["got"], r["expected"]):
            assert torch.equal(got, expected)


@slow
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_dead_peer_ends_the_run_with_an_error(tmp_path, mode):
    """Rank 1 exits, or hangs, after two steps: rank 0 fails within its 8 s timeout."""
    r0, _ = run_workers(W.dead_peer, tmp_path, args=(mode,), timeout=90, wait_ranks=[0])
    # an error the scripts turn into "communication with another process failed" (not a hang, not another bug)
    from mpfp16.train.cli import _COMM_FAILURE
    assert r0["error"] is not None and _COMM_FAILURE.search(r0["error"]), r0["error"]
    assert r0["elapsed"] < (30 if mode == "exit" else 8 + 22)


GROUP.add("log-levels", W.log_levels)


@slow
def test_only_rank_zero_logs_info(group):
    r0, r1 = group("log-levels")
    assert r0 == logging.INFO and r1 == logging.WARNING


def test_single_process_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = mdist.init(device="cpu")
    assert info == mdist.DistInfo(0, 1, 0, torch.device("cpu"), None)
    assert not info.distributed and info.is_main_process
    # Without DDP the context changes nothing: gradients accumulate as usual, twice.
    layer = nn.Linear(1, 1, bias=False)
    for _ in range(2):
        with mdist.sync_gradients(layer, False):
            layer(torch.ones(1, 1)).sum().backward()
    assert layer.weight.grad.item() == 2.0


def test_the_log_writes_to_the_streams_of_the_moment_not_those_of_init(monkeypatch, capsys):
    """init() under a redirect (a notebook cell, pytest's capture), the redirect
    closed, then a record: it goes to the stdout and stderr of now, not to the closed
    stream ("--- Logging error --- I/O operation on closed file", seen in CI)."""
    import contextlib
    import io

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    log = logging.getLogger("mpfp16")
    monkeypatch.setattr(log, "handlers", list(log.handlers))
    monkeypatch.setattr(log, "level", log.level)
    monkeypatch.setattr(log, "propagate", log.propagate)
    old_out, old_err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(old_out), contextlib.redirect_stderr(old_err):
        mdist.init(device="cpu", log_level=logging.INFO)
    old_out.close()
    old_err.close()
    log.info("progress")
    log.warning("trouble")
    out, err = capsys.readouterr()
    assert out == "progress\n" and err == "WARNING: trouble\n"


@pytest.mark.parametrize("kw,match", [
    ({"backend": "mpi"}, "unknown distributed backend"),
    ({"timeout_s": 0}, "timeout must be positive"),
    ({"device": "tpu"}, "device must be"),
])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        mdist.init(**kw)


def test_nccl_needs_cuda(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="NCCL backend needs CUDA"):
        mdist.init(backend="nccl", device="cpu")


def test_wrap_needs_a_process_group():
    with pytest.raises(RuntimeError, match="under torchrun"):
        mdist.wrap(nn.Linear(1, 1))


# ----------------------------------------------------------------- construction orders

ORDER_STEPS = 3


def single_process_reference(dtype, master_weights, accum):
    """One process, the whole (concatenated) batch, rank 0's initial weights."""
    model = W.mlp(seed=0, norm="ln")
    if dtype == "float32":
        mpfp16.flatten_parameters(model)
    else:
        mpfp16.to_half(model, getattr(torch, dtype))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               loss_scale=W.ORDER_DTYPES[dtype], master_weights=master_weights)
    W.train_steps(0, model, model, opt, ORDER_STEPS, accum, world=1)
    return W.flat_params(model)


def grad_bytes(dtype):
    model = W.mlp(norm="ln")
    if dtype != "float32":
        mpfp16.to_half(model, getattr(torch, dtype))
    return sum(p.numel() * p.element_size() for p in model.parameters())


WRAPPERS = ["ddp", "ddp-bucket-view", "wrap"]
for _wrapper in WRAPPERS:
    GROUP.add(("orders", _wrapper), W.order_matrix, _wrapper, ORDER_STEPS)


@slow
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_any_construction_order_averages_and_keeps_replicas_identical(group, wrapper):
    """apex's order (convert, DDP, optimizer) and the optimizer-first order, for stock
    DDP (with and without gradient_as_bucket_view) and wrap(), fp16/bf16/fp32, with and
    without masters, with and without accumulation under no_sync. The ranks start from
    different weights and see different data."""
    r0, r1 = group(("orders", wrapper))
    for dtype, master, accum in W.order_configs():
        case = f"{dtype}, master_weights={master}, accum={accum}"
        first, second = r0[("ddp_first", dtype, master, accum)], r0[("opt_first", dtype, master, accum)]
        for order in ("ddp_first", "opt_first"):
            key = (order, dtype, master, accum)
            assert torch.equal(r0[key]["params"], r1[key]["params"]), f"{case}, {order}: replicas differ"
            for a, b in zip(r0[key]["masters"], r1[key]["masters"]):
                assert torch.equal(a, b), f"{case}, {order}: masters differ"
            if wrapper == "wrap":  # the hook ran once per optimizer step, over every gradient
                assert [s["allreduce_bytes"] for s in r0[key]["stats"]] == [grad_bytes(dtype)] * ORDER_STEPS, case
        assert torch.equal(first["params"], second["params"]), f"{case}: the two orders differ"
        assert len(first["masters"]) == len(second["masters"])
        for a, b in zip(first["masters"], second["masters"]):
            assert torch.equal(a, b), f"{case}: the two orders' masters differ"
        reference = single_process_reference(dtype, master, accum)
        tol = {"float32": (1e-5, 1e-6), "float16": (1e-2, 2e-3), "bfloat16": (5e-2, 1e-2)}[dtype]
        torch.testing.assert_close(first["params"], reference, rtol=tol[0], atol=tol[1], msg=case)


MOVES = ["half", "to_half-then-move", "to_half-after-ddp"]
for _case in MOVES:
    GROUP.add(("moved", _case), W.moved_after_ddp, _case)


@slow
@pytest.mark.parametrize("case", MOVES)
def test_parameters_that_ddp_holds_are_never_moved(group, case):
    """Converting them is refused in one line; an optimizer built over them keeps them
    where they are (the per-tensor store) and the replicas stay identical."""
    r0, r1 = group(("moved", case))
    assert r0 == r1
    if case == "to_half-after-ddp":
        assert "DistributedDataParallel" in r0["error"] and "before wrapping it in DDP" in r0["error"]
        assert "\n" not in r0["error"]
    else:
        assert r0 == {"error": None, "store": "per-tensor"}


@slow
@pytest.mark.parametrize("fused", [None, True], ids=["auto", "fused-true"])
@pytest.mark.parametrize("kernels", ["inductor", "native"])
def test_a_compile_failure_on_one_rank_sends_every_rank_the_same_way(tmp_path, fused, kernels):
    # a launch of its own: the case breaks the compiler of rank 1's process for good
    r0, r1 = run_workers(W.compile_fails_on_one_rank, tmp_path, args=(fused, kernels))
    reason = ("InvalidCxxCompiler: Compiler: /bin/false is not found." if kernels == "inductor" else
              "FileNotFoundError: no C++ compiler: 'no-such-c++' is not on PATH (set CXX)")
    if fused:
        assert r0["error"] == r1["error"] == (
            f"fused=True cannot be honoured: compiling the fused step failed on rank 1 ({reason})")
        return
    assert r0["error"] is r1["error"] is None
    assert not r0["fused"] and not r1["fused"]
    assert torch.equal(r0["params"], r1["params"])
    said = [m for m in r0["messages"] if "fused" in m]
    assert said == [  # rank 0 says it compiles (INFO), then the one warning; no "ready" line
        "fused step: compiling its kernels (they are kept on disk, so a later run starts sooner)",
        f"fused optimizer step unavailable: compiling failed on rank 1 ({reason}); every rank uses the unfused step"]
    assert not [m for m in r1["messages"] if "fused" in m]


# ----------------------------------------------------------------- the replica checker

PERTURBED = {
    "weight": "0.weight differs (rank 0 holds one value, rank 1 another); 1 of 19 tensors differ",
    "master": "master weight of 3.weight differs",
    "momentum": "optimizer state 'momentum_buffer' of 0.weight differs",
    "loss_scale": "optimizer value scaler.scale differs (rank 0: 1024.0, rank 1: 2048.0)",
    "lr": "optimizer value optimizer.param_groups.0.lr differs (rank 0: 0.05, rank 1: 0.051)",
}
for _where in PERTURBED:
    GROUP.add(("perturbed", _where), W.perturb_one_rank, _where)


@slow
@pytest.mark.parametrize("where", list(PERTURBED))
def test_a_one_ulp_difference_on_one_rank_is_caught_on_every_rank(group, where):
    expected = PERTURBED[where]
    r0, r1 = group(("perturbed", where))
    assert r0["clean"] == r1["clean"] > 10  # params, masters, momentum, rng state...
    assert r0["error"] == r1["error"]
    assert r0["error"].startswith("replicas diverged at step 2: ")
    assert expected in r0["error"]


def test_a_group_of_one_says_one_process(monkeypatch, capsys):
    from dist_helpers import free_port

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        mdist.init(device="cpu", timeout_s=30)
    finally:
        mdist.teardown()
    assert "distributed: 1 process, backend gloo" in capsys.readouterr().out


for _fused in (False, True):
    GROUP.add(("unscale", _fused), W.unscale_under_ddp, _fused)


@slow
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_unscale_and_your_own_clipping_under_ddp(group, fused):
    r0, r1 = group(("unscale", fused))
    assert torch.equal(r0["unscale"], r1["unscale"])  # replicas identical
    if fused:  # the constructor's norm comes from a flat sum of squares: equal to fp32 rounding
        torch.testing.assert_close(r0["unscale"], r0["max_grad_norm"], rtol=2e-3, atol=1e-5)
    else:
        assert torch.equal(r0["unscale"], r0["max_grad_norm"])


GROUP.add("unused", W.fp32_accumulate_with_unused_search, 10)


@slow
def test_fp32_accumulate_with_find_unused_parameters(group):
    """The hook's exchanges run on a worker thread, on a process group of their own: on
    DDP's group they met DDP's collective for the used-parameter map, and gloo aborted
    the process ("collective mismatch") in 4 runs out of 5."""
    r0, r1 = group("unused")
    assert torch.equal(r0[True], r1[True]) and torch.equal(r0[True], r0[False])


for _name in W.HALF_UNDER_DDP:
    GROUP.add(("half-under-ddp", _name), W.half_model_under_torch_ddp, _name, 3)


@slow
@pytest.mark.parametrize("name", list(W.HALF_UNDER_DDP))
def test_a_half_model_that_torch_ddp_holds_steps_as_one_process_on_the_whole_batch(group, name):
    """apex's order with a ``.half()`` model (its parameters can no longer move, so the
    per-tensor store), under each mode and DDP option: bit for bit the one-process run
    on the whole batch (a flat store: the same numerics), and the replicas agree."""
    case = W.HALF_UNDER_DDP[name]
    r0, r1 = group(("half-under-ddp", name))
    assert r0["store"] == r1["store"] == "per-tensor"
    model = mpfp16.to_half(W.mlp())
    opt = W.half_optimizer(model.parameters(), case.get("inner", "sgd"), case.get("opt"))
    W.half_model_steps(model, model, opt, 3, 0, 1, case.get("unscale_clip"), case.get("round_trip", False))
    assert torch.equal(r0["params"], r1["params"])
    assert torch.equal(r0["params"], W.flat_params(model))


@pytest.mark.parametrize("convert", ["half", "float64"])
def test_a_model_converted_after_wrap_is_refused_at_its_next_forward(monkeypatch, convert):
    """``ddp.half()`` after ``wrap()``: torch gives each parameter a new gradient
    accumulator, DDP's hooks stay on the old ones, and the gradients went unaveraged in
    silence (plain torch DDP does the same; docs/RESILIENCE.md)."""
    from dist_helpers import free_port

    for name, value in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    try:
        mdist.init(device="cpu", timeout_s=30)
        ddp = mdist.wrap(mpfp16.flatten_parameters(W.mlp()))
        ddp(torch.randn(2, 8)).sum().backward()  # as wrapped: fine
        dtype = {"half": torch.float16, "float64": torch.float64}[convert]
        ddp.to(dtype)
        with pytest.raises(RuntimeError, match=r"^parameter 0.weight was float32 on cpu when the model was wrapped in "
                                               r"DDP and is (float16|float64) on cpu now \(.half\(\) or .to\(\) after "
                                               r"wrapping\): torch gave it a new gradient accumulator"):
            ddp(torch.randn(2, 8, dtype=dtype))
    finally:
        mdist.teardown()
