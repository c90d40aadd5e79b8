"""wrap() and shard() record one handle per model (mpfp16.parallel.handles) and set
nothing on the user's module; the option rules are pure and word options the caller's
way."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mpfp16
import mpfp16.distributed as mdist
from dist_workers import mlp
from mpfp16.parallel import ddp, fsdp
from mpfp16.parallel.handles import Handle, handle_of, register


def mpfp16_attributes(model: nn.Module) -> list[str]:
    return [f"{name}.{attr}" for name, module in model.named_modules() for attr in vars(module)
            if attr.startswith("_mpfp16")]


def test_wrap_records_a_handle_and_sets_nothing_on_the_model(one_process_group):
    model = mpfp16.to_half(mlp())
    before = mpfp16_attributes(model)  # to_half's own, if any
    wrapped = mdist.wrap(model, strategy="fp32_accumulate")
    handle = handle_of(wrapped)
    assert handle.kind == "ddp" and handle.group is None
    assert mdist.comm_stats(wrapped) is handle.stats is handle.hook_state.stats
    assert handle_of(model) is None and mdist.comm_stats(model) is None  # the DDP module is the one wrapped
    assert not [attr for attr in vars(wrapped) if attr.startswith("_mpfp16")]
    assert mpfp16_attributes(model) == before
    del wrapped


def test_shard_records_a_handle_and_sets_nothing_on_the_model(one_process_group):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                          nn.Linear(8, 2))
    sharded = mdist.shard(model, torch.bfloat16)
    handle = handle_of(sharded)
    assert handle.kind == "sharded" and handle.param_dtype == torch.bfloat16
    assert dist.get_process_group_ranks(handle.group) == [0]
    assert fsdp.is_sharded_model(sharded) and mdist.comm_stats(sharded) is handle.stats
    assert mpfp16_attributes(sharded) == []
    with mdist.sync_gradients(sharded, False):
        assert handle.sync is False
        sharded(torch.randn(3, 4)).sum().backward()
    assert handle.sync is True
    assert mdist.comm_stats(sharded).pop_step()["reduce_scatter_calls"] == 0  # accumulated, nothing sent


def test_a_handle_lives_as_long_as_its_model():
    model = nn.Linear(2, 2)
    register(model, Handle("ddp", stats=None, group=None))
    assert handle_of(model) is not None
    assert handle_of(nn.Linear(2, 2)) is None and handle_of(3) is None
    with pytest.raises(ValueError, match="kind is one of ddp, sharded"):
        Handle("fsdp", stats=None, group=None)


def flag_words(name, value):
    """How a front end might word the library's options: as its flags."""
    return f"--{name.replace('_', '-')} {value}"


@pytest.mark.parametrize("kw,library,flags", [
    ({"strategy": "fp16_compress", "grads_16bit": True}, "strategy='fp16_compress' is torch's compression hook",
     "--strategy fp16_compress is torch's compression hook"),
    ({"powersgd_rank": 3}, "powersgd_rank=3 applies to strategy='powersgd' only, not strategy='allreduce'",
     "--powersgd-rank 3 applies to --strategy powersgd only, not --strategy allreduce"),
    ({"bucket_mb": 0}, "bucket_mb=0 must be positive", "--bucket-mb 0 must be positive"),
])
def test_the_ddp_rules_word_options_the_callers_way(kw, library, flags):
    options = dict(strategy="allreduce", allreduce_dtype=None, predivide_factor=1.0, bucket_mb=25.0,
                   powersgd_rank=1, powersgd_start_iter=2, grads_16bit=False)
    ddp.check_options(**options)  # wrap()'s defaults pass
    options.update(kw)
    with pytest.raises(ValueError, match=library.replace("(", r"\(")):
        ddp.check_options(**options)
    with pytest.raises(ValueError, match=flags):
        ddp.check_options(**options, say=flag_words)


def test_the_shard_rules_word_options_the_callers_way():
    fsdp.check_options(torch.float16, None)
    with pytest.raises(ValueError, match=r"param_dtype=torch.float32 is not possible for a sharded model: it computes in float16 or bfloat16"):
        fsdp.check_options(torch.float32, None)
    with pytest.raises(ValueError, match=r"--reduce-dtype torch.int8 must be None"):
        fsdp.check_options(torch.bfloat16, torch.int8, say=flag_words)
