"""master_weights="remainder" (docs/REMAINDER.md): the bf16 weights and an int16 remainder
per parameter hold the fp32 masters exactly. Checked against independent references:
hand-made bit patterns, exact rational rounding, and the run with fp32 masters, bit
for bit (where no master lies exactly halfway between two bf16 values, which each
test counts), and at constructed ties, the one place where the weights may differ."""

import io
import struct
from fractions import Fraction

import pytest
import torch
import torch.nn as nn

import mpfp16
from mpfp16.options import check_options
from mpfp16.rounding import REMAINDER_TIE, join_remainder, split_remainder
from mpfp16.train.cli import build_parser
from mpfp16.train.config import ConfigError, TrainConfig
from reference import batches, saved_masters, tiny_mlp

BF16 = torch.bfloat16


def patterns(values) -> torch.Tensor:
    """fp32 tensors of the given 32-bit patterns (written unsigned)."""
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor, to compare with torch.equal (-0.0 and NaN too)."""
    return t.detach().view({torch.float32: torch.int32, BF16: torch.int16}[t.dtype])


# ---------------------------------------------------------------- the split, on bits

# fp32 bits -> (bf16 bits, remainder): the weight is the fp32 value rounded to nearest, ties away from zero
HAND = [
    (0x3F800000, 0x3F80, 0),  # 1.0 is a bf16 value: remainder 0
    (0x3F807FFF, 0x3F80, 0x7FFF),  # just under half a bf16 ulp above 1.0: down
    (0x3F808000, 0x3F81, -0x8000),  # a tie over an even value: RNE keeps 1.0, away from zero goes up
    (0x3F808001, 0x3F81, -0x7FFF),
    (0x3F818000, 0x3F82, -0x8000),  # a tie over an odd value: up, as RNE does
    (0xBF808000, 0xBF81, -0x8000),  # -1.00390625: away from zero is more negative
    (0xBF807FFF, 0xBF80, 0x7FFF),
    (0x3F7FFFFF, 0x3F80, -1),  # the carry out of the mantissa steps into the next binade: 1.0
    (0x3F7F8000, 0x3F80, -0x8000),
    (0x7F7F7FFF, 0x7F7F, 0x7FFF),  # the largest bf16 value
    (0x7F7F8000, 0x7F80, -0x8000),  # halfway past it: inf, as RNE (the master stays finite)
    (0x7F800000, 0x7F80, 0),  # inf
    (0xFF800000, 0xFF80, 0),  # -inf
    (0x00000000, 0x0000, 0),
    (0x80000000, 0x8000, 0),  # -0.0 stays -0.0
    (0x00007FFF, 0x0000, 0x7FFF),  # an fp32 subnormal under half the smallest bf16 one: to zero
    (0x00008000, 0x0001, -0x8000),  # half the smallest bf16 subnormal: away from zero, to it
    (0x80008000, 0x8001, -0x8000),
    (0x807FFFFF, 0x8080, -1),  # the largest fp32 subnormal, negative: to the smallest normal
]
NANS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFF8000, 0x7FFFFFFF, 0xFFFF8000, 0xFFFFFFFF]


def test_hand_made_patterns_split_as_worked_out():
    x = patterns([u for u, _, _ in HAND])
    weight, remainder = split_remainder(x)
    assert bits(weight).tolist() == torch.tensor([w for _, w, _ in HAND]).to(torch.int16).tolist()
    assert remainder.dtype == torch.int16 and remainder.tolist() == [r for _, _, r in HAND]
    assert torch.equal(bits(join_remainder(weight, remainder)), bits(x))


def test_a_nan_stays_a_nan():
    """No (weight, remainder) pair holds every NaN payload (0x7F800001 would need the
    weight inf, 0x7FFF8000 a weight that wraps to -0.0): a NaN's weight is the quiet
    NaN 0x7FC0, its remainder 0, and it comes back a NaN."""
    x = patterns(NANS)
    weight, remainder = split_remainder(x)
    assert bits(weight).tolist() == [0x7FC0] * len(NANS)
    assert remainder.tolist() == [0] * len(NANS)
    assert torch.isnan(join_remainder(weight, remainder)).all()


def test_millions_of_random_patterns_come_back_exactly():
    """4M random fp32 bit patterns, and the hand-made ones: rebuilt bit for bit (a NaN as
    a NaN); the weight is torch's round-to-nearest-even but at exact ties (remainder
    -0x8000) over an even value, where it is the neighbour away from zero. (The same
    check over all 2**32 patterns passes too, in 9 minutes: docs/REMAINDER.md.)"""
    g = torch.Generator().manual_seed(0)
    u = torch.randint(-(1 << 31), 1 << 31, (1 << 22,), generator=g, dtype=torch.int64)
    u = torch.cat([u, torch.tensor([h for h, _, _ in HAND] + NANS, dtype=torch.int64)]).to(torch.int32)
    ties = torch.randint(0, u.numel(), (1 << 12,), generator=g)
    u[ties] = (u[ties] & ~0xFFFF) | 0x8000  # exact ties, so that there are thousands of them
    x = u.view(torch.float32)
    weight, remainder = split_remainder(x)
    back = join_remainder(weight, remainder)
    nan = torch.isnan(x)
    assert torch.equal(bits(back)[~nan], u[~nan]) and torch.isnan(back[nan]).all()
    tie = (remainder == REMAINDER_TIE) & ~nan
    assert tie.sum() > 4000
    assert torch.equal(tie, ((u & 0xFFFF) == 0x8000) & ~nan)
    w, rne, upper = bits(weight).to(torch.int32), bits(x.to(BF16)).to(torch.int32), u >> 16
    assert torch.isnan(weight[nan]).all() and nan.sum() > 0
    assert torch.equal(w[~tie & ~nan], rne[~tie & ~nan])
    assert torch.equal(w[tie], upper[tie] + 1)  # away from zero, in magnitude, for either sign
    even = tie & (upper % 2 == 0)
    assert torch.equal((w != rne) & ~nan, even)  # RNE differs exactly where it kept the even value toward zero


def _f(u: int) -> Fraction:
    return Fraction(struct.unpack("<f", struct.pack("<I", u))[0])


def test_the_weight_is_the_nearest_bf16_value_ties_away_from_zero():
    """Against exact rational arithmetic: the two bf16 values around the fp32 value (the
    one toward zero, its upper half, and the next in magnitude) and the nearer of them,
    a tie going to the larger magnitude."""
    g = torch.Generator().manual_seed(1)
    upper = torch.randint(0, 0x7F7F, (1500,), generator=g) | (torch.randint(0, 2, (1500,), generator=g) << 15)
    lower = torch.randint(0, 1 << 16, (1500,), generator=g)
    lower[::3] = 0x8000
    us = ((upper << 16) | lower).tolist()
    weight, _ = split_remainder(patterns(us))
    for u, w in zip(us, (bits(weight).to(torch.int32) & 0xFFFF).tolist()):
        x = _f(u)
        toward, away = (u >> 16) << 16, ((u >> 16) + 1) << 16
        dt, da = abs(x - _f(toward)), abs(x - _f(away))
        assert w << 16 == (away if da <= dt else toward), hex(u)


# ---------------------------------------------------------------- training, bit for bit

# Learning rates of no round value: with lr 0.05, lr * g is short for a bf16 gradient whose mantissa 5 divides, so
# that w - lr * g is often exactly halfway between two bf16 values at the first steps (docs/REMAINDER.md).
INNER = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.0371, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=3.7e-3, weight_decay=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3.7e-3, weight_decay=1e-2),
}


def half_group(opt):
    return next(g for g in opt.store.groups if g.half)


def count_ties(opt) -> int:
    """Elements whose master lies exactly halfway between two bf16 values now: with
    remainders, remainder -0x8000; with fp32 masters, lower half 0x8000."""
    if opt.master_mode == "remainder":
        return sum(int((g.remainder == REMAINDER_TIE).sum()) for g in opt.store.groups if g.remainder is not None)
    return sum(int(((bits(g.master) & 0xFFFF) == 0x8000).sum()) for g in opt.store.groups if g.has_master)


def loose(model: nn.Module) -> nn.Module:
    """The model with every parameter in a storage of its own, its gradient accumulator
    held as DDP holds it: the optimizer gets the per-tensor store (tests/test_per_tensor_store.py)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.detach().clone()
    model._held = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
    return model


def train(master_weights, kind="sgd", steps=12, *, fused=False, accum=1, unscale=False, write_at=None, nan_at=None,
          per_tensor=False, model=None, opt=None, data_seed=1, **kw):
    """``steps`` steps of a bf16 tiny MLP (LayerNorm in fp32); returns the model, the
    optimizer and the ties seen after each step."""
    if model is None:
        model = mpfp16.to_half(tiny_mlp(0), BF16)
        if per_tensor:
            model = loose(model)
    if opt is None:
        opt = mpfp16.FP16Optimizer(INNER[kind](model.parameters()), loss_scale=None, master_weights=master_weights,
                                   fused=fused, **kw)
    ties = []
    data = batches(steps * accum, seed=data_seed)
    for i in range(steps):
        if i == write_at:  # a write from outside: the next step re-reads that weight's master
            with torch.no_grad():
                model[0].weight.mul_(0.75)
        opt.zero_grad()
        for j, (x, y) in enumerate(data[i * accum:(i + 1) * accum]):
            if i == nan_at and j == 0:
                x = x.clone()
                x[0, 0] = float("nan")
            opt.backward(nn.functional.cross_entropy(model(x).float(), y) / accum)
        if unscale:
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.5)
        assert opt.step() == (i != nan_at)
        ties.append(count_ties(opt))
    return model, opt, ties


def assert_same_training(a, b):
    """The same weights, fp32 masters and optimizer state, bit for bit."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(bits(p), bits(q)), name
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    for i, (m, n) in enumerate(zip(saved_masters(sa), saved_masters(sb))):
        assert (m is None) == (n is None), i
        if m is not None:
            assert m.dtype == n.dtype == torch.float32 and torch.equal(bits(m), bits(n)), i
    for index, state in sa["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["optimizer"]["state"][index][key])), key


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_training_is_bit_identical_to_fp32_masters_where_no_tie_occurs(kind, fused):
    """12 steps of SGD-momentum, Adam (its weight decay reads the rebuilt master) and
    AdamW, fused and unfused: the ties are counted in both runs (none occurred in this
    set-up), and then every weight, master and state is the fp32-master run's."""
    model, opt, ties = train("remainder", kind, fused=fused)
    ref_model, ref_opt, ref_ties = train(True, kind, fused=fused)
    assert opt.fused == ref_opt.fused == fused
    assert ties == ref_ties == [0] * 12, "a tie occurred: choose another seed for this set-up"
    assert_same_training((model, opt), (ref_model, ref_opt))
    assert opt.master_weights is True and opt.master_mode == "remainder" and ref_opt.master_mode == "fp32"
    assert half_group(opt).master.untyped_storage().nbytes() == 0  # no fp32 master between steps


MODES = [dict(accum=2, accumulate_dtype=torch.float32), dict(unscale=True), dict(write_at=5), dict(nan_at=3),
         dict(per_tensor=True), dict(kind="adamw", per_tensor=True, max_grad_norm=0.3)]


@pytest.mark.parametrize("mode", MODES, ids=["fp32-accumulation", "unscale_-clip", "written-from-outside",
                                             "skipped-step", "per-tensor", "per-tensor-adamw-clip"])
def test_it_composes_with_the_rest_of_the_step(mode):
    """fp32 gradient accumulation, unscale_() and clipping the masters' gradients, a
    weight written from outside (its remainder is reset, as a master is re-read), a
    skipped step, and the per-tensor store: the fp32-master run's numbers, bit for bit."""
    model, opt, ties = train("remainder", **mode)
    ref_model, ref_opt, ref_ties = train(True, **mode)
    assert ties == ref_ties == [0] * 12
    if mode.get("per_tensor"):
        assert opt.store.kind == "per-tensor"
    assert_same_training((model, opt), (ref_model, ref_opt))


class Direct(nn.Module):
    """One bf16 weight vector; the loss is w . c, so the gradient is c, exactly."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.float())

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w.float() * c).sum()


# (weight bits, gradient): one SGD step with lr 0.5 lands the master exactly halfway (w - g / 2)
TIES = [
    (0x3F80, -2.0 ** -7),  # 1 + 2**-8 = 0x3F808000: over the even 0x3F80, RNE keeps it, away goes up
    (0xBF80, 2.0 ** -7),  # -(1 + 2**-8): RNE keeps -1, away goes to 0xBF81
    (0x4000, -2.0 ** -6),  # 2 + 2**-7: even
    (0x3F81, -2.0 ** -7),  # over the odd 0x3F81: both go up to 0x3F82
    (0x3F7F, -2.0 ** -8),  # 0x3F7F8000: the carry into the exponent, to 1.0 (odd: as RNE)
    (0x8002, 2.0 ** -133),  # a negative subnormal tie, 0x80028000, even: to 0x8003
    (0x0001, -2.0 ** -133),  # 0x00018000, odd: to 0x0002 either way
    (0x7F7F, -2.0 ** 120),  # halfway past the largest bf16: inf either way, the master finite
]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_at_constructed_ties_only_the_weights_differ_and_by_the_rule(fused):
    """One SGD step from the same state, where 8 masters are made to land exactly halfway
    between two bf16 values (the others, w - c / 2 of two bf16 values, often do too):
    the masters are the fp32-master run's bit for bit; the weights differ exactly at
    the ties over an even value nearer zero (4 of the 8 made), and there are the
    neighbour away from zero."""
    g = torch.Generator().manual_seed(2)
    n = 64
    w = torch.randn(n, generator=g).to(BF16)
    c = (torch.randn(n, generator=g) * 1e-2).to(BF16)
    at = torch.arange(len(TIES)) * 7
    w.view(torch.int16)[at] = torch.tensor([b for b, _ in TIES], dtype=torch.int32).to(torch.int16)
    c[at] = torch.tensor([v for _, v in TIES]).to(BF16)
    runs = {}
    for mode in ("remainder", True):
        model = mpfp16.to_half(Direct(w), BF16)
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), loss_scale=None,
                                   master_weights=mode, fused=fused)
        opt.zero_grad()
        opt.backward(model(c.float()))
        assert opt.step() and opt.fused == fused
        runs[mode] = (bits(model.w).clone(), saved_masters(opt.state_dict())[0], count_ties(opt))
    (w_rem, m_rem, ties_rem), (w_rne, m_rne, ties_rne) = runs["remainder"], runs[True]
    assert torch.equal(bits(m_rem), bits(m_rne))  # the masters, bit for bit
    tie = (bits(m_rne) & 0xFFFF) == 0x8000
    assert ties_rem == ties_rne == int(tie.sum()) and tie[at].all()
    upper = bits(m_rne) >> 16
    differ = w_rem != w_rne
    assert torch.equal(differ, tie & (upper % 2 == 0)) and differ[at].tolist() == [True, True, True, False, False,
                                                                                   True, False, False]
    assert torch.equal(w_rem[tie].to(torch.int32), upper[tie] + 1)  # away from zero
    assert torch.equal(bits(m_rne.to(BF16))[~tie], w_rem[~tie])
    assert w_rem[at[-1]] == 0x7F80 and torch.isfinite(m_rem[at[-1]])  # inf (its forward's loss was -inf)


# ---------------------------------------------------------------- memory and state


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_memory_shows_two_bytes_saved_per_bf16_parameter(fused):
    """No alignment gaps and no fp32 parameters: master_weights 0 and master_remainder 2
    between steps. Fused, the total drops by 2 against fp32 masters; unfused by 6, as
    the fp32 gradients are then transient too (as without masters)."""
    def report(mode):
        torch.manual_seed(0)
        model = mpfp16.to_half(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)), BF16)
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_scale=None,
                                   master_weights=mode, fused=fused)
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 32).to(BF16)).float().mean())
        assert opt.step()
        return opt.memory_bytes_per_param()

    held, masters = report("remainder"), report(True)
    assert held == {"model_weights": 2.0, "model_grads": 2.0, "master_weights": 0.0, "master_grads": 0.0,
                    "optimizer_state": 4.0, "compensation": 0.0, "master_remainder": 2.0, "total": 10.0}
    assert masters["master_remainder"] == 0.0 and masters["total"] - held["total"] == (2.0 if fused else 6.0)


def test_with_fp32_parameters_the_saving_is_per_bf16_parameter():
    """tiny_mlp's LayerNorm stays fp32: 2 bytes less per bf16 parameter (fused, so that
    the fp32 gradients are no part of the difference)."""
    _, opt, _ = train("remainder", steps=1, fused=True)
    _, ref_opt, _ = train(True, steps=1, fused=True)
    n16 = sum(p.numel() for p in opt.model_params() if p.dtype == BF16)
    n = sum(p.numel() for p in opt.model_params())
    held, ref = opt.memory_bytes_per_param(), ref_opt.memory_bytes_per_param()
    assert ref["master_weights"] >= 4 * n16 / n and held["master_weights"] == 0.0
    assert ref["total"] - held["total"] == pytest.approx(ref["master_weights"] / 2)  # 2 of each master's 4 bytes


def roundtrip(state_dict: dict) -> dict:
    """Through torch.save and torch.load(weights_only=True), as a checkpoint goes."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("saved_mode,loaded_mode", [("remainder", "remainder"), ("remainder", True),
                                                    (True, "remainder")])
def test_a_checkpoint_loads_into_either_mode_and_continues_bit_for_bit(saved_mode, loaded_mode):
    """The state_dict holds the fp32 masters (rebuilt exactly from a remainder run's
    weights and remainders); loaded into either mode (a remainder run's weights and
    remainders computed from them), the run continues as the uninterrupted one."""
    model, opt, ties = train(saved_mode, "adamw", steps=6)
    saved_model, saved_opt = roundtrip(model.state_dict()), roundtrip(opt.state_dict())
    assert saved_opt["master_weights"] is True and saved_opt["master_mode"] == ("remainder" if saved_mode ==
                                                                               "remainder" else "fp32")
    fresh = mpfp16.to_half(tiny_mlp(5), BF16)  # other weights: all of it comes from the checkpoint
    fresh_opt = mpfp16.FP16Optimizer(INNER["adamw"](fresh.parameters()), loss_scale=None, master_weights=loaded_mode)
    fresh.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved_opt)
    assert_same_training((fresh, fresh_opt), (model, opt))  # masters (rebuilt where held so) and weights
    _, _, later = train(None, "adamw", steps=6, model=fresh, opt=fresh_opt, data_seed=3)
    _, _, straight = train(None, "adamw", steps=6, model=model, opt=opt, data_seed=3)
    assert ties + later == ties + straight == [0] * 12
    assert_same_training((fresh, fresh_opt), (model, opt))
    ref_model, ref_opt, _ = train(True, "adamw", steps=6)  # and both are the fp32-master run's
    train(None, "adamw", steps=6, model=ref_model, opt=ref_opt, data_seed=3)
    assert_same_training((fresh, fresh_opt), (ref_model, ref_opt))


def test_masters_against_no_masters_is_refused_in_one_line():
    model, opt, _ = train("remainder", steps=1)
    _, plain, _ = train(False, steps=1)
    with pytest.raises(ValueError, match=r"^the state_dict was saved with master_weights=False and this optimizer "
                                         r"has master_weights='remainder'$"):
        opt.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match=r"^the state_dict was saved with master_weights='remainder' and this "
                                         r"optimizer has master_weights=False$"):
        plain.load_state_dict(opt.state_dict())


# ---------------------------------------------------------------- where it cannot apply


@pytest.mark.parametrize("dtypes,words", [
    ((torch.float16,), "needs bf16 parameters, and these include float16: a bf16 value is the upper half"),
    ((torch.float16, BF16), "needs bf16 parameters, and these include float16"),
    ((torch.float32,), "needs bf16 parameters and there are none"),
])
def test_only_bf16_parameters_can_hold_their_masters_so(dtypes, words):
    model = nn.Sequential(*[nn.Linear(4, 4).to(dtype) for dtype in dtypes])
    with pytest.raises(ValueError, match=f"^master_weights='remainder' {words}") as info:
        mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=None, master_weights="remainder")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("options,words", [
    (dict(rounding="kahan"), r"^rounding='kahan' is for 16-bit weights stepped without masters; "
                             r"master_weights='remainder' keeps exact fp32 masters"),
    (dict(sharded=True), r"^master_weights='remainder' is not possible for a sharded model: its fp32 shards are "
                         r"FSDP2's own parameters"),
])
def test_other_refusals_are_one_line(options, words):
    with pytest.raises(ValueError, match=words):
        check_options(master_weights="remainder", dtypes={BF16}, **options)
    with pytest.raises(ValueError, match=r"^master_weights must be True, False or 'remainder', got 'fp32'$"):
        check_options(master_weights="fp32")


def test_the_scripts_flag():
    args = build_parser("cifar").parse_args(["--precision", "bf16", "--master-weights", "remainder"])
    assert args.master_weights == "remainder"
    assert build_parser("cifar").parse_args(["--master-weights", "fp32"]).master_weights is True
    assert TrainConfig(task="cifar", precision="bf16", master_weights="remainder").validate().master_weights == \
        "remainder"
    assert "--master-weights {fp32,remainder}" in build_parser("cifar").format_help()
    for settings, words in [(dict(precision="fp16"), "--master-weights remainder needs bf16 parameters, and these "
                                                     "include float16"),
                            (dict(precision="fp32"), "--master-weights remainder needs bf16 parameters and there are "
                                                     "none"),
                            (dict(precision="bf16", shard=True), "--master-weights remainder is not possible for a "
                                                                 "sharded model")]:
        with pytest.raises(ConfigError, match=f"^{words}"):
            TrainConfig(task="cifar", master_weights="remainder", **settings).validate()


def test_the_tie_count_tool_agrees_with_the_fp32_masters_at_the_first_step(tmp_path, capsys):
    """python -m mpfp16.bench.remainder: after the first step the two runs' masters are
    the same, so the remainder run's ties (remainder -0x8000) are the fp32-master run's
    (lower half 0x8000), over even values alike."""
    from mpfp16.bench import remainder as tool

    out = tmp_path / "ties.json"
    assert tool.main(["--steps", "2", "--batch-size", "4", "--optimizer", "sgd", "--json", str(out)]) == 0
    import json

    (result,) = json.loads(out.read_text())
    first = result["per_step"][0]
    assert first["ties"] == first["fp32_ties"] > 0 and first["ties_over_even"] == first["fp32_ties_over_even"]
    assert result["ties"] == sum(s["ties"] for s in result["per_step"]) and "per million" in capsys.readouterr().out


def test_the_step_benchmark_counts_two_bytes_less_for_remainders():
    from mpfp16.bench import step

    for kind in ("sgd", "adamw", "adam"):
        t = step.traffic(kind)
        assert t["j"] == t["d"] and t["k"] == t["j"] - 2
