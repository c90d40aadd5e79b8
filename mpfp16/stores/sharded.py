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

from ..errors import dtype_name
from ..parallel.fsdp_shim import held_like, is_sharded, unsharded_tensors
from ..parallel.handles import handle_of
from .interface import Checked, HiddenGradients, ParamStore, StoreOptions, storage_bytes
from .nonfinite import find_nonfinite, unscale_and_check
from .state_rules import settle, state_problem

__all__ = ["ShardedStore"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t


class ShardedStore(ParamStore):
    """The inner optimizer's own step on the sharded fp32 parameters (module docstring).

    Args:
        optimizer: the inner optimizer, built over the sharded parameters.
        params: every parameter it holds, in its order.
        options: what FP16Optimizer asks of it (``model``: the model
            :func:`mpfp16.distributed.shard` returned).
    """

    kind = "sharded"
    noun = "a sharded model"
    hooks_gradients = False  # FSDP2 writes the sharded gradients itself, outside autograd's view of them
    shards_gradients = True
    has_half = True
    no_gradient = ("step() was called but no gradient reached the sharded parameters since the last step(): call "
                   "opt.backward(loss) first, with gradient sync on for the last micro-batch "
                   "(mpfp16.distributed.sync_gradients(model, True))")
    # The options a sharded model cannot take, and why (mpfp16.options.check_options
    # words them as the caller spells options: ``say``).
    limits = {
        "accumulate_dtype": lambda say: (
            "FSDP2 sums the micro-batches' unsharded gradients itself, in its reduce_dtype: for an fp32 sum, shard "
            f"with {say('reduce_dtype', torch.float32)} instead"),
        "master_weights": lambda say: (
            "its sharded fp32 parameters are the master weights, from which FSDP2 makes the 16-bit weights at each "
            f"forward; drop {say('master_weights', False)}, or train without masters unsharded"),
        "master_weights_remainder": lambda say: (
            "its fp32 shards are FSDP2's own parameters, from which it makes the bf16 weights at each forward and "
            "frees them after, so there is no bf16 weight kept to hold the rest of a master; drop "
            f"{say('master_weights', 'remainder')}"),
        "fused": lambda say: (
            "mpfp16's fused step works on flat buffers, and the inner optimizer's own step runs on the shards (build "
            f"it with fused=True for torch's fused kernel); drop {say('fused', True)}"),
        "reduce_overflow": lambda say: (
            "each rank sees only its own shards' inf/NaN, so the ranks would make different skip decisions"),
        "state_dtypes": lambda say: (
            "FSDP2's shards are stepped by the inner optimizer itself, whose states it keeps in its parameters' "
            "dtype; drop it, or train unsharded"),
    }

    @classmethod
    def claims(cls, params: list[torch.Tensor]) -> bool:
        return any(is_sharded(p) for p in params)

    @classmethod
    def refusal(cls, optimizer: torch.optim.Optimizer, options: StoreOptions) -> str | None:
        """What the options alone cannot tell (:attr:`limits` says the rest): the model
        must be the one shard() returned, with every parameter sharded, and the overflow
        flag must be reduced over the group the model is sharded over, as the norm is."""
        model, process_group = options.model, options.process_group
        handle = handle_of(model) if model is not None else None
        if handle is None or handle.kind != "sharded":
            return ("a sharded model's optimizer needs model=, the model returned by mpfp16.distributed.shard(): "
                    "its state is saved by parameter name")
        unsharded = [p for group in optimizer.param_groups for p in group["params"] if not is_sharded(p)]
        if unsharded:
            return (f"{len(unsharded)} of the optimizer's parameters are not sharded (the first has shape "
                    f"{list(unsharded[0].shape)}): build the optimizer after shard(model)")
        if process_group is not None and dist.get_process_group_ranks(process_group) != \
                dist.get_process_group_ranks(handle.group):
            return ("process_group is not the group the model is sharded over: a sharded model's overflow flag and "
                    "gradient norm are reduced over its mesh's group; leave process_group unset")
        return None

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], options: StoreOptions) -> None:
        super().__init__()
        handle = handle_of(options.model)
        self.optimizer, self.model = optimizer, options.model
        self.params = self.stepped = list(params)
        self.dtypes = [None] * len(params)
        self.labels = list(options.labels) or [f"param {i} {list(p.shape)}" for i, p in enumerate(params)]
        self.compute_dtype = handle.param_dtype
        self.group = params[0].device_mesh.get_group()
        self.device = params[0].device
        world = dist.get_world_size(self.group)
        self.description = (f"sharded store: {len(self.params)} parameters sharded over {world} "
                            f"process{'es' * (world > 1)} (FSDP2), {dtype_name(self.compute_dtype)} compute")

    # ---------------------------------------------------------------- the phases

    def check(self, *, fp32_grads: bool, with_norm: bool, group=None, agree: bool = True) -> bool:
        problem = state_problem(self.optimizer, self.stepped, self.params, self.labels)
        if problem is not None:
            raise RuntimeError(problem)
        return any(p.grad is not None for p in self.params)

    def zero(self, set_to_none: bool) -> None:
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

    def unscale(self, scale: float, *, materialize: bool, with_norm: bool) -> Checked:
        """fp32 shard gradients *= 1/scale in place, and whether this rank's shards hold
        inf/NaN (GradScaler's kernel); the optimizer reduces the flag over the group."""
        return Checked(unscale_and_check(self._local_grads(), scale).to(self.device), materialized=True)

    def overflow(self, checked: Checked | None, limit: int, before_unscale: bool = False) -> list[tuple[int, int, int]]:
        """This rank's shards of the fp32 gradients (unscaled in place, or not yet:
        inf/NaN are the same); the optimizer gathers the ranks' reports, whose counts
        add up to the whole parameter's."""
        return find_nonfinite(((i, p.grad.to_local()) for i, p in enumerate(self.params) if p.grad is not None),
                              limit)

    def norm(self, checked: Checked) -> torch.Tensor:
        """The global 2-norm: the squares of this rank's shard norms, summed over the
        group."""
        grads = [p.grad.to_local() for p in self.params if p.requires_grad and p.grad is not None]
        norms = torch._foreach_norm(grads, 2.0) if grads else [torch.zeros((), device=self.device)]
        squares = torch.linalg.vector_norm(torch.stack(norms), 2.0).square()
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(squares, group=self.group)
        return squares.sqrt()

    def update(self, checked: Checked, scale: float, clip_coef: torch.Tensor | None, rng: torch.Generator) -> None:
        settle(self.optimizer, self.stepped, self.params, {})
        grads = [p.grad.to_local() for p in self.params if p.requires_grad and p.grad is not None]
        if clip_coef is not None and grads:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        with HiddenGradients(p for p in self.params if not p.requires_grad):  # frozen now
            self.optimizer.step()

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

    def state_out(self) -> list[dict]:
        """The masters are the model's own sharded fp32 parameters."""
        return [{"master": p.detach()} for p in self.params]

    @torch.no_grad()
    def state_in(self, entries: list[dict], legacy: dict, load_inner) -> None:
        """The inner state, each tensor as this rank's shard; then each saved master
        (whole, or of any sharding) into its shard: this rank cuts its own, with no
        communication for a whole one. None: the model's value stays (it was loaded
        first)."""
        load_inner(lambda index, t: held_like(t, self.params[index]))
        for p, entry in zip(self.params, entries):
            if entry.get("master") is not None:
                p.copy_(held_like(entry["master"], p))
