"""The mixed-precision step, per tensor, in one screen: the definition.

:class:`ReferenceStep` is the algorithm FP16Optimizer implements, written with plain
torch operations, one tensor at a time, in the order of the step: copy the 16-bit
gradients to fp32 and unscale them, check them for inf/NaN, skip (back the scale off)
or clip, step the fp32 masters with an ordinary torch optimizer, copy the masters back
into the 16-bit model, let the scale grow. Nothing here is fast; everything is
readable. Each of FP16Optimizer's stores (flat buffers, fused kernels, per-tensor,
FSDP2 shards) is proven to step as this does, under every change torch lets a user make
to the optimizer between steps (tests/test_store_conformance.py). Cite this file for
what mpfp16 computes, and compare an extension with it::

    ref = ReferenceStep(model.parameters(), lambda masters: torch.optim.AdamW(masters, lr=1e-3))
    ref.backward(loss)       # (loss.float() * scale).backward()
    ref.step()               # False when skipped

With ``state_dtype=torch.bfloat16`` the optimizer's states are kept in bf16 between
steps: widened for the fp32 step, and the new ones rounded to nearest once.
"""

from __future__ import annotations

import torch

from .scaler import DynamicLossScaler, LossScaler

__all__ = ["ReferenceStep"]


class ReferenceStep:
    """fp32 masters of a model's 16-bit parameters, stepped by a plain torch optimizer.

    Args:
        params: the model's parameters (16-bit ones get an fp32 master; fp32 ones, a
            normalization layer's, are stepped as they are).
        make_optimizer: ``make_optimizer(masters)`` -> the torch optimizer over them.
        scaler: the loss scale (default: a :class:`~mpfp16.DynamicLossScaler`).
        max_grad_norm: clip the global 2-norm of the unscaled fp32 gradients.
        master_weights: False steps the 16-bit weights directly: each step starts from
            them widened, and rounds its result to nearest.
        state_dtype: keep the optimizer's floating states in this dtype between steps.
    """

    def __init__(self, params, make_optimizer, scaler: LossScaler | None = None, max_grad_norm: float | None = None,
                 master_weights: bool = True, state_dtype: torch.dtype = torch.float32) -> None:
        self.params = list(params)
        self.masters = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in self.params]
        self.optimizer = make_optimizer(self.masters)
        self.scaler = scaler if scaler is not None else DynamicLossScaler()
        self.max_grad_norm, self.master_weights, self.state_dtype = max_grad_norm, master_weights, state_dtype

    def backward(self, loss: torch.Tensor) -> None:
        (loss.float() * self.scaler.scale).backward()

    @torch.no_grad()
    def step(self) -> bool:
        """One step, in the order of FP16Optimizer's phases; False when skipped."""
        if not self.unscale():
            self.skip()
            return False
        self.clip()
        self.update()
        return True

    def unscale(self) -> bool:
        """1. The 16-bit gradients copied to fp32 and unscaled (a parameter that requires
        grad and got none gets a zero one, as under DDP); 2. whether all are finite."""
        inv_scale = torch.tensor(1.0 / self.scaler.scale, dtype=torch.float32)  # GradScaler's reciprocal
        for p, m in zip(self.params, self.masters):
            grad = (p.grad if p.grad is not None else torch.zeros_like(p)) if p.requires_grad else None
            m.grad = None if grad is None else grad.float() * inv_scale
        return all(bool(torch.isfinite(m.grad).all()) for m in self.masters if m.grad is not None)

    def skip(self) -> None:
        """3. An inf or NaN: nothing is stepped, and the scale backs off."""
        self._zero_grad()
        self.scaler.update(True)

    def clip(self, total_norm: torch.Tensor | None = None) -> None:
        """4. The unscaled gradients clipped to ``max_grad_norm`` by their global norm
        (``total_norm``: that norm, where it is known)."""
        if self.max_grad_norm is not None:
            stepped = [m for m in self.masters if m.grad is not None]
            norm = torch.nn.utils.get_total_norm([m.grad for m in stepped]) if total_norm is None else total_norm
            torch.nn.utils.clip_grads_with_norm_(stepped, self.max_grad_norm, norm)

    def update(self) -> None:
        """5. The masters stepped (without master weights, from the 16-bit weights
        widened); 6. copied back into the model, rounded to nearest; 7. the scale grows
        after its interval of clean steps."""
        for p, m in zip(self.params, self.masters):
            if m is not p and not self.master_weights:
                m.copy_(p)
        self._states(self.state_dtype)  # each state in its dtype (one assigned in another converted, to nearest)
        self._states(torch.float32)  # widened for the fp32 step
        self.optimizer.step()
        self._states(self.state_dtype)  # the new states rounded to their dtype, once
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)
        self._zero_grad()
        self.scaler.update(False)

    def load_optimizer_state(self, state_dict: dict) -> None:
        """The optimizer's state loaded (torch's load makes every state fp32), kept in
        its dtype from the load on."""
        self.optimizer.load_state_dict(state_dict)
        self._states(self.state_dtype)

    def _states(self, dtype: torch.dtype) -> None:
        for entry in self.optimizer.state.values():
            for name, value in entry.items():
                if name != "step" and torch.is_tensor(value) and value.is_floating_point() and value.dtype != dtype:
                    entry[name] = value.to(dtype)

    def _zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None
