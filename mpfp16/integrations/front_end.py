"""What the front ends that convert the model themselves share (the Lightning plugins,
MPFP16Trainer): their mpfp16 options, checked when the front end is built, before any
trainer runs, and the FP16Optimizer made from them. Imports neither Lightning nor
transformers."""

from __future__ import annotations

import torch

from ..convert import to_half
from ..optimizer import FP16Optimizer
from ..options import check_options, check_rounding_seed, make_scaler, state_dtypes_of

__all__ = ["FrontEndOptions", "show_unscaled_gradients", "take_written_gradients", "written"]

ALLREDUCE_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)


class FrontEndOptions:
    """The 16-bit dtype the front end converts the model to, FP16Optimizer's options
    (:func:`mpfp16.options.check_options`' rules, the scaler, the optimizer states'
    dtypes), the DDP hook's wire dtype and the rounding seed; a bad one is refused in one
    line naming it (the states' dtypes against the inner optimizer's class when the
    trainer has made it)."""

    def __init__(self, dtype, master_weights, loss_scale, rounding, accumulate_dtype, fused, rounding_seed,
                 allreduce_dtype, *, state_dtype=None, state_dtypes=None, state_rounding="nearest",
                 keep_fp32=(), keep_inputs=()) -> None:
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
        self.keep_fp32 = _checked_keep_fp32(keep_fp32)
        if isinstance(keep_inputs, (str, int)):
            keep_inputs = (keep_inputs,)
        if not all((isinstance(k, str) and k) or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)
                   for k in keep_inputs):
            raise TypeError(f"keep_inputs takes input names (and a batch's positions), not {keep_inputs!r}")
        self.keep_inputs = tuple(keep_inputs)

    def convert(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` converted in place as :func:`mpfp16.to_half` converts it, to this
        dtype, with the modules ``keep_fp32`` names kept fp32 and the keyword inputs
        ``keep_inputs`` names left in their dtype."""
        return to_half(model, self.dtype, keep_fp32=self.keep_fp32,
                       keep_inputs=[k for k in self.keep_inputs if isinstance(k, str)])

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


def _checked_keep_fp32(keep_fp32) -> tuple:
    """``keep_fp32`` as a tuple of module classes and names; anything else refused in one
    line now, before any trainer runs (names are matched when the model is converted)."""
    if isinstance(keep_fp32, (str, type)):
        keep_fp32 = (keep_fp32,)
    try:
        entries = tuple(keep_fp32 or ())
    except TypeError:
        raise TypeError(f"keep_fp32 takes a list of module classes and module names, not {keep_fp32!r}") from None
    for entry in entries:
        if not ((isinstance(entry, type) and issubclass(entry, torch.nn.Module)) or (isinstance(entry, str) and entry)):
            raise TypeError(f"keep_fp32 takes module classes and module names, not {entry!r}")
    return entries


@torch.no_grad()
def show_unscaled_gradients(opt: FP16Optimizer) -> None:
    """After ``opt.unscale_()``, for a framework's hook that reads the model's gradients
    before the step (Lightning's ``on_before_optimizer_step``, the transformers
    Trainer's ``on_pre_optimizer_step``): each 16-bit ``.grad`` set to its unscaled
    fp32 gradient rounded to 16 bits, as the hook reads it under torch.amp. The step
    reads the fp32 gradients that ``unscale_()`` wrote."""
    pairs = [(p.grad, m.grad) for p, m in zip(opt.model_params(), opt.master_params())
             if p is not m and p.grad is not None and m.grad is not None]
    if pairs:
        torch._foreach_copy_([g for g, _ in pairs], [m for _, m in pairs])


@torch.no_grad()
def take_written_gradients(opt: FP16Optimizer) -> None:
    """After such a hook: a 16-bit ``.grad`` it wrote (zeroed, scaled, clipped again)
    becomes its master's gradient, which the step reads, as an fp32 step reads what a
    hook writes; an element whose bits are still its fp32 gradient's rounding keeps the
    fp32 value."""
    for p, m in zip(opt.model_params(), opt.master_params()):
        if p is m or p.grad is None or m.grad is None:
            continue
        mask = written(p.grad, m.grad)
        if bool(mask.any()):
            torch.where(mask, p.grad.float(), m.grad, out=m.grad)


def written(sixteen: torch.Tensor, fp32: torch.Tensor) -> torch.Tensor:
    """The elements of a 16-bit tensor whose bits are not its fp32 twin's rounding to
    nearest: what was written into it since it was copied from the fp32 values (a
    weight from its master, a gradient from its unscaled fp32 one). NaN-safe: bits,
    not values, are compared."""
    return sixteen.detach().view(torch.int16) != fp32.to(sixteen.dtype).view(torch.int16)
