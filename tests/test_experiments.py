"""The paper experiments run, write their sections and plots, and are deterministic."""

import sys

import pytest
import torch

from mpfp16.experiments import __main__ as cli
from mpfp16.experiments import common, ema, loss_scale, lost_updates, memory, regularizer, underflow


@pytest.fixture(scope="module")
def setup():
    return common.quick(common.Setup())


@pytest.mark.slow  # every experiment end to end
def test_every_experiment_writes_its_section_and_plot(tmp_path, capsys):
    doc, out = tmp_path / "EXPERIMENTS.md", tmp_path / "img"
    assert cli.main(["all", "--quick", "--out", str(out), "--doc", str(doc), "--seeds", "0,1"]) == 0
    text = doc.read_text()
    for name, png in [("lost-updates", "exp_lost_updates.png"), ("underflow", "exp_underflow.png"),
                      ("regularizer", "exp_regularizer.png"), ("loss-scale", "exp_loss_scale.png"),
                      ("ema", ema.PNG)]:
        assert text.count(f"<!-- experiment:{name} -->") == 1
        assert (out / png).stat().st_size > 1000
        assert f"](img/{png})" in text
    assert text.count("<!-- experiment:memory -->") == 1
    assert cli.main(["underflow", "--quick", "--out", str(out), "--doc", str(doc)]) == 0
    assert doc.read_text().count("<!-- experiment:underflow -->") == 1  # replaced, not appended
    assert "done in" in capsys.readouterr().out


def test_a_lost_update_is_one_fp16_cannot_add():
    """Hand-made cases: fp16 has 11 significant bits, so an update under half an ulp of
    the weight vanishes (1 + 2^-12 is 1 in fp16), one over it does not."""
    old = torch.tensor([1.0, 1.0, 2048.0, 2048.0, 0.5])
    update = torch.tensor([2.0**-12, 2.0**-10, 0.5, 2.0, 0.0])  # lost, kept, lost, kept, not an update
    assert lost_updates.lost_fraction(old, update) == 2 / 4


def test_some_updates_are_lost_without_masters(tmp_path, setup):
    result = lost_updates.run(setup, 0, str(tmp_path), str(tmp_path / "doc.md"))
    assert result["steps"] and all(len(v) == len(result["steps"]) for v in result["history"].values())
    assert result["overall_lost"] > 0  # Micikevicius et al. 2018, section 3.1: masters are needed


def test_loss_scaling_brings_flushed_gradients_back(tmp_path, setup):
    """Section 3.2's claim, measured: without scaling fp16 flushes some activation
    gradients to zero (over 1%); at 2^16 almost none (under 0.001%, and over a thousand
    times fewer: 0 on 2 threads, about 1e-6 on 1, whose reduction order gives slightly
    other fp32 gradients); most that were subnormal become normal."""
    table = underflow.run(setup, 0, str(tmp_path), str(tmp_path / "doc.md"))["table"]
    zero = {s: table[("activation gradients", "end", s)][0] for s in underflow.SCALES}
    subnormal = {s: table[("activation gradients", "end", s)][1] for s in underflow.SCALES}
    assert zero[1.0] > 0.01 and zero[2.0**16] < 1e-5 and zero[2.0**16] < zero[1.0] / 1000
    assert subnormal[2.0**16] < subnormal[1.0] / 10
    assert all(table[key][2] == 0.0 for key in table)  # nothing overflows at these scales


def test_fractions_arithmetic():
    log2g = torch.tensor([-30.0, -20.0, -10.0, 17.0])  # flushed, subnormal, normal, overflow
    assert underflow.fractions(log2g, 1.0) == (0.25, 0.5, 0.25)
    assert underflow.fractions(log2g, 2.0**8) == (0.0, 0.25, 0.25)


@pytest.mark.slow  # the experiment end to end, twice
def test_regularizer_is_deterministic(tmp_path, setup):
    a = regularizer.run(setup, [0, 1], str(tmp_path), str(tmp_path / "a.md"))["results"]
    b = regularizer.run(setup, [0, 1], str(tmp_path), str(tmp_path / "b.md"))["results"]
    assert a == b and set(a) == set(common.MODES)


def test_loss_scale_trace_backs_off_from_the_ceiling(tmp_path, setup):
    """The trace is the dynamic scaler's rule replayed from the skips: halve on a
    skipped step, double after two clean ones; starting at 2^24 overflows at once."""
    result = loss_scale.run(setup, 0, str(tmp_path), str(tmp_path / "doc.md"), growth_interval=2)
    scales, skipped = result["scales"], result["skipped"]
    assert len(scales) == 4 and skipped and skipped[0] == 1
    expected, scale, clean = [], 2.0**24, 0
    for step in range(1, len(scales) + 1):
        if step in skipped:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == 2:
                scale, clean = min(scale * 2, 2.0**24), 0
        expected.append(scale)
    assert scales == expected


def test_bad_seeds_are_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["regularizer", "--seeds", "a,b"])
    assert exc.value.code == 2 and "--seeds" in capsys.readouterr().err


def test_16_true_loses_an_update_fp16_cannot_add():
    """Hand-made: torch's SGD stepping fp16 weights directly (what Lightning's "16-true"
    does). Near 2048 fp16 values are 2 apart: +0.5 is lost, +1 is a tie that rounds back
    to even 2048 (lost), +2 is kept; near 1024 they are 1 apart, so +1 is kept."""
    weight = torch.tensor([2048.0, 2048.0, 2048.0, 1024.0, 5.0], dtype=torch.float16, requires_grad=True)
    weight.grad = -torch.tensor([0.5, 1.0, 2.0, 1.0, 0.0], dtype=torch.float16)
    opt = torch.optim.SGD([weight], lr=1.0)
    old = weight.detach().clone()
    fp32_new = lost_updates.sgd_step_fp32(weight, weight.grad, None, lr=1.0)
    assert fp32_new.tolist() == [2048.5, 2049.0, 2050.0, 1025.0, 5.0]
    opt.step()
    assert weight.tolist() == [2048.0, 2048.0, 2050.0, 1025.0, 5.0]
    assert lost_updates.lost_in_fp16_step(old, weight.detach(), fp32_new) == 2 / 4  # the 5th is no update


@pytest.mark.parametrize("momentum,nesterov,weight_decay", [(0.9, True, 5e-4), (0.9, False, 0.0), (0.0, False, 1e-2)])
def test_sgd_step_fp32_is_torchs_rule_bit_for_bit(momentum, nesterov, weight_decay):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 9))
    opt = torch.optim.SGD([param], lr=0.3, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    for _ in range(3):
        param.grad = torch.randn_like(param)
        expected = lost_updates.sgd_step_fp32(param, param.grad, opt.state[param].get("momentum_buffer"), 0.3,
                                              momentum, weight_decay, nesterov)
        opt.step()
        assert torch.equal(param.detach(), expected)


def test_flushed_fraction_counts_fp32_gradients_fp16_makes_zero():
    grad32 = torch.tensor([1e-8, 1e-3, 0.0, 2e-8, 1e-7])  # fp16 flushes below 2^-25 (about 3e-8)
    assert lost_updates.flushed_fraction(grad32.half(), grad32) == 2 / 4


def test_the_16_true_run_sees_the_batches_train_feeds(setup):
    model, opt = common.build("fp32", setup, 0)
    seen = []
    model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    common.train(model, opt, setup, 0)
    fed = lost_updates.batches(setup, 0)
    assert len(fed) == len(seen) - 1  # the last forward is the validation batch
    assert all(torch.equal(x, s) for (x, _), s in zip(fed, seen))


def test_lightning_16_true_loses_updates_and_the_section_says_so(tmp_path, setup):
    pytest.importorskip("lightning")
    doc = tmp_path / "doc.md"
    result = lost_updates.run(setup, 0, str(tmp_path), str(doc))
    true16 = result["sixteen_true"]
    steps = true16["steps"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == len(result["steps"])
    assert set(result["history"]) < set(true16["lost"])  # the weights, and the BatchNorm tensors too
    for history in (true16["lost"], true16["flushed"]):
        assert all(len(v) == len(steps) and all(0 <= x <= 1 for x in v) for v in history.values())
    assert sum(sum(v) for v in true16["lost"].values()) > 0  # fp16 alone loses updates
    assert 0 <= true16["accuracy"] <= 100
    text = doc.read_text()
    assert 'precision="16-true"' in text and f"]({lost_updates.SIXTEEN_TRUE_PNG})" in text
    assert (tmp_path / lost_updates.SIXTEEN_TRUE_PNG).stat().st_size > 1000


def test_without_lightning_the_experiment_runs_and_says_so(tmp_path, setup, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lightning", None)  # import lightning now fails
    result = lost_updates.run(setup, 0, str(tmp_path), str(tmp_path / "doc.md"))
    assert "sixteen_true" not in result and result["overall_lost"] > 0
    assert "Lightning is not installed" in (tmp_path / "doc.md").read_text()
    assert capsys.readouterr().out.count("Lightning is not installed") == 1


@pytest.mark.slow  # two workloads, two modes, fp16 on CPU
def test_the_memory_experiment_measures_bytes_and_distance_per_mode(tmp_path):
    """bf16 states hold 4 of AdamW's 8 state bytes per parameter and end near the fp32
    states' weights; the fp32 mode is its own reference; the section holds both tables."""
    doc = tmp_path / "MEMORY.md"
    results = memory.run(quick=True, doc=str(doc))
    for workload in ("cifar", "gpt"):
        fp32, bf16 = results[workload]["fp32 states"], results[workload]["bf16 states, nearest"]
        assert fp32["distance"] == 0.0 and 0 < bf16["distance"] < 1e-2
        assert fp32["bytes"]["optimizer_state"] == pytest.approx(8.0, abs=0.05)
        assert bf16["bytes"]["optimizer_state"] == pytest.approx(4.0, abs=0.05)
        assert fp32["bytes"]["model_weights"] == bf16["bytes"]["model_weights"]
    text = doc.read_text()
    assert text.count("| bf16 states, nearest |") == 2 and "--quick: the modes" in text


def test_a_16_bit_ema_loses_the_movement_the_fp32_ema_of_the_masters_keeps(tmp_path):
    """The ema experiment on a tiny run: at 0.99998 the fp16 and bf16 averages of the
    16-bit weights lose nearly every update and most of the movement, the fp32 average
    of the masters almost none and ends near the fp64 one; the section and the plot are
    written."""
    doc, out = tmp_path / "EXPERIMENTS.md", tmp_path / "img"
    result = ema.run(ema.quick(), 0, str(out), str(doc))
    text = doc.read_text()
    assert text.count("<!-- experiment:ema -->") == 1 and f"](img/{ema.PNG})" in text
    assert (out / ema.PNG).stat().st_size > 1000
    assert result["updates"] == len(result["steps"]) > 3
    by_label = {label: summary for label, _, summary, _ in result["results"]}
    assert set(by_label) >= {ema.RECIPE_LABEL, ema.UNADJUSTED}
    unadjusted = by_label[ema.UNADJUSTED]
    ours = unadjusted[ema.OURS]
    assert ours["updates_lost"] < 0.05 and abs(ours["movement_lost"]) < 0.01 and ours["error"] < 0.05
    for name in ("fp16 EMA of the fp16 weights (torchvision, fp16 model)",
                 "bf16 EMA of the bf16 weights (torchvision, bf16 model)"):
        assert unadjusted[name]["updates_lost"] > 0.9 and unadjusted[name]["movement_lost"] > 0.5
    for summary in by_label.values():  # the masters' average is never the worse one
        assert all(summary[ema.OURS]["error"] <= s["error"] for s in summary.values())


def test_the_experiment_averages_as_the_trainer_does():
    """The experiment's averages are the trainer's arithmetic (mpfp16.train.ema.average_),
    and its decays include torchvision's recipe's, adjusted as the trainer adjusts it."""
    from mpfp16.train.ema import ema_decay

    found = dict((label, decay) for label, decay in ema.decays(ema.EMASetup()))
    assert found[ema.RECIPE_LABEL] == ema_decay(8, 128, 1, 32, 600, 0.99998) == 1 - (1 - 0.99998) * 8 * 128 * 32 / 600
    assert found[ema.UNADJUSTED] == 0.99998
    assert ema.average_ is __import__("mpfp16.train.ema", fromlist=["average_"]).average_


def test_the_ema_experiment_is_one_command(tmp_path, monkeypatch, capsys):
    """`python -m mpfp16.experiments ema [--quick]` runs it, with its own run's size."""
    calls = []
    monkeypatch.setattr(ema, "run", lambda setup, seed, out, doc: calls.append((setup, seed, out, doc)))
    assert cli.main(["ema", "--quick", "--out", str(tmp_path), "--doc", str(tmp_path / "d.md"), "--seed", "3"]) == 0
    assert cli.main(["ema", "--out", str(tmp_path), "--doc", str(tmp_path / "d.md")]) == 0
    assert calls == [(ema.quick(), 3, str(tmp_path), str(tmp_path / "d.md")),
                     (ema.EMASetup(), 0, str(tmp_path), str(tmp_path / "d.md"))]
    assert "ema: done in" in capsys.readouterr().out

