"""mpfp16: a small, exact fp16/bf16 mixed-precision trainer for PyTorch.

    model = mpfp16.to_half(model)                       # 16-bit weights, fp32 norm layers
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt.zero_grad(); opt.backward(loss); opt.step()     # step() is False when skipped
"""

from . import distributed
from .convert import cast_floating, model_dtype, to_float, to_half
from .flat_buffers import flatten_parameters
from .optimizer import FP16Optimizer
from .errors import ReplicaDivergenceError
from .scaler import DynamicLossScaler, LossScaler, LossScaleStuckError

__all__ = [
    "to_half",
    "to_float",
    "flatten_parameters",
    "model_dtype",
    "cast_floating",
    "FP16Optimizer",
    "LossScaler",
    "DynamicLossScaler",
    "LossScaleStuckError",
    "ReplicaDivergenceError",
    "distributed",
]

__version__ = "0.5.0"
