"""torchvision's reference recipe for image classification (references/classification:
``presets.py``, ``transforms.py``, ``train.py``), by its names and meanings, built from
torchvision's own transforms, with every random draw seeded.

Per sample (:func:`imagenet_train_transform`, as ``ClassificationPresetTrain`` orders
it): ``RandomResizedCrop(image_size, interpolation)``, ``RandomHorizontalFlip``, the
``--auto-augment`` policy (:func:`auto_augment`), then ``RandomErasing(p=--random-erase)``.
Validation (:func:`imagenet_val_transform`, ``ClassificationPresetEval``):
``Resize(val_resize_size, interpolation)``, ``CenterCrop(val_crop_size)``. CIFAR
(:func:`cifar_train_transform`): its reflect-padded random crop and flip, then the same
policy and erasing.

Two differences of form, none of result:

- Images stay uint8 through the loader and are normalized on the device (the engine's
  ``_prepare``: ``(x - 255 mean) / (255 std)``). torchvision erases *after* Normalize,
  to 0; here the erasing runs on the float image in pixel units and erases to the mean
  pixel, ``255 mean`` in float32, the very value the engine subtracts: the erased
  pixels normalize to exactly 0, as torchvision's, and the draws are the same. A
  recipe with erasing hands the loader float32 images (pixel units), one without it
  uint8, as before.
- Mixup and CutMix (:func:`mix_batch`) are torchvision's ``v2.MixUp``/``v2.CutMix`` in
  a ``v2.RandomChoice``, as ``get_mixup_cutmix`` builds them and ``train.py``'s
  ``collate_fn`` applies them to the collated batch; here the engine applies them to
  each normalized micro-batch on the device (the two commute with normalization: a
  convex combination, a pasted box), under a CPU RNG seeded from (seed, epoch, batch
  index), so that a resumed run draws the same lambda, box and choice.

Every draw is torch's global CPU generator, reseeded for the one call and restored
after (:func:`seeded`): a sample's augmentation is a function of (seed, epoch, index)
(:func:`mpfp16.train.data.sample_seed`), a batch's mix of (seed, epoch, batch index)
(:func:`mix_seed`). Given the same generator state, each result is torchvision's own.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2

from .config import ConfigError

__all__ = ["INTERPOLATIONS", "AUTO_AUGMENT_POLICIES", "Augmentation", "seeded", "interpolation_mode", "auto_augment",
           "erasing", "imagenet_train_transform", "imagenet_val_transform", "val_sizes", "cifar_train_transform",
           "cifar_val_transform", "mixup_cutmix", "mix_seed", "batch_index", "mix_batch"]

INTERPOLATIONS = ("nearest", "bilinear", "bicubic")  # torchvision's --interpolation
# --auto-augment: torchvision's preset takes ra, ta_wide, augmix, or an AutoAugmentPolicy's value
# (imagenet, cifar10, svhn); "imagenet" is the ImageNet policy on CIFAR too, as the name says.
AUTO_AUGMENT_POLICIES = ("ra", "ta_wide", "augmix") + tuple(p.value for p in v2.AutoAugmentPolicy)


@dataclass(frozen=True)
class Augmentation:
    """The recipe's per-sample settings, by TrainConfig's names. The defaults are the
    pipelines before the recipe existed: no policy, no erasing, bilinear, and the
    task's validation rule."""

    auto_augment: str | None = None  # ra | ta_wide | augmix | imagenet (| cifar10 | svhn)
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0  # RandomErasing's p
    interpolation: str = "bilinear"
    val_resize_size: int | None = None  # None: the task's rule (imagenet: the crop * 256/224, cifar: none)
    val_crop_size: int | None = None  # None: the image size (imagenet), none (cifar)

    @classmethod
    def from_config(cls, cfg) -> Augmentation:
        """The settings of a :class:`mpfp16.train.config.TrainConfig` (or anything with its fields)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def seeded(fn, seed: int, *args):
    """``fn(*args)`` with torch's CPU generator seeded with ``seed``, and restored after.

    Only the CPU generator: ``torch.manual_seed`` would reseed every CUDA generator too,
    and leave them so (``fork_rng(devices=[])`` restores the CPU one only)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return fn(*args)


def interpolation_mode(name: str) -> InterpolationMode:
    """``--interpolation`` as torchvision's train.py reads it: ``InterpolationMode(name)``."""
    if name not in INTERPOLATIONS:
        raise ConfigError(f"unknown --interpolation {name!r}; choose one of {', '.join(INTERPOLATIONS)}")
    return InterpolationMode(name)


def auto_augment(policy: str, *, interpolation: str = "bilinear", ra_magnitude: int = 9,
                 augmix_severity: int = 3) -> v2.Transform:
    """The ``--auto-augment`` policy, as ``ClassificationPresetTrain`` builds it:
    ``ra`` RandAugment(magnitude), ``ta_wide`` TrivialAugmentWide, ``augmix``
    AugMix(severity), otherwise AutoAugment(AutoAugmentPolicy(policy)); each with the
    recipe's interpolation. On uint8 tensors, and with ``bicubic`` on a PIL image
    between two conversions (torchvision's tensor kernels refuse bicubic rotations).

    Raises:
        ConfigError: an unknown policy or interpolation, or AugMix with bicubic (which
            torchvision's AugMix cannot do on any backend).
    """
    mode = interpolation_mode(interpolation)
    if policy == "ra":
        transform = v2.RandAugment(interpolation=mode, magnitude=ra_magnitude)
    elif policy == "ta_wide":
        transform = v2.TrivialAugmentWide(interpolation=mode)
    elif policy == "augmix":
        if mode == InterpolationMode.BICUBIC:  # AugMix mixes tensors, a PIL image too: its rotations refuse bicubic
            raise ConfigError("--auto-augment augmix cannot go with --interpolation bicubic: torchvision's AugMix "
                              "rotates and shears tensors, which take nearest or bilinear only")
        transform = v2.AugMix(interpolation=mode, severity=augmix_severity)
    elif policy in AUTO_AUGMENT_POLICIES:
        transform = v2.AutoAugment(policy=v2.AutoAugmentPolicy(policy), interpolation=mode)
    else:
        raise ConfigError(f"unknown --auto-augment {policy!r}; choose one of {', '.join(AUTO_AUGMENT_POLICIES)}")
    if mode == InterpolationMode.BICUBIC:
        # torchvision's geometric kernels (rotate, shear, translate) take nearest and
        # bilinear only on tensors; its preset's default backend is PIL, which takes
        # bicubic: the policy runs on a PIL image (the same draws, the same ops).
        return v2.Compose([v2.ToPILImage(), transform, v2.PILToTensor()])
    return transform


def erasing(p: float, mean: tuple[float, float, float]) -> list[v2.Transform]:
    """torchvision's ``RandomErasing(p)`` for images that the engine normalizes later:
    to float32 in pixel units, then erased to ``255 mean`` (float32, per channel), which
    normalizes to exactly 0, torchvision's value (module docstring)."""
    value = (torch.tensor(mean, dtype=torch.float32) * 255).tolist()  # as build.data's Data.mean, exactly
    return [v2.ToDtype(torch.float32, scale=False), v2.RandomErasing(p=p, value=value)]


def _policy_and_erasing(aug: Augmentation, mean) -> list[v2.Transform]:
    steps = []
    if aug.auto_augment is not None:
        steps.append(auto_augment(aug.auto_augment, interpolation=aug.interpolation, ra_magnitude=aug.ra_magnitude,
                                  augmix_severity=aug.augmix_severity))
    if aug.random_erase > 0:
        steps += erasing(aug.random_erase, mean)
    return steps


def imagenet_train_transform(size: int, aug: Augmentation | None = None,
                             mean: tuple[float, float, float] = (0.485, 0.456, 0.406)) -> v2.Compose:
    """``ClassificationPresetTrain(crop_size=size, ...)`` on uint8 tensors, less the
    Normalize the engine does (``mean`` is for the erasing only)."""
    aug = aug or Augmentation()
    return v2.Compose([v2.RandomResizedCrop(size, interpolation=interpolation_mode(aug.interpolation), antialias=True),
                       v2.RandomHorizontalFlip(), *_policy_and_erasing(aug, mean)])


def val_sizes(size: int, aug: Augmentation | None = None) -> tuple[int, int]:
    """(resize, crop) of ImageNet's validation at training crop ``size``: the crop is
    ``val_crop_size`` or ``size``; the resize ``val_resize_size`` or ``round(crop *
    256 / 224)`` (224 -> 256, torchvision's pair; with neither given, the rule before the
    recipe existed)."""
    aug = aug or Augmentation()
    crop = aug.val_crop_size or size
    return aug.val_resize_size or round(crop * 256 / 224), crop


def imagenet_val_transform(size: int, aug: Augmentation | None = None) -> v2.Compose:
    """``ClassificationPresetEval(crop_size, resize_size, interpolation)`` on uint8
    tensors, less the Normalize (:func:`val_sizes`)."""
    aug = aug or Augmentation()
    resize, crop = val_sizes(size, aug)
    return v2.Compose([v2.Resize(resize, interpolation=interpolation_mode(aug.interpolation), antialias=True),
                       v2.CenterCrop(crop)])


def cifar_train_transform(size: int = 32, aug: Augmentation | None = None,
                          mean: tuple[float, float, float] = (0.5, 0.5, 0.5)) -> v2.Compose:
    """CIFAR's crop (``size``, reflect-padded by ``size // 8``) and flip, then the
    recipe's policy and erasing."""
    aug = aug or Augmentation()
    return v2.Compose([v2.RandomCrop(size, padding=size // 8, padding_mode="reflect"), v2.RandomHorizontalFlip(),
                       *_policy_and_erasing(aug, mean)])


def cifar_val_transform(aug: Augmentation | None = None) -> v2.Compose | None:
    """None (the 32x32 images as they are), unless ``val_resize_size`` or
    ``val_crop_size`` asks for a Resize or a CenterCrop."""
    aug = aug or Augmentation()
    steps = []
    if aug.val_resize_size:
        steps.append(v2.Resize(aug.val_resize_size, interpolation=interpolation_mode(aug.interpolation),
                               antialias=True))
    if aug.val_crop_size:
        steps.append(v2.CenterCrop(aug.val_crop_size))
    return v2.Compose(steps) if steps else None


# ----------------------------------------------------------------- mixup and cutmix


@functools.lru_cache(maxsize=8)
def mixup_cutmix(mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> v2.RandomChoice | None:
    """What torchvision's ``get_mixup_cutmix(use_v2=True)`` returns: a ``RandomChoice`` of
    ``MixUp(mixup_alpha)`` and ``CutMix(cutmix_alpha)``, of those whose alpha is above 0
    (a choice of one where only one is), or None where neither is."""
    mixers = []
    if mixup_alpha > 0:
        mixers.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        mixers.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    return v2.RandomChoice(mixers) if mixers else None


def mix_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one batch's mix. The key ``(seed, epoch, -1 - index)`` is none of the
    samples' (:func:`mpfp16.train.data.sample_seed`: indices are 0 or more), and tuples
    of ints hash alike in every process."""
    return hash((seed, epoch, -1 - index)) & 0x7FFF_FFFF_FFFF_FFFF


def batch_index(samples_done: int, *, earlier: int, world_size: int, rank: int) -> int:
    """A micro-batch's index for :func:`mix_batch`: the position, in the epoch's order
    over all ranks, of its first sample. ``samples_done`` is where the step starts
    (before it is counted), ``earlier`` the samples of this rank's earlier micro-batches
    of the step. The samplers deal rank r positions r, r + world, ... of the order, so
    this is unique per rank and micro-batch, and the same in a run resumed with the
    same shape (processes, ``-b``, ``--accum-steps``)."""
    return samples_done + earlier * world_size + rank


def mix_batch(images: torch.Tensor, labels: torch.Tensor, *, epoch: int, index: int, seed: int, mixup_alpha: float,
              cutmix_alpha: float, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or CutMix of one batch, torchvision's (:func:`mixup_cutmix`), its draws
    (the choice, lambda, CutMix's box) from the CPU generator seeded with
    ``mix_seed(seed, epoch, index)``. The partner of sample i is sample i - 1 (i = 0:
    the last), as torchvision's ``roll(1, 0)`` pairs them: no permutation is drawn.

    Args:
        images: a float batch (N, C, H, W), normalized or not, on any device; not
            changed (the result is new, in its memory format: channels_last stays so).
        labels: class indices (N,) (int64).
        index: the batch's index in the epoch (:func:`batch_index`).

    Returns:
        The mixed images and soft targets, float32 (N, num_classes), on the labels'
        device; where both alphas are 0, ``images`` and ``labels`` themselves.
    """
    mixer = mixup_cutmix(float(mixup_alpha), float(cutmix_alpha), int(num_classes))
    if mixer is None:
        return images, labels
    mixed, targets = seeded(mixer, mix_seed(seed, epoch, index), images, labels)
    if images.dim() == 4 and not images.is_contiguous() and images.is_contiguous(memory_format=torch.channels_last):
        mixed = mixed.contiguous(memory_format=torch.channels_last)  # as the engine's --channels-last gave it
    return mixed, targets
