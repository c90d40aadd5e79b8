"""The unfused step backend: fp32 master gradients, then the inner optimizer's own
``step()`` on the fp32 masters, then one copy per flat buffer into the 16-bit model."""

from __future__ import annotations

import torch

from ..rounding import write_weights
from . import total_norm, unscale_into_master_grads

__all__ = ["UnfusedBackend"]


class UnfusedBackend:
    """Any ``torch.optim`` optimizer, stepped on per-parameter views of the masters.

    Args:
        optimizer: the inner optimizer (its param_groups hold the masters).
        groups: the :class:`mpfp16.groups.FlatGroup` list.
        stepped: the tensors the inner optimizer steps, in its order.
        rounding: without master weights, how new weights are rounded to 16 bits.
    """

    name = "unfused"

    def __init__(self, optimizer: torch.optim.Optimizer, groups, stepped, rounding: str) -> None:
        self.optimizer, self.groups, self.stepped, self.rounding = optimizer, groups, stepped, rounding

    def prepare(self) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def unscale(self, scale: float, materialize: bool, with_norm: bool) -> torch.Tensor:
        return unscale_into_master_grads(self.groups, scale)

    def grad_norm(self) -> torch.Tensor:
        return total_norm(self.stepped)

    def update(self, clip_coef: torch.Tensor | None, noise: list) -> None:
        if clip_coef is not None:  # what clip_grads_with_norm_ does, one multiply per flat buffer
            for g in self.groups:
                g.master_grads.mul_(clip_coef.to(g.device))
        for g in self.groups:
            if g.transient:
                g.master_from_weights()
        self.optimizer.step()

    def copy_back(self, noise: list) -> None:
        """Round the fp32 masters into the 16-bit model, one copy per buffer (without
        master weights, with the chosen rounding)."""
        for g, group_noise in zip(self.groups, noise):
            if not g.half:
                continue
            if g.transient:
                write_weights(g.weights, g.master, g.weights.float(), group_noise, g.comp, self.rounding)
            else:
                g.weights.copy_(g.master)
            g.release()
