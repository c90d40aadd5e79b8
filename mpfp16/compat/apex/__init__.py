"""apex's legacy mixed-precision API, for apex-era code to run unchanged on mpfp16.

Port by changing the import::

    from apex.fp16_utils import FP16_Optimizer, network_to_half      # before
    from mpfp16.compat.apex import FP16_Optimizer, network_to_half   # after

apex removed ``fp16_utils`` and ``apex.parallel`` in 2025, and their compiled parts no
longer build with current torch. Numerics, skips and loss-scale sequences follow
apex's ``FP16_Optimizer`` bit for bit wherever apex is right; where it is not, this
does the right thing, warns once, and docs/APEX.md says so.
"""

from .checkpoint import load_apex_checkpoint
from .fp16_optimizer import FP16_Optimizer
from .fp16util import (BN_convert_float, FP16Model, clip_grad_norm, convert_module, convert_network,
                       master_params_to_model_params, model_grads_to_master_grads, network_to_half,
                       prep_param_lists, tofp16)
from .loss_scaler import DynamicLossScaler, LossScaler, to_python_float
from .parallel import DistributedDataParallel

__all__ = ["FP16_Optimizer", "network_to_half", "BN_convert_float", "FP16Model", "tofp16", "convert_module",
           "convert_network", "prep_param_lists", "model_grads_to_master_grads", "master_params_to_model_params",
           "to_python_float", "clip_grad_norm", "LossScaler", "DynamicLossScaler", "DistributedDataParallel",
           "load_apex_checkpoint"]
