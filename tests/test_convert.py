"""to_half: which layers become 16-bit, and the input/output casts."""

import copy

import pytest
import torch
import torch.nn as nn

import mpfp16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm1d(4), nn.BatchNorm2d(4), nn.BatchNorm3d(4)
        self.sync = nn.SyncBatchNorm(4)
        self.ln, self.gn = nn.LayerNorm(4), nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.fc = nn.Linear(4, 2)
        self.register_buffer("table", torch.ones(3))
        self.register_buffer("index", torch.arange(3))

    def forward(self, x):
        x = self.gn(self.bn2(self.conv(x)))
        return self.fc(self.ln(x.mean((2, 3))))


NORMS = ("bn1", "bn2", "bn3", "sync", "ln", "gn", "inorm")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_layers_stay_fp32(dtype):
    net = mpfp16.to_half(Net(), dtype)
    for name, t in list(net.named_parameters()) + list(net.named_buffers()):
        module = name.split(".")[0]
        if name.endswith("num_batches_tracked") or name == "index":
            assert t.dtype == torch.int64, name
        elif module in NORMS:
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == dtype, name
    assert net.bn2.running_mean.dtype == torch.float32
    assert mpfp16.model_dtype(net) == dtype


def test_parameters_stay_the_same_objects():
    net = Net()
    params = list(net.parameters())
    mpfp16.to_half(net)
    assert all(a is b for a, b in zip(params, net.parameters()))


def test_an_already_half_model_gets_fp32_norms_back():
    net = mpfp16.to_half(Net().half())
    assert net.bn2.weight.dtype == torch.float32 and net.conv.weight.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inputs_cast_in_and_logits_cast_out(dtype):
    net = mpfp16.to_half(Net(), dtype)
    out = net(torch.randn(2, 3, 5, 5))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert net.conv.weight.grad.dtype == dtype and net.bn2.weight.grad.dtype == torch.float32


def test_hooks_are_installed_once():
    net = mpfp16.to_half(mpfp16.to_half(Net()))
    assert len(net._forward_pre_hooks) == 1 and len(net._forward_hooks) == 1


def test_without_cast_io_the_output_stays_16_bit():
    net = mpfp16.to_half(nn.Linear(4, 2), cast_io=False)
    assert net(torch.randn(3, 4).half()).dtype == torch.float16


def test_cast_floating_leaves_integers_alone():
    x, y = torch.randn(2), torch.arange(2)
    out = mpfp16.cast_floating({"x": x, "pair": (x, y), "n": 3}, torch.float16)
    assert out["x"].dtype == torch.float16 and out["pair"][1].dtype == torch.int64 and out["n"] == 3


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        mpfp16.to_half(nn.Linear(2, 2), torch.float64)


def test_a_converted_model_goes_back_to_fp32():
    """``model.float()`` after to_half: the input cast follows the model's dtype, so the
    forward takes fp32 again (it raised "mat1 and mat2 must have the same dtype");
    ``mpfp16.to_float`` also removes the cast hooks and places the fp32 parameters."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    for back in ("float", "to_float"):
        model = mpfp16.to_half(copy.deepcopy(reference))
        twin = copy.deepcopy(reference)
        twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the rounded weights, in fp32
        if back == "float":
            model.float()
        else:
            mpfp16.to_float(model)
            assert not model._forward_pre_hooks and not model._forward_hooks
            # in flat buffers: the norm layer's, adopted as it was, and one for the weights now fp32
            assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 2
        assert all(p.dtype == torch.float32 for p in model.parameters())
        out = model(x)
        assert out.dtype == torch.float32 and torch.equal(out, twin(x))
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=None)
        opt.backward(out.sum())
        assert opt.step()


def test_to_float_refuses_parameters_that_ddp_holds():
    model = mpfp16.to_half(nn.Linear(8, 4))
    held = [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]  # as DDP's reducer keeps them
    with pytest.raises(RuntimeError, match="would have to move into a flat buffer after DistributedDataParallel"):
        mpfp16.to_float(model)
    del held


class MyRMSNorm(nn.Module):
    """A norm written as libraries write their own (transformers' LlamaRMSNorm): it
    computes in fp32 and returns ``weight * x`` in the weight's dtype."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj, self.head = MyRMSNorm(8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, target=None):
        out = self.head(self.proj(self.norm(x)))
        return out if target is None else (out, target)


@pytest.mark.parametrize("keep", [["proj"], [nn.Linear], "proj"])
def test_library_norms_and_the_users_modules_stay_fp32_and_hand_back_16_bits(keep):
    """A norm class named as libraries name theirs stays fp32 (it made the next Linear
    fail: an fp32 output into fp16 weights), and so do the modules ``keep_fp32`` names,
    by name or class; each computes in fp32 and hands the next layer fp16. The model
    pickles, and to_float removes every hook."""
    torch.manual_seed(0)
    model = mpfp16.to_half(Block(), keep_fp32=keep)
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept == ({"norm.weight", "proj.weight", "proj.bias"} | (
        {"head.weight", "head.bias"} if keep == [nn.Linear] else set()))
    seen = {}
    handle = model.proj.register_forward_hook(lambda m, a, out: seen.update(inp=a[0].dtype, out=out.dtype))
    with torch.no_grad():
        out = model(torch.randn(4, 8))
        copy.deepcopy(model)(torch.randn(2, 8))
    assert seen == {"inp": torch.float32, "out": torch.float16} and out.dtype == torch.float32
    handle.remove()
    mpfp16.to_float(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks for name, m in model.named_modules() if name)


def test_keep_fp32_refuses_a_name_no_module_has_and_a_bad_entry():
    with pytest.raises(ValueError, match="keep_fp32 names 'nope', which no module of the Block is called"):
        mpfp16.to_half(Block(), keep_fp32=["nope"])
    with pytest.raises(ValueError, match="keep_fp32 takes module classes and module names, not 3"):
        mpfp16.to_half(Block(), keep_fp32=[3])


def test_inputs_named_in_keep_inputs_keep_their_dtype():
    """A target passed by keyword stays fp32 (a regression target in the hundreds is
    rounded in fp16); the model's input is cast."""
    model = mpfp16.to_half(Block(), keep_inputs=["target"])
    target = torch.randn(4, 3) * 300
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append((a[0].dtype, kw["target"])), with_kwargs=True)
    model(torch.randn(4, 8), target=target)
    assert seen[0][0] == torch.float16 and seen[0][1].dtype == torch.float32 and torch.equal(seen[0][1], target)
