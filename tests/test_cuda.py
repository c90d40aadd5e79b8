"""CUDA checks (pytest -m cuda): skipped on CPU, run by `python -m mpfp16.bench.gpu`."""

import os

import pytest
import torch
import torch.nn as nn

import mpfp16
from reference import ReferenceTrainer, batches, make_inner, step_both, tiny_mlp

pytestmark = pytest.mark.cuda
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = torch.device("cuda")


def cuda_pair(dtype=torch.float16):
    return (mpfp16.to_half(tiny_mlp(0).to(DEV), dtype), mpfp16.to_half(tiny_mlp(0).to(DEV), dtype))


def cuda_batches(n):
    return [(x.to(DEV), y.to(DEV)) for x, y in batches(n)]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "nesterov"])
def test_sgd_on_cuda_matches_torch(kind, fused):
    model, ref_model = cuda_pair()
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=512.0, fused=fused)
    ref = ReferenceTrainer(ref_model, kind, scale=512.0)
    for x, y in cuda_batches(4):
        assert step_both(model, opt, ref_model, ref, x, y)
    assert opt.fused == fused
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_on_cuda_follows_torch(fused):
    model, ref_model = cuda_pair()
    opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), loss_scale=512.0, fused=fused)
    ref = ReferenceTrainer(ref_model, "adamw", scale=512.0)
    for x, y in cuda_batches(4):
        step_both(model, opt, ref_model, ref, x, y)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_master_free_rounding_on_cuda(rounding):
    w = nn.Parameter(torch.ones(64, dtype=torch.float16, device=DEV))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD([w], lr=1.0), loss_scale=None, master_weights=False,
                               rounding=rounding, fused=True)
    for _ in range(1000):
        opt.zero_grad()
        opt.backward((w.float() * -1e-4).sum())
        opt.step()
    assert abs(w.float().mean().item() - 1.1) < (0.01 if rounding == "stochastic" else 0.002)


def test_overflow_skips_on_cuda():
    model, _ = cuda_pair()
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = cuda_batches(1)[0]
    opt.backward(nn.functional.cross_entropy(model(x), y))
    model[0].weight.grad[0, 0] = float("inf")
    assert opt.step() is False and opt.loss_scale == 2.0**15


def test_train_cifar_under_torchrun_with_nccl(tmp_path):
    from dist_helpers import torchrun

    proc = torchrun(["train_cifar.py", "--synthetic-size", "256,64", "-a", "resnet9-w8", "-b", "32",
                     "--epochs", "1", "--channels-last", "--no-progress", "--checkpoint-dir", str(tmp_path),
                     "--allreduce-strategy", "fp32_accumulate"], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend nccl" in proc.stdout
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ckpt["step"] == 8
