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
