"""The step backend of a model sharded by :func:`mpfp16.distributed.shard`.

The parameters are FSDP2's sharded fp32 DTensors: the master weights themselves, with
fp32 sharded gradients that FSDP2 reduce-scattered from the 16-bit ones. Each phase
works on this rank's shards; only the gradient norm needs the other ranks (one
all-reduce of a scalar). There is nothing to copy back: the next forward all-gathers
the new values in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import inv_scale_tensor

__all__ = ["ShardedBackend"]


class ShardedBackend:
    """The inner optimizer's own step on the sharded fp32 parameters.

    Args:
        optimizer: the inner optimizer, built over the sharded parameters.
        params: the trainable sharded parameters, in the inner optimizer's order.
        group: the process group the parameters are sharded over.
    """

    name = "sharded"

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], group) -> None:
        self.optimizer, self.params, self.group = optimizer, params, group

    def prepare(self, fp32_grads: bool = False) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's shard of every gradient. A parameter that got no gradient gets a
        zero one, so that it is stepped as under DDP (decay and momentum still apply)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad.to_local() for p in self.params]

    def unscale(self, scale: float, materialize: bool, with_norm: bool) -> torch.Tensor:
        """fp32 shard gradients /= scale in place, and whether this rank's shards hold
        inf/NaN (GradScaler's kernel)."""
        grads = self.local_grads()
        device = grads[0].device
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale_tensor(scale, device).view(1))
        return found_inf

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm: the squares of this rank's shard norms, summed over the
        ranks."""
        norms = torch._foreach_norm(self.local_grads(), 2.0)
        squares = torch.linalg.vector_norm(torch.stack(norms), 2.0).square()
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(squares, group=self.group)
        return squares.sqrt()

    def update(self, clip_coef: torch.Tensor | None, noise: list) -> None:
        if clip_coef is not None:
            grads = self.local_grads()
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        self.optimizer.step()

    def copy_back(self, noise: list) -> None:
        pass
