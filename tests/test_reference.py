"""The library's definition of the step (mpfp16/reference.py) against what a user of plain
torch writes: fp32 copies of the weights, ``torch.amp.GradScaler`` (its unscale, its skip
of a non-finite step, its scale), ``clip_grad_norm_``, a torch optimizer, a copy back. Bit
for bit, over clean, overflowing and clipped steps. The stores are held to the definition
by tests/test_store_conformance.py."""

import pytest
import torch
import torch.nn as nn

import mpfp16
from mpfp16.reference import ReferenceStep
from reference import batches, make_inner, tiny_mlp


def _plain_torch(model16: nn.Module, kind: str, clip: float | None):
    """The loop of the GradScaler docs, over fp32 copies of a 16-bit model."""
    params = list(model16.parameters())
    masters = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in params]
    opt = make_inner(kind, masters)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)

    def step(loss) -> bool:
        scaler.scale(loss.float()).backward()
        with torch.no_grad():
            for p, m in zip(params, masters):
                if m is not p:
                    m.grad = p.grad.float()
        scaler.unscale_(opt)
        finite = all(bool(torch.isfinite(m.grad).all()) for m in masters)
        if clip is not None and finite:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            for p, m in zip(params, masters):
                if m is not p:
                    p.copy_(m)
                p.grad = m.grad = None
        return finite

    return step, scaler, masters, opt


@pytest.mark.parametrize("clip", [None, 0.25], ids=["no-clip", "clip"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_the_definition_is_plain_torch_with_grad_scaler(kind, clip):
    model, torch_model = mpfp16.to_half(tiny_mlp(0)), mpfp16.to_half(tiny_mlp(0))
    ref = ReferenceStep(model.parameters(), lambda masters: make_inner(kind, masters), max_grad_norm=clip,
                        scaler=mpfp16.DynamicLossScaler(init_scale=1024.0, growth_interval=2))
    plain, scaler, masters, opt = _plain_torch(torch_model, kind, clip)
    for i, (x, y) in enumerate(batches(7, seed=2)):
        factor = 2.0**16 if i == 3 else 1.0  # an overflow of the 16-bit gradients: skipped by both
        ref.backward(nn.functional.cross_entropy(model(x), y) * factor)
        assert ref.step() == plain(nn.functional.cross_entropy(torch_model(x), y) * factor) == (i != 3)
        assert ref.scaler.scale == scaler.get_scale()
        for a, b in zip(ref.masters, masters):
            assert torch.equal(a, b)
        for a, b in zip(model.parameters(), torch_model.parameters()):
            assert torch.equal(a, b)
        for a, b in zip(ref.optimizer.state.values(), opt.state.values()):
            assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in b)


def test_with_bf16_states_the_definition_rounds_the_new_states_once():
    """state_dtype=bf16: the states are bf16 between steps, and each is the fp32 step's
    new state from the widened old one, rounded to nearest."""
    model = mpfp16.to_half(tiny_mlp(0))
    ref = ReferenceStep(model.parameters(), lambda masters: make_inner("adamw", masters), state_dtype=torch.bfloat16)
    for x, y in batches(2):
        before = {id(m): {k: v.float() if k != "step" else v.clone() for k, v in e.items()}
                  for m, e in ref.optimizer.state.items()}
        ref.backward(nn.functional.cross_entropy(model(x), y))
        grads = [p.grad.float() / ref.scaler.scale for p in ref.params]
        masters = [m.detach().clone() for m in ref.masters]
        assert ref.step()
        for m, old_master, grad in zip(ref.masters, masters, grads):
            entry = ref.optimizer.state[m]
            assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.bfloat16
            fp32 = torch.optim.AdamW([old_master.requires_grad_()], lr=5e-3, weight_decay=1e-2)
            old_master.grad = grad
            if id(m) in before:
                fp32.state[old_master] = {k: v.clone() for k, v in before[id(m)].items()}
            fp32.step()
            assert torch.equal(entry["exp_avg"], fp32.state[old_master]["exp_avg"].to(torch.bfloat16))
