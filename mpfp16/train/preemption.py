"""Stop cleanly when a scheduler or a user asks: SIGTERM (sent before preemption) and
SIGINT (Ctrl-C).

While :class:`StopSignals` is installed, the first of these signals only sets a flag:
the training loop finishes the optimizer step in progress, every rank agrees to stop
after the same step (:meth:`StopSignals.agreed`), the checkpoint is written atomically
and the run ends with :class:`Stopped`, which the scripts turn into one line and the
conventional exit status (128 + the signal number: 143 for SIGTERM, 130 for SIGINT).
A second signal ends the process at once, with the signal's own default action;
checkpoint writes are atomic, so nothing on disk is left half-written.
"""

from __future__ import annotations

import os
import signal
import threading

from ..parallel.ranks import max_over_ranks

__all__ = ["StopSignals", "Stopped", "SIGNALS"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The run stopped on a signal after saving; ``exit_status`` is 128 + its number."""

    def __init__(self, signum: int, message: str, announce: bool = True) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_status = 128 + signum
        self.announce = announce  # print the line (rank 0 does; the others stay quiet)


class StopSignals:
    """Turns SIGTERM and SIGINT into a request to stop after the current step.

    Args:
        announce: write one line to stderr when the first signal arrives (rank 0).
    """

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.signum: int | None = None
        self._previous: dict = {}

    def install(self) -> "StopSignals":
        """Catch the signals (only the main thread can; elsewhere this does nothing)."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if self.announce:  # os.write: safe inside a signal handler, unlike logging
            os.write(2, f"{signal.Signals(signum).name}: finishing this step and saving; send it again to stop "
                        "at once\n".encode())

    def agreed(self, group=None) -> int | None:
        """The signal that any rank of ``group`` received, the same on every rank (one
        small max-reduce), or None. When several ranks got different signals, the
        highest number wins, on every rank."""
        return max_over_ranks(self.signum or 0, group) or None
