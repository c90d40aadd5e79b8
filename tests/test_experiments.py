"""The paper experiments run, write their sections and plots, and are deterministic."""

import pytest

from mpfp16.experiments import __main__ as cli
from mpfp16.experiments import common, loss_scale, lost_updates, regularizer, underflow


@pytest.fixture(scope="module")
def setup():
    return common.quick(common.Setup())


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


def test_lost_updates_are_measured_per_layer(tmp_path, setup):
    result = lost_updates.run(setup, 0, str(tmp_path), str(tmp_path / "doc.md"))
    assert result["steps"] and all(len(v) == len(result["steps"]) for v in result["history"].values())
    assert all(0.0 <= x <= 1.0 for v in result["history"].values() for x in v)


def test_underflow_fractions_fall_with_the_loss_scale(tmp_path, setup):
    table = underflow.run(setup, 0, str(tmp_path), str(tmp_path / "doc.md"))["table"]
    for kind in ("weight gradients", "activation gradients"):
        zero = [table[(kind, "end", s)][0] for s in underflow.SCALES]
        assert zero == sorted(zero, reverse=True)


def test_fractions_arithmetic():
    import torch

    log2g = torch.tensor([-30.0, -20.0, -10.0, 17.0])  # flushed, subnormal, normal, overflow
    assert underflow.fractions(log2g, 1.0) == (0.25, 0.5, 0.25)
    assert underflow.fractions(log2g, 2.0**8) == (0.0, 0.25, 0.25)


def test_regularizer_is_deterministic(tmp_path, setup):
    a = regularizer.run(setup, [0, 1], str(tmp_path), str(tmp_path / "a.md"))["results"]
    b = regularizer.run(setup, [0, 1], str(tmp_path), str(tmp_path / "b.md"))["results"]
    assert a == b and set(a) == set(common.MODES)


def test_loss_scale_trace_backs_off_from_the_ceiling(tmp_path, setup):
    result = loss_scale.run(setup, 0, str(tmp_path), str(tmp_path / "doc.md"), growth_interval=2)
    assert len(result["scales"]) == 4 and max(result["scales"]) <= 2.0**24
    assert all(s in result["skipped"] for s in range(1, len(result["skipped"]) + 1))


def test_bad_seeds_are_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["regularizer", "--seeds", "a,b"])
    assert exc.value.code == 2 and "--seeds" in capsys.readouterr().err
