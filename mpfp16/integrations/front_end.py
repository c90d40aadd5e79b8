"""What the front ends that convert the model themselves share (the Lightning plugins,
MPFP16Trainer): their mpfp16 options, checked when the front end is built, before any
trainer runs, and the FP16Optimizer made from them. Imports neither Lightning nor
transformers."""

from __future__ import annotations

import torch

from ..optimizer import FP16Optimizer
from ..options import check_options, check_rounding_seed, make_scaler, state_dtypes_of

__all__ = ["FrontEndOptions"]

ALLREDUCE_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)


class FrontEndOptions:
    """The 16-bit dtype the front end converts the model to, FP16Optimizer's options
    (:func:`mpfp16.options.check_options`' rules, the scaler, the optimizer states'
    dtypes), the DDP hook's wire dtype and the rounding seed; a bad one is refused in one
    line naming it (the states' dtypes against the inner optimizer's class when the
    trainer has made it)."""

    def __init__(self, dtype, master_weights, loss_scale, rounding, accumulate_dtype, fused, rounding_seed,
                 allreduce_dtype, *, state_dtype=None, state_dtypes=None, state_rounding="nearest") -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        check_options(master_weights=master_weights, rounding=rounding, fused=fused, accumulate_dtype=accumulate_dtype,
                      dtypes={dtype})
        make_scaler(loss_scale, dtype)  # refuses a bad loss_scale now
        if allreduce_dtype not in ALLREDUCE_DTYPES:
            raise ValueError(f"allreduce_dtype must be None, torch.float16, torch.bfloat16 or torch.float32, "
                             f"got {allreduce_dtype}")
        check_rounding_seed(rounding_seed)
        self.dtype, self.master_weights, self.loss_scale, self.rounding = dtype, master_weights, loss_scale, rounding
        self.accumulate_dtype, self.fused, self.rounding_seed = accumulate_dtype, fused, rounding_seed
        self.allreduce_dtype = allreduce_dtype
        state_dtypes_of(None, state_dtype, state_dtypes, state_rounding)  # refuses a bad one now
        self.state_dtype, self.state_dtypes, self.state_rounding = state_dtype, state_dtypes, state_rounding

    def build(self, inner: torch.optim.Optimizer, model: torch.nn.Module, loss_scale=None) -> FP16Optimizer:
        """The FP16Optimizer over ``inner``, the torch optimizer the trainer made over
        ``model``'s parameters (``loss_scale``: in place of the option's, for a front end
        that gives each optimizer its own copy of a scaler)."""
        if isinstance(inner, torch.optim.LBFGS):
            raise ValueError("LBFGS evaluates its closure many times per step; FP16Optimizer steps once per backward "
                             "pass: use another optimizer")
        return FP16Optimizer(inner, loss_scale=self.loss_scale if loss_scale is None else loss_scale,
                             master_weights=self.master_weights, model=model, fused=self.fused, rounding=self.rounding,
                             rounding_seed=self.rounding_seed, accumulate_dtype=self.accumulate_dtype,
                             state_dtype=self.state_dtype, state_dtypes=self.state_dtypes,
                             state_rounding=self.state_rounding)
