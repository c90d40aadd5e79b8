"""The sharded store: a model sharded by :func:`mpfp16.distributed.shard` (FSDP2).

The parameters are FSDP2's sharded fp32 DTensors: the master weights themselves, with
fp32 sharded gradients that FSDP2 reduce-scattered from the 16-bit ones. Each phase
works on this rank's shards. The ranks hold different shards, so whatever decides
the step is reduced over the mesh's process group: the overflow flag (by the
optimizer, over :attr:`ShardedStore.group`) and the squares of the shard norms. There
is nothing to copy back: the next forward all-gathers the new values in the compute
dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.fsdp_shim import is_sharded, unsharded_tensors
from ..parallel.handles import handle_of
from .interface import ParamStore, find_nonfinite, storage_bytes, unscale_and_check, whole

__all__ = ["ShardedStore", "holds_sharded"]


def like_shard(t: torch.Tensor, target) -> torch.Tensor:
    """``t`` (whole, or a DTensor of any sharding) as ``target`` (a DTensor) holds it:
    of its dtype, device and sharding; a whole tensor is cut by each rank alone."""
    from torch.distributed.tensor import distribute_tensor

    if is_sharded(t) and (t.device_mesh, tuple(t.placements)) == (target.device_mesh, tuple(target.placements)):
        return t.to(target.dtype)  # of this sharding already
    return distribute_tensor(whole(t).to(dtype=target.dtype, device=target.device), target.device_mesh,
                             target.placements, src_data_rank=None)


def holds_sharded(params) -> bool:
    return any(is_sharded(p) for p in params)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class ShardedStore(ParamStore):
    """The inner optimizer's own step on the sharded fp32 parameters (module docstring).

    Args:
        optimizer: the inner optimizer, built over the sharded parameters.
        params: every parameter it holds, in its order.
        model: the model :func:`mpfp16.distributed.shard` returned.
    """

    kind = "sharded"
    hooks_gradients = False  # FSDP2 writes the sharded gradients itself, outside autograd's view of them
    shards_gradients = True

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], model: torch.nn.Module) -> None:
        super().__init__()
        unsharded = [p for p in params if not is_sharded(p)]
        if unsharded:
            raise ValueError(f"{len(unsharded)} of the optimizer's parameters are not sharded (the first has shape "
                             f"{list(unsharded[0].shape)}): build the optimizer after shard(model)")
        handle = handle_of(model)
        self.optimizer, self.model = optimizer, model
        self.params = self.stepped = list(params)
        self.compute_dtype = handle.param_dtype
        self.has_fp16 = self.compute_dtype == torch.float16
        self.has_half = True
        self.group = params[0].device_mesh.get_group()
        self.device = params[0].device

    @classmethod
    def refusal(cls, *, process_group, model) -> str | None:
        """What the options alone cannot tell (mpfp16.optimizer.check_options says the
        rest): the model must be the one shard() returned, and the overflow flag must
        be reduced over the group the model is sharded over, as the norm is."""
        handle = handle_of(model) if model is not None else None
        if handle is None or handle.kind != "sharded":
            return ("a sharded model's optimizer needs model=, the model returned by mpfp16.distributed.shard(): "
                    "its state is saved by parameter name")
        if process_group is not None and dist.get_process_group_ranks(process_group) != \
                dist.get_process_group_ranks(handle.group):
            return ("process_group is not the group the model is sharded over: a sharded model's overflow flag and "
                    "gradient norm are reduced over its mesh's group; leave process_group unset")
        return None

    def fused_unsupported(self) -> str | None:
        return ("mpfp16's fused step works on flat buffers; the inner optimizer's own step runs on the shards (build "
                "it with fused=True for torch's fused kernel)")

    def explain(self) -> str:
        return (f"sharded store: {len(self.params)} parameters sharded over {dist.get_world_size(self.group)} "
                f"process{'es' * (dist.get_world_size(self.group) > 1)} (FSDP2), {_dtype_name(self.compute_dtype)} "
                "compute")

    # ---------------------------------------------------------------- the phases

    def check_ready(self) -> None:
        pass

    def gradients_present(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def no_gradient_message(self) -> str:
        return ("step() was called but no gradient reached the sharded parameters since the last step(): call "
                "opt.backward(loss) first, with gradient sync on for the last micro-batch "
                "(mpfp16.distributed.sync_gradients(model, True))")

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop the gradients (FSDP2 writes fresh sharded ones at the next synchronized
        backward), whatever ``set_to_none`` says."""
        for p in self.params:
            p.grad = None

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's shard of the gradient of every parameter stepped now. One that
        requires grad and got none gets a zero one, so that it is stepped as under DDP
        (decay and momentum still apply)."""
        for p in self.params:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        return [p.grad.to_local() for p in self.params if p.grad is not None]

    def unscale(self, state, scale: float, materialize: bool, with_norm: bool) -> torch.Tensor:
        """fp32 shard gradients /= scale in place, and whether this rank's shards hold
        inf/NaN (GradScaler's kernel); the optimizer reduces the flag over the group."""
        return unscale_and_check(self._local_grads(), scale).to(self.device)

    def nonfinite_grads(self, state, limit: int, before_unscale: bool = False) -> list[tuple[int, int, int]]:
        """This rank's shards of the fp32 gradients (unscaled in place, or not yet:
        inf/NaN are the same); the optimizer gathers the ranks' reports, whose counts
        add up to the whole parameter's."""
        return find_nonfinite(((i, p.grad.to_local()) for i, p in enumerate(self.params) if p.grad is not None),
                              limit)

    def grad_norm(self, state) -> torch.Tensor:
        """The global 2-norm: the squares of this rank's shard norms, summed over the
        group."""
        grads = [p.grad.to_local() for p in self.params if p.requires_grad and p.grad is not None]
        norms = torch._foreach_norm(grads, 2.0) if grads else [torch.zeros((), device=self.device)]
        squares = torch.linalg.vector_norm(torch.stack(norms), 2.0).square()
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(squares, group=self.group)
        return squares.sqrt()

    def update(self, state, scale: float, clip_coef: torch.Tensor | None, rng: torch.Generator) -> None:
        grads = [p.grad.to_local() for p in self.params if p.requires_grad and p.grad is not None]
        if clip_coef is not None and grads:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        hidden = [(p, p.grad) for p in self.params if not p.requires_grad and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, grad in hidden:
                p.grad = grad

    def copy_back(self) -> None:
        """Nothing to copy: the next forward all-gathers the sharded fp32 values."""

    # ---------------------------------------------------------------- memory and state

    def memory(self) -> dict[str, float]:
        """Bytes this rank holds between steps per parameter of the whole model, by kind:
        ``master_weights`` and ``master_grads`` are this rank's fp32 shards;
        ``model_weights`` and ``model_grads`` the 16-bit unsharded parameters and
        accumulated gradients FSDP2 still holds (none after a resharding backward);
        ``optimizer_state`` this rank's part of the inner state."""
        numel = sum(p.numel() for p in self.params)
        weights, grads = unsharded_tensors(self.model)
        state = [_local(v) for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        report = {
            "model_weights": storage_bytes(weights) / numel,
            "model_grads": storage_bytes(grads) / numel,
            "master_weights": storage_bytes(_local(p) for p in self.params) / numel,
            "master_grads": storage_bytes(_local(p.grad) for p in self.params if p.grad is not None) / numel,
            "optimizer_state": storage_bytes(state) / numel,
            "compensation": 0.0,
            "master_remainder": 0.0,
        }
        report["total"] = sum(report.values())
        return report

    def param_state(self) -> list[dict]:
        """The masters are the model's own sharded fp32 parameters."""
        return [{"master": p.detach()} for p in self.params]

    def saved_dtypes(self) -> list[str | None]:
        return [None] * len(self.params)

    def like_stepped(self, index: int, t: torch.Tensor) -> torch.Tensor:
        return like_shard(t, self.params[index])

    @torch.no_grad()
    def load_state(self, entries: list[dict], legacy: dict) -> None:
        """Each saved master (whole, or of any sharding) into its shard: this rank cuts
        its own, with no communication for a whole one. None: the model's value stays
        (it was loaded first)."""
        for p, entry in zip(self.params, entries):
            if entry.get("master") is not None:
                p.copy_(like_shard(entry["master"], p))
