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
