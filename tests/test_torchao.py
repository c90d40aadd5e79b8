"""torchao's low-bit optimizers (AdamW8bit, AdamW4bit, AdamWFp8) as FP16Optimizer's inner
optimizer over the fp32 masters: they train as over a plain fp32 model, their quantized
states are counted by memory_bytes_per_param(), their state_dict round-trips (also through
torch.load(weights_only=True)), a state of another kind of optimizer is refused, and the
fused step declines in one line. torchao is an optional extra (``mpfp16[torchao]``, in
``dev``): without it the file is skipped.

torchao quantizes a state only for a tensor of at least 4096 elements whose count its
block size divides (256 for 8-bit and fp8, 128 for 4-bit); any other gets plain fp32
states. Both layers here are 4096-element weights, so every weight's states are quantized
and the biases' are not. torchao's step is torch.compile'd per parameter shape (time the
fast tier's bound leaves aside).
"""

import io
import logging
import pickle

import pytest
import torch
from torch import nn

import mpfp16

ao = pytest.importorskip("torchao.optim", reason="torchao is not installed (pip install 'mpfp16[torchao]')")

from torchao.optim.subclass_4bit import OptimState4bit  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402
from torchao.optim.subclass_fp8 import OptimStateFp8  # noqa: E402

# the optimizer, its state class, the bytes of one code, the entries of its lookup table
KINDS = {
    "AdamW8bit": (ao.AdamW8bit, OptimState8bit, 1.0, 256),
    "AdamW4bit": (ao.AdamW4bit, OptimState4bit, 0.5, 16),
    "AdamWFp8": (ao.AdamWFp8, OptimStateFp8, 1.0, 0),
}
SCALE = 1024.0


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32))


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x.to(model[0].weight.dtype)).float(), y)


def _built(kind: str, seed: int = 0, **options):
    model = mpfp16.to_half(_model(seed))
    return model, mpfp16.FP16Optimizer(KINDS[kind][0](model.parameters(), lr=1e-3), loss_scale=SCALE, **options)


def _train(model, opt, data) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = _loss(model, x, y)
        opt.backward(loss)
        assert opt.step()  # a static scale: no step is skipped
        losses.append(loss.item())
    return losses


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` as plain values (a quantized state dequantized: torchao's states
    implement neither clone nor deepcopy)."""
    return t.dequantize() if hasattr(t, "dequantize") else t.clone()


def _state_tensors(opt):
    return [(p, name, v) for p, s in opt.optimizer.state.items() for name, v in s.items() if torch.is_tensor(v)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_low_bit_optimizer_trains_over_the_fp32_masters_as_over_an_fp32_model(kind):
    """The same torchao optimizer over a plain fp32 copy of the model is the reference:
    the masters' updates are its updates but for the fp16 forward and backward. Compared
    element by element up to the 99th percentile: where a second moment is quantized to
    zero, torchao's update is the first moment over eps, a jump of up to 0.4 in one
    element (the fp32 reference makes them too), and which elements jump follows the
    last bits of the gradients."""
    cls, state_cls, _, _ = KINDS[kind]
    model, opt = _built(kind)
    ref_model = _model(0)
    ref = cls(ref_model.parameters(), lr=1e-3)
    start = [p.detach().clone() for p in ref_model.parameters()]
    data = _batches(4) * 2
    losses = _train(model, opt, data)
    for x, y in data:
        ref.zero_grad()
        _loss(ref_model, x, y).backward()
        ref.step()
    assert losses[4] < losses[0]  # the same batches, four steps later
    assert opt.store.kind == "flat" and not opt.fused
    assert {type(v) for _, name, v in _state_tensors(opt) if name != "step" and v.numel() >= 4096} == {state_cls}
    moved = 1e-3 * len(data)  # how far Adam's steps of lr=1e-3 move an element
    for m, r, s in zip(opt.master_params(), ref_model.parameters(), start):
        assert m.dtype == torch.float32
        gap = ((m.detach() - s) - (r.detach() - s)).abs().flatten()
        assert gap.median() < 0.01 * moved and gap.quantile(0.99) < 0.1 * moved


@pytest.mark.parametrize("kind", list(KINDS))
def test_memory_bytes_per_param_counts_the_quantized_states(kind):
    """Per state of a quantized tensor: its codes, a fp32 scale per block of torchao's
    block_size and, for 8 and 4 bits, a fp32 lookup table; fp32 states elsewhere; a fp32
    step counter per parameter. Before storage_bytes read through tensor subclasses,
    memory_bytes_per_param() raised on them."""
    _, _, code_bytes, table = KINDS[kind]
    model, opt = _built(kind)
    _train(model, opt, _batches(1))
    block = opt.optimizer.block_size
    expected = 0.0
    for p in model.parameters():
        n = p.numel()
        quantized = n >= 4096 and n % block == 0
        per_state = n * code_bytes + 4 * n // block + 4 * table if quantized else 4 * n
        expected += 2 * per_state + 4
    numel = sum(p.numel() for p in model.parameters())
    report = opt.memory_bytes_per_param()
    assert report["optimizer_state"] == pytest.approx(expected / numel)
    assert report["master_weights"] == pytest.approx(4.0, abs=0.01)
    assert report["total"] == pytest.approx(sum(v for k, v in report.items() if k != "total"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_state_dict_round_trips_through_torch_load_weights_only(kind):
    """Saved with torch.save, read back with weights_only=True (torchao registers its
    state classes with torch.serialization.add_safe_globals when torchao.optim is
    imported), loaded into a fresh FP16Optimizer over the same kind of optimizer: the
    states come back quantized, and the two go on bit for bit."""
    state_cls = KINDS[kind][1]
    assert state_cls in torch.serialization.get_safe_globals()
    model, opt = _built(kind)
    data = _batches(4)
    _train(model, opt, data[:2])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh_model, fresh = _built(kind, seed=1)
    fresh.load_state_dict(saved)
    assert {type(v) for _, name, v in _state_tensors(fresh) if v.numel() >= 4096} == {state_cls}
    _train(model, opt, data[2:])
    _train(fresh_model, fresh, data[2:])
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)
    for m, n in zip(opt.master_params(), fresh.master_params()):
        assert torch.equal(m, n)
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = opt.state[m][name], fresh.state[n][name]
            assert type(a) is type(b)
            assert torch.equal(_plain(a), _plain(b))


def test_weights_only_reads_a_low_bit_state_only_while_torchao_allows_its_classes():
    """torch's weights_only unpickler builds torchao's state classes only because
    importing torchao.optim adds them to torch.serialization's safe globals: in a
    process that has not imported it (here: with the class taken off the list), the
    load is refused naming the class."""
    model, opt = _built("AdamW8bit")
    _train(model, opt, _batches(1))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    allowed = torch.serialization.get_safe_globals()
    try:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals([g for g in allowed if g is not OptimState8bit])
        buf.seek(0)
        with pytest.raises(pickle.UnpicklingError, match="GLOBAL torchao.optim.subclass_8bit.OptimState8bit"):
            torch.load(buf, weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(allowed)
    buf.seek(0)
    assert type(torch.load(buf, weights_only=True)["optimizer"]["state"]["0"]["exp_avg"]) is OptimState8bit


@pytest.mark.parametrize("saver,loader", [("AdamW8bit", "AdamW"), ("AdamW", "AdamW8bit")])
def test_a_low_bit_state_and_a_plain_adamw_one_are_refused_into_each_other(saver, loader):
    def build(name, seed):
        model = mpfp16.to_half(_model(seed))
        inner = KINDS[name][0] if name in KINDS else torch.optim.AdamW
        return model, mpfp16.FP16Optimizer(inner(model.parameters(), lr=1e-3), loss_scale=SCALE)

    model, opt = build(saver, 0)
    _train(model, opt, _batches(1))
    target_model, target = build(loader, 1)
    _train(target_model, target, _batches(1, seed=2))
    def values(state_dict):
        return ([_plain(e["master"]) for e in state_dict["params"].values()] +
                [_plain(v) for s in state_dict["optimizer"]["state"].values() for v in s.values()])

    before, weights = values(target.state_dict()), [p.detach().clone() for p in target_model.parameters()]
    with pytest.raises(ValueError) as info:
        target.load_state_dict(opt.state_dict())
    message = str(info.value)
    assert "\n" not in message and saver in message and loader in message
    assert message == (f"the state_dict holds the state of a {saver} optimizer and this FP16Optimizer wraps a "
                       f"{loader}: build it over the same kind of optimizer")
    for p, w in zip(target_model.parameters(), weights):
        assert torch.equal(p, w)
    after = values(target.state_dict())
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def _big(seed: int = 0) -> nn.Module:
    """1,049,600 parameters: over FUSED_MIN_NUMEL, where fused=None picks the fused step."""
    torch.manual_seed(seed)
    return mpfp16.to_half(nn.Sequential(nn.Linear(1024, 1024)))


def test_fused_none_over_a_big_model_declines_the_fused_step_in_one_info_line(caplog):
    model = _big()
    with caplog.at_level(logging.INFO, logger="mpfp16"):
        opt = mpfp16.FP16Optimizer(ao.AdamW8bit(model.parameters()), loss_scale=SCALE)
    assert not opt.fused
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "AdamW8bit over 1049600 parameters: mpfp16's fused step cannot take it (AdamW8bit is not SGD, "
                       "Adam or AdamW); AdamW8bit's own step runs")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mpfp16"):  # the same size, torch's AdamW: the fused step, unsaid
        plain = mpfp16.FP16Optimizer(torch.optim.AdamW(_big().parameters()), loss_scale=SCALE)
    assert plain.fused and caplog.records == []
    with caplog.at_level(logging.INFO, logger="mpfp16"):  # asked for no fused step: nothing to say
        mpfp16.FP16Optimizer(ao.AdamW8bit(_big().parameters()), loss_scale=SCALE, fused=False)
        mpfp16.FP16Optimizer(ao.AdamW8bit(mpfp16.to_half(_model()).parameters()), loss_scale=SCALE)  # small
    assert caplog.records == []


def test_fused_true_and_state_dtype_are_refused_in_one_line_naming_the_optimizer():
    model = mpfp16.to_half(_model())
    with pytest.raises(ValueError) as info:
        mpfp16.FP16Optimizer(ao.AdamW4bit(model.parameters()), fused=True)
    assert str(info.value) == "fused=True is not possible: AdamW4bit is not SGD, Adam or AdamW"
    for options in ({"state_dtype": torch.bfloat16}, {"state_dtypes": {"exp_avg": torch.bfloat16}}):
        with pytest.raises(ValueError) as info:
            mpfp16.FP16Optimizer(ao.AdamWFp8(model.parameters()), **options)
        message = str(info.value)
        assert "\n" not in message and "AdamWFp8 keeps states of its own" in message


def test_mpfp16s_checkpoint_file_holds_a_low_bit_state_with_its_checksums(tmp_path):
    """mpfp16.checkpoint's file format sums each quantized state by the tensors it
    wraps (its codes, scales and lookup table): written, verified and read back, the
    state is the same; a flipped code is caught and named."""
    from mpfp16 import checkpoint
    from mpfp16.checkpoint import file
    from mpfp16.errors import CheckpointError

    model, opt = _built("AdamW8bit")
    _train(model, opt, _batches(1))
    path = str(tmp_path / "last.pt")
    checkpoint.FILE.save(path, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    state = checkpoint.read(path, model)
    fresh_model, fresh = _built("AdamW8bit", seed=1)
    fresh.load_state_dict(state["optimizer"])
    for m, n in zip(opt.master_params(), fresh.master_params()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert type(fresh.state[n][name]) is type(opt.state[m][name])
            assert torch.equal(_plain(opt.state[m][name]), _plain(fresh.state[n][name]))
    raw = torch.load(path, weights_only=True)
    big = next(i for i, s in raw["optimizer"]["optimizer"]["state"].items()
               if isinstance(s.get("exp_avg"), OptimState8bit))
    raw["optimizer"]["optimizer"]["state"][big]["exp_avg"].codes.view(-1)[0] ^= 1
    torch.save(raw, path)
    with pytest.raises(CheckpointError, match=r"exp_avg\.codes"):
        file.load(path)
