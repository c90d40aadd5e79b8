"""mpfp16/train/gpt.py: the named sizes' parameter counts, the tied output projection
through to_half and FP16Optimizer, and a tiny GPT trained in fp16 against a plain
fp32 torch run from the same weights."""

import copy
import math

import pytest
import torch
import torch.nn as nn

import mpfp16
from mpfp16.train.gpt import GPT, GPT_SIZES, build_gpt, next_token_loss

TINY = dict(vocab_size=64, seq_len=16, width=32, layers=2, heads=4)


def parameter_count_by_hand(vocab_size: int, seq_len: int, width: int, layers: int, heads: int) -> tuple[int, int]:
    """(parameters, tensors) from the configuration: token and position embeddings;
    per block two LayerNorms (weight and bias), the q/k/v projection (w x 3w and 3w),
    the attention output (w x w and w), the MLP (w x 4w and 4w, 4w x w and w); the
    final LayerNorm. The output projection is the token embedding: nothing more.
    Heads split the width and add nothing."""
    w = width
    block = 2 * (2 * w) + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w)
    return vocab_size * w + seq_len * w + layers * block + 2 * w, 2 + 12 * layers + 2


@pytest.mark.parametrize("name", list(GPT_SIZES))
def test_named_sizes_have_the_parameters_counted_by_hand(name):
    with torch.device("meta"):
        model = build_gpt(name)
    params = list(model.parameters())
    assert (sum(p.numel() for p in params), len(params)) == parameter_count_by_hand(**GPT_SIZES[name])


def test_gpt2_small_is_124m_parameters_in_148_tensors():
    assert parameter_count_by_hand(**GPT_SIZES["gpt2"]) == (124_439_808, 148)
    with torch.device("meta"):
        model = build_gpt("gpt2", layers=2)
    assert model.wte.weight.shape == (50257, 768) and len(model.blocks) == 2


def half_tiny_gpt(seed: int = 0) -> tuple[GPT, GPT]:
    """(an fp16 tiny GPT, an fp32 copy holding the same values)."""
    torch.manual_seed(seed)
    half = GPT(**TINY)
    ref = copy.deepcopy(half)
    mpfp16.to_half(half)
    with torch.no_grad():
        for r, h in zip(ref.parameters(), half.parameters()):
            r.copy_(h.float())  # the fp16 rounding of the initial weights, for both
    return half, ref


def test_output_projection_stays_tied_through_to_half_and_the_optimizer():
    half, _ = half_tiny_gpt()
    assert half.lm_head.weight is half.wte.weight
    params = list(half.parameters())
    assert len(params) == parameter_count_by_hand(**TINY)[1]
    for module in half.modules():
        for name, p in module.named_parameters(recurse=False):
            assert p.dtype == (torch.float32 if isinstance(module, nn.LayerNorm) else torch.float16), (module, name)
    assert sum(isinstance(m, nn.LayerNorm) for m in half.modules()) == 2 * TINY["layers"] + 1

    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(half.parameters(), lr=1e-2))
    assert len(opt.master_params()) == len(params)  # one master for the shared weight
    tokens = torch.randint(0, 64, (2, 16))
    opt.backward(nn.functional.cross_entropy(half(tokens).flatten(0, 1), tokens.flatten()))
    before = half.wte.weight.detach().clone()
    assert opt.step()
    assert half.lm_head.weight is half.wte.weight and not torch.equal(half.wte.weight, before)


def test_flatten_keeps_the_fp32_model_tied():
    torch.manual_seed(0)
    model = mpfp16.flatten_parameters(GPT(**TINY))
    assert model.lm_head.weight is model.wte.weight
    assert len(list(model.parameters())) == parameter_count_by_hand(**TINY)[1]
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()


def arithmetic_sequences(generator: torch.Generator, batch: int = 8) -> torch.Tensor:
    """Token sequences start, start + d, start + 2d, ... mod 64, d in 1..3: learnable
    from the first two tokens."""
    start = torch.randint(0, 64, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    return (start + stride * torch.arange(TINY["seq_len"] + 1)) % 64


def test_tiny_gpt_trains_in_fp16_close_to_fp32():
    """20 AdamW steps. Over seeds 0-5, the fp16 losses stay within 0.3% of the fp32
    run's; an fp32 run with a 10% larger lr is 2.4-3.6% away, so 1% tells them apart."""
    half, ref = half_tiny_gpt()
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(half.parameters(), lr=1e-2, weight_decay=0.01), fused=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    losses, ref_losses = [], []
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = arithmetic_sequences(generator)
        opt.zero_grad()
        loss = next_token_loss(half, tokens)
        opt.backward(loss)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = next_token_loss(ref, tokens)
        ref_loss.backward()
        ref_opt.step()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    assert opt.skipped_steps == 0 and opt.loss_scale == 2.0**16
    assert losses[0] == pytest.approx(math.log(64), rel=0.02)  # logits start near zero
    assert losses[-1] < 0.6 * losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)


def test_tied_weight_gradient_sums_the_embedding_and_the_output_projection():
    half, ref = half_tiny_gpt()
    untied = copy.deepcopy(ref)
    untied.lm_head.weight = nn.Parameter(ref.wte.weight.detach().clone())
    tokens = arithmetic_sequences(torch.Generator().manual_seed(0))
    next_token_loss(ref, tokens).backward()
    next_token_loss(untied, tokens).backward()
    from_embedding, from_output = untied.wte.weight.grad, untied.lm_head.weight.grad
    expected = ref.wte.weight.grad
    torch.testing.assert_close(expected, from_embedding + from_output)
    # Both parts matter: leaving out either is far outside the tolerance below.
    assert min(from_embedding.norm(), from_output.norm()) > 0.25 * expected.norm()

    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(half.parameters(), lr=1e-2), fused=False)
    opt.backward(next_token_loss(half, tokens))
    opt.unscale_()
    index = next(i for i, p in enumerate(opt.model_params()) if p is half.wte.weight)
    grad = opt.master_params()[index].grad
    assert grad.dtype == torch.float32
    assert (grad - expected).norm() < 0.01 * expected.norm()


def test_a_sequence_longer_than_the_positions_is_refused():
    model = GPT(**TINY)
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 64)
    with pytest.raises(ValueError, match="sequence of 17 tokens is longer than the model's 16 positions"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown GPT size 'gpt3'"):
        build_gpt("gpt3")
