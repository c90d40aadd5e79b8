"""Master-free 16-bit training: nearest, stochastic and Kahan rounding of the new weight."""

import io

import pytest
import torch
import torch.nn as nn

import mpfp16
from mpfp16.rounding import stochastic_round
from reference import batches, tiny_mlp, train_mpfp16

DTYPES = [torch.float16, torch.bfloat16]


def small_updates(rounding, dtype, fused, n=64, steps=250):
    """n weights at 1.0, `steps` updates of +4e-4 each (SGD, lr 1, gradient -4e-4): each
    is under half the spacing of 16-bit values at 1.0, which is 2^-11 (4.9e-4) for fp16
    and 2^-8 for bf16."""
    w = nn.Parameter(torch.ones(n, dtype=dtype))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD([w], lr=1.0), loss_scale=None, master_weights=False,
                               rounding=rounding, rounding_seed=3, fused=fused)
    for _ in range(steps):
        opt.zero_grad()
        opt.backward((w.float() * -4e-4).sum())
        assert opt.step()
    return w.detach().float(), opt


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_updates_by_rounding_mode(dtype, fused):
    nearest, _ = small_updates("nearest", dtype, fused)
    assert torch.equal(nearest, torch.ones_like(nearest))  # 1 + 4e-4 rounds back to 1, every time
    stochastic, _ = small_updates("stochastic", dtype, fused)
    assert abs(stochastic.mean().item() - 1.1) < 0.01
    assert stochastic.std() > 0  # the weights took different paths
    kahan, _ = small_updates("kahan", dtype, fused)
    assert (kahan - 1.1).abs().max().item() < 0.002  # bf16: 1.1015625, the 16-bit value nearest 1.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, generator=g) * torch.logspace(-6, 3, 2000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, float("inf"), 3e-8, -3e-8])])
    nearest = x.to(dtype).float()
    draws = torch.stack([stochastic_round(x, torch.rand(len(x), generator=g), dtype).float() for _ in range(400)])
    lo, hi = draws.min(0).values, draws.max(0).values
    assert torch.all((lo <= x.nan_to_num(posinf=float("inf"))) | (lo == nearest))
    assert torch.all((hi >= x) | (hi == nearest))
    exact = x == nearest
    assert torch.equal(draws[:, exact], nearest[exact].expand(400, -1))  # exact values never move
    finite = torch.isfinite(x) & ~exact
    # the gap between the two 16-bit neighbours of x: 2^(exponent - mantissa bits),
    # floored at the subnormal spacing
    mantissa, min_exponent = (10, -14) if dtype == torch.float16 else (7, -126)
    exponent = torch.floor(torch.log2(x[finite].abs())).clamp(min=min_exponent)
    gap = torch.exp2(exponent - mantissa)
    # unbiased: the mean of 400 draws is within 4 standard errors (gap / 2 / 20) of x
    assert torch.all((draws.mean(0)[finite] - x[finite]).abs() <= 0.1 * gap)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_rounding_is_reproducible_and_resumes_exactly(rounding):
    a, _ = small_updates(rounding, torch.float16, False, steps=50)
    b, _ = small_updates(rounding, torch.float16, False, steps=50)
    assert torch.equal(a, b)

    def run(split):
        model = mpfp16.to_half(tiny_mlp(0))
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loss_scale=256.0,
                                   master_weights=False, rounding=rounding, rounding_seed=7)
        data = batches(6)
        train_mpfp16(model, opt, data[:split])
        buf = io.BytesIO()
        torch.save({"m": model.state_dict(), "o": opt.state_dict()}, buf)
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        model2 = mpfp16.to_half(tiny_mlp(1))
        opt2 = mpfp16.FP16Optimizer(torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9), loss_scale=256.0,
                                    master_weights=False, rounding=rounding, rounding_seed=99)
        model2.load_state_dict(ckpt["m"])
        opt2.load_state_dict(ckpt["o"])
        train_mpfp16(model2, opt2, data[split:])
        return [p.detach().clone() for p in model2.parameters()]

    for p, q in zip(run(6), run(3)):
        assert torch.equal(p, q)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_fused_and_unfused_round_alike(rounding):
    a, _ = small_updates(rounding, torch.float16, False, n=256, steps=40)
    b, _ = small_updates(rounding, torch.float16, True, n=256, steps=40)
    assert torch.equal(a, b)


def test_memory_cost_of_each_rounding():
    reports = {}
    for rounding in ("nearest", "stochastic", "kahan"):
        model = mpfp16.to_half(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16)))
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_scale=8.0,
                                   master_weights=False, rounding=rounding)
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 32)).float().mean())
        opt.step()
        reports[rounding] = opt.memory_bytes_per_param()
    assert reports["nearest"]["total"] == reports["stochastic"]["total"] == 8.0
    assert reports["kahan"]["compensation"] == 2.0 and reports["kahan"]["total"] == 10.0


def test_rounding_needs_no_masters():
    model = mpfp16.to_half(tiny_mlp(0))
    with pytest.raises(ValueError, match="master_weights=False"):
        mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), rounding="kahan")
    with pytest.raises(ValueError, match="rounding must be one of"):
        mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_weights=False, rounding="up")
