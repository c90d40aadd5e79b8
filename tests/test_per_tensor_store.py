"""The per-tensor store (16-bit parameters that can no longer move into a flat buffer,
such as a ``.half()`` model that DDP already holds) gives the flat store's numbers bit
for bit, in every mode; their state_dicts load into each other."""

import logging

import pytest
import torch
import torch.nn as nn

import mpfp16
from reference import batches, make_inner, tiny_mlp

MODES = [
    dict(kind="sgd"), dict(kind="nesterov"), dict(kind="adam"), dict(kind="adamw"),
    dict(kind="sgd", master_weights=False), dict(kind="adamw", master_weights=False),
    dict(kind="sgd", master_weights=False, rounding="stochastic"),
    dict(kind="adam", master_weights=False, rounding="kahan"),
    dict(kind="sgd", max_grad_norm=0.05), dict(kind="adamw", unscale=True),
    dict(kind="sgd", dtype=torch.bfloat16), dict(kind="adamw", dtype=torch.bfloat16, master_weights=False),
]
IDS = ["sgd", "nesterov", "adam", "adamw", "sgd-no-masters", "adamw-no-masters", "stochastic", "kahan", "clip",
       "unscale_", "bf16", "bf16-no-masters"]


def models(dtype):
    """The same 16-bit model twice: in flat buffers, and with every parameter in a
    storage of its own, its gradient accumulator held as DDP holds it."""
    flat = mpfp16.to_half(tiny_mlp(0), dtype)
    loose = mpfp16.to_half(tiny_mlp(0), dtype)
    with torch.no_grad():
        for p in loose.parameters():
            p.data = p.detach().clone()
    loose._held = [p.view_as(p).grad_fn.next_functions[0][0] for p in loose.parameters()]
    return flat, loose


def run(model, mode, steps=6, nan_at=2):
    mode = dict(mode)
    unscale = mode.pop("unscale", False)
    mode.pop("dtype", None)
    kind = mode.pop("kind")
    scale = 512.0 if model[0].weight.dtype == torch.float16 else None
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=scale, **mode)
    stepped = []
    for i, (x, y) in enumerate(batches(steps)):
        if i == nan_at:
            x = x.clone()
            x[0, 0] = float("nan")
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        if unscale:
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.05)
        stepped.append(opt.step())
    return opt, stepped


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_the_per_tensor_store_gives_the_flat_stores_numbers_bit_for_bit(mode):
    flat, loose = models(mode.get("dtype", torch.float16))
    where = [p.data_ptr() for p in loose.parameters()]
    flat_opt, flat_steps = run(flat, mode)
    loose_opt, loose_steps = run(loose, mode)
    assert flat_opt.store.kind == "flat" and loose_opt.store.kind == "per-tensor"
    assert [p.data_ptr() for p in loose.parameters()] == where  # nothing moved
    assert flat_steps == loose_steps and not flat_steps[2]  # the NaN batch skipped on both
    for (name, p), q in zip(flat.named_parameters(), loose.parameters()):
        assert torch.equal(p, q), name
    for m, n in zip(flat_opt.master_params(), loose_opt.master_params()):
        assert (m.numel() == 0 and n.numel() == 0) or torch.equal(m, n)
    for m, n in zip(flat_opt.master_params(), loose_opt.master_params()):
        for key, value in flat_opt.state[m].items():
            assert torch.equal(torch.as_tensor(loose_opt.state[n][key]), torch.as_tensor(value)), key
    assert flat_opt.last_grad_norm == loose_opt.last_grad_norm


def test_their_state_dicts_load_into_each_other():
    flat, loose = models(torch.float16)
    mode = dict(kind="adamw")
    flat_opt, _ = run(flat, mode, steps=3, nan_at=-1)
    loose_opt, _ = run(loose, mode, steps=3, nan_at=-1)
    for src, dst, dst_model, src_model in ((flat_opt, loose_opt, loose, flat), (loose_opt, flat_opt, flat, loose)):
        saved = src.state_dict()
        dst_model.load_state_dict(src_model.state_dict())
        dst.load_state_dict(saved)
        for m, n in zip(src.master_params(), dst.master_params()):
            assert torch.equal(m, n)


def test_the_choice_is_one_info_line(caplog):
    _, loose = models(torch.float16)
    with caplog.at_level(logging.INFO, logger="mpfp16"):
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(loose.parameters(), lr=0.1))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "per-tensor store" in lines[0] and "DistributedDataParallel" in lines[0]
    with pytest.raises(ValueError, match="fused=True is not possible: its parameters are not in flat buffers"):
        mpfp16.FP16Optimizer(torch.optim.SGD(loose.parameters(), lr=0.1), fused=True)
    assert not opt.fused


def test_zero_grad_honours_set_to_none_per_tensor():
    _, loose = models(torch.float16)
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(loose.parameters(), lr=0.1), loss_scale=8.0)
    x, y = batches(1)[0]
    opt.backward(nn.functional.cross_entropy(loose(x), y))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in loose.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in loose.parameters())
