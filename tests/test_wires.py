"""The 8-bit and top-k wires (mpfp16.parallel.wires): the codes against hand values,
each exchange against the same exchange computed here from both ranks' own gradients,
error feedback's and top-k's bookkeeping (nothing lost: what was not sent is in the
state), replicas identical, buckets and no_sync changing nothing, a NaN step on one
rank changing no state (PowerSGD's included), resume bit for bit, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

import mpfp16.distributed as mdist
import train_cifar
import wire_workers as WW
from conformance_workers import _tensors as tensors_of
from dist_helpers import Group, _distinct_ports as distinct_ports, run_workers
from mpfp16.parallel import quantize
from mpfp16.parallel.wires import BucketLayout
from mpfp16.train.config import ConfigError, TrainConfig
from run_helpers import assert_same_final_state, records, run_main

slow = pytest.mark.slow
STEPS = 5
CODES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int8": torch.int8}
LARGEST = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}
NUMELS = [768, 96, 384, 4]  # wire_workers.net()
ROWS = [3, 1, 2, 1]
EXCHANGES = {
    "e4m3": dict(strategy="fp8_compress"),
    "e5m2": dict(strategy="fp8_compress", fp8_format="e5m2"),
    "int8": dict(strategy="int8_compress"),
    "e4m3-ef": dict(strategy="fp8_compress", error_feedback=True),
    "e5m2-ef": dict(strategy="fp8_compress", fp8_format="e5m2", error_feedback=True),
    "int8-ef": dict(strategy="int8_compress", error_feedback=True),
    "topk": dict(strategy="topk", topk_ratio=0.05),
    "topk-momentum": dict(strategy="topk", topk_ratio=0.05, topk_momentum=0.9),
}
NAN_CASES = {**{k: EXCHANGES[k] for k in ("e4m3-ef", "int8", "topk-momentum")},
             "powersgd": dict(strategy="powersgd", powersgd_start_iter=2)}
SMALL_BUCKETS = 0.001  # 1 KiB: the 768-element weight alone, the rest in another bucket

GROUP = Group(timeout=600)
for _name, _kw in EXCHANGES.items():
    GROUP.add(("exchange", _name), WW.wire_run, _kw, STEPS)
for _name in ("e4m3-ef", "topk-momentum"):
    GROUP.add(("buckets", _name), WW.wire_run, EXCHANGES[_name], STEPS, SMALL_BUCKETS)
    GROUP.add(("resume", _name), WW.wire_resume, EXCHANGES[_name], (1, 3), STEPS, SMALL_BUCKETS)
GROUP.add(("accum", "e4m3-ef"), WW.wire_run, EXCHANGES["e4m3-ef"], 3, 25, 2)
for _name, _kw in NAN_CASES.items():
    GROUP.add(("nan", _name), WW.wire_run, _kw, STEPS, 25, 1, 3)
GROUP.add(("dtype", "fp16-e4m3"), WW.wire_run, EXCHANGES["e4m3"], 3, 25, 1, None, "float16")
GROUP.add(("dtype", "bf16-int8-ef"), WW.wire_run, EXCHANGES["int8-ef"], 3, 25, 1, None, "bfloat16")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """The two-process cases, in one launch."""
    return GROUP.run(tmp_path_factory.mktemp("group"))


# ----------------------------------------------------------------- the exchange, computed here


def q(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows through the codes and back: a scale per row from its largest magnitude."""
    amax = rows.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / LARGEST[fmt], torch.ones_like(amax))
    y = rows / scale
    if fmt == "int8":
        y = y.round()
    return y.to(CODES[fmt]).float() * scale


def as_rows(flat: torch.Tensor) -> torch.Tensor:
    rows = -(-flat.numel() // 256)
    return torch.cat([flat.float(), flat.new_zeros(rows * 256 - flat.numel(), dtype=torch.float32)]).view(rows, 256)


def expected_8bit(xs: list[torch.Tensor], index: int, fmt: str):
    """One parameter's exchange on 2 ranks from each rank's input (gradient plus
    residual): its rows in two groups, group j owned by rank (j + index) % 2, which
    adds its own rows to the other's decoded ones and sends the decoded average.
    Returns the average each rank writes and each rank's new residual."""
    x = [as_rows(t) for t in xs]
    out, residual = torch.zeros_like(x[0]), [torch.zeros_like(x[0]), torch.zeros_like(x[0])]
    for j, rows in enumerate(torch.arange(x[0].shape[0]).tensor_split(2)):
        owner = (j + index) % 2
        parts = [x[r][rows] if r == owner else q(x[r][rows], fmt) for r in range(2)]
        average = (parts[0] + parts[1]) / 2
        out[rows] = q(average, fmt)
        for r in range(2):
            residual[r][rows] = 2 * (average - out[rows]) if r == owner else x[r][rows] - q(x[r][rows], fmt)
    n = xs[0].numel()
    return out.view(-1)[:n], [t.view(-1)[:n] for t in residual]


def fmt_of(kw) -> str:
    return "int8" if kw["strategy"] == "int8_compress" else kw.get("fp8_format", "e4m3")


def residuals(state, rank_name):
    return state["state"]["residual"][rank_name] if state is not None else None


@slow
@pytest.mark.parametrize("name", [n for n in EXCHANGES if not n.startswith("topk")])
def test_each_8bit_exchange_is_the_one_computed_from_both_ranks_gradients(group, name):
    kw = EXCHANGES[name]
    fmt, fed_back = fmt_of(kw), kw.get("error_feedback", False)
    r0, r1 = group(("exchange", name))
    assert torch.equal(r0["params"], r1["params"])  # replicas identical
    names = list(r0["steps"][0]["local"])
    for step, (s0, s1) in enumerate(zip(r0["steps"], r1["steps"])):
        for index, n in enumerate(names):
            xs = [s["local"][n].reshape(-1) for s in (s0, s1)]
            if fed_back:
                xs = [x + (s["before"]["state"]["residual"][n] if step else 0) for x, s in zip(xs, (s0, s1))]
            average, new = expected_8bit(xs, index, fmt)
            assert torch.equal(s0["average"][n].reshape(-1), average), (step, n)
            assert torch.equal(s1["average"][n], s0["average"][n])
            if fed_back:
                assert torch.equal(s0["after"]["state"]["residual"][n], new[0])
                assert torch.equal(s1["after"]["state"]["residual"][n], new[1])
    assert all(s["finite"] for s in r0["steps"])


@slow
@pytest.mark.parametrize("name", ["e4m3-ef", "e5m2-ef", "int8-ef"])
def test_error_feedback_loses_nothing(group, name):
    """Summed over the steps, what the wire delivered is the true average of the
    gradients less what the residuals hold at the end (to fp32 rounding); without
    error feedback the same sum is further off."""
    with_ef = group(("exchange", name))
    without = group(("exchange", name[:-3]))
    for ranks, fed_back in ((with_ef, True), (without, False)):
        off = []
        for n in ranks[0]["steps"][0]["local"]:
            delivered = sum(s["average"][n] for s in ranks[0]["steps"])
            true = sum((s0["local"][n] + s1["local"][n]) / 2 for s0, s1 in zip(*(r["steps"] for r in ranks)))
            if fed_back:
                kept = sum(r["steps"][-1]["after"]["state"]["residual"][n].view_as(true) for r in ranks) / 2
                torch.testing.assert_close(delivered, true - kept, rtol=0, atol=1e-6 * float(true.abs().max()))
            off.append(float((delivered - true).abs().max() / true.abs().max()))
        if fed_back:
            ef_off = max(off)
        else:
            assert max(off) > ef_off


def simulate_topk(ranks, ratio: float, momentum: float):
    """DGC on 2 ranks from each rank's recorded gradients: per rank u = m u + g,
    v = v + u; the top ceil(ratio n) of |v| per parameter sent and zeroed in v and u;
    the average of what was sent. Returns the averages per step and the final u, v."""
    names = list(ranks[0]["steps"][0]["local"])
    u = [{n: torch.zeros(ranks[0]["steps"][0]["local"][n].numel()) for n in names} for _ in ranks]
    v = [{n: t.clone() for n, t in ur.items()} for ur in u]
    averages = []
    for step in range(len(ranks[0]["steps"])):
        average = {}
        for n in names:
            total = torch.zeros_like(u[0][n])
            k = max(1, math.ceil(ratio * total.numel()))
            for r, rank in enumerate(ranks):
                u[r][n] = u[r][n] * momentum + rank["steps"][step]["local"][n].reshape(-1)
                v[r][n] = v[r][n] + u[r][n]
                picked = v[r][n].abs().topk(k).indices
                total.index_add_(0, picked, v[r][n][picked])
                v[r][n][picked] = 0
                u[r][n][picked] = 0
            average[n] = total / 2
        averages.append(average)
    return averages, u, v


@slow
@pytest.mark.parametrize("name", ["topk", "topk-momentum"])
def test_each_topk_exchange_is_dgc_computed_from_both_ranks_gradients(group, name):
    kw = EXCHANGES[name]
    ranks = group(("exchange", name))
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    averages, u, v = simulate_topk(ranks, kw["topk_ratio"], kw.get("topk_momentum", 0.0))
    for step, expected in enumerate(averages):
        for n, average in expected.items():
            for rank in ranks:
                assert torch.equal(rank["steps"][step]["average"][n].reshape(-1), average), (step, n)
            sent = int(average.count_nonzero())
            assert 0 < sent <= 2 * max(1, math.ceil(kw["topk_ratio"] * average.numel()))
    for r, rank in enumerate(ranks):
        state = rank["steps"][-1]["after"]["state"]
        for n in u[r]:
            assert torch.equal(state["momentum"][n], u[r][n]) and torch.equal(state["accumulated"][n], v[r][n])
    if "topk_momentum" not in kw:  # nothing lost: delivered + what is still accumulated = the true sum
        for n in u[0]:
            delivered = sum(s["average"][n].reshape(-1) for s in ranks[0]["steps"])
            true = sum((s0["local"][n] + s1["local"][n]).reshape(-1) / 2
                       for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"]))
            torch.testing.assert_close(delivered + (v[0][n] + v[1][n]) / 2, true, rtol=0,
                                       atol=1e-6 * float(true.abs().max()))


@slow
@pytest.mark.parametrize("name", list(EXCHANGES))
def test_each_wire_counts_the_bytes_it_sends(group, name):
    kw = EXCHANGES[name]
    stats = [s["stats"] for s in group(("exchange", name))[0]["steps"]]
    if kw["strategy"] == "topk":
        k = sum(max(1, math.ceil(kw["topk_ratio"] * n)) for n in NUMELS)
        expected = {"float32": 4 * k, "int32": 4 * k}
    else:
        code = str(CODES[fmt_of(kw)]).removeprefix("torch.")
        expected = {code: 256 * sum(ROWS), "float32": 4 * sum(ROWS)}
    assert all(s["allreduce_bytes_by_dtype"] == expected and s["allreduce_calls"] == 1 for s in stats)
    assert all(s["allreduce_bytes"] == sum(expected.values()) for s in stats)


@slow
@pytest.mark.parametrize("name", ["e4m3-ef", "topk-momentum"])
def test_several_buckets_give_the_weights_of_one(group, name):
    """Rows, owners and top-k picks are per parameter: DDP's buckets change nothing."""
    one, several = group(("exchange", name)), group(("buckets", name))
    assert torch.equal(several[0]["params"], one[0]["params"]) and torch.equal(several[1]["params"], one[0]["params"])
    assert [s["stats"]["allreduce_calls"] for s in several[0]["steps"]][1:] == [2] * (STEPS - 1)


@slow
def test_no_sync_accumulation_sends_once_per_step(group):
    r0, r1 = group(("accum", "e4m3-ef"))
    assert torch.equal(r0["params"], r1["params"])
    for step, (s0, s1) in enumerate(zip(r0["steps"], r1["steps"])):
        assert s0["stats"]["allreduce_calls"] == 1
        assert s0["stats"]["allreduce_bytes"] == (256 + 4) * sum(ROWS)  # codes and scales, once
        for index, n in enumerate(s0["local"]):
            xs = [s["local"][n].reshape(-1) + (s["before"]["state"]["residual"][n] if step else 0) for s in (s0, s1)]
            assert torch.equal(s0["average"][n].reshape(-1), expected_8bit(xs, index, "e4m3")[0])


@slow
@pytest.mark.parametrize("name", ["fp16-e4m3", "bf16-int8-ef"])
def test_16bit_models_exchange_their_gradients_as_they_are(group, name):
    """A 16-bit gradient goes into the rows exactly; the average comes back rounded
    to the gradient's dtype."""
    kw = EXCHANGES[name.split("-", 1)[1]]
    r0, r1 = group(("dtype", name))
    assert torch.equal(r0["params"], r1["params"])
    dtype = torch.float16 if name.startswith("fp16") else torch.bfloat16
    for step, (s0, s1) in enumerate(zip(r0["steps"], r1["steps"])):
        for index, n in enumerate(s0["local"]):
            xs = [s["local"][n].reshape(-1) for s in (s0, s1)]
            if kw.get("error_feedback"):
                xs = [x + (s["before"]["state"]["residual"][n] if step else 0) for x, s in zip(xs, (s0, s1))]
            average = expected_8bit(xs, index, fmt_of(kw))[0].to(dtype).float()
            assert torch.equal(s0["average"][n].reshape(-1), average), (step, n)


# ----------------------------------------------------------------- a bad step, and resume


def same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):  # PowerSGD's counts of the elements it compressed count traffic, which was sent
        keys = [k for k in a if not str(k).startswith("total_numel_")]
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in keys)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


@slow
@pytest.mark.parametrize("name", list(NAN_CASES))
def test_a_nan_on_one_rank_is_skipped_by_both_and_changes_no_state(group, name):
    """Step 3's input on rank 1 holds a NaN: both ranks' averages hold NaN (so every
    rank skips it), the state after it is the state before it, and the next steps
    train on finite gradients."""
    ranks = group(("nan", name))
    for rank in ranks:
        assert [s["finite"] for s in rank["steps"]] == [True, True, True, False, True]
        bad = rank["steps"][3]
        if name == "int8":  # no state: the NaN reaches both ranks all the same
            assert bad["before"] is None and bad["after"] is None
            continue
        assert bad["before"] is not None and same_state(bad["after"], bad["before"])
        assert not same_state(rank["steps"][2]["after"], rank["steps"][2]["before"])  # a good step changes it
        assert not same_state(rank["steps"][4]["after"], rank["steps"][4]["before"])
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]) and bool(torch.isfinite(ranks[0]["params"]).all())


@slow
@pytest.mark.parametrize("name", ["e4m3-ef", "topk-momentum"])
def test_a_wire_resumes_bit_identically(group, name):
    """Stops after 1 step (DDP not yet rebuilt: one bucket) and 3 (two buckets), each
    resumed in a new DDP module, which starts with one bucket."""
    for rank in group(("resume", name)):
        assert torch.equal(rank["resumed"], rank["straight"])
        assert rank["reasons"] == [None, None]


# ----------------------------------------------------------------- the scripts, end to end


TINY = ["-a", "resnet9-w4", "-b", "16", "--no-progress", "-p", "1", "--precision", "fp32"]
# The case end to end, and top-k (whose momentum the script moves into the exchange);
# the other wires' NaN steps are the library cases above.
SCRIPT_WIRES = {"powersgd": ["--allreduce-strategy", "powersgd"],
                "topk": ["--allreduce-strategy", "topk", "--no-nesterov"]}


@slow
@pytest.mark.parametrize("name", list(SCRIPT_WIRES))
def test_the_script_skips_a_nan_step_and_goes_on_with_a_finite_checkpoint(cifar_root, tmp_path, name):
    """2 processes, rank 1's batch at step 4 holds a NaN: both skip it, train on, save
    a finite state at every step, and a resume goes on from it."""
    common = [cifar_root, *TINY, *SCRIPT_WIRES[name], "--save-every", "1", "--checkpoint-dir", str(tmp_path)]
    runs = [common + ["--max-steps", "8"], common + ["--max-steps", "10", "--resume", "auto"]]
    ranks = run_workers(WW.poisoned_script_runs, tmp_path / "out", args=(runs, distinct_ports(2)), timeout=300)
    for rank in ranks:
        assert [r["status"] for r in rank] == [0, 0], rank[-1]["stderr"][-3000:]
    train = {r["step"]: r for r in records(tmp_path / "metrics.jsonl") if r["type"] == "train"}
    assert [train[step]["skipped_steps"] for step in (3, 4, 8, 10)] == [0, 1, 1, 1]
    comm = torch.load(tmp_path / "last.pt", weights_only=True)["comm"]
    tensors = [t for rank in comm for t in tensors_of(rank)]
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


@slow
def test_the_script_resumes_an_error_feedback_run_bit_identically(cifar_root, tmp_path):
    from dist_helpers import scripts

    common = [cifar_root, *TINY, "--allreduce-strategy", "int8_compress", "--error-feedback", "--bucket-mb", "0.05"]
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    runs = [common + ["--max-steps", "5", "--checkpoint-dir", str(straight)]]
    runs += [common + ["--max-steps", steps, "--checkpoint-dir", str(parts), *resume]
             for steps, resume in (("1", []), ("5", ["--resume", "auto"]))]
    for ranks in scripts("train_cifar", runs, tmp_path / "out"):
        assert ranks[0] is not None and ranks[0]["status"] == ranks[1]["status"] == 0, ranks[0]["stderr"][-3000:]
    assert_same_final_state(straight / "last.pt", parts / "last.pt")
    sent = [r["allreduce_bytes_by_dtype"] for r in records(straight / "metrics.jsonl") if r["type"] == "train"]
    from mpfp16.train import models

    rows = sum(-(-p.numel() // 256) for p in models.build_cifar_model("resnet9-w4", 10).parameters())
    assert sent and all(s == {"int8": 256 * rows, "float32": 4 * rows} for s in sent)


# ----------------------------------------------------------------- the codes, by hand


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
def test_a_rows_largest_value_lands_on_the_largest_code(fmt):
    x = torch.zeros(2, 256)
    x[0, :4] = torch.tensor([-3.0, 1.5, 0.75, 0.0])
    codes, scales = quantize.encode(x, fmt)
    assert codes.dtype == CODES[fmt] and scales.dtype == torch.float32
    assert torch.equal(scales, torch.tensor([3.0 / LARGEST[fmt], 1.0]))  # a row of zeros: scale 1, codes 0
    assert codes[0, 0].float().item() == -LARGEST[fmt] and not codes[1].float().any()
    decoded = quantize.decode(codes, scales)
    assert decoded[0, 0].item() == -3.0 and not decoded[1].any()
    # 1.5 and 0.75 are 448/2 and 448/4 (e4m3), 57344/2, /4 (e5m2): exact; int8: 63.5 -> 64, 31.75 -> 32
    if fmt == "int8":
        assert codes[0, 1:3].tolist() == [64, 32]
    else:
        assert decoded[0, 1:3].tolist() == [1.5, 0.75]


def test_int8_rounds_half_to_even():
    x = torch.zeros(1, 256)
    x[0, :4] = torch.tensor([127.0, 0.5, 1.5, 2.5])  # scale 1
    codes, scales = quantize.encode(x, "int8")
    assert scales.item() == 1.0 and codes[0, :4].tolist() == [127, 0, 2, 2]


@pytest.mark.parametrize("fmt,bound", [("e4m3", 2 ** -4), ("e5m2", 2 ** -3), ("int8", 1 / 254)])
def test_the_error_is_bounded_by_the_rows_largest_value(fmt, bound):
    """Half a step of the code at the largest magnitude, relative to the row's max,
    for values in the normal range; nothing overflows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    decoded = quantize.decode(*quantize.encode(x, fmt))
    assert bool(torch.isfinite(decoded).all())
    amax = x.abs().amax(1, keepdim=True)
    rel = ((decoded - x).abs() / amax)
    assert float(rel.max()) <= bound
    big = x.abs() >= amax / 8  # these keep their relative precision too
    if fmt != "int8":
        assert float(((decoded - x).abs() / x.abs())[big].max()) <= bound


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_row_holding_inf_or_nan_decodes_to_nan(fmt, bad):
    x = torch.ones(2, 256)
    x[1, 7] = bad
    decoded = quantize.decode(*quantize.encode(x, fmt))
    assert bool(decoded[1].isnan().all()) and torch.equal(decoded[0], torch.ones(256))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_row_has_one_owner_and_each_rank_a_fair_share(world):
    layout = BucketLayout(("a", "b", "c"), [256 * 5, 3, 256 * 7 + 1], [0, 1, 2], world, torch.device("cpu"), 0.01)
    owned = [set(t.tolist()) for t in layout.owned]
    assert sorted(r for rows in owned for r in rows) == list(range(layout.rows)) == list(range(5 + 1 + 8))
    assert max(map(len, owned)) - min(map(len, owned)) <= 2
    assert layout.topk_counts == [13, 1, 18]


# ----------------------------------------------------------------- refusals, in one line


@pytest.mark.parametrize("kw,message", [
    (dict(strategy="fp8_compress", fp8_format="e3m4"), "unknown fp8_format='e3m4'; choose one of e4m3, e5m2"),
    (dict(strategy="int8_compress", fp8_format="e5m2"),
     "fp8_format='e5m2' applies to strategy='fp8_compress' only, not strategy='int8_compress'"),
    (dict(strategy="topk", topk_ratio=0.0), "topk_ratio=0.0 must be in (0, 1)"),
    (dict(strategy="topk", topk_ratio=1.0), "topk_ratio=1.0 must be in (0, 1)"),
    (dict(strategy="topk", topk_momentum=1.0), "topk_momentum=1.0 must be in [0, 1)"),
    (dict(strategy="fp8_compress", topk_ratio=0.1), "topk_ratio=0.1 applies to strategy='topk' only"),
    (dict(strategy="topk", error_feedback=True), "error_feedback=True applies to strategy='fp8_compress' and "
     "strategy='int8_compress'; strategy='topk' keeps what it does not send always"),
    (dict(strategy="powersgd", error_feedback=True), "strategy='powersgd' feeds its error back always"),
    (dict(strategy="allreduce", error_feedback=True), "strategy='allreduce' drops nothing to feed back"),
    (dict(strategy="fp8_compress", allreduce_dtype=torch.float16), "decides its own wire dtype"),
    (dict(strategy="int8_compress", predivide_factor=2.0), "divides by the world size itself"),
], ids=["format", "format-elsewhere", "ratio-0", "ratio-1", "momentum-1", "ratio-elsewhere", "ef-topk",
        "ef-powersgd", "ef-allreduce", "wire-dtype", "predivide"])
def test_wrap_refuses_in_one_line(one_process_group, kw, message):
    with pytest.raises(ValueError) as err:
        mdist.wrap(WW.net(), **kw)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("strategy,kw", [("topk", {}), ("fp8_compress", {"error_feedback": True})])
def test_state_in_loss_scale_units_is_refused_for_fp16_gradients(one_process_group, strategy, kw):
    import mpfp16

    with pytest.raises(ValueError, match="fp16 gradients are scaled by a loss scale that changes between steps"):
        mdist.wrap(mpfp16.to_half(WW.net(), torch.float16), strategy=strategy, **kw)
    mdist.wrap(mpfp16.to_half(WW.net(), torch.bfloat16), strategy=strategy, **kw)  # bf16 is not scaled


def test_a_wire_in_one_process_is_its_own_average(one_process_group):
    """World size 1: the gradient through the codes and back (no peers)."""
    model = WW.net()
    ddp = mdist.wrap(model, strategy="int8_compress")
    x = torch.randn(4, 8)
    torch.nn.functional.cross_entropy(ddp(x), torch.tensor([0, 1, 2, 3])).backward()
    local = WW.net()
    torch.nn.functional.cross_entropy(local(x), torch.tensor([0, 1, 2, 3])).backward()
    for p, ref in zip(model.parameters(), local.parameters()):
        assert torch.equal(p.grad.reshape(-1), q(as_rows(ref.grad.reshape(-1)), "int8").view(-1)[:p.numel()])
    del ddp


@pytest.mark.parametrize("kw,message", [
    (dict(allreduce_strategy="fp8_compress", fp8_format="e5m2", error_feedback=True, precision="fp16"),
     "--error-feedback keeps gradients from step to step, and fp16 gradients"),
    (dict(allreduce_strategy="int8_compress", fp8_format="e5m2"),
     "--fp8-format e5m2 applies to --allreduce-strategy fp8_compress only, not --allreduce-strategy int8_compress"),
    (dict(allreduce_strategy="topk", error_feedback=True, precision="fp32"),
     "--error-feedback applies to --allreduce-strategy fp8_compress and --allreduce-strategy int8_compress"),
    (dict(topk_ratio=0.1), "--topk-ratio 0.1 applies to --allreduce-strategy topk only"),
    (dict(allreduce_strategy="topk", precision="fp32"), "use --optimizer sgd with --no-nesterov, not --nesterov"),
    (dict(allreduce_strategy="topk", precision="fp32", optimizer="adamw", nesterov=False),
     "use --optimizer sgd with --no-nesterov, not --optimizer adamw"),
    (dict(allreduce_strategy="fp8_compress", shard=True), "--allreduce-strategy fp8_compress configures DDP's "
     "allreduce; --shard reduce-scatters instead"),
    (dict(error_feedback=True, shard=True), "--error-feedback configures DDP's allreduce; --shard"),
], ids=["ef-fp16", "format-elsewhere", "ef-topk", "ratio-elsewhere", "topk-nesterov", "topk-adamw", "shard",
        "shard-ef"])
def test_config_refuses_wires_that_do_not_fit(kw, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig(task="cifar", **kw).validate()
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv,message", [
    (["--fp8-format", "e3m4"], "argument --fp8-format: invalid choice: 'e3m4'"),
    (["--topk-ratio", "0"], "argument --topk-ratio"),
    (["--topk-ratio", "1.5"], "argument --topk-ratio"),
    (["--allreduce-strategy", "fp4_compress"], "argument --allreduce-strategy: invalid choice: 'fp4_compress'"),
])
def test_the_script_refuses_bad_wire_flags(capsys, argv, message):
    status, err = run_main(train_cifar.main, argv, capsys)
    assert status == 2 and message in err.strip().splitlines()[-1]


def test_help_lists_the_wires(capsys):
    with pytest.raises(SystemExit):
        train_cifar.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fp16_compress,bf16_compress,powersgd,fp8_compress,int8_compress,topk}" in text
    assert "--fp8-format {e4m3,e5m2}" in text and "--error-feedback" in text and "--topk-ratio R" in text
