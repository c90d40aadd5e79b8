"""``FP16_Optimizer``: apex's legacy mixed-precision optimizer wrapper, on FP16Optimizer.

The class keeps apex's constructor, methods and attributes, and apex's order of
events: ``backward()`` scales the loss, runs backward and (unless told not to)
calls ``update_master_grads()``, which finds whether the gradients overflowed and
updates the loss scale right there, as apex does; ``step()`` then skips, or steps.
Underneath, one :class:`mpfp16.FP16Optimizer` (unfused, so the inner optimizer's own
``step()`` runs, as in apex) holds the flat buffers, the fp32 masters and the step.

Where it differs from apex, and why (docs/APEX.md has the full list):

- a static loss scale is checked for overflow, and an overflowing step is skipped
  (apex never checks it: one overflow writes inf into every master), with one
  warning;
- a scale that keeps overflowing at its floor raises ``LossScaleStuckError`` (apex
  halves forever, or skips forever at ``min_loss_scale``);
- overflow is found without unscaling: the gradients are unscaled once, by
  ``step()``, ``clip_master_grads()`` or ``inspect_master_grad_data()``, so several
  ``backward()`` calls per step are exact for fp32 parameters too (apex unscales
  fp32 gradients in place at every ``update_master_grads()``, so the earlier part of
  the sum is divided again);
- ``zero_grad(set_grads_to_None=True)`` zeroes: the gradients are views of flat
  buffers; ``state_dict()`` holds plain values, so ``torch.load(weights_only=True)``
  reads it; CPU and bf16 parameters are accepted; messages go to the ``mpfp16``
  logger instead of ``print``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ...optimizer import FP16Optimizer
from ...overflow import describe_overflow, with_culprits
from ...parallel.ranks import any_rank
from ...scaler import LossScaleStuckError
from ...stores import any_nonfinite
from .loss_scaler import AmpLossScaler

__all__ = ["FP16_Optimizer"]

logger = logging.getLogger("mpfp16")


class FP16_Optimizer:  # noqa: N801 - apex's name
    """apex's ``FP16_Optimizer`` (module docstring).

    Args:
        init_optimizer: a ``torch.optim`` optimizer over the model's parameters
            (16-bit ones get fp32 masters; fp32 ones are stepped directly).
        static_loss_scale: the loss scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: use apex's dynamic loss scaling.
        dynamic_loss_args: keyword arguments of apex's dynamic scaler
            (``init_scale``, ``scale_factor`` (ignored, as by apex), ``scale_window``,
            ``min_loss_scale``, ``max_loss_scale``).
        verbose: log the parameters found in each param group.
    """

    _warned_static_overflow = False

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict | None = None,
                 verbose: bool = True) -> None:
        self.verbose = verbose
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.loss_scaler = (AmpLossScaler("dynamic", **(dynamic_loss_args or {})) if self.dynamic_loss_scale
                            else AmpLossScaler(static_loss_scale))
        self.optimizer = init_optimizer
        self._opt = FP16Optimizer(init_optimizer, loss_scale=self.loss_scaler, fused=False)
        model_of = {id(m): p for p, m in zip(self._opt.model_params(), self._opt.master_params())}
        self.fp16_groups, self.fp32_from_fp16_groups, self.fp32_from_fp32_groups = [], [], []
        for i, group in enumerate(init_optimizer.param_groups):
            fp16, masters, fp32 = [], [], []
            for t in group["params"]:
                model = model_of.get(id(t))
                if model is None or not model.requires_grad:  # frozen: not in apex's lists (the core still
                    continue  # steps it through its master once it is unfrozen)
                if model is t:
                    fp32.append(t)
                else:
                    fp16.append(model)
                    masters.append(t)
            self.fp16_groups.append(fp16)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32)
            if verbose:
                logger.info("FP16_Optimizer param group %d: %d 16-bit parameters (with fp32 masters), %d fp32 "
                            "parameters", i, len(fp16), len(fp32))
        self.overflow = False
        self.first_closure_call_this_step = True
        self.skipped_steps = 0

    # ------------------------------------------------------------------ apex's surface

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.scale = value

    @property
    def last_overflow(self) -> list[dict]:
        """After an overflow, the parameters whose 16-bit gradient held inf or NaN
        (:attr:`mpfp16.FP16Optimizer.last_overflow`); ``[]`` after a clean step."""
        return self._opt.last_overflow

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803 - apex's name
        """Zero the model's gradients and the masters' (``set_grads_to_None`` zeroes
        too: the gradients are views of persistent flat buffers)."""
        self._opt.zero_grad()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward(retain_graph=...)``, then, unless
        ``update_master_grads=False``, :meth:`update_master_grads`."""
        self._opt.backward(loss, retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Find whether the gradients hold inf/NaN, agree on it across ranks, and update
        the loss scale now, as apex does; sets :attr:`overflow`."""
        self.overflow = self._found_inf()
        if self.overflow:  # name the culprits while the gradients are there (every rank is here: agreed)
            self._opt.report_overflow(before_unscale=True)
        try:
            self.loss_scaler.update_scale(self.overflow)
        except LossScaleStuckError as exc:
            raise with_culprits(exc, self._opt.last_overflow) from None
        if self.overflow and not self.loss_scaler.dynamic and not FP16_Optimizer._warned_static_overflow:
            FP16_Optimizer._warned_static_overflow = True
            logger.warning("inf/NaN gradients with a static loss scale of %g: skipping the step (apex would have "
                           "applied it and written inf/NaN into every master weight)", self.loss_scale)

    @torch.no_grad()
    def _found_inf(self) -> bool:
        """Whether any model gradient holds inf/NaN, read without unscaling anything
        (one multi-tensor pass, one host synchronization), the same on every rank."""
        grads = [p.grad for p in self._opt.model_params() if p.requires_grad and p.grad is not None]
        # With no gradient, still take part in the agreement: every rank makes the same collective calls.
        return any_rank(any_nonfinite(grads) if grads else torch.zeros(1, device=self._opt.model_params()[0].device))

    def clip_master_grads(self, max_norm: float, norm_type: float = 2):
        """Clip the unscaled fp32 gradients with ``torch.nn.utils.clip_grad_norm_``;
        return their total norm, or -1 if the gradients overflowed."""
        if self.overflow:
            return -1
        self._opt.unscale_()
        return torch.nn.utils.clip_grad_norm_(self._opt.master_params(), max_norm, norm_type)

    def inspect_master_grad_data(self):
        """Per param group, the masters' unscaled fp32 gradients (None where a parameter
        has none); None after an overflow, with a warning, as apex does."""
        if self.overflow:
            logger.warning("inspect_master_grad_data() after an overflow: the gradients are invalid; returning None")
            return None
        self._opt.unscale_()
        return [[p.grad for p in group["params"]] for group in self.optimizer.param_groups]

    def step(self, closure=None):
        """Skip (after an overflow) or step the masters and copy them into the model.
        Returns what the inner optimizer's ``step`` returns (None when skipped)."""
        if closure is not None:
            return self._step_with_closure(closure)
        if self.overflow:
            self._log_skip()
            return None
        self._opt.step()
        return None

    def _log_skip(self) -> None:
        self.skipped_steps += 1
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            found = describe_overflow(self._opt.last_overflow)
            logger.info("Gradient overflow. Skipping step, loss scale reduced to %g%s", self.loss_scale,
                        f" (inf/NaN: {found})" if found else "")

    def _step_with_closure(self, closure):
        """apex's closure protocol: the closure zeroes the gradients, computes the loss
        and calls :meth:`backward`; it is called again while the gradients overflow,
        and the masters are copied into the model between the inner optimizer's calls
        (LBFGS calls it several times)."""
        calls = 0

        def wrapped_closure():
            nonlocal calls
            if calls:
                self._opt.copy_masters_to_model()
            calls += 1
            loss = closure()
            while self.overflow:
                self._log_skip()
                loss = closure()
            self._opt.unscale_()
            return loss

        result = self.optimizer.step(wrapped_closure)
        self._opt.copy_masters_to_model()
        self.first_closure_call_this_step = True
        return result

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """apex's keys, with plain values only (``torch.load(weights_only=True)``
        reads it): the scaler as a dict, the inner optimizer's state, the masters."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [list(group) for group in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s output, or the optimizer part of an apex checkpoint
        read by :func:`mpfp16.compat.apex.load_apex_checkpoint`. Load the model first.

        Raises:
            ValueError: one line, when the state does not fit this optimizer.
        """
        saved_masters = state_dict["fp32_from_fp16"]
        if [len(g) for g in saved_masters] != [len(g) for g in self.fp32_from_fp16_groups]:
            raise ValueError(f"the state_dict holds masters for {[len(g) for g in saved_masters]} 16-bit "
                             f"parameters per group, this optimizer has {[len(g) for g in self.fp32_from_fp16_groups]}")
        if bool(state_dict["dynamic_loss_scale"]) != self.dynamic_loss_scale:
            raise ValueError(f"the state_dict was saved with dynamic_loss_scale={state_dict['dynamic_loss_scale']} "
                             f"and this optimizer has dynamic_loss_scale={self.dynamic_loss_scale}")
        for gi, (mine, saved) in enumerate(zip(self.fp32_from_fp16_groups, saved_masters)):
            for i, (m, value) in enumerate(zip(mine, saved)):
                if tuple(value.shape) != tuple(m.shape):
                    raise ValueError(f"the state_dict's master {i} of param group {gi} has shape {list(value.shape)} "
                                     f"and this optimizer's {list(m.shape)}")
        position = {id(m): i for i, m in enumerate(self._opt.master_params())}
        masters: list = [None] * len(position)
        for mine, saved in zip(self.fp32_from_fp16_groups, saved_masters):
            for m, value in zip(mine, saved):
                masters[position[id(m)]] = value
        native = self._opt.state_dict()  # keyed by parameter (mpfp16/state_format.py); apex's by index
        keys = list(native["params"])
        inner = state_dict["optimizer_state_dict"]
        native["optimizer"] = {"state": {keys[int(i)]: s for i, s in inner["state"].items()},
                               "param_groups": [{**g, "params": [keys[int(i)] for i in g["params"]]}
                                                for g in inner["param_groups"]]}
        for key, master in zip(keys, masters):
            if master is not None:
                native["params"][key]["master"] = master
        self._opt.load_state_dict(native)
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = bool(state_dict.get("overflow", False))
        self.first_closure_call_this_step = bool(state_dict.get("first_closure_call_this_step", True))

    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.loss_scaler!r}, {self.optimizer!r})"
