"""FP16Optimizer over a model sharded by :func:`mpfp16.distributed.shard`.

``FP16Optimizer(inner, model=model)`` returns this subclass when the inner
optimizer's parameters are sharded (DTensors). The step is the same seven phases
(mpfp16/optimizer.py), on this rank's shards (mpfp16/backends/sharded.py): the
sharded fp32 parameters are the masters, the inf/NaN flag is max-reduced over the
ranks so that every rank skips together, and the clipping norm is the global one.
What differs from the flat-buffer path:

- ``master_weights=False`` is refused: the sharded parameters are fp32 masters by
  construction, and FSDP2 makes the fp16 weights from them at each forward;
- the inner optimizer's own step runs (torch's foreach or fused kernels, as it was
  built); mpfp16's fused kernel works on flat buffers, so ``fused=True`` is refused;
- ``zero_grad()`` drops the gradients (FSDP2 writes fresh sharded ones);
- the state_dict is keyed by parameter name, with the sharded tensors as DTensors
  (save it with :mod:`mpfp16.sharded_checkpoint`, which reshards on load).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .backends.sharded import ShardedBackend
from .optimizer import FP16Optimizer, storage_bytes
from .scaler import DynamicLossScaler, LossScaler
from .sharding import is_sharded, is_sharded_model

__all__ = ["ShardedFP16Optimizer", "SHARDED_STATE_FORMAT"]

SHARDED_STATE_FORMAT = "mpfp16.FP16Optimizer/sharded-1"


class ShardedFP16Optimizer(FP16Optimizer):
    """:class:`mpfp16.FP16Optimizer` for a sharded model (module docstring); build it
    as ``FP16Optimizer(inner, model=model)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, loss_scale="dynamic", master_weights: bool = True,
                 max_grad_norm: float | None = None, *, model: torch.nn.Module | None = None,
                 track_grad_norm: bool = False, process_group: dist.ProcessGroup | None = None,
                 reduce_overflow: bool = True, fused: bool | None = None, rounding: str = "nearest",
                 rounding_seed: int = 0) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if not master_weights:
            raise ValueError("master_weights=False has no meaning for a sharded model: its sharded fp32 parameters "
                             "are the master weights, from which FSDP2 makes the 16-bit weights at each forward; "
                             "train without masters on the unsharded (DDP) path")
        if rounding != "nearest":
            raise ValueError(f"rounding={rounding!r} applies to 16-bit weights stepped directly, which a sharded "
                             "model does not have")
        if fused:
            raise ValueError("fused=True is not possible for a sharded model: mpfp16's fused step works on flat "
                             "buffers; the inner optimizer's own step runs on the shards (build it with fused=True "
                             "for torch's fused kernel)")
        if model is None or not is_sharded_model(model):
            raise ValueError("a sharded model's optimizer needs model=, the model returned by "
                             "mpfp16.distributed.shard(): its state is saved by parameter name")
        self.optimizer = optimizer
        self.rounding = rounding
        self.master_weights = True
        self.max_grad_norm = max_grad_norm
        self.track_grad_norm = bool(track_grad_norm)
        self.process_group = process_group
        self.reduce_overflow = reduce_overflow
        self.skipped_steps = 0
        self.iteration = 0
        self._last_grad_norm = None
        self._model = model
        self._param_dtype = model._mpfp16_param_dtype

        params = self._trainable_params(model)
        unsharded = [p for p in params if not is_sharded(p)]
        if unsharded:
            raise ValueError(f"{len(unsharded)} of the optimizer's parameters are not sharded (the first has shape "
                             f"{list(unsharded[0].shape)}): build the optimizer after shard(model)")
        self._groups = []  # no flat buffers: FSDP2 owns the storage
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._model_params = params
        self._stepped = params
        self._shapes = [list(p.shape) for p in params]
        self._dtypes = [str(p.dtype).replace("torch.", "") for p in params]
        if isinstance(loss_scale, str) and loss_scale == "dynamic":
            # Only fp16 compute needs scaling: bf16 has fp32's exponent range.
            loss_scale = DynamicLossScaler() if self._param_dtype == torch.float16 else LossScaler(1.0)
        self.scaler = self._make_scaler(loss_scale, params)
        self._backend = ShardedBackend(optimizer, params, params[0].device_mesh.get_group())
        self._fused_requested = False
        self._prepared = True

        self._constructing = True
        super(FP16Optimizer, self).__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self._constructing = False
        self._share_inner_state()
        self._in_backward = False
        self._unscaled = None
        self._backward_scale = None
        self._new_step()

    # The misuse guard: FSDP2 writes the sharded gradients itself, outside autograd, so
    # backward() records that it ran (and whether after unscale_()).

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        super().backward(loss, **kwargs)
        self._grads_arrived = True
        self._grads_after_unscale |= self._unscaled is not None

    def _check_ready(self) -> None:
        if not any(p.grad is not None for p in self._stepped):
            raise RuntimeError("step() was called but no gradient reached the sharded parameters since the last "
                               "step(): call opt.backward(loss) first, with gradient sync on for the last "
                               "micro-batch (mpfp16.distributed.sync_gradients(model, True))")
        if self.scaler.scale != 1.0 and not self._grads_arrived:
            raise RuntimeError(f"gradients were computed outside opt.backward() while the loss scale is "
                               f"{self.scaler.scale:g}; they would be unscaled wrongly. Call opt.backward(loss)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (FSDP2 writes fresh sharded ones at the next synchronized
        backward), whatever ``set_to_none`` says, and start a new step."""
        for p in self._stepped:
            p.grad = None
        self._new_step()

    def copy_masters_to_model(self) -> None:
        """Nothing to copy: the next forward all-gathers the sharded fp32 values."""

    @property
    def fused(self) -> bool:
        return False

    # ------------------------------------------------------------------ memory

    def memory_bytes_per_param(self) -> dict[str, float]:
        """Bytes this rank holds between steps per parameter of the whole model, by kind
        (the keys of :meth:`FP16Optimizer.memory_bytes_per_param`): ``master_weights``
        and ``master_grads`` are this rank's fp32 shards; ``model_weights`` and
        ``model_grads`` the 16-bit unsharded parameters and accumulated gradients
        FSDP2 still holds (none after a resharding backward); ``optimizer_state``
        this rank's part of the inner state."""
        numel = sum(p.numel() for p in self._stepped)
        unsharded_weights, unsharded_grads = [], []
        for fsdp_param in _fsdp_params(self._model):
            weight = getattr(fsdp_param, "_unsharded_param", None)
            if weight is not None:
                unsharded_weights.append(weight)
            grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if grad is not None:
                unsharded_grads.append(grad)
        state = [_local(v) for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        report = {
            "model_weights": storage_bytes(unsharded_weights) / numel,
            "model_grads": storage_bytes(unsharded_grads) / numel,
            "master_weights": storage_bytes(_local(p) for p in self._stepped) / numel,
            "master_grads": storage_bytes(_local(p.grad) for p in self._stepped if p.grad is not None) / numel,
            "optimizer_state": storage_bytes(state) / numel,
            "compensation": 0.0,
        }
        report["total"] = sum(report.values())
        return report

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The inner optimizer's state keyed by parameter name (sharded tensors stay
        DTensors), the param groups, the scaler and the counters. The masters are the
        model's own sharded parameters: they are in the model's state_dict."""
        inner = self.optimizer.state_dict()
        index_name = [self._names[id(p)] for p in self._model_params]
        return {
            "format": SHARDED_STATE_FORMAT,
            "optimizer": {
                "state": {index_name[i]: dict(s) for i, s in inner["state"].items()},
                "param_groups": [{**g, "params": [index_name[i] for i in g["params"]]} for g in inner["param_groups"]],
            },
            "param_names": index_name,
            "param_shapes": self._shapes,
            "compute_dtype": str(self._param_dtype).replace("torch.", ""),
            "scaler": self.scaler.state_dict(),
            "scaler_type": type(self.scaler).__name__,
            "skipped_steps": self.skipped_steps,
            "iteration": self.iteration,
        }

    def _check_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or state_dict.get("format") != SHARDED_STATE_FORMAT:
            found = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"not a sharded FP16Optimizer state_dict (format {found!r}, expected "
                             f"{SHARDED_STATE_FORMAT!r}): an unsharded run's state does not load into a sharded one")
        names = [self._names[id(p)] for p in self._model_params]
        if list(state_dict["param_names"]) != names:
            saved = list(state_dict["param_names"])
            first = next((i for i, (a, b) in enumerate(zip(saved, names)) if a != b), min(len(saved), len(names)))
            raise ValueError(f"optimizer state_dict is for other parameters ({len(saved)} saved, {len(names)} here; "
                             f"the first difference at position {first})")
        for name, saved, mine in zip(names, state_dict["param_shapes"], self._shapes):
            if list(saved) != mine:
                raise ValueError(f"optimizer state_dict does not match the model: {name} has shape {list(saved)} "
                                 f"in the state_dict and {mine} here")
        dtype = str(self._param_dtype).replace("torch.", "")
        if state_dict.get("compute_dtype") != dtype:
            raise ValueError(f"the state_dict was saved by a {state_dict.get('compute_dtype')} sharded model and "
                             f"this one computes in {dtype}")
        if state_dict["scaler_type"] != type(self.scaler).__name__:
            raise ValueError(f"the state_dict holds a {state_dict['scaler_type']} state but this optimizer uses a "
                             f"{type(self.scaler).__name__}: use the same loss_scale setting")

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned, its sharded tensors as DTensors of
        this model's sharding (:func:`mpfp16.sharded_checkpoint.load` makes them).

        Raises:
            ValueError: one line, before anything is changed, when it does not fit.
        """
        self._check_state_dict(state_dict)
        position = {self._names[id(p)]: i for i, p in enumerate(self._model_params)}
        saved = state_dict["optimizer"]
        self.optimizer.load_state_dict({
            "state": {position[name]: s for name, s in saved["state"].items()},
            "param_groups": [{**g, "params": [position[name] for name in g["params"]]} for g in saved["param_groups"]],
        })
        self._share_inner_state()
        self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.iteration = int(state_dict["iteration"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_sharded(t) else t


def _fsdp_params(model: torch.nn.Module):
    """FSDP2's per-parameter records (``FSDPParam``) of every unit of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params
