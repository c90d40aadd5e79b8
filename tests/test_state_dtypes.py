"""Optimizer states in 16 bits (FP16Optimizer(state_dtype=...), mpfp16/stores/state_dtypes.py)
against the reference: plain fp32 torch with its states rounded once to bf16 after each
step, bit for bit where the step is torch's own arithmetic; the mean over seeds for
stochastic rounding."""

import logging

import pytest
import torch
import torch.optim.optimizer as torch_optimizer

import mpfp16
import mpfp16.stores.state_dtypes as SD
from reference import ReferenceTrainer, batches, make_inner, tiny_mlp, train_mpfp16

BF16 = torch.bfloat16
STATES = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq")}


class RoundedStates(ReferenceTrainer):
    """The fp32 reference, its states rounded to ``dtypes`` after each step (held in
    fp32 tensors: the next step widens them exactly, as the 16-bit step does)."""

    def __init__(self, *args, dtypes: dict, **kw):
        super().__init__(*args, **kw)
        self.dtypes = dtypes

    @torch.no_grad()
    def step(self):
        super().step()
        for state in self.opt.state.values():
            for name, dtype in self.dtypes.items():
                if name in state:
                    state[name].copy_(state[name].to(dtype).float())


def _pair(kind, master_weights=True, seed=0, **options):
    model, ref_model = mpfp16.to_half(tiny_mlp(seed)), mpfp16.to_half(tiny_mlp(seed))
    opt = mpfp16.FP16Optimizer(make_inner(kind, model.parameters()), loss_scale=1024.0, master_weights=master_weights,
                               **options)
    return model, opt, ref_model


def _train_both(kind, master_weights, fused, dtypes, steps=4):
    model, opt, ref_model = _pair(kind, master_weights, fused=fused, state_dtypes=dtypes)
    ref = RoundedStates(ref_model, kind, scale=1024.0, master_weights=master_weights, dtypes=dtypes)
    for x, y in batches(steps):
        opt.zero_grad()
        opt.backward(torch.nn.functional.cross_entropy(model(x), y))
        ref.backward(torch.nn.functional.cross_entropy(ref_model(x), y))
        assert opt.step()
        ref.step()
    return model, opt, ref_model, ref


@pytest.mark.parametrize("master_weights", [True, False], ids=["masters", "no-masters"])
@pytest.mark.parametrize("kind,fused", [("sgd", False), ("sgd", True), ("adam", False), ("adamw", False)])
def test_nearest_is_the_fp32_update_rounded_once_bit_for_bit(kind, fused, master_weights):
    dtypes = {name: BF16 for name in STATES[kind]}
    model, opt, ref_model, ref = _train_both(kind, master_weights, fused, dtypes)
    assert opt.fused == fused
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    for m, r in zip(opt.master_params(), ref.masters):
        for state_name in STATES[kind]:
            mine, theirs = opt.state[m][state_name], ref.opt.state[r][state_name]
            assert mine.dtype == BF16  # every state, the fp32 (normalization) parameters' too
            assert torch.equal(mine.float(), theirs), state_name


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_one_fused_adam_step_is_the_reference_but_the_updates_last_bits(kind):
    """What docs/MEMORY.md claims for the fused Adam/AdamW step with bf16 states: from the
    same masters, weights and states, one step gives the reference's bf16 moments bit for
    bit, and masters that differ in a few elements by at most 2 fp32 epsilons of the
    larger of the master and its update (the fused kernel's square root is correctly
    rounded where torch's CPU one is not: tests/test_fused.py). Each step starts again
    from the fused step's values, so that no difference carries over."""
    dtypes = {"exp_avg": BF16, "exp_avg_sq": BF16}
    model, opt, ref_model = _pair(kind, fused=True, state_dtypes=dtypes)
    ref = RoundedStates(ref_model, kind, scale=1024.0, master_weights=True, dtypes=dtypes)
    assert opt.fused
    eps = torch.finfo(torch.float32).eps
    differing = total = 0
    for x, y in batches(4):
        before = [r.clone() for r in ref.masters]
        opt.zero_grad()
        opt.backward(torch.nn.functional.cross_entropy(model(x), y))
        ref.backward(torch.nn.functional.cross_entropy(ref_model(x), y))
        assert opt.step()
        ref.step()
        with torch.no_grad():
            for m, r, start in zip(opt.master_params(), ref.masters, before):
                assert ((m - r).abs() <= 2 * eps * torch.maximum(r.abs(), (r - start).abs())).all()
                differing, total = differing + int((m != r).sum()), total + m.numel()
                for name in dtypes:
                    assert opt.state[m][name].dtype == BF16
                    assert torch.equal(opt.state[m][name].float(), ref.opt.state[r][name]), name
                r.copy_(m)  # the next step from the same values
            for p, q in zip(model.parameters(), ref_model.parameters()):
                q.copy_(p)
    # a few last bits at most; how many depends on the CPU and the thread count (none on
    # AVX-512 at 2 threads, where torch's square root rounds as the kernel's does)
    assert differing < total / 20


@pytest.mark.parametrize("fused", [False, True])
def test_the_states_hold_half_the_bytes_between_steps(fused):
    def state_bytes(**options):
        model, opt, _ = _pair("adamw", fused=fused, **options)
        train_mpfp16(model, opt, batches(2))
        return opt.memory_bytes_per_param()["optimizer_state"]

    fp32, bf16 = state_bytes(), state_bytes(state_dtype=BF16)
    assert fp32 > 7.9 and bf16 == pytest.approx(fp32 / 2, abs=0.1)  # 8 -> 4 (and Adam's step counters)
    one = state_bytes(state_dtypes={"exp_avg": BF16})
    assert one == pytest.approx(fp32 * 3 / 4, abs=0.1)


def test_one_state_by_name_over_every_other():
    model, opt, _ = _pair("adamw", state_dtype=BF16, state_dtypes={"exp_avg_sq": torch.float32})
    train_mpfp16(model, opt, batches(1))
    entry = opt.state[opt.master_params()[0]]
    assert entry["exp_avg"].dtype == BF16 and entry["exp_avg_sq"].dtype == torch.float32
    assert opt.state_dtypes == {"exp_avg": BF16, "max_exp_avg_sq": BF16}


def test_the_unfused_step_widens_a_bounded_chunk_at_a_time_with_the_same_bits(monkeypatch):
    whole_model, whole_opt, _ = _pair("adamw", state_dtype=BF16)
    train_mpfp16(whole_model, whole_opt, batches(3))
    widened = []
    original = SD.StateKeeper._widen

    def spy(self, params):
        widened.append(sum(p.numel() for p in params))
        return original(self, params)

    monkeypatch.setattr(SD, "CHUNK_NUMEL", 200)
    monkeypatch.setattr(SD.StateKeeper, "_widen", spy)
    model, opt, _ = _pair("adamw", state_dtype=BF16)
    train_mpfp16(model, opt, batches(3))
    assert len(widened) >= 3 * 2 and max(widened) <= 200 + 128  # several chunks a step; one at most a tensor over
    for p, q in zip(whole_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_a_chunked_step_runs_the_inner_optimizers_step_hooks_once_with_every_gradient(monkeypatch):
    """The unfused step calls the inner optimizer once per chunk; its step hooks (the
    optimizer's own and torch's global ones) still run once per step, the pre-hooks
    before any chunk is stepped and the post-hooks after the last, each seeing every
    gradient, as one unchunked call shows them. The states come out as without hooks."""
    monkeypatch.setattr(SD, "CHUNK_NUMEL", 200)
    plain_model, plain_opt, _ = _pair("adamw", state_dtype=BF16, fused=False)
    train_mpfp16(plain_model, plain_opt, batches(2))
    model, opt, _ = _pair("adamw", state_dtype=BF16, fused=False)
    inner, seen = opt.optimizer, []
    masters = [p for group in inner.param_groups for p in group["params"]]

    def spy(kind):
        def hook(optimizer, args, kwargs):
            if optimizer is inner:
                steps = [int(optimizer.state[p]["step"]) if p in optimizer.state else 0 for p in masters]
                seen.append((kind, sum(p.grad is not None for p in masters), min(steps), max(steps)))
        return hook

    handles = [inner.register_step_pre_hook(spy("pre")), inner.register_step_post_hook(spy("post")),
               torch_optimizer.register_optimizer_step_pre_hook(spy("global pre")),
               torch_optimizer.register_optimizer_step_post_hook(spy("global post"))]
    try:
        train_mpfp16(model, opt, batches(2))
    finally:
        for handle in handles:
            handle.remove()
    n = len(masters)
    assert seen == [("global pre", n, 0, 0), ("pre", n, 0, 0), ("post", n, 1, 1), ("global post", n, 1, 1),
                    ("global pre", n, 1, 1), ("pre", n, 1, 1), ("post", n, 2, 2), ("global post", n, 2, 2)]
    assert not torch_optimizer._global_optimizer_pre_hooks and not inner._optimizer_step_post_hooks
    for p, q in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_stochastic_rounding_is_unbiased_over_seeds():
    """SGD's momentum with lr 0 (the weights, and so the gradients, stay put): the fp32
    momentum is a fixed sequence, and the bf16 one rounded stochastically averages to it
    over seeds, where rounding to nearest keeps a bias."""
    x, y = batches(1)[0]

    def momentum(seed, **options):
        model = mpfp16.to_half(tiny_mlp(0))
        opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9), loss_scale=None,
                                   rounding_seed=seed, **options)
        for _ in range(6):
            opt.zero_grad()
            opt.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
        return opt.state[opt.master_params()[0]]["momentum_buffer"].float()

    exact = momentum(0)
    nearest = momentum(0, state_dtype=BF16)
    mean = torch.stack([momentum(s, state_dtype=BF16, state_rounding="stochastic") for s in range(48)]).mean(0)
    ulp = (exact.abs() * 2.0**-8).clamp_min(1e-30)
    assert ((mean - exact).abs() / ulp).mean() < 0.25 * ((nearest - exact).abs() / ulp).mean() + 0.05
    assert ((mean - exact).abs() / ulp).mean() < 0.2  # within a fifth of a bf16 ulp on average


@pytest.mark.parametrize("options,words", [
    (dict(state_dtype=torch.float16), r"^state_dtype=torch.float16: fp16 cannot hold optimizer states: its 5-bit "
                                      r"exponent underflows the second moment"),
    (dict(state_dtypes={"exp_avg_sq": torch.float16}), r"^state_dtypes=\{'exp_avg_sq': torch.float16\}: fp16"),
    (dict(state_dtype=torch.int8), r"a state is kept in torch.float32 or torch.bfloat16"),
    (dict(state_dtypes={"momentum": BF16}), r"^state_dtypes=\{'momentum': torch.bfloat16\}: AdamW keeps exp_avg, "
                                            r"exp_avg_sq, max_exp_avg_sq$"),
    (dict(state_rounding="stochastic"), r"^state_rounding='stochastic' rounds 16-bit states, and every state is fp32: "
                                        r"pass state_dtype=torch.bfloat16 too"),
    (dict(state_dtype=BF16, state_rounding="up"), r"^state_rounding='up' must be one of 'nearest', 'stochastic'"),
])
def test_state_dtype_refusals_are_one_line(options, words):
    model = mpfp16.to_half(tiny_mlp(0))
    with pytest.raises(ValueError, match=words):
        mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), **options)


def test_an_optimizer_with_states_of_its_own_is_refused():
    model = mpfp16.to_half(tiny_mlp(0))
    with pytest.raises(ValueError, match=r"^state_dtype applies to SGD, Adam and AdamW, whose states are mpfp16's to "
                                         r"keep; RMSprop keeps states of its own"):
        mpfp16.FP16Optimizer(torch.optim.RMSprop(model.parameters()), state_dtype=BF16)


@pytest.mark.parametrize("saved,here", [(BF16, None), (None, BF16)], ids=["bf16-into-fp32", "fp32-into-bf16"])
def test_a_state_of_other_state_dtypes_loads_converted_with_one_info_line(saved, here, caplog):
    model, opt, _ = _pair("adamw", state_dtype=saved)
    train_mpfp16(model, opt, batches(2))
    state = opt.state_dict()
    assert state["state_dtypes"] == ({"exp_avg": "bfloat16", "exp_avg_sq": "bfloat16", "max_exp_avg_sq": "bfloat16"}
                                     if saved else {})
    other, other_opt, _ = _pair("adamw", seed=3, state_dtype=here)
    other.load_state_dict(model.state_dict())
    with caplog.at_level(logging.INFO, logger="mpfp16"):
        other_opt.load_state_dict(state)
    lines = [r.getMessage() for r in caplog.records if "optimizer states were saved as" in r.getMessage()]
    assert len(lines) == 1
    for m, n in zip(opt.master_params(), other_opt.master_params()):  # as saved, in this optimizer's dtype
        assert other_opt.state[n]["exp_avg"].dtype == (here or torch.float32)
        assert torch.equal(other_opt.state[n]["exp_avg"], opt.state[m]["exp_avg"].to(here or torch.float32))
    assert all(train_mpfp16(other, other_opt, batches(1, seed=5)))


@pytest.mark.parametrize("argv,words", [
    (["--state-rounding", "stochastic"], "--state-rounding stochastic rounds 16-bit states, and every state is fp32: "
                                         "pass --state-dtype bf16 too"),
    (["--state-dtype", "bf16", "--shard"], "--state-dtype bf16 is not possible for a sharded model"),
])
def test_the_scripts_flags_refuse_as_the_library_does(argv, words):
    from mpfp16.train.cli import build_parser
    from mpfp16.train.config import ConfigError, TrainConfig

    args = build_parser("cifar").parse_args(argv)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        TrainConfig(task="cifar", **vars(args)).validate()
    assert TrainConfig(task="cifar", state_dtype="bf16", state_rounding="stochastic").validate().state_dtype == "bf16"


def _resumed_run(fused: bool, split: int | None, steps: int = 5):
    """AdamW over bf16 states rounded stochastically, saved and loaded into a new
    model and optimizer before step ``split`` (None: not interrupted)."""
    def build(seed):
        model = mpfp16.to_half(tiny_mlp(seed))
        return model, mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), loss_scale=1024.0, fused=fused,
                                           state_dtype=BF16, state_rounding="stochastic")
    model, opt = build(0)
    for i, (x, y) in enumerate(batches(steps)):
        if i == split:
            saved = {"model": model.state_dict(), "opt": opt.state_dict()}
            model, opt = build(1)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        opt.zero_grad()
        opt.backward(torch.nn.functional.cross_entropy(model(x), y))
        assert opt.step()
    return model, opt


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_stochastic_state_rounding_is_seeded_and_resumes_bit_for_bit(fused):
    """The states' rounding noise comes from the generator the weights' stochastic
    rounding uses, saved in the state_dict: a run saved and loaded mid-way draws the
    same noise as one not interrupted."""
    whole, whole_opt = _resumed_run(fused, None)
    resumed, resumed_opt = _resumed_run(fused, 2)
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    for m, r in zip(whole_opt.master_params(), resumed_opt.master_params()):
        for name in STATES["adamw"]:
            assert whole_opt.state[m][name].dtype == BF16
            assert torch.equal(whole_opt.state[m][name], resumed_opt.state[r][name]), name


def test_remainder_with_bf16_states_holds_two_bytes_of_each():
    """master_weights='remainder' over bf16 weights, AdamW's moments in bf16: the
    weight, its remainder and each moment 2 bytes per parameter (issue 39)."""
    model = mpfp16.to_half(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)), torch.bfloat16)
    opt = mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), master_weights="remainder",
                               state_dtype=BF16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    opt.zero_grad()
    opt.backward(model(x).float().square().mean())
    assert opt.step()
    held = opt.memory_bytes_per_param()
    # storages round up to whole allocations; `step` is one scalar per tensor
    assert (held["model_weights"], held["master_remainder"], held["optimizer_state"]) == pytest.approx(
        (2.0, 2.0, 4.0), abs=0.05)
    assert held["master_weights"] == 0.0


@pytest.mark.parametrize("fused", [False, True])
def test_a_loaded_state_is_held_in_bf16_from_the_load_on(fused):
    """load_state_dict() (torch's load makes every state fp32) keeps the 16-bit states in
    16 bits at once, on either step: a state_dict taken before the next step holds the
    dtypes it records, and the bytes between steps are those of bf16 states."""
    model, opt, _ = _pair("adamw", fused=fused, state_dtype=BF16)
    train_mpfp16(model, opt, batches(2))
    other, other_opt, _ = _pair("adamw", seed=3, fused=fused, state_dtype=BF16)
    other.load_state_dict(model.state_dict())
    other_opt.load_state_dict(opt.state_dict())
    saved = other_opt.state_dict()
    assert saved["state_dtypes"] == {"exp_avg": "bfloat16", "exp_avg_sq": "bfloat16", "max_exp_avg_sq": "bfloat16"}
    for entry in saved["optimizer"]["state"].values():
        assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == BF16
    assert other_opt.memory_bytes_per_param()["optimizer_state"] == opt.memory_bytes_per_param()["optimizer_state"]


def test_max_exp_avg_sq_is_named_only_where_a_group_keeps_it():
    model = mpfp16.to_half(tiny_mlp(0))
    with pytest.raises(ValueError, match=r"^state_dtypes=\{'max_exp_avg_sq': torch.bfloat16\}: AdamW keeps "
                                         r"max_exp_avg_sq only with amsgrad=True, and no param group has it$"):
        mpfp16.FP16Optimizer(make_inner("adamw", model.parameters()), state_dtypes={"max_exp_avg_sq": BF16})
    opt = mpfp16.FP16Optimizer(torch.optim.AdamW(model.parameters(), amsgrad=True),
                               state_dtypes={"max_exp_avg_sq": BF16})
    assert opt.state_dtypes == {"max_exp_avg_sq": BF16}


def test_a_sharded_models_refusal_names_the_option_given():
    from mpfp16.options import state_dtypes_of

    for given, words in [(dict(state_dtypes={"exp_avg": BF16}), "state_dtypes={'exp_avg': torch.bfloat16}"),
                         (dict(state_dtype=BF16), "state_dtype=torch.bfloat16")]:
        with pytest.raises(ValueError) as err:
            state_dtypes_of(torch.optim.AdamW, sharded=True, **given)
        assert str(err.value).startswith(f"{words} is not possible for a sharded model: FSDP2's shards")


def test_a_subclass_that_keeps_the_step_of_its_base_is_its_base():
    """A subclass of AdamW that does not override step() (a name of one's own, a
    helper method) keeps AdamW's states and takes the fused step bit for bit as
    AdamW; one whose step() is its own keeps states of its own, refused in one line."""
    class Named(torch.optim.AdamW):
        pass

    class Own(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    runs = []
    for cls in (torch.optim.AdamW, Named):
        model = mpfp16.to_half(tiny_mlp(0))
        opt = mpfp16.FP16Optimizer(cls(model.parameters(), lr=5e-3, weight_decay=1e-2), fused=True, state_dtype=BF16)
        train_mpfp16(model, opt, batches(3))
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    model = mpfp16.to_half(tiny_mlp(0))
    with pytest.raises(ValueError, match=r"^state_dtype applies to SGD, Adam and AdamW, whose states are mpfp16's to "
                                         r"keep; Own has a step\(\) of its own"):
        mpfp16.FP16Optimizer(Own(model.parameters()), state_dtype=BF16)
    with pytest.raises(ValueError, match=r"^fused=True is not possible: Own has a step\(\) of its own$"):
        mpfp16.FP16Optimizer(Own(model.parameters()), fused=True)
