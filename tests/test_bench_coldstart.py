"""The cold-start benchmark measures what it says (no timing is asserted): the first
and second step and each kernel compiled during the first."""

import pytest

from mpfp16.bench import coldstart


def test_first_steps_name_the_kernels_the_first_step_compiled():
    got = coldstart.first_steps("squeezenet1_1", "adamw", threads=1)
    assert got["first_step_s"] > 0 and got["second_step_s"] > 0
    # in this process other tests may have compiled them already; whatever compiled now is named
    for c in got["compiles"]:
        assert c["kernel"] in {"grad_stats", "adam_update", "native.cpp"} and c["s"] > 0
        assert c["flags"].get("with_norm") in (None, "False")  # no clipping: the norm's variant never compiles


@pytest.mark.parametrize("argv,words", [(["--runs", "0"], "--runs"), (["--threads", "0"], "--threads"),
                                        (["--optimizer", "lamb"], "invalid choice")])
def test_bad_flags_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        coldstart.main(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err
