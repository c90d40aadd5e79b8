"""Loss scalers against torch.amp.GradScaler and hand-computed sequences."""

import random

import pytest
import torch

import mpfp16
from mpfp16.scaler import _f32


def grad_scaler_trace(overflows, **kw):
    """Scales and skips of torch.amp.GradScaler for a given sequence of overflows."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    gs = torch.amp.GradScaler("cpu", **kw)
    scales, skipped = [], []
    for overflow in overflows:
        opt.zero_grad()
        gs.scale(p.sum() + 1.0).backward()
        if overflow:
            p.grad.fill_(float("inf"))
        before = p.detach().clone()
        gs.step(opt)
        gs.update()
        skipped.append(torch.equal(before, p.detach()))
        scales.append(gs.get_scale())
    return scales, skipped


def our_trace(overflows, **kw):
    scaler = mpfp16.DynamicLossScaler(min_scale=None, max_scale=None, **kw)
    scales = []
    for overflow in overflows:
        scaler.update(bool(overflow))
        scales.append(scaler.scale)
    return scales


@pytest.mark.parametrize("factors", [(2.0, 0.5), (3.0, 0.3), (1.7, 0.61)])
@pytest.mark.parametrize("seed", range(3))
def test_scale_sequence_matches_grad_scaler(factors, seed):
    rng = random.Random(seed)
    overflows = [rng.random() < 0.25 for _ in range(300)]
    kw = dict(init_scale=2.0**12 * 1.37, growth_factor=factors[0], backoff_factor=factors[1], growth_interval=3)
    expected, skipped = grad_scaler_trace(overflows, **kw)
    assert skipped == overflows
    assert our_trace(overflows, **kw) == expected  # exact, bit for bit


def test_growth_stops_short_of_inf_like_grad_scaler():
    overflows = [False] * 40
    kw = dict(init_scale=2.0**120, growth_factor=2.0, growth_interval=1)
    assert our_trace(overflows, **kw) == grad_scaler_trace(overflows, **kw)[0]


def test_floor_and_ceiling_clamp():
    scaler = mpfp16.DynamicLossScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=16.0)
    for _ in range(2):
        scaler.update(True)
    assert scaler.scale == 2.0
    for _ in range(10):
        scaler.update(False)
    assert scaler.scale == 16.0


def test_hysteresis_tolerates_n_minus_one_overflows():
    scaler = mpfp16.DynamicLossScaler(init_scale=64.0, growth_interval=2, hysteresis=3)
    seen = []
    for overflow in [1, 1, 1, 1, 0, 0, 1, 1, 0, 1]:
        scaler.update(bool(overflow))
        seen.append(scaler.scale)
    # Two overflows absorbed, then every overflow backs off until a growth refills
    # the budget (Megatron-LM's semantics); the growth counter restarts at each overflow.
    assert seen == [64, 64, 32, 16, 16, 32, 32, 32, 32, 16]


def test_stuck_error_after_overflows_at_the_floor():
    scaler = mpfp16.DynamicLossScaler(init_scale=8.0, min_scale=1.0, stuck_after=2)
    for _ in range(4):  # 8 -> 4 -> 2 -> 1, then the first overflow at the floor
        scaler.update(True, step=7)
    with pytest.raises(mpfp16.LossScaleStuckError, match="stuck at 1.*2 consecutive.*step 7"):
        scaler.update(True, step=7)


def test_a_clean_step_resets_the_stuck_count():
    scaler = mpfp16.DynamicLossScaler(init_scale=1.0, min_scale=1.0, stuck_after=2)
    for _ in range(10):
        scaler.update(True)
        scaler.update(False)
    assert scaler.scale == 1.0


def test_no_floor_still_stops_eventually():
    scaler = mpfp16.DynamicLossScaler(min_scale=None, stuck_after=3)
    with pytest.raises(mpfp16.LossScaleStuckError):
        for _ in range(1000):
            scaler.update(True)
    assert scaler.scale < 2.0**-100


def test_static_scaler_skips_but_never_changes():
    scaler = mpfp16.LossScaler(128.0, stuck_after=3)
    scaler.update(True)
    scaler.update(False)
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 128.0
    with pytest.raises(mpfp16.LossScaleStuckError):
        scaler.update(True)


@pytest.mark.parametrize("cls", [mpfp16.LossScaler, mpfp16.DynamicLossScaler])
def test_state_dict_is_plain_numbers_and_round_trips(cls):
    scaler = cls(256.0)
    for overflow in [1, 0, 0, 1]:
        scaler.update(bool(overflow))
    state = scaler.state_dict()
    assert all(type(v) in (int, float) for v in state.values())
    other = cls(2.0)
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({"scale": 1.0})


@pytest.mark.parametrize("kw", [dict(init_scale=0.0), dict(growth_factor=1.0), dict(backoff_factor=1.5),
                                dict(growth_interval=0), dict(hysteresis=0), dict(min_scale=8.0, max_scale=4.0)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        mpfp16.DynamicLossScaler(**kw)


def test_f32_rounding():
    assert _f32(0.1) == float(torch.tensor(0.1, dtype=torch.float32))
    assert _f32(3.0) == 3.0


# ------------------------------------------------------------------ issue 37, 2: a state's own rules on load


def _dynamic():
    return mpfp16.DynamicLossScaler(init_scale=2.0**16, growth_interval=4, hysteresis=2, min_scale=1.0,
                                    max_scale=2.0**24, stuck_after=3)


@pytest.mark.parametrize("make,field,value,words", [
    (_dynamic, "scale", 2.0**32, "scale is 4294967296.0, and it must be a normal fp32 number from 1.0 (min_scale) "
                                 "to 16777216.0 (max_scale)"),
    (_dynamic, "scale", 0.5, "scale is 0.5"),  # below min_scale
    (_dynamic, "scale", 65536.00000000001, "scale is 65536.00000000001"),  # a double, not an fp32 number
    (_dynamic, "scale", float("nan"), "scale is nan"),
    (_dynamic, "scale", True, "scale is True, not a number"),
    (_dynamic, "scale", "65536", "scale is '65536', not a number"),
    (_dynamic, "growth_tracker", 4, "growth_tracker is 4, and it must be an integer from 0 to 3 (below "
                                    "growth_interval 4)"),
    (_dynamic, "growth_tracker", -1, "growth_tracker is -1"),
    (_dynamic, "growth_tracker", 1.0, "growth_tracker is 1.0"),
    (_dynamic, "growth_tracker", True, "growth_tracker is True"),
    (_dynamic, "hysteresis_tracker", 3, "hysteresis_tracker is 3, and it must be an integer of at most 2"),
    (_dynamic, "overflows_at_floor", 4, "overflows_at_floor is 4, and it must be an integer from 0 to 3 "
                                        "(stuck_after 3)"),
    (_dynamic, "overflows_at_floor", None, "overflows_at_floor is None"),
    (lambda: mpfp16.LossScaler(128.0), "scale", 0.0, "scale is 0.0, and it must be a normal fp32 number from "
                                                     "1.175e-38 to 3.403e+38"),
    (lambda: mpfp16.LossScaler(128.0), "scale", float("inf"), "scale is inf"),
    (lambda: mpfp16.LossScaler(128.0), "scale", 2.0**-130, "scale is 7.346839692639297e-40"),  # subnormal
    (lambda: mpfp16.LossScaler(128.0), "overflows_at_floor", -1, "overflows_at_floor is -1"),
])
def test_a_state_the_scaler_cannot_be_in_is_one_line_and_changes_nothing(make, field, value, words):
    """A checkpoint without checksums of its fields (written before them) is checked
    by these rules alone: a flipped bit had resumed a scale of 2**32 over a max_scale of 2**24."""
    scaler = make()
    state = {**scaler.state_dict(), field: value}
    before = scaler.state_dict()
    with pytest.raises(ValueError) as caught:
        scaler.load_state_dict(state)
    assert str(caught.value).startswith(f"the loss scaler's {words}") and "\n" not in str(caught.value)
    assert scaler.state_dict() == before


def test_every_state_a_scaler_reaches_loads():
    """The bounds are those of the states that updates reach: the hysteresis tracker
    below 0 (each overflow past the budget takes one more off), the growth tracker one
    short of the interval, and the count of overflows at the floor that raised
    LossScaleStuckError, a scale at the floor and at the ceiling."""
    scaler = _dynamic()
    seen = []
    rng = random.Random(3)
    overflows = [False] * 40 + [rng.random() < 0.3 for _ in range(300)] + [True] * 40  # up to 2**24, down to 1
    with pytest.raises(mpfp16.LossScaleStuckError):
        for overflow in overflows:
            scaler.update(overflow)
            seen.append(scaler.state_dict())
    seen.append(scaler.state_dict())
    assert min(s["hysteresis_tracker"] for s in seen) < 0 and max(s["growth_tracker"] for s in seen) == 3
    assert seen[-1]["overflows_at_floor"] == 3 and {1.0, 2.0**24} <= {s["scale"] for s in seen}
    for state in seen:
        other = _dynamic()
        other.load_state_dict(state)
        assert other.state_dict() == state
