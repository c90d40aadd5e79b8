"""Metrics: one JSON object per line, written by the main process only, plus an
optional TensorBoard mirror."""

from __future__ import annotations

import json
import math
import os

from ..errors import UserError, one_line

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
    ``truncate`` empties the file first."""

    def __init__(self, path: str | None, enabled: bool, tensorboard_dir: str | None = None,
                 truncate: bool = False) -> None:
        self.path = path
        self.enabled = enabled and path is not None
        self._file = None
        self._tb = None
        if not enabled:
            return
        if self.path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._file = open(self.path, "w" if truncate else "a", encoding="utf-8")
            except OSError as exc:
                raise UserError(f"cannot write metrics file {self.path}: {one_line(exc)}") from None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
            self._tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(_clean(record), sort_keys=False) + "\n")
            self._file.flush()
        if self._tb is not None and "step" in record:
            prefix = record.get("type", "train")
            for key, value in record.items():
                if key not in ("step", "type", "epoch") and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
