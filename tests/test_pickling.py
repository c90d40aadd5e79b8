"""A converted model pickles: ``torch.save(model)``, ``torch.load(..., weights_only=False)``
and ``copy.deepcopy(model)``, before the optimizer, after it, after steps, and under the
per-tensor store; the copy computes the same outputs and trains with a new
FP16Optimizer exactly as the original does. apex's word_language_model example saves
its whole model after every epoch."""

import copy
import io

import pytest
import torch
import torch.nn as nn

import mpfp16
from reference import batches, make_inner, tiny_mlp, train_mpfp16

STAGES = ["converted", "optimizer built", "after steps", "per-tensor store"]


def _scale(value, dtype):
    """A static scale for fp16; bf16 takes none (refused: it needs no scaling)."""
    return value if dtype == torch.float16 else None


def converted(stage, dtype):
    model = mpfp16.to_half(tiny_mlp(0), dtype)
    if stage == "per-tensor store":
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.detach().clone()
        model._held = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]  # as DDP holds them
    if stage != "converted":
        opt = mpfp16.FP16Optimizer(make_inner("sgd", model.parameters()), loss_scale=_scale(128.0, dtype))
        assert opt.store.kind == ("per-tensor" if stage == "per-tensor store" else "flat")
        if stage == "after steps":
            train_mpfp16(model, opt, batches(2))
    if stage == "per-tensor store":
        del model._held
    return model


def saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_converted_model_pickles_and_its_copy_trains_the_same(how, stage, dtype):
    model = converted(stage, dtype)
    twin = saved_and_loaded(model) if how == "torch.save" else copy.deepcopy(model)
    x, y = batches(1, seed=7)[0]
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))  # fp32 inputs are cast, outputs come back fp32
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)
    outcomes = []
    for m in (model, twin):
        opt = mpfp16.FP16Optimizer(make_inner("adamw", m.parameters()), loss_scale=_scale(64.0, dtype))
        outcomes.append(train_mpfp16(m, opt, batches(3, seed=3)))
    assert outcomes[0] == outcomes[1] == [True] * 3
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_a_loaded_copy_keeps_its_flat_buffers():
    """torch.save keeps views of one storage as views of one storage: the loaded model's
    buffers are adopted as they are, nothing moves."""
    twin = saved_and_loaded(converted("after steps", torch.float16))
    where = [p.data_ptr() for p in twin.parameters()]
    assert len({p.untyped_storage().data_ptr() for p in twin.parameters()}) == 2
    mpfp16.FP16Optimizer(torch.optim.SGD(twin.parameters(), lr=0.1))
    assert [p.data_ptr() for p in twin.parameters()] == where


def test_converting_twice_keeps_one_pair_of_cast_hooks():
    model = mpfp16.to_half(tiny_mlp(0))
    mpfp16.to_half(model, torch.bfloat16)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    x = torch.randn(2, 8)
    assert model(x).dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(model(x), nn.functional.linear(torch.relu(model[1](model[0](x.bfloat16()))),
                                                          model[3].weight, model[3].bias).float())
