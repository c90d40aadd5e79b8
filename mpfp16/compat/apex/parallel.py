"""apex's ``DistributedDataParallel``, mapped onto :func:`mpfp16.distributed.wrap`.

==========================================  ==========================================
apex                                        here
==========================================  ==========================================
``message_size`` (elements per bucket)      ``bucket_mb`` of that many elements
``delay_allreduce=True``                    one bucket for every gradient: its
                                            allreduce starts when backward is done
``allreduce_always_fp32``                   ``allreduce_dtype=torch.float32``
``gradient_predivide_factor``               ``predivide_factor`` (the same division)
``gradient_average_split_factor``           its old name, mapped the same way
``gradient_average=False`` (sums)           refused: gradients are always averaged
``shared_param``, ``allreduce_trigger_      refused: no faithful mapping (torch's DDP
params``, ``retain_allreduce_buffers``,     decides bucketing and streams itself)
``num_allreduce_streams``, ``allreduce_
communicators``, ``prof``
==========================================  ==========================================

The module's parameters are placed in mpfp16's flat buffers first, so that an
``FP16_Optimizer`` built afterwards (apex's order) moves nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ... import distributed as mdist
from ...flat_buffers import flatten_parameters

__all__ = ["DistributedDataParallel"]

_UNMAPPED = {"shared_param": None, "allreduce_trigger_params": None, "retain_allreduce_buffers": False,
             "num_allreduce_streams": 1, "allreduce_communicators": None, "prof": False}


def DistributedDataParallel(module: nn.Module, message_size: int = 10_000_000, delay_allreduce: bool = False,  # noqa: N802
                            allreduce_always_fp32: bool = False, gradient_average: bool = True,
                            gradient_predivide_factor: float = 1.0, gradient_average_split_factor: float | None = None,
                            **unmapped) -> nn.Module:
    """Wrap ``module`` as apex's DDP would, in torch's DDP with mpfp16's hook (module
    docstring); returns the ``torch.nn.parallel.DistributedDataParallel``.

    Raises:
        ValueError: an option with no faithful mapping, in one line.
    """
    for name, value in unmapped.items():
        if name not in _UNMAPPED:
            raise TypeError(f"DistributedDataParallel got an unexpected keyword argument {name!r}")
        if value != _UNMAPPED[name]:
            raise ValueError(f"apex DistributedDataParallel's {name}={value!r} has no faithful mapping onto torch's "
                             "DistributedDataParallel; drop it")
    if not gradient_average:
        raise ValueError("gradient_average=False (summed gradients) has no faithful mapping: mpfp16 averages; "
                         "multiply the learning rate by the world size instead")
    if gradient_average_split_factor is not None:
        gradient_predivide_factor = gradient_average_split_factor
    flatten_parameters(module)
    params = [p for p in module.parameters() if p.requires_grad]
    itemsize = params[0].element_size() if params else 2
    if delay_allreduce:
        bucket_mb = max(1.0, sum(p.numel() * p.element_size() for p in params) / 2**20 + 1)
    else:
        bucket_mb = message_size * itemsize / 2**20
    return mdist.wrap(module, allreduce_dtype=torch.float32 if allreduce_always_fp32 else None,
                      predivide_factor=gradient_predivide_factor, bucket_mb=bucket_mb)
