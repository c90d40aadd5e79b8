"""What a training run is built of, from its config: the process group, the data, the
model in its precision (16-bit with fp32 masters, or sharded), the optimizer, the DDP
wrapper and the learning-rate schedule. Each function builds one part; the engine
calls them in order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import distributed as mdist
from ..convert import NORM_TYPES, to_half
from ..errors import UserError
from ..flat_buffers import flatten_parameters
from ..optimizer import FP16Optimizer
from . import data as data_mod
from . import models
from .config import SYNTHETIC_SIZES, TORCH_DTYPES, TrainConfig
from .schedule import lr_multiplier

__all__ = ["Data", "Schedule", "init_distributed", "image_size", "check_model_fits", "data", "model",
           "param_groups", "optimizer", "wrap", "schedule", "beyond_the_schedule"]

logger = logging.getLogger("mpfp16")

def init_distributed(cfg: TrainConfig) -> mdist.DistInfo:
    """torch.distributed from torchrun's environment; a sharded run on one process gets
    a process group of itself (FSDP2 needs one)."""
    return mdist.init(backend=cfg.dist_backend, timeout_s=cfg.dist_timeout, device=cfg.device,
                      group_of_one=cfg.shard)


def image_size(cfg: TrainConfig, epoch: int) -> int:
    """The training crop size of ``epoch``: ``--image-size``, or the resize phase it is in."""
    size = cfg.image_size
    for start, phase_size in cfg.resize_phases:
        if epoch >= start:
            size = phase_size
    return size


def check_model_fits(cfg: TrainConfig) -> None:
    """Refuse an unknown arch, or an image size it cannot take, before any data is loaded."""
    models.check_arch(cfg.task, cfg.arch)
    # The sizes the epochs train at: a phase that starts at epoch 0 replaces --image-size.
    sizes = [image_size(cfg, 0)] + [size for start, size in cfg.resize_phases if start > 0]
    models.check_image_sizes(cfg.task, cfg.arch, sizes)


@dataclass
class Data:
    spec: data_mod.DataSpec
    train_sampler: data_mod.ResumableDistributedSampler
    val_sampler: data_mod.ShardSampler
    mean: torch.Tensor  # (1, 3, 1, 1), in 0..255 pixel units
    std: torch.Tensor


def data(cfg: TrainConfig, info: mdist.DistInfo) -> Data:
    if cfg.task == "cifar":
        spec = data_mod.cifar_data(cfg.data, cfg.seed, cfg.synthetic_size or SYNTHETIC_SIZES[cfg.task])
    else:
        spec = data_mod.imagenet_data(cfg.data, image_size(cfg, 0), cfg.seed, cfg.bad_images,
                                      cfg.synthetic_size or SYNTHETIC_SIZES[cfg.task])
    logger.info("data: %s", spec.description)
    warning = data_mod.single_class_warning(spec)
    if warning and info.is_main_process:  # once, not on every rank
        logger.warning("%s", warning)
    shape = (1, 3, 1, 1)
    return Data(spec=spec,
                train_sampler=data_mod.ResumableDistributedSampler(spec.train, info.world_size, info.rank,
                                                                   shuffle=True, seed=cfg.seed),
                val_sampler=data_mod.ShardSampler(len(spec.val), info.world_size, info.rank),
                mean=torch.tensor(spec.mean, device=info.device).view(shape) * 255,
                std=torch.tensor(spec.std, device=info.device).view(shape) * 255)


def model(cfg: TrainConfig, num_classes: int, info: mdist.DistInfo) -> nn.Module:
    """The model on its device, in the run's precision: 16-bit with fp32 normalization
    layers (``to_half``), or, with ``--shard``, its fp32 parameters sharded by FSDP2
    (they are the masters)."""
    if cfg.task == "cifar":
        net = models.build_cifar_model(cfg.arch, num_classes)
    else:
        net = models.build_imagenet_model(cfg.arch, num_classes, image_size=image_size(cfg, 0))
    if cfg.zero_init_residual:
        count = models.zero_init_residual_bn(net)
        logger.info("zero-initialized the last BatchNorm gamma of %d residual blocks", count)
    net = net.to(info.device)
    if cfg.channels_last:
        net = net.to(memory_format=torch.channels_last)
    dtype = TORCH_DTYPES[cfg.precision]
    if cfg.shard:  # the fp32 parameters become the sharded masters
        net = mdist.shard(net, dtype, reduce_dtype=TORCH_DTYPES.get(cfg.allreduce_dtype))
    elif dtype != torch.float32:
        to_half(net, dtype)
    else:
        flatten_parameters(net)  # as to_half does: nothing moves when DDP wraps the model
    n = sum(p.numel() for p in net.parameters())
    masters = "" if cfg.precision == "fp32" else (
        " with fp32 master weights held as the bf16 weights and 16-bit remainders" if cfg.master_weights == "remainder"
        else " with fp32 master weights" if cfg.master_weights else " without master weights")
    sharded = f", sharded over {info.world_size} process{'es' * (info.world_size > 1)} (FSDP2)" if cfg.shard else ""
    logger.info("model: %s, %.2fM parameters, %s%s%s", cfg.arch, n / 1e6, cfg.precision, masters, sharded)
    return net


def param_groups(net: nn.Module, weight_decay: float, no_bn_wd: bool) -> list[dict]:
    """One group, or, with ``no_bn_wd``, normalization-layer parameters and biases in a
    group without weight decay."""
    params = [p for p in net.parameters() if p.requires_grad]
    if not no_bn_wd:
        return [{"params": params, "weight_decay": weight_decay}]
    no_decay_ids = set()
    for module in net.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, NORM_TYPES) or name == "bias" or p.ndim <= 1:
                no_decay_ids.add(id(p))
    return [{"params": [p for p in params if id(p) not in no_decay_ids], "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) in no_decay_ids], "weight_decay": 0.0}]


def optimizer(cfg: TrainConfig, net: nn.Module, world_size: int) -> FP16Optimizer:
    lr = cfg.lr
    if cfg.scale_lr:
        lr = cfg.lr * cfg.batch_size * cfg.accum_steps * world_size / 256
        logger.info("learning rate %.4g for a global batch of %d (%.4g per 256)", lr,
                    cfg.batch_size * cfg.accum_steps * world_size, cfg.lr)
    groups = param_groups(net, cfg.weight_decay, cfg.no_bn_wd)
    build = {"sgd": lambda: torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov),
             "adamw": lambda: torch.optim.AdamW(groups, lr=lr)}
    try:
        inner = build[cfg.optimizer]()  # validate() refused any other name
    except ValueError as exc:  # e.g. Nesterov without momentum
        raise UserError(f"optimizer settings: {exc}") from None
    loss_scale = None if cfg.precision != "fp16" else cfg.loss_scale
    try:
        return FP16Optimizer(inner, loss_scale=loss_scale, master_weights=cfg.master_weights,
                             max_grad_norm=cfg.max_grad_norm, model=net, track_grad_norm=True,
                             fused=cfg.fused_option, rounding=cfg.rounding if cfg.precision != "fp32" else "nearest",
                             rounding_seed=cfg.seed,
                             accumulate_dtype=TORCH_DTYPES.get(cfg.accumulate_dtype) if cfg.precision != "fp32" else None,
                             state_dtype=TORCH_DTYPES[cfg.state_dtype], state_rounding=cfg.state_rounding)
    except ValueError as exc:  # --fused on with an optimizer it cannot fuse
        raise UserError(str(exc)) from None


def wrap(cfg: TrainConfig, net: nn.Module, info: mdist.DistInfo) -> nn.Module:
    """The module a training step calls: DDP over ``net`` when there are several
    processes; ``net`` itself on one, or when sharded (its forward is FSDP2's)."""
    if not info.distributed or cfg.shard:
        return net
    return mdist.wrap(net, allreduce_dtype=TORCH_DTYPES.get(cfg.allreduce_dtype),
                      predivide_factor=cfg.predivide_factor, bucket_mb=cfg.bucket_mb,
                      strategy=cfg.allreduce_strategy, powersgd_rank=cfg.powersgd_rank,
                      powersgd_start_iter=cfg.powersgd_start_iter)


@dataclass
class Schedule:
    scheduler: torch.optim.lr_scheduler.LambdaLR
    steps_per_epoch: int
    total_steps: int  # where the run stops: the end of the schedule (--epochs), or --max-steps before it
    max_steps: int | None  # --max-steps where it stops the run before --epochs does, else None
    epochs_shown: int  # --epochs


def schedule(cfg: TrainConfig, opt: FP16Optimizer, train_samples: int) -> Schedule:
    """The learning-rate schedule, over ``--epochs``; ``--max-steps`` only says where to
    stop, so that a run stopped early and resumed follows the same schedule as one that
    was not. It only shortens a run: one beyond the schedule's end is said in one line,
    and the run ends at ``--epochs`` (it went on at lr 0 before).

    Raises:
        UserError: an epoch has no full optimizer step.
    """
    steps_per_epoch = train_samples // cfg.batch_size // cfg.accum_steps
    if steps_per_epoch == 0:
        raise UserError(
            f"an epoch has no full optimizer step: {train_samples} training samples per process "
            f"for a batch of {cfg.batch_size} x {cfg.accum_steps} accumulation steps; lower -b or --accum-steps"
        )
    schedule_steps = cfg.epochs * steps_per_epoch
    total_steps = min(cfg.max_steps, schedule_steps) if cfg.max_steps is not None else schedule_steps
    line = beyond_the_schedule(cfg.max_steps, cfg.epochs, schedule_steps)
    if line:
        logger.info("%s", line)
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_multiplier(s, schedule_steps, warmup, cfg.lr_schedule))
    max_steps = cfg.max_steps if cfg.max_steps is not None and cfg.max_steps < schedule_steps else None
    return Schedule(scheduler, steps_per_epoch, total_steps, max_steps, cfg.epochs)


def beyond_the_schedule(max_steps: int | None, epochs: int, schedule_steps: int) -> str | None:
    """The line that says a ``--max-steps`` beyond the end of the schedule is not
    reached, or None.

    Not a refusal: ``--max-steps`` is a cap that stops a run early (a budget, the same
    over runs of different lengths, and free to change on resume), and a cap the run
    does not reach changes nothing it asked for: the schedule and the run end at
    ``--epochs``. Training on past it, at lr 0, was the silent divergence."""
    if max_steps is None or max_steps <= schedule_steps:
        return None
    return (f"--max-steps {max_steps} is beyond the end of the schedule: the run ends with --epochs {epochs}, at "
            f"step {schedule_steps} (--max-steps only shortens a run; raise --epochs to train longer)")
