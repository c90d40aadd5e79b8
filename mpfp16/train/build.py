"""What a training run is built of, from its config: the process group, the data, the
model in its precision (16-bit with fp32 masters, or sharded), the optimizer, the DDP
wrapper and the learning-rate schedule. Each function builds one part; the engine
calls them in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import distributed as mdist
from ..convert import NORM_TYPES, fp32_modules, to_half
from ..errors import UserError
from ..flat_buffers import flatten_parameters
from ..optimizer import FP16Optimizer
from . import augment
from . import data as data_mod
from . import models
from .config import EMBEDDING_KEYS, SYNTHETIC_SIZES, TORCH_DTYPES, TrainConfig
from .schedule import lr_multiplier, torchvision_multiplier

__all__ = ["Data", "Schedule", "init_distributed", "image_size", "check_model_fits", "data", "model",
           "param_groups", "weight_decay_groups", "TORCHVISION_NORM_TYPES", "inner_optimizer", "learning_rate",
           "optimizer", "wrap", "schedule", "lr_lambda", "beyond_the_schedule", "deterministic_algorithms"]

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
    if cfg.task == "imagenet" and models.has_fixed_input_size(cfg.task, cfg.arch):
        crop = cfg.val_sizes(sizes[0])[1]
        if crop != sizes[0]:  # validate() refused a crop larger than the resize
            raise models.ImageSizeError(f"{cfg.arch} is built for one image size, {sizes[0]}, and cannot take "
                                        f"--val-crop-size {crop}: drop --val-crop-size, or give it {sizes[0]}")
    elif cfg.task == "imagenet" and cfg.val_crop_size is not None:
        models.check_image_sizes(cfg.task, cfg.arch, [cfg.val_crop_size])


@dataclass
class Data:
    spec: data_mod.DataSpec
    train_sampler: data_mod.ResumableDistributedSampler  # or, with --ra-sampler, a RepeatedAugmentationSampler
    val_sampler: data_mod.ShardSampler
    mean: torch.Tensor  # (1, 3, 1, 1), in 0..255 pixel units
    std: torch.Tensor


def data(cfg: TrainConfig, info: mdist.DistInfo) -> Data:
    """The data sets with the recipe's augmentation and validation sizes
    (:mod:`mpfp16.train.augment`), and the samplers: the training one with
    ``--ra-sampler``'s repeated augmentation where asked (mpfp16/train/sampler.py)."""
    augmentation = augment.Augmentation.from_config(cfg)
    if cfg.task == "cifar":
        spec = data_mod.cifar_data(cfg.data, cfg.seed, cfg.synthetic_size or SYNTHETIC_SIZES[cfg.task],
                                   augmentation=augmentation)
    else:
        spec = data_mod.imagenet_data(cfg.data, image_size(cfg, 0), cfg.seed, cfg.bad_images,
                                      cfg.synthetic_size or SYNTHETIC_SIZES[cfg.task], augmentation=augmentation)
    logger.info("data: %s", spec.description)
    warning = data_mod.single_class_warning(spec)
    if warning and info.is_main_process:  # once, not on every rank
        logger.warning("%s", warning)
    shape = (1, 3, 1, 1)
    return Data(spec=spec,
                train_sampler=data_mod.train_sampler(spec.train, info.world_size, info.rank, seed=cfg.seed,
                                                     ra_sampler=cfg.ra_sampler, ra_reps=cfg.ra_reps),
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
    if cfg.weights is not None:
        logger.info("weights: %s", models.load_weights(net, cfg.weights))
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
        to_half(net, dtype, keep_fp32=models.fp32_norm_classes(net))
    else:
        flatten_parameters(net)  # as to_half does: nothing moves when DDP wraps the model
    n = sum(p.numel() for p in net.parameters())
    masters = "" if cfg.precision == "fp32" else (
        " with fp32 master weights held as the bf16 weights and 16-bit remainders" if cfg.master_weights == "remainder"
        else " with fp32 master weights" if cfg.master_weights else " without master weights")
    sharded = f", sharded over {info.world_size} process{'es' * (info.world_size > 1)} (FSDP2)" if cfg.shard else ""
    logger.info("model: %s, %.2fM parameters, %s%s%s", cfg.arch, n / 1e6, cfg.precision, masters, sharded)
    return net


def param_groups(net: nn.Module, weight_decay: float, no_bn_wd: bool, norm_weight_decay: float | None = None,
                 bias_weight_decay: float | None = None,
                 transformer_embedding_decay: float | None = None) -> list[dict]:
    """The optimizer's param groups and their weight decay.

    Without torchvision's per-kind decays: one group, or, with ``no_bn_wd``,
    normalization-layer parameters, biases and every 1-d parameter in a group without
    weight decay (the groups of runs before the recipe existed, which their
    checkpoints hold). With any of them: :func:`weight_decay_groups`, torchvision's rule.
    """
    if norm_weight_decay is not None or bias_weight_decay is not None or transformer_embedding_decay is not None:
        custom = [("bias", bias_weight_decay)] if bias_weight_decay is not None else []
        if transformer_embedding_decay is not None:
            custom += [(key, transformer_embedding_decay) for key in EMBEDDING_KEYS]
        return weight_decay_groups(net, weight_decay, norm_weight_decay, custom)
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


# torchvision's utils.set_weight_decay: the norm classes it knows, and to_half's (timm's
# LayerNorm2d, BatchNormAct2d, RmsNorm are subclasses of these or named as they are).
TORCHVISION_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
                          nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)


def _norm_layers(net: nn.Module) -> set[int]:
    """The ids of ``net``'s normalization layers: torchvision's classes, and the layers
    :func:`mpfp16.to_half` keeps in fp32 as norms (by class, or by a class name such as
    timm's LayerNorm2d and RmsNorm), and timm's EvoNorm and FilterResponseNorm."""
    extra = models.fp32_norm_classes(net)
    return {id(m) for m in net.modules() if isinstance(m, TORCHVISION_NORM_TYPES + extra)} | {
        id(m) for m in fp32_modules(net) if any(True for _ in m.parameters(recurse=False))}


def weight_decay_groups(net: nn.Module, weight_decay: float, norm_weight_decay: float | None = None,
                        custom_keys_weight_decay: list[tuple[str, float]] | None = None) -> list[dict]:
    """torchvision's ``utils.set_weight_decay`` (references/classification/utils.py):
    each parameter that requires a gradient goes to the first custom key it matches
    (its own name, or, for a key with a dot, its dotted name in the model), else, with
    ``norm_weight_decay``, to the norm group if its module is a normalization layer,
    else to the rest; the groups, in the order rest, norm, then the keys', each with
    its decay, empty ones left out."""
    keys = [key for key, _ in custom_keys_weight_decay or ()]
    params: dict[str, list] = {"other": [], "norm": [], **{key: [] for key in keys}}
    decays = {"other": weight_decay, "norm": norm_weight_decay, **dict(custom_keys_weight_decay or ())}
    norms = _norm_layers(net)

    def add(module: nn.Module, prefix: str = "") -> None:
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            key = next((key for key in keys
                        if key == (f"{prefix}.{name}" if prefix != "" and "." in key else name)), None)
            if key is not None:
                params[key].append(p)
            elif norm_weight_decay is not None and id(module) in norms:
                params["norm"].append(p)
            else:
                params["other"].append(p)
        for child_name, child in module.named_children():
            add(child, f"{prefix}.{child_name}" if prefix != "" else child_name)

    add(net)
    return [{"params": params[key], "weight_decay": decays[key]} for key in params if params[key]]


def learning_rate(cfg: TrainConfig, world_size: int) -> float:
    """``--lr``, scaled by the global batch over 256 where ``scale_lr`` (ImageNet's own
    schedules by default; not torchvision's, whose --lr is for the global batch)."""
    if not cfg.scale_lr:
        return cfg.lr
    return cfg.lr * cfg.batch_size * cfg.accum_steps * world_size / 256


def inner_optimizer(cfg: TrainConfig, groups: list[dict], lr: float) -> torch.optim.Optimizer:
    """The inner optimizer, as torchvision's train.py builds ``--opt``: SGD (Nesterov for
    ``sgd_nesterov``, else as --nesterov says), RMSprop(alpha=0.9, eps=0.0316), AdamW;
    each group's weight decay is its own (:func:`param_groups`).

    Raises:
        UserError: settings torch refuses (Nesterov without momentum).
    """
    build = {"sgd": lambda: torch.optim.SGD(groups, lr=lr, momentum=cfg.optimizer_momentum, nesterov=cfg.nesterov),
             "sgd_nesterov": lambda: torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=True),
             "rmsprop": lambda: torch.optim.RMSprop(groups, lr=lr, momentum=cfg.momentum, eps=0.0316, alpha=0.9),
             "adamw": lambda: torch.optim.AdamW(groups, lr=lr)}
    try:
        return build[cfg.optimizer]()  # validate() refused any other name
    except ValueError as exc:  # e.g. Nesterov without momentum
        raise UserError(f"optimizer settings: {exc}") from None


def optimizer(cfg: TrainConfig, net: nn.Module, world_size: int) -> FP16Optimizer:
    lr = learning_rate(cfg, world_size)
    if cfg.scale_lr:
        logger.info("learning rate %.4g for a global batch of %d (%.4g per 256)", lr,
                    cfg.batch_size * cfg.accum_steps * world_size, cfg.lr)
    groups = param_groups(net, cfg.weight_decay, cfg.no_bn_wd, cfg.norm_weight_decay, cfg.bias_weight_decay,
                          cfg.transformer_embedding_decay)
    inner = inner_optimizer(cfg, groups, lr)
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
                      powersgd_start_iter=cfg.powersgd_start_iter, fp8_format=cfg.fp8_format,
                      error_feedback=cfg.error_feedback, topk_ratio=cfg.topk_ratio, topk_momentum=cfg.topk_momentum)


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
    if steps_per_epoch == 0 and cfg.ra_sampler:
        raise UserError(
            f"an epoch has no full optimizer step: --ra-sampler gives each process {train_samples} training samples "
            "an epoch (torchvision's RASampler trains floor(images // 256 * 256 / processes) of them) for a batch of "
            f"{cfg.batch_size} x {cfg.accum_steps} accumulation steps; train on more images, lower -b, or drop "
            "--ra-sampler"
        )
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, steps_per_epoch, opt.param_groups[0]["lr"]))
    max_steps = cfg.max_steps if cfg.max_steps is not None and cfg.max_steps < schedule_steps else None
    return Schedule(scheduler, steps_per_epoch, total_steps, max_steps, cfg.epochs)


def lr_lambda(cfg: TrainConfig, steps_per_epoch: int, base_lr: float):
    """The lr multiplier of optimizer step ``s``, for LambdaLR: this trainer's own
    schedules per step (:func:`lr_multiplier`), or torchvision's per epoch
    (:func:`torchvision_multiplier`: constant through each epoch, as torchvision steps
    its scheduler at each epoch's end). ``base_lr``: the lr the multiplier scales, for
    ``--lr-min`` (an lr, not a factor)."""
    if cfg.torchvision_schedule:
        schedule = dict(kind=cfg.lr_schedule, epochs=cfg.epochs, warmup_epochs=int(cfg.warmup_epochs),
                        warmup_method=cfg.lr_warmup_method, warmup_decay=cfg.lr_warmup_decay,
                        step_size=cfg.lr_step_size, gamma=cfg.lr_gamma, min_ratio=cfg.lr_min / base_lr)
        return lambda s: torchvision_multiplier(s, steps_per_epoch, **schedule)
    schedule_steps, warmup = cfg.epochs * steps_per_epoch, round(cfg.warmup_epochs * steps_per_epoch)
    return lambda s: lr_multiplier(s, schedule_steps, warmup, cfg.lr_schedule)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """``--use-deterministic-algorithms``: torch's deterministic kernels only
    (``torch.use_deterministic_algorithms(True)``, and cuDNN's benchmark off, as
    torchvision's train.py sets them), for the run, and the process's settings as they
    were after it. On CUDA, cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` for deterministic
    matrix products: ``:4096:8`` where it is not set (torch's error says so otherwise)."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]
        if before[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


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
