"""The paper experiments run, write their sections and plots, and are deterministic."""

import pytest
import torch

from mpfp16.experiments import __main__ as cli
from mpfp16.experiments import common, loss_scale, lost_updates, regularizer, underflow


@pytest.fixture(scope="module")
def setup():
    return common.quick(common.Setup())


@pytest.mark.slow  # every experiment end to end
def test_every_experiment_writes_its_section_and_plot(tmp_path, capsys):
    doc, out = tmp_path / "EXPERIMENTS.md", tmp_path / "img"
    assert cli.main(["all", "--quick", "--out", str(out), "--doc", str(doc), "--seeds", "0,1"]) == 0
    text = doc.read_text()
    for name, png in [("lost-updates", "exp_lost_updates.png"), ("underflow", "exp_underflow.png"),
                      ("regularizer", "exp_regularizer.png"), ("loss-scale", "exp_loss_scale.png")]:
        assert text.count(f"<!-- experiment:{name} -->") == 1
        assert (out / png).stat().st_size > 1000
        assert f"](img/{png})" in text
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
