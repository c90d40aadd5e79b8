"""Models: a DAWNBench-style ResNet for 32x32 images, and any torchvision model by name.

``resnet9`` is the network of David Page's CIFAR-10 DAWNBench entry (94% in 26 s on a
V100): a prep convolution, three stages that double the width and halve the
resolution, residual blocks after the first and last, a global max-pool and a linear
head whose logits are scaled by 1/8. ``resnet9-wN`` is the same with N channels in
the prep layer instead of 64 (``resnet9-w8`` trains on a 2-core CPU in fp16 in about
two minutes). ``resnet18`` for CIFAR is torchvision's with a 3x3 stride-1 stem and no
max-pool.

Most torchvision models take any image size. A vision transformer (``vit_*``) and
MaxViT (``maxvit_t``) are built for one: a ViT's position embeddings and MaxViT's
attention grids are sized when the model is constructed. These get the run's image
size at construction (:func:`build_imagenet_model`), and cannot change it between
epochs (:func:`check_image_sizes`).
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torchvision

from ..errors import UserError, one_line

__all__ = ["CIFAR_ARCHS", "build_cifar_model", "build_imagenet_model", "zero_init_residual_bn",
           "imagenet_arch_names", "check_arch", "check_image_sizes", "has_fixed_input_size",
           "UnknownArchError", "ImageSizeError"]

# torchvision's builders that take the input size, by name prefix: how they take it.
_INPUT_SIZE_KWARGS = {
    "vit_": lambda size: {"image_size": size},
    "maxvit_": lambda size: {"input_size": (size, size)},
}


class UnknownArchError(UserError, ValueError):
    """An --arch that names no model."""


class ImageSizeError(UserError, ValueError):
    """An --image-size or --resize-phases that the arch cannot take."""


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(inplace=True))


class Residual(nn.Module):
    """x + f(x) with f two conv-bn-relu layers."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = conv_bn(channels, channels)
        self.conv2 = conv_bn(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.conv1(x))

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.conv2[1]


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def resnet9(width: int = 64, num_classes: int = 10) -> nn.Sequential:
    w = width
    return nn.Sequential(
        conv_bn(3, w),
        conv_bn(w, 2 * w), nn.MaxPool2d(2), Residual(2 * w),
        conv_bn(2 * w, 4 * w), nn.MaxPool2d(2),
        conv_bn(4 * w, 8 * w), nn.MaxPool2d(2), Residual(8 * w),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        nn.Linear(8 * w, num_classes, bias=False),
        Scale(0.125),
    )


def cifar_resnet18(num_classes: int = 10) -> nn.Module:
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


CIFAR_ARCHS = ("resnet9", "resnet9-wN (e.g. resnet9-w8)", "resnet18")


def _resnet9_width(arch: str) -> int | None:
    if arch == "resnet9":
        return 64
    match = re.fullmatch(r"resnet9-w(\d+)", arch)
    return int(match.group(1)) if match and int(match.group(1)) > 0 else None


def check_arch(task: str, arch: str) -> None:
    """Raise :class:`UnknownArchError` unless ``arch`` names a model for ``task``."""
    if task == "cifar":
        if _resnet9_width(arch) is None and arch != "resnet18":
            raise UnknownArchError(f"unknown CIFAR arch {arch!r}; choose one of {', '.join(CIFAR_ARCHS)}")
        return
    names = imagenet_arch_names()
    if arch not in names:
        close = [n for n in names if n.startswith(arch[:4])][:8]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UnknownArchError(f"unknown torchvision arch {arch!r}{hint}; see torchvision.models.list_models()")


def has_fixed_input_size(task: str, arch: str) -> bool:
    """Whether ``arch`` is built for one image size (a ViT, MaxViT) rather than taking any."""
    return task == "imagenet" and any(arch.startswith(prefix) for prefix in _INPUT_SIZE_KWARGS)


def check_image_sizes(task: str, arch: str, sizes: list[int]) -> None:
    """Raise a one-line :class:`ImageSizeError` if ``arch`` cannot take square images of
    each of ``sizes`` (the run's sizes, first to last). A forward pass on the meta
    device checks every shape in a fraction of a second, before any data is loaded
    (Inception wants at least 75, a ViT a multiple of its patch size). An arch built
    for one size (:func:`has_fixed_input_size`) takes no other, so it cannot be resized
    between epochs."""
    check_arch(task, arch)
    sizes = list(dict.fromkeys(sizes))
    fixed = has_fixed_input_size(task, arch)
    if fixed and len(sizes) > 1:
        raise ImageSizeError(f"{arch} is built for one image size and cannot be resized between epochs (the run "
                             f"asks for {', '.join(map(str, sizes))}): give --resize-phases one size, or drop it")
    patch = _patch_size(arch) if fixed else None
    for size in sizes:
        if patch and size % patch:
            raise ImageSizeError(f"{arch} cannot take {size}x{size} images: the size must be a multiple of its "
                                 f"patch size, {patch}")
        try:
            with torch.device("meta"):
                model = (build_cifar_model(arch, 10) if task == "cifar" else
                         build_imagenet_model(arch, 10, image_size=size)).eval()
                with torch.no_grad():
                    model(torch.empty(2, 3, size, size))
        except (RuntimeError, AssertionError, ValueError) as exc:
            raise ImageSizeError(f"{arch} cannot take {size}x{size} images: {one_line(exc)}") from None


def _patch_size(arch: str) -> int | None:
    """A vision transformer's patch size (torchvision's ViT keeps it as ``patch_size``)."""
    with torch.device("meta"):
        return getattr(build_imagenet_model(arch, 10), "patch_size", None)


def build_cifar_model(arch: str, num_classes: int = 10) -> nn.Module:
    """``resnet9``, ``resnet9-wN`` or ``resnet18``."""
    check_arch("cifar", arch)
    if arch == "resnet18":
        return cifar_resnet18(num_classes)
    return resnet9(_resnet9_width(arch), num_classes)


def imagenet_arch_names() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_imagenet_model(arch: str, num_classes: int = 1000, image_size: int | None = None) -> nn.Module:
    """Any torchvision classification model, by name, randomly initialized.

    Args:
        arch: a name from :func:`imagenet_arch_names`.
        num_classes: outputs of the classifier.
        image_size: the side of the square images it will take. Models built for one
            size (:func:`has_fixed_input_size`) are built for this one; the others take
            any size and ignore it. None: torchvision's default, 224.
    """
    check_arch("imagenet", arch)
    kwargs = {}
    for prefix, size_kwargs in _INPUT_SIZE_KWARGS.items():
        if arch.startswith(prefix) and image_size is not None:
            kwargs = size_kwargs(image_size)
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)


def zero_init_residual_bn(model: nn.Module) -> int:
    """Zero the gamma of the last BatchNorm in each residual block (Goyal et al. 2017),
    so that every block starts as the identity. Returns how many were zeroed."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    count = 0
    for m in model.modules():
        bn = None
        if isinstance(m, Bottleneck):
            bn = m.bn3
        elif isinstance(m, BasicBlock):
            bn = m.bn2
        elif isinstance(m, Residual):
            bn = m.last_bn
        if bn is not None and bn.weight is not None:
            nn.init.zeros_(bn.weight)
            count += 1
    return count
