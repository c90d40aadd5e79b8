"""Validation: loss and top-1/top-5 accuracy over the whole validation split, sharded
across the ranks and summed, so that every image counts once."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import distributed as mdist
from . import data as data_mod
from .build import Data
from .config import TrainConfig

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(model: nn.Module, data: Data, cfg: TrainConfig, info: mdist.DistInfo, prepare,
             spare_size: int) -> dict:
    """Evaluate ``model`` (not a DDP wrapper: ranks may run different numbers of
    batches) on ``data``'s validation split.

    Args:
        prepare: images from the loader -> the model's input (normalized, on the device).
        spare_size: the image size of a dummy forward, where a rank has no image of its
            own for it (a sharded model, below).

    Returns:
        ``val_loss``, ``val_acc1``, ``val_acc5`` (percent) and ``val_samples``.
    """
    mdist.broadcast_buffers(model)  # BatchNorm statistics: rank 0's, as DDP does at forward
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=info.device)  # loss, top1, top5, count
    loader = data_mod.make_loader(data.spec.val, data.val_sampler, cfg.batch_size, cfg.workers,
                                  info.device.type == "cuda", drop_last=False)
    k = min(5, data.spec.num_classes)
    batches, spare = 0, None
    for images, labels in loader:
        batches += 1
        images, labels = prepare(images), labels.to(info.device, non_blocking=True)
        spare = images[:1]
        logits = model(images).float()
        top = logits.topk(k, dim=1).indices
        sums[0] += nn.functional.cross_entropy(logits, labels, reduction="sum").double()
        sums[1] += (top[:, 0] == labels).sum()
        sums[2] += (top == labels[:, None]).any(dim=1).sum()
        sums[3] += len(labels)
    if cfg.shard:
        _even_out_forwards(model, len(data.spec.val), cfg.batch_size, info, batches, spare, spare_size)
    if info.distributed:
        dist.all_reduce(sums)
    model.train()
    loss, top1, top5, count = sums.tolist()
    count = max(count, 1.0)
    return {"val_loss": loss / count, "val_acc1": 100 * top1 / count, "val_acc5": 100 * top5 / count,
            "val_samples": int(count)}


def _even_out_forwards(model: nn.Module, val_size: int, batch_size: int, info: mdist.DistInfo, done: int,
                       spare: torch.Tensor | None, spare_size: int) -> None:
    """A sharded model's forward is a collective (its all-gathers): a rank whose
    validation shard has fewer batches runs forwards on one image (``spare``),
    ignored, until it made as many as the rank with the most."""
    per_rank = -(-val_size // info.world_size)
    most = -(-per_rank // batch_size)
    if spare is None:
        spare = torch.zeros(1, 3, spare_size, spare_size, device=info.device)
    for _ in range(most - done):
        model(spare)
