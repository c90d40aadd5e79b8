"""Repeated augmentation: torchvision's ``RASampler`` (references/classification/
sampler.py), resumable mid-epoch as :class:`mpfp16.train.data.ResumableDistributedSampler`
is.

torchvision's sampler, per epoch: ``g.manual_seed(seed + epoch)``, a permutation of the
data set, each index repeated ``repetitions`` times in a row, padded with its own start
to ``total_size = ceil(len * reps / world) * world``, rank r takes ``[r::world]`` and of
that the first ``num_selected_samples = floor(len // 256 * 256 / world)``. Rank r's
i-th sample is thus position ``r + i * world`` of the repeated order, and the positions
taken are its first ``num_selected_samples * world`` (never the padding: that is at
most ``len``): the same structure as the plain sampler's, one order dealt round the
ranks, so the same resume arithmetic holds (:func:`mpfp16.train.resume.epoch_rest`,
with ``dataset_size`` the sampler's :attr:`epoch_size`).

Each key is ``(epoch, index, position)``: the repeats of an index are the same image,
and must get different augmentations, so the data set seeds a sample from its position
in the epoch's order too (:func:`mpfp16.train.data.sample_seed`).
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler

__all__ = ["RepeatedAugmentationSampler"]


class RepeatedAugmentationSampler(Sampler):
    """torchvision's ``RASampler(dataset, num_replicas, rank, shuffle, seed, repetitions)``,
    yielding ``(epoch, index, position)`` keys, from any point of the epoch.

    ``set_epoch(epoch, start)`` skips the first ``start`` positions of the epoch's order
    (all ranks'); of the rest rank r takes positions r, r + world, ... and every rank
    the same number. With ``start`` 0, rank r's indices are torchvision's, in its order.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 repetitions: int = 3) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of {num_replicas} processes")
        if repetitions < 1:
            raise ValueError(f"repetitions must be 1 or more, not {repetitions}")
        self.size, self.num_replicas, self.rank = len(dataset), num_replicas, rank
        self.shuffle, self.seed, self.repetitions = shuffle, seed, repetitions
        self.num_samples = int(math.ceil(self.size * float(repetitions) / num_replicas))
        self.total_size = self.num_samples * num_replicas
        self.num_selected_samples = int(math.floor(self.size // 256 * 256 / num_replicas))
        self.epoch, self.start = 0, 0

    @property
    def epoch_size(self) -> int:
        """The positions an epoch trains, over all ranks: ``num_selected_samples * world``."""
        return self.num_selected_samples * self.num_replicas

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Reshuffle for ``epoch`` and begin after its first ``start`` positions (all ranks')."""
        self.epoch, self.start = epoch, start

    def order(self) -> list[int]:
        """The epoch's order: the data set indices at its :attr:`epoch_size` positions, the
        same on every rank (and a prefix of the same list for every world size)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.size, generator=g)
        else:
            indices = torch.arange(self.size)
        repeated = indices.repeat_interleave(self.repetitions).tolist()
        repeated += repeated[: self.total_size - len(repeated)]  # torchvision's padding (never selected)
        return repeated[: self.epoch_size]

    def __iter__(self):
        order = self.order()
        first = self.start + self.rank
        for position in range(first, first + len(self) * self.num_replicas, self.num_replicas):
            yield self.epoch, order[position], position

    def __len__(self) -> int:
        return max(0, self.epoch_size - self.start) // self.num_replicas
