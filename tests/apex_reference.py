"""apex's FP16_Optimizer, as its documentation and code describe its arithmetic, written
per tensor for the tests (apex itself no longer installs with current torch).

- ``backward``: ``(loss.float() * scale).backward()``, then ``update_master_grads``.
- ``update_master_grads``: every fp32 master gradient is the model gradient times
  ``1./scale``; overflow is an inf/NaN anywhere; the amp scaler then halves the scale
  on an overflow (dynamic only) or counts a clean update, doubling after
  ``scale_window`` of them, capped at ``max_loss_scale``.
- ``clip_master_grads``: ``clip_grad_norm_`` over the masters (and fp32 params).
- ``step``: nothing after an overflow; else the inner optimizer's step on the masters,
  then every 16-bit weight = its master.
"""

from __future__ import annotations

import torch


class ApexReference:
    def __init__(self, model, make_inner, scale=1.0, dynamic=False, scale_window=2000, min_loss_scale=None,
                 max_loss_scale=2.0**24, init_scale=2.0**16):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().clone().float().requires_grad_() if p.dtype != torch.float32 else p
                        for p in self.params]
        self.inner = make_inner(self.masters)
        self.dynamic = dynamic
        self.scale = init_scale if dynamic else scale
        self.scale_window, self.min_loss_scale, self.max_loss_scale = scale_window, min_loss_scale, max_loss_scale
        self.unskipped = 0
        self.overflow = False
        self.scales = []

    def zero_grad(self):
        for t in self.params + self.masters:
            if t.grad is not None:
                t.grad.zero_()

    def backward(self, loss):
        (loss.float() * self.scale).backward()
        self.update_master_grads()

    @torch.no_grad()
    def update_master_grads(self):
        overflow = False
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                continue
            overflow |= not bool(torch.isfinite(p.grad).all())
            if m is not p:
                m.grad = p.grad.float()
            m.grad.mul_(1.0 / self.scale)
        if overflow and self.dynamic:
            halved = self.scale / 2.0
            self.scale = max(self.min_loss_scale, halved) if self.min_loss_scale else halved
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.dynamic and self.unskipped == self.scale_window:
            self.scale = min(self.max_loss_scale, self.scale * 2.0)
            self.unskipped = 0
        self.overflow = overflow and self.dynamic
        self.scales.append(self.scale)

    def clip_master_grads(self, max_norm):
        if self.overflow:
            return -1
        return torch.nn.utils.clip_grad_norm_(self.masters, max_norm)

    @torch.no_grad()
    def step(self):
        if self.overflow:
            return
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)
