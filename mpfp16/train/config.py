"""The training configuration shared by train_cifar.py and train_imagenet.py: the one
source of its defaults, and of the rules between its settings.

A setting whose default depends on the task, or on whether the data is real or the
embedded synthetic set, is None in the dataclass and filled in by ``__post_init__``
from :data:`TASK_DEFAULTS` and :data:`DATA_DEFAULTS`; the command line shows the same
values in ``--help`` (:func:`default_text`) and passes only the flags that were given.
:meth:`TrainConfig.validate` checks the rules between settings, for the command line
and for code that builds a config itself. The rules of the optimizer, of DDP and of
FSDP2 are the library's own validators, called with the options the engine will pass
and worded as flags (:func:`say`): the config cannot accept what the library refuses.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch

from .. import options as optimizer_rules
from ..options import STATE_ROUNDINGS
from ..errors import UserError, dtype_name, library_words
from ..parallel import ddp as ddp_rules
from ..parallel import fsdp as fsdp_rules
from ..parallel import setup as setup_rules
from ..parallel.hooks import STRATEGIES
from ..parallel.setup import DEFAULT_TIMEOUT_S
from ..rounding import ROUNDINGS
from ..scaler import check_loss_scale
from .schedule import SCHEDULES, TORCHVISION_SCHEDULES, WARMUP_METHODS

__all__ = ["TrainConfig", "ConfigError", "FREE_ON_RESUME", "BEFORE_THEY_EXISTED", "TASK_DEFAULTS", "DATA_DEFAULTS", "SYNTHETIC_SIZES",
           "OPTIMIZERS", "PRECISIONS", "WIRE_DTYPES", "TORCH_DTYPES", "BAD_IMAGE_POLICIES", "FUSED_CHOICES", "say",
           "default_text", "AUTO_AUGMENT_POLICIES", "INTERPOLATIONS", "EMBEDDING_KEYS", "RECIPE_LIMITS",
           "TORCHVISION_DEFAULTS", "inner_optimizer_class"]

# sgd: SGD with --nesterov as given (off on ImageNet, as torchvision's --opt sgd; on for CIFAR);
# sgd_nesterov, rmsprop: torchvision's --opt (SGD with nesterov=True; RMSprop(alpha=0.9, eps=0.0316)).
OPTIMIZERS = ("sgd", "adamw", "sgd_nesterov", "rmsprop")
# --auto-augment: torchvision's preset takes ra, ta_wide, augmix, or an AutoAugmentPolicy's value.
AUTO_AUGMENT_POLICIES = ("ra", "ta_wide", "augmix", "imagenet", "cifar10", "svhn")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")  # --interpolation
# torchvision's --transformer-embedding-decay keys (train.py: class_token, position_embedding,
# relative_position_bias_table), with the names torchvision's ViT (pos_embedding) and timm's models
# (cls_token, pos_embed, dist_token, reg_token) give theirs: a parameter's own name.
EMBEDDING_KEYS = ("class_token", "position_embedding", "relative_position_bias_table", "pos_embedding",
                  "cls_token", "pos_embed", "dist_token", "reg_token")
# The ranges of the recipe's numbers, for the flags and validate() alike: (low, high, low open, high open).
RECIPE_LIMITS = {
    "lr_warmup_decay": (0.0, 1.0, True, False),  # LinearLR's start_factor, ConstantLR's factor
    "lr_gamma": (0.0, float("inf"), True, False),
    "lr_min": (0.0, float("inf"), False, False),
    "norm_weight_decay": (0.0, float("inf"), False, False),
    "bias_weight_decay": (0.0, float("inf"), False, False),
    "transformer_embedding_decay": (0.0, float("inf"), False, False),
    "random_erase": (0.0, 1.0, False, False),  # RandomErasing's p
    "mixup_alpha": (0.0, float("inf"), False, False),
    "cutmix_alpha": (0.0, float("inf"), False, False),
    "model_ema_decay": (0.0, 1.0, True, True),
    "lr_step_size": (1, None), "ra_magnitude": (0, 30),  # RandAugment's 31 magnitude bins: 0..30
    "augmix_severity": (1, 10), "ra_reps": (1, None), "model_ema_steps": (1, None),  # AugMix takes 1..10
}
# With torchvision's schedulers (--lr-scheduler), the settings around them default to torchvision's
# too, so that a recipe pasted from its README means what it meant there: no warm-up unless
# --lr-warmup-epochs, and --lr for the global batch as given.
TORCHVISION_DEFAULTS = {"warmup_epochs": 0.0, "scale_lr": False}
PRECISIONS = ("fp32", "fp16", "bf16")
WIRE_DTYPES = ("fp16", "bf16", "fp32")
BAD_IMAGE_POLICIES = ("fail", "skip")
FUSED_CHOICES = ("auto", "on", "off")
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # precisions and wire dtypes
STATE_DTYPE_CHOICES = ("fp32", "bf16")  # --state-dtype

# Defaults that differ between the two tasks.
TASK_DEFAULTS = {
    "cifar": {"workers": 0, "image_size": 32, "weight_decay": 5e-4, "nesterov": True, "warmup_epochs": 0.0,
              "lr_schedule": "onecycle", "scale_lr": False},
    "imagenet": {"workers": 4, "image_size": 224, "weight_decay": 1e-4, "nesterov": False, "warmup_epochs": 5.0,
                 "lr_schedule": "cosine", "scale_lr": True},
}
# (train, val) images of the embedded synthetic set, when --synthetic-size is not given.
SYNTHETIC_SIZES = {"cifar": (5000, 1000), "imagenet": (2000, 400)}
# Defaults that also differ between real data and the embedded synthetic set, which
# must train on a 2-core CPU in fp16 in about two minutes.
DATA_DEFAULTS = {
    "cifar": {
        "real": {"arch": "resnet9", "epochs": 24, "batch_size": 512, "lr": 0.4},
        "embedded": {"arch": "resnet9-w8", "epochs": 3, "batch_size": 128, "lr": 0.4},
    },
    "imagenet": {
        "real": {"arch": "resnet50", "epochs": 90, "batch_size": 256, "lr": 0.1},
        "embedded": {"arch": "resnet18", "epochs": 2, "batch_size": 32, "lr": 0.1},
    },
}

# Settings that change neither the sample order, the schedule nor the meaning of a
# step: where the data lives and how it is read, how often to log, save and check,
# where things go, and how the step is computed (fused or not, sharded or not, memory
# format, device, DDP bucket size), never what it computes. A resume that changes how
# a step is computed may change the last bits of the sums.
# Settings a later release added, and what a run of a release before them did: a
# checkpoint that does not record one ran with this value, and is compared with it.
BEFORE_THEY_EXISTED = {
    "state_dtype": "fp32", "state_rounding": "nearest",
    # torchvision's recipe: before it, the own schedules' linear warm-up, one weight decay (or --no-bn-wd),
    # no augmentation beyond the crop and flip, the validation resize of crop * 256/224, random
    # initialization, no EMA, torch's default algorithms
    "lr_warmup_method": "linear", "lr_warmup_decay": 0.01, "lr_step_size": 30, "lr_gamma": 0.1, "lr_min": 0.0,
    "norm_weight_decay": None, "bias_weight_decay": None, "transformer_embedding_decay": None,
    "auto_augment": None, "ra_magnitude": 9, "augmix_severity": 3, "random_erase": 0.0, "mixup_alpha": 0.0,
    "cutmix_alpha": 0.0, "val_resize_size": None, "val_crop_size": None, "interpolation": "bilinear",
    "ra_sampler": False, "ra_reps": 3, "model_ema": False, "model_ema_steps": 32, "model_ema_decay": 0.99998,
    "weights": None, "use_deterministic_algorithms": False,
    "fp8_format": "e4m3", "error_feedback": False, "topk_ratio": 0.01,  # the 8-bit and top-k wires
}

FREE_ON_RESUME = frozenset({
    "data", "workers", "bad_images", "max_steps", "channels_last", "fused", "shard", "bucket_mb", "dist_backend",
    "dist_timeout", "device", "check_replicas", "checkpoint_dir", "save_every", "resume", "metrics", "tensorboard",
    "print_freq", "progress", "evaluate", "overwrite", "allow_changed_config",
    "use_deterministic_algorithms",  # how a step is computed (which kernels), never what it computes
})


class ConfigError(UserError, ValueError):
    """Settings that contradict each other, or a name that means nothing."""


@dataclass
class TrainConfig:
    task: str  # "cifar" | "imagenet"
    # data
    data: str | None = None  # None: the embedded synthetic set
    workers: int | None = None
    image_size: int | None = None
    bad_images: str = "fail"
    synthetic_size: tuple[int, int] | None = None  # (train, val) images of the embedded set
    # model
    arch: str | None = None
    channels_last: bool = False
    zero_init_residual: bool = False
    # optimization
    epochs: int | None = None
    max_steps: int | None = None
    batch_size: int | None = None
    accum_steps: int = 1
    optimizer: str = "sgd"
    lr: float | None = None
    scale_lr: bool | None = None  # lr is for a global batch of 256 and scales linearly
    momentum: float = 0.9
    nesterov: bool | None = None
    weight_decay: float | None = None
    no_bn_wd: bool = False
    label_smoothing: float = 0.0
    warmup_epochs: float | None = None
    lr_schedule: str | None = None
    resize_phases: list[tuple[int, int]] = field(default_factory=list)  # (start epoch, image size)
    seed: int = 0
    # torchvision's reference recipe (references/classification/train.py), by its names
    lr_warmup_method: str = "linear"  # linear | constant (torchvision's)
    lr_warmup_decay: float = 0.01  # the warm-up's starting factor (torchvision's --lr-warmup-decay)
    lr_step_size: int = 30  # steplr: epochs between decays
    lr_gamma: float = 0.1  # steplr / exponentiallr: the factor
    lr_min: float = 0.0  # cosineannealinglr: eta_min
    norm_weight_decay: float | None = None  # None: --weight-decay
    bias_weight_decay: float | None = None
    transformer_embedding_decay: float | None = None
    auto_augment: str | None = None  # ra | ta_wide | augmix | imagenet
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    val_resize_size: int | None = None  # None: the task's rule (imagenet: image size * 256/224)
    val_crop_size: int | None = None  # None: the image size
    interpolation: str = "bilinear"  # nearest | bilinear | bicubic
    ra_sampler: bool = False  # repeated augmentation (torchvision's RASampler)
    ra_reps: int = 3
    model_ema: bool = False  # an EMA of the fp32 masters, evaluated beside the model
    model_ema_steps: int = 32  # optimizer steps between EMA updates
    model_ema_decay: float = 0.99998  # per-step decay, as torchvision's --model-ema-decay
    weights: str | None = None  # a local file of weights to start from (nothing is downloaded)
    use_deterministic_algorithms: bool = False
    # precision
    precision: str = "fp16"
    master_weights: bool | str = True  # False: none; "remainder" (bf16): held as the weights and 16-bit remainders
    rounding: str = "nearest"  # without master weights: nearest | stochastic | kahan
    loss_scale: str | float = "dynamic"
    max_grad_norm: float | None = None
    accumulate_dtype: str | None = None  # None: micro-batch gradients summed in the model's dtype; "fp32"
    fused: str = "auto"  # auto | on | off
    state_dtype: str = "fp32"  # fp32 | bf16: the optimizer's states (momentum, Adam's moments) between steps
    state_rounding: str = "nearest"  # with --state-dtype bf16: nearest | stochastic
    # distributed
    shard: bool = False  # FSDP2: fp32 masters, gradients and optimizer state sharded across ranks
    allreduce_dtype: str | None = None
    allreduce_strategy: str = "allreduce"
    powersgd_rank: int = 1  # PowerSGD's matrix_approximation_rank
    powersgd_start_iter: int = 2  # optimizer steps of plain allreduce before PowerSGD compresses
    fp8_format: str = "e4m3"  # --allreduce-strategy fp8_compress: e4m3 | e5m2
    error_feedback: bool = False  # fp8_compress, int8_compress: feed what the encoding dropped back next step
    topk_ratio: float = 0.01  # --allreduce-strategy topk: the share of each parameter's entries sent
    predivide_factor: float = 1.0
    bucket_mb: float = 25.0
    dist_backend: str | None = None
    dist_timeout: float = DEFAULT_TIMEOUT_S
    device: str | None = None
    check_replicas: int = 100  # optimizer steps between replica checks; 0: never
    # checkpoints and logs
    checkpoint_dir: str = "checkpoints"
    save_every: int = 0
    resume: str | None = None
    metrics: str | None = None
    tensorboard: str | None = None
    print_freq: int = 10
    progress: bool = True
    evaluate: bool = False
    overwrite: bool = False  # a fresh run may replace the checkpoints and metrics already in checkpoint_dir
    allow_changed_config: bool = False  # resume even where the settings that give the run its meaning changed

    def __post_init__(self) -> None:
        if self.task not in TASK_DEFAULTS:
            raise ConfigError(f"unknown task {self.task!r}; choose one of {', '.join(TASK_DEFAULTS)}")
        defaults = {**TASK_DEFAULTS[self.task], **DATA_DEFAULTS[self.task][_data_kind(self.data)]}
        if self.lr_schedule in TORCHVISION_SCHEDULES:
            defaults.update(TORCHVISION_DEFAULTS)
        if self.optimizer == "sgd_nesterov":
            defaults["nesterov"] = True  # what the name says; validate() refuses --no-nesterov with it
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.synthetic_size is not None:
            self.synthetic_size = tuple(self.synthetic_size)
        self.resize_phases = [tuple(p) for p in self.resize_phases]

    @property
    def fused_option(self) -> bool | None:
        """``--fused`` as FP16Optimizer's ``fused=`` takes it."""
        return {"auto": None, "on": True, "off": False}.get(self.fused)

    @property
    def torchvision_schedule(self) -> bool:
        """Whether the lr follows one of torchvision's schedulers (``--lr-scheduler``)."""
        return self.lr_schedule in TORCHVISION_SCHEDULES

    def val_sizes(self, image_size: int | None = None) -> tuple[int, int]:
        """(resize, crop) of ImageNet's validation images for training crop
        ``image_size`` (default ``--image-size``): the crop is ``--val-crop-size`` or the
        training crop; the resize ``--val-resize-size`` or ``round(crop * 256 / 224)``
        (torchvision's 256 for 224, and the rule before the recipe existed)."""
        crop = self.val_crop_size or image_size or self.image_size
        return self.val_resize_size or round(crop * 256 / 224), crop

    def validate(self) -> TrainConfig:
        """Raise :class:`ConfigError` (one line, in the flags' words) for a name that
        means nothing or settings that contradict each other; return ``self``."""
        for name, allowed in (("optimizer", OPTIMIZERS), ("precision", PRECISIONS), ("rounding", ROUNDINGS),
                              ("lr_schedule", SCHEDULES), ("allreduce_strategy", STRATEGIES),
                              ("bad_images", BAD_IMAGE_POLICIES), ("fused", FUSED_CHOICES),
                              ("state_dtype", STATE_DTYPE_CHOICES), ("state_rounding", STATE_ROUNDINGS),
                              ("lr_warmup_method", WARMUP_METHODS), ("interpolation", INTERPOLATIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"unknown {_flag(name)} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        if self.auto_augment is not None and self.auto_augment not in AUTO_AUGMENT_POLICIES:
            raise ConfigError(f"unknown --auto-augment {self.auto_augment!r}; choose one of "
                              f"{', '.join(AUTO_AUGMENT_POLICIES)}")
        self._check_recipe()
        if self.master_weights not in (True, False, "remainder"):
            raise ConfigError(f"unknown --master-weights {self.master_weights!r}; choose one of fp32, remainder")
        if self.allreduce_dtype not in (None,) + WIRE_DTYPES:
            raise ConfigError(f"unknown --allreduce-dtype {self.allreduce_dtype!r}; choose one of "
                              f"{', '.join(WIRE_DTYPES)}")
        if self.precision != "fp16" and self.loss_scale != "dynamic":
            raise ConfigError(f"--loss-scale applies to fp16 only, not --precision {self.precision}")
        if self.shard:
            for name in ("allreduce_strategy", "predivide_factor", "bucket_mb", "powersgd_rank",
                         "powersgd_start_iter", "fp8_format", "error_feedback", "topk_ratio"):
                if getattr(self, name) != _default(name):
                    raise ConfigError(f"{say(name, getattr(self, name))} configures DDP's allreduce; --shard "
                                      "reduce-scatters instead "
                                      "(its dtype: --allreduce-dtype)")
            if self.channels_last:  # FSDP2 raises NotImplementedError for non-contiguous parameters
                raise ConfigError("--channels-last makes the convolution weights non-contiguous, and FSDP2 shards "
                                  "contiguous parameters only: drop --channels-last with --shard")
        self._check_library_rules()
        if self.evaluate and self.resume is None and self.weights is None:
            raise ConfigError("--evaluate needs --resume PATH (or auto), or --weights FILE")
        if self.overwrite and self.resume is not None:
            raise ConfigError("--overwrite starts a new run in place of the old one; it cannot be combined with "
                              "--resume")
        return self

    def _check_recipe(self) -> None:
        """The rules of torchvision's recipe settings (--lr-scheduler and what goes with
        it, the weight-decay kinds, augmentation, validation sizes, the EMA, --weights)."""
        for name, limits in RECIPE_LIMITS.items():
            value = getattr(self, name)
            if value is not None and not _within(value, limits):
                raise ConfigError(f"{_flag(name)} {value!r}: must be {_wanted(limits)}")
        schedule = say("lr_schedule", self.lr_schedule)
        own = f"{schedule} warms up linearly from 1/(warm-up steps), per step"
        if self.lr_warmup_method != _default("lr_warmup_method") and not self.torchvision_schedule:
            raise ConfigError(f"--lr-warmup-method applies to torchvision's --lr-scheduler "
                              f"({', '.join(TORCHVISION_SCHEDULES)}); {own}")
        if self.lr_warmup_decay != _default("lr_warmup_decay") and not self.torchvision_schedule:
            raise ConfigError(f"--lr-warmup-decay applies to torchvision's --lr-scheduler "
                              f"({', '.join(TORCHVISION_SCHEDULES)}); {own}")
        for name, uses in (("lr_step_size", ("steplr",)), ("lr_gamma", ("steplr", "exponentiallr")),
                           ("lr_min", ("cosineannealinglr",))):
            if getattr(self, name) != _default(name) and self.lr_schedule not in uses:
                default = "; steplr is torchvision's default scheduler, not this script's" if "steplr" in uses else ""
                raise ConfigError(f"{_flag(name)} applies to --lr-scheduler {' or '.join(uses)}, not "
                                  f"{schedule}{default}: pass --lr-scheduler {uses[0]}")
        if self.torchvision_schedule:
            if self.warmup_epochs != int(self.warmup_epochs):
                raise ConfigError(f"--lr-warmup-epochs {self.warmup_epochs:g}: torchvision's schedulers step once "
                                  f"per epoch, so {schedule} warms up over whole epochs")
            if self.lr_schedule == "cosineannealinglr" and self.warmup_epochs >= self.epochs:
                raise ConfigError(f"--lr-warmup-epochs {self.warmup_epochs:g} leaves no epoch of --epochs "
                                  f"{self.epochs} to --lr-scheduler cosineannealinglr (its T_max is epochs - warm-up "
                                  "epochs)")
        if self.no_bn_wd:
            for name in ("norm_weight_decay", "bias_weight_decay", "transformer_embedding_decay"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"--no-bn-wd and {_flag(name)} both set the decay of normalization layers "
                                      "or biases: pass torchvision's per-kind decays alone (--no-bn-wd is "
                                      "--norm-weight-decay 0 --bias-weight-decay 0, and no decay on any 1-d "
                                      "parameter)")
        if self.optimizer == "sgd_nesterov" and not self.nesterov:
            raise ConfigError("--opt sgd_nesterov is SGD with Nesterov momentum; it contradicts --no-nesterov")
        if self.optimizer == "rmsprop" and self.state_dtype != "fp32":
            raise ConfigError(f"--state-dtype {self.state_dtype} applies to SGD, Adam and AdamW, whose states mpfp16 "
                              "keeps; --opt rmsprop keeps its own: drop --state-dtype")
        if self.optimizer == "rmsprop" and self.fused == "on":
            raise ConfigError("--fused on: mpfp16's fused step takes SGD, Adam and AdamW, not --opt rmsprop (its "
                              "own step runs over the fp32 masters with --fused auto or off)")
        if self.task == "cifar":
            for name in ("val_resize_size", "val_crop_size", "transformer_embedding_decay"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{_flag(name)} applies to train_imagenet.py; CIFAR's validation images "
                                      "are used whole, and its models have no transformer embeddings")
        else:
            sizes = [self.image_size] + [size for _, size in self.resize_phases]
            for size in sizes:
                resize, crop = self.val_sizes(size)
                if crop > resize:
                    given = f"--val-crop-size {crop}" if self.val_crop_size else f"the validation crop {crop} (the " \
                            "training crop, without --val-crop-size)"
                    raise ConfigError(f"{given} is larger than --val-resize-size {resize}: the center crop must "
                                      "fit in the resized image")
        if self.weights is not None:
            if "://" in self.weights or not os.path.isfile(self.weights):
                raise ConfigError(f"--weights {self.weights}: no such file here, and nothing is downloaded (not a "
                                  "torchvision weights name, nor a URL): pass a local file of the model's state_dict, "
                                  "or a checkpoint with a 'model' key")

    def _check_library_rules(self) -> None:
        """The library's own rules, on the options the engine will pass it: the loss
        scale's, the process set-up's (device, backend, timeout, on this machine, so that
        ``--device cuda`` without a GPU or ``--dist-backend nccl`` on the CPU is refused
        before any data is loaded), the optimizer's, and DDP's (several processes) or
        FSDP2's (``--shard``)."""
        compute, wire = TORCH_DTYPES[self.precision], TORCH_DTYPES.get(self.allreduce_dtype)
        if self.accumulate_dtype is not None and compute == torch.float32:
            raise ConfigError(f"{say('accumulate_dtype', self.accumulate_dtype)} needs 16-bit gradients: with "
                              f"{say('precision', self.precision)} they are summed in fp32 already")
        try:
            if self.loss_scale != "dynamic":
                check_loss_scale(self.loss_scale, "loss_scale", say=say)
            setup_rules.check_options(backend=self.dist_backend, timeout_s=self.dist_timeout, device=self.device,
                                      say=say)
            optimizer_rules.check_options(master_weights=self.master_weights, rounding=self.rounding,
                                          max_grad_norm=self.max_grad_norm, fused=self.fused_option, dtypes=(compute,),
                                          sharded=self.shard, accumulate_dtype=TORCH_DTYPES.get(self.accumulate_dtype),
                                          say=say)
            optimizer_rules.state_dtypes_of(inner_optimizer_class(self.optimizer),
                                            TORCH_DTYPES[self.state_dtype], None, self.state_rounding,
                                            sharded=self.shard, say=say)
            if self.shard:
                fsdp_rules.check_options(compute, wire, say=say)
            else:
                ddp_rules.check_options(strategy=self.allreduce_strategy, allreduce_dtype=wire,
                                        predivide_factor=self.predivide_factor, bucket_mb=self.bucket_mb,
                                        powersgd_rank=self.powersgd_rank, powersgd_start_iter=self.powersgd_start_iter,
                                        grads_16bit=compute != torch.float32,
                                        grad_dtypes=(say("precision", self.precision),), say=say,
                                        fp8_format=self.fp8_format, error_feedback=self.error_feedback,
                                        topk_ratio=self.topk_ratio, topk_momentum=self.topk_momentum)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.allreduce_strategy == "topk":
            if self.optimizer != "sgd" or self.nesterov:
                raise ConfigError(f"--allreduce-strategy topk applies --momentum in the exchange (DGC's momentum "
                                  f"correction), for plain SGD only: use --optimizer sgd with --no-nesterov, not "
                                  f"{'--nesterov' if self.optimizer == 'sgd' else say('optimizer', self.optimizer)}")

    @property
    def topk_momentum(self) -> float:
        """DGC's momentum correction factor: --momentum, which the exchange applies in
        place of SGD's (:meth:`optimizer_momentum`)."""
        return self.momentum if self.allreduce_strategy == "topk" else 0.0

    @property
    def optimizer_momentum(self) -> float:
        """The momentum the optimizer applies: none under top-k, whose exchange applies it."""
        return 0.0 if self.allreduce_strategy == "topk" else self.momentum

    def changed_on_resume(self, saved: dict) -> list[tuple[str, object, object]]:
        """(name, saved value, value now) for each setting whose change would make a
        resumed run differ from an uninterrupted one: the sample order, the schedule,
        the model, the optimizer, the numerics. Settings in :data:`FREE_ON_RESUME`
        may change. A setting the checkpoint does not record is compared with what runs
        did before it existed (:data:`BEFORE_THEY_EXISTED`), where that is known, and
        otherwise not at all."""
        now = self.as_dict()
        saved = {**{k: v for k, v in BEFORE_THEY_EXISTED.items() if k not in saved}, **saved}
        return [(name, saved[name], now[name]) for name in now
                if name not in FREE_ON_RESUME and name in saved and saved[name] != now[name]]

    def as_dict(self) -> dict:
        """Plain values only (for checkpoints and the metrics file)."""
        out = dataclasses.asdict(self)
        out["resize_phases"] = [list(p) for p in self.resize_phases]
        out["synthetic_size"] = list(self.synthetic_size) if self.synthetic_size else None
        return out


def inner_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The torch optimizer that ``--optimizer``/``--opt`` ``name`` builds."""
    return {"sgd": torch.optim.SGD, "sgd_nesterov": torch.optim.SGD, "adamw": torch.optim.AdamW,
            "rmsprop": torch.optim.RMSprop}[name]


def _within(value, limits: tuple) -> bool:
    if len(limits) == 2:  # an integer range, either end None: open
        low, high = limits
        return (isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
                and (high is None or value <= high))
    low, high, low_open, high_open = limits
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return False
    return ((value > low if low_open else value >= low) and (value < high if high_open else value <= high)
            and value != float("inf"))


def _wanted(limits: tuple) -> str:
    """The range ``limits`` in words, as the flags' errors say it."""
    if len(limits) == 2:
        low, high = limits
        return f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
    low, high, low_open, high_open = limits
    if high == float("inf"):
        return "a positive finite number" if low_open and low == 0 else f"a finite number >= {low:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _data_kind(data: str | None) -> str:
    return "embedded" if data is None else "real"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# The library's option names that are spelled otherwise as flags.
_FLAGS = {"state_dtypes": "--state-dtype", "strategy": "--allreduce-strategy", "accumulate_dtype": "--accumulate-dtype", "param_dtype": "--precision", "reduce_dtype": "--allreduce-dtype",
          "backend": "--dist-backend", "timeout_s": "--dist-timeout"}
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def say(name: str, value) -> str:
    """A library option as the flag that sets it: the ``say`` of the library's
    validators (:func:`mpfp16.errors.library_words`), so that their refusals name
    flags (``say("master_weights", False) -> "--no-master-weights"``,
    ``say("fused", True) -> "--fused on"``, ``say("rounding", "kahan") -> "--rounding kahan"``,
    ``say("backend", "nccl") -> "--dist-backend nccl"``, ``say("loss_scale", 1e39) -> "--loss-scale 1e+39"``)."""
    if name == "master_weights":
        return "--no-master-weights" if not value else f"--master-weights {'remainder' if value == 'remainder' else 'fp32'}"
    if name == "fused":
        return f"--fused {({True: 'on', False: 'off', None: 'auto'}[value])}"
    if name == "error_feedback":  # a switch
        return "--error-feedback" if value else "no --error-feedback"
    if name == "reduce_overflow":  # not a flag: the scripts always reduce it
        return library_words(name, value)
    if name == "lr_schedule":  # two flags: this trainer's schedules, and torchvision's schedulers
        return f"--lr-scheduler {value}" if value in TORCHVISION_SCHEDULES else f"--lr-schedule {value}"
    flag = _FLAGS.get(name, _flag(name))
    if value is None:
        return f"out {flag}" if name in ("allreduce_dtype", "reduce_dtype", "accumulate_dtype") else f"{flag} unset"
    if isinstance(value, torch.dtype):
        value = _DTYPE_NAMES.get(value, dtype_name(value))
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"{flag} {value}"


def _default(name: str):
    return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)


def default_text(task: str, name: str) -> str:
    """The default of setting ``name`` for ``task`` as ``--help`` shows it: one value,
    or the values on real and on embedded data when they differ."""
    def show(value):
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return ",".join(map(str, value))
        return str(value)

    if name in DATA_DEFAULTS[task]["real"]:
        real, embedded = DATA_DEFAULTS[task]["real"][name], DATA_DEFAULTS[task]["embedded"][name]
        return show(real) if real == embedded else f"{show(real)}; {show(embedded)} on the embedded data"
    if name in TASK_DEFAULTS[task]:
        return show(TASK_DEFAULTS[task][name])
    return show(_default(name))
