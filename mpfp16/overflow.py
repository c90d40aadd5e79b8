"""Where an overflow came from: the parameters whose gradients held inf or NaN at a
skipped step, gathered over the ranks that agreed to skip, and the words for them.

The report costs nothing on a clean step: it is made only once the ranks agreed that
a step overflows, from the gradients the step read, before they are zeroed.

``FP16Optimizer.last_overflow`` is such a report: the first :data:`OVERFLOW_REPORTED`
parameters in parameter order whose gradient held inf or NaN, one dict each, of plain
(JSON-serializable) values:

- ``name``: the parameter's name in ``model=``, else ``"param 3 [64, 32]"`` (its index
  in ``model_params()`` and its shape);
- ``kind``: ``"nan"`` if the gradient holds a NaN, else ``"inf"``;
- ``count``: how many of its elements are of that kind (NaN wins: a gradient with both
  counts its NaNs);
- ``ranks``: the ranks whose loss in ``backward()`` was inf or NaN this step (the same
  list in every entry; ``[]`` when every loss was finite: the overflow arose inside the
  backward pass).

The gradients scanned are those the step read (the 16-bit ones, or the fp32 ones where
the step copied or summed them there). Under torch.distributed the ranks' reports are
gathered on the skip (every rank skips together), and every rank holds their union: a
sharded model's counts add up its shards.
"""

from __future__ import annotations

import torch

from .parallel.ranks import all_gather_object, get_rank, get_world_size, group_ranks
from .scaler import LossScaleStuckError

__all__ = ["OVERFLOW_REPORTED", "OVERFLOW_NAMED", "gather_report", "describe_overflow", "with_culprits"]

OVERFLOW_REPORTED = 8  # parameters last_overflow names after a skipped step (the first, in parameter order)
OVERFLOW_NAMED = 3  # of those, how many the skip's log line and LossScaleStuckError name


def gather_report(local: list[tuple[int, int, int]], labels: list[str], *, loss_finite: torch.Tensor | None,
                  shards_gradients: bool, group=None, reduce: bool = True) -> list[dict]:
    """``last_overflow`` from this rank's scan of its gradients (``local``: ``(index,
    NaN count, inf count)``, from the store), gathered over ``group``: on a skip every
    rank of it is here (the skip was agreed), so the one all-gather is safe.

    Args:
        labels: per parameter index, the name the report gives it.
        loss_finite: whether this rank's loss was finite in this step's backward passes
            (None: no backward recorded it).
        shards_gradients: each rank holds a part of every gradient, so the ranks'
            counts add up; replicas hold the same gradient, so the largest count is it.
        reduce: False when this rank steps alone (``reduce_overflow=False``).
    """
    bad_loss = loss_finite is not None and not bool(loss_finite)
    if reduce and get_world_size(group) > 1:
        reports = all_gather_object((local, bad_loss), group=group)
        ranks = group_ranks(group)
    else:
        reports, ranks = [(local, bad_loss)], [get_rank()]
    counts: dict[int, tuple[int, int]] = {}
    for entries, _ in reports:
        for index, nans, infs in entries:
            n, i = counts.get(index, (0, 0))
            counts[index] = (n + nans, i + infs) if shards_gradients else (max(n, nans), max(i, infs))
    loss_ranks = [rank for rank, (_, bad) in zip(ranks, reports) if bad]
    return [{"name": labels[index], "kind": "nan" if nans else "inf", "count": nans or infs, "ranks": list(loss_ranks)}
            for index, (nans, infs) in sorted(counts.items())[:OVERFLOW_REPORTED]]


def describe_overflow(report: list[dict], named: int = OVERFLOW_NAMED) -> str:
    """``last_overflow`` in words: ``nan in fc.weight (12), inf in fc.bias (3) and 2
    more, the loss non-finite on rank 1``; ``""`` for ``[]``."""
    words = ", ".join(f"{e['kind']} in {e['name']} ({e['count']})" for e in report[:named])
    if len(report) > named:
        words += f" and {len(report) - named} more"
    ranks = report[0]["ranks"] if report else []
    if ranks:
        words += f", the loss non-finite on rank{'s' * (len(ranks) > 1)} {', '.join(str(r) for r in ranks)}"
    return words


def with_culprits(exc: LossScaleStuckError, report: list[dict]) -> LossScaleStuckError:
    """``exc`` (the scaler's, which knows no parameter) with the parameters that held
    inf/NaN at the last step appended, still one line; also as ``.overflow``."""
    found = describe_overflow(report)
    error = LossScaleStuckError(f"{exc} At the last step: {found}." if found else str(exc))
    error.overflow = report
    return error
