"""The training configuration shared by train_cifar.py and train_imagenet.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig:
    task: str  # "cifar" | "imagenet"
    # data
    data: str | None = None
    workers: int = 0
    image_size: int = 32
    bad_images: str = "fail"
    synthetic_size: tuple[int, int] | None = None  # (train, val) images of the embedded set
    # model
    arch: str = "resnet9"
    channels_last: bool = False
    zero_init_residual: bool = False
    # optimization
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 128
    accum_steps: int = 1
    optimizer: str = "sgd"
    lr: float = 0.1
    scale_lr: bool = False  # lr is for a global batch of 256 and scales linearly
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    no_bn_wd: bool = False
    label_smoothing: float = 0.0
    warmup_epochs: float = 0.0
    lr_schedule: str = "cosine"
    resize_phases: list[tuple[int, int]] = field(default_factory=list)  # (start epoch, image size)
    seed: int = 0
    # precision
    precision: str = "fp16"
    master_weights: bool = True
    rounding: str = "nearest"  # without master weights: nearest | stochastic | kahan
    loss_scale: str | float = "dynamic"
    max_grad_norm: float | None = None
    fused: str = "auto"  # auto | on | off
    # distributed
    allreduce_dtype: str | None = None
    allreduce_strategy: str = "allreduce"
    predivide_factor: float = 1.0
    bucket_mb: float = 25.0
    dist_backend: str | None = None
    dist_timeout: float = 600.0
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

    def as_dict(self) -> dict:
        """Plain values only (for checkpoints and the metrics file)."""
        out = dataclasses.asdict(self)
        out["resize_phases"] = [list(p) for p in self.resize_phases]
        out["synthetic_size"] = list(self.synthetic_size) if self.synthetic_size else None
        return out
