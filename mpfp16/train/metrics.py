"""Metrics: one JSON object per line, written by the main process only, plus an
optional TensorBoard mirror.

A write that fails (a full disk: "No space left on device") stops the run with one
line naming the file on every rank. Only the main process writes, so it cannot raise
there alone while the others wait in a collective: it keeps the line, writes nothing
more, and :meth:`MetricsWriter.check`, which every rank calls (at each logged step,
before each checkpoint and at the end), raises it on all of them. A run of one process raises at once."""

from __future__ import annotations

import json
import math
import os

from ..errors import UserError
from ..parallel.ranks import failures, get_world_size, raise_first
from ..serialization import write_failure

__all__ = ["MetricsWriter"]


def _clean(value):
    """JSON has no inf/NaN: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class MetricsWriter:
    """Appends records to ``path`` (JSON lines), flushing each, when ``enabled``;
    ``truncate`` empties the file first. Every rank builds one (``enabled`` on the
    main process), and every rank calls :meth:`check` and :meth:`close`."""

    def __init__(self, path: str | None, enabled: bool, tensorboard_dir: str | None = None,
                 truncate: bool = False) -> None:
        self.path = path
        self.enabled = enabled and path is not None
        self._file = None
        self._tb = None
        self.failure: str | None = None  # why a write failed (the main process's), until check() raises it
        if not enabled:
            return
        if self.path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._file = open(self.path, "w" if truncate else "a", encoding="utf-8")
            except OSError as exc:
                raise UserError(self._cannot_write(exc)) from None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
            self._tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict) -> None:
        """Append ``record``. A failed write ends the file's writes; alone, it raises
        at once; with other processes, at the next :meth:`check`.

        Raises:
            UserError: the file cannot be written ("No space left on device"), in a
                run of one process.
        """
        if self._file is not None:
            try:
                self._file.write(json.dumps(_clean(record), sort_keys=False) + "\n")
                self._file.flush()
            except OSError as exc:
                self._failed(exc)
        if self._tb is not None and "step" in record:
            prefix = record.get("type", "train")
            for key, value in record.items():
                if key not in ("step", "type", "epoch") and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def _cannot_write(self, exc: OSError) -> str:
        """The one line for a write to the file that failed (a full disk named so)."""
        return f"cannot write metrics file {self.path}: {write_failure(exc, self.path)}"

    def _failed(self, exc: OSError) -> None:
        self.failure = self._cannot_write(exc)
        file, self._file = self._file, None
        try:
            file.close()  # it flushes what is buffered, which fails the same way
        except OSError:
            pass
        if get_world_size() == 1:
            raise UserError(self.failure)

    def check(self) -> None:
        """Raise a failed write on every rank (a collective: one small all-gather).

        Raises:
            UserError: one line naming the file and why, the same on every rank.
        """
        raise_first(failures(self.failure), UserError)

    def close(self) -> None:
        """Close the files, then :meth:`check` (a collective: every rank calls it).

        Raises:
            UserError: a write failed, or the last one does now.
        """
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as exc:
                self.failure = self.failure or self._cannot_write(exc)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self.check()
