"""The replica checker's checksum: exact, and sensitive to every single element."""

import pytest
import torch
import torch.nn as nn

import mpfp16
from mpfp16.parallel.replicas import tensor_checksum


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("numel", [1, 3, 257, 1031])  # odd byte counts leave bytes outside the int64 words
def test_a_one_ulp_change_of_any_single_element_changes_the_checksum(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=g) * 100).to(dtype)
    reference = tensor_checksum(t)
    assert torch.equal(tensor_checksum(t.clone()), reference)
    for i in range(numel):
        changed = t.clone()
        if dtype.is_floating_point:
            changed[i] = torch.nextafter(changed[i], torch.tensor(float("inf"), dtype=dtype))
        else:
            changed[i] += 1
        assert not torch.equal(tensor_checksum(changed), reference), i


def test_a_change_in_the_bytes_past_the_last_whole_word_is_caught():
    """The bytes after the last whole 8-byte word count as one zero-padded word: added
    as separate bytes, fp16 [1.0009765625, 0, 0] (bits 0x3C01) and [1.25, 0, 0] (0x3D00)
    gave one checksum."""
    a = torch.tensor([1.0009765625, 0.0, 0.0], dtype=torch.float16)
    b = torch.tensor([1.25, 0.0, 0.0], dtype=torch.float16)
    assert not torch.equal(tensor_checksum(a), tensor_checksum(b))


def test_values_swapped_between_rows_are_caught():
    t = torch.arange(4096, dtype=torch.float32)
    swapped = t.clone()
    swapped[[4, 3000]] = swapped[[3000, 4]]  # both low halves of their int64 words
    assert tensor_checksum(t)[0] == tensor_checksum(swapped)[0]  # the plain sum cannot see it
    assert not torch.equal(tensor_checksum(t), tensor_checksum(swapped))


def test_checksum_reads_bytes_in_memory_order():
    """A channels_last tensor and a sliced (non-dense) one give stable sums; -0.0 and
    0.0 differ (replicas must be bit-identical, not merely equal)."""
    x = torch.randn(2, 3, 4, 5).half()
    cl = x.contiguous(memory_format=torch.channels_last)
    assert torch.equal(tensor_checksum(cl), tensor_checksum(cl.clone(memory_format=torch.channels_last)))
    sliced = torch.randn(6, 6)[:, ::2]
    assert torch.equal(tensor_checksum(sliced), tensor_checksum(sliced.contiguous()))
    assert not torch.equal(tensor_checksum(torch.tensor([0.0])), tensor_checksum(torch.tensor([-0.0])))


def test_without_a_process_group_there_is_nothing_to_compare():
    model = mpfp16.to_half(nn.Linear(4, 2))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert mpfp16.distributed.check_replicas(model, opt) == 0
