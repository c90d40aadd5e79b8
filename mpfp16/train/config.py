"""The training configuration shared by train_cifar.py and train_imagenet.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["TrainConfig", "FREE_ON_RESUME"]

# Settings that change neither the sample order, the schedule nor the result of a
# step: where the data lives and how it is read, how often to log, save and check,
# where things go, and how the step is computed (fused or not, memory format, device,
# DDP bucket size), never what it computes.
FREE_ON_RESUME = frozenset({
    "data", "workers", "bad_images", "max_steps", "channels_last", "fused", "bucket_mb", "dist_backend",
    "dist_timeout", "device", "check_replicas", "checkpoint_dir", "save_every", "resume", "metrics", "tensorboard",
    "print_freq", "progress", "evaluate", "overwrite", "allow_changed_config",
})


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
    overwrite: bool = False  # a fresh run may replace the checkpoints and metrics already in checkpoint_dir
    allow_changed_config: bool = False  # resume even where the settings that give the run its meaning changed

    def changed_on_resume(self, saved: dict) -> list[tuple[str, object, object]]:
        """(name, saved value, value now) for each setting whose change would make a
        resumed run differ from an uninterrupted one: the sample order, the schedule,
        the model, the optimizer, the numerics. Settings in :data:`FREE_ON_RESUME`
        may change; a setting the checkpoint does not record is not compared."""
        now = self.as_dict()
        return [(name, saved[name], now[name]) for name in now
                if name not in FREE_ON_RESUME and name in saved and saved[name] != now[name]]

    def as_dict(self) -> dict:
        """Plain values only (for checkpoints and the metrics file)."""
        out = dataclasses.asdict(self)
        out["resize_phases"] = [list(p) for p in self.resize_phases]
        out["synthetic_size"] = list(self.synthetic_size) if self.synthetic_size else None
        return out
