"""Errors in one line: mpfp16.errors.one_line."""

import pytest

from mpfp16.errors import CheckpointError, UserError, one_line


@pytest.mark.parametrize("exc_type", [UserError, CheckpointError])
def test_a_path_with_a_line_break_is_not_cut_at_it(exc_type):
    assert one_line(exc_type("checkpoint runs/a\nb/last.pt does not exist")) == \
        "checkpoint runs/a\\nb/last.pt does not exist"


def test_a_foreign_message_is_its_first_line_and_a_worker_traceback_its_last():
    assert one_line(RuntimeError("first\nsecond")) == "first"
    assert one_line(RuntimeError("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent "
                                 "call last):\n  File ...\nValueError: bad image x.jpg")) == "bad image x.jpg"
    assert one_line(FileNotFoundError(2, "No such file or directory", "a\nb")) == "No such file or directory"
    assert one_line(RuntimeError()) == "RuntimeError"


def test_the_scripts_print_a_stop_and_a_flag_error_with_the_path_whole(capsys, monkeypatch):
    """The lines the scripts print themselves: a signal's stop line (which names the
    checkpoint) and a contradiction between flags (which can name a folder)."""
    from mpfp16.train import cli
    from mpfp16.train.config import ConfigError
    from mpfp16.train.preemption import Stopped

    def stopped(cfg):
        raise Stopped(15, "stopped by SIGTERM at step 3: saved runs/a\nb/last.pt; continue with --resume auto")

    assert cli._train_and_report(stopped, None) == 143
    assert capsys.readouterr().err == ("stopped by SIGTERM at step 3: saved runs/a\\nb/last.pt; continue with "
                                       "--resume auto\n")
    parser = cli.build_parser("cifar")

    class Refused:
        def __init__(self, **kw):
            pass

        def validate(self):
            raise ConfigError("--checkpoint-dir runs/a\nb is a file")

    monkeypatch.setattr(cli, "TrainConfig", Refused)
    with pytest.raises(SystemExit):
        cli.config_from_args("cifar", parser.parse_args([]), parser)
    assert capsys.readouterr().err.endswith(": error: --checkpoint-dir runs/a\\nb is a file (see --help)\n")
