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

timm's models by name, where torchvision has none of that name (``vit_tiny_patch16_224``,
``resnet10t``), or by ``timm/NAME`` (``timm/resnet50``, where torchvision has one too):
``timm.create_model(name, pretrained=False, num_classes=..., img_size=...)``, the image
size for the models that take one (a ViT, Swin, MaxViT: built for that one size).
timm is imported only for such a name, and is an optional extra (``pip install
'mpfp16[timm]'``). Nothing is downloaded: ``--weights`` loads a local file
(:func:`load_weights`).
"""

from __future__ import annotations

import argparse
import functools
import re

import torch
import torch.nn as nn
import torchvision

from ..errors import UserError, one_line

__all__ = ["CIFAR_ARCHS", "build_cifar_model", "build_imagenet_model", "zero_init_residual_bn",
           "imagenet_arch_names", "check_arch", "check_image_sizes", "has_fixed_input_size", "model_source",
           "load_weights", "fp32_norm_classes", "UnknownArchError", "ImageSizeError", "WeightsError",
           "TIMM_PREFIX", "TIMM_INSTALL"]

TIMM_PREFIX = "timm/"  # --model timm/NAME: timm's model, where torchvision has one of that name too
TIMM_INSTALL = "pip install 'mpfp16[timm]'"

# torchvision's builders that take the input size, by name prefix: how they take it.
_INPUT_SIZE_KWARGS = {
    "vit_": lambda size: {"image_size": size},
    "maxvit_": lambda size: {"input_size": (size, size)},
}


class UnknownArchError(UserError, ValueError):
    """An --arch that names no model."""


class ImageSizeError(UserError, ValueError):
    """An --image-size or --resize-phases that the arch cannot take."""


class WeightsError(UserError, ValueError):
    """A --weights file that cannot be read, or does not fit the model."""


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
    model_source(arch)


def model_source(arch: str) -> tuple[str, str]:
    """``("torchvision", name)`` or ``("timm", name)``: where an ImageNet ``--arch``
    comes from. torchvision's name first; ``timm/NAME``, or a name torchvision does not
    have and timm does, is timm's.

    Raises:
        UnknownArchError: neither has it; a timm name without timm installed; a hub
            name (nothing is downloaded).
    """
    if ":" in arch:  # timm's hf-hub:... and local-dir:... names fetch or read a model's config
        raise UnknownArchError(f"--arch {arch}: nothing is downloaded or read from a hub: name the model "
                               "(a torchvision name, or timm's), and pass local weights with --weights FILE")
    names = imagenet_arch_names()
    if not arch.startswith(TIMM_PREFIX) and arch in names:
        return "torchvision", arch
    name = arch[len(TIMM_PREFIX):] if arch.startswith(TIMM_PREFIX) else arch
    try:
        timm = _import_timm()
    except ImportError:
        if arch.startswith(TIMM_PREFIX):
            raise UnknownArchError(f"--arch {arch} is timm's, and timm is not installed: {TIMM_INSTALL}") from None
        raise UnknownArchError(f"unknown torchvision arch {arch!r}{_close(arch, names)}; see "
                               f"torchvision.models.list_models(), or for timm's models: {TIMM_INSTALL}") from None
    if name and timm.is_model(name):
        return "timm", name
    if arch.startswith(TIMM_PREFIX):
        raise UnknownArchError(f"unknown timm arch {name!r}{_close(name, timm.list_models())}; see "
                               "timm.list_models()")
    raise UnknownArchError(f"unknown torchvision arch {arch!r}{_close(arch, names)}, and timm has none of that "
                           "name; see torchvision.models.list_models() and timm.list_models()")


def _close(arch: str, names) -> str:
    close = [n for n in names if n.startswith(arch[:4])][:8]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _import_timm():
    """timm, imported only when a model is timm's (an ImportError where it is missing)."""
    import timm

    return timm


def has_fixed_input_size(task: str, arch: str) -> bool:
    """Whether ``arch`` is built for one image size (a ViT, MaxViT; timm's models that
    take ``img_size``) rather than taking any."""
    if task != "imagenet":
        return False
    source, name = model_source(arch)
    if source == "timm":
        return _timm_takes_img_size(name)
    return any(arch.startswith(prefix) for prefix in _INPUT_SIZE_KWARGS)


@functools.lru_cache(maxsize=None)
def _timm_takes_img_size(name: str) -> bool:
    """Whether timm's model ``name`` is built for an ``img_size`` (tried on the meta
    device: nothing is allocated)."""
    with torch.device("meta"):
        try:
            _import_timm().create_model(name, pretrained=False, num_classes=10, img_size=224)
        except TypeError as exc:
            if "img_size" in str(exc):
                return False
            raise
    return True


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
    """A vision transformer's patch size (torchvision's ViT keeps it as ``patch_size``,
    timm's as ``patch_embed.patch_size``, a pair)."""
    with torch.device("meta"):
        model = build_imagenet_model(arch, 10)
    patch = getattr(model, "patch_size", None) or getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if isinstance(patch, (tuple, list)):
        patch = max(patch) if patch else None
    return patch if isinstance(patch, int) else None


def build_cifar_model(arch: str, num_classes: int = 10) -> nn.Module:
    """``resnet9``, ``resnet9-wN`` or ``resnet18``."""
    check_arch("cifar", arch)
    if arch == "resnet18":
        return cifar_resnet18(num_classes)
    return resnet9(_resnet9_width(arch), num_classes)


def imagenet_arch_names() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_imagenet_model(arch: str, num_classes: int = 1000, image_size: int | None = None) -> nn.Module:
    """Any torchvision classification model, or timm's (:func:`model_source`), by
    name, randomly initialized.

    Args:
        arch: a name from :func:`imagenet_arch_names`, or timm's.
        num_classes: outputs of the classifier.
        image_size: the side of the square images it will take. Models built for one
            size (:func:`has_fixed_input_size`) are built for this one; the others take
            any size and ignore it. None: the library's default (224 for most).
    """
    source, name = model_source(arch)
    if source == "timm":
        kwargs = {"img_size": image_size} if image_size is not None and _timm_takes_img_size(name) else {}
        return _import_timm().create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
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


# Normalization layers of timm's that to_half's name rule does not know (EvoNorm2dB0,
# EvoNorm2dS0a, FilterResponseNormAct2d, ...): their statistics are sums too.
_TIMM_NORM_NAME = re.compile(r"^(EvoNorm|FilterResponseNorm)")


def fp32_norm_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of ``model``'s normalization layers that :func:`mpfp16.to_half`
    would not keep in fp32 by itself, for its ``keep_fp32``."""
    return tuple(dict.fromkeys(type(m) for m in model.modules() if _TIMM_NORM_NAME.search(type(m).__name__)))


def load_weights(model: nn.Module, path: str) -> str:
    """Load the weights in the local file ``path`` into ``model`` (fp32, before it is
    converted), strictly: every parameter and buffer, in its shape. The file holds a
    state_dict, or a checkpoint with one under ``"model"`` (torchvision's reference
    train.py, and this trainer's own checkpoints) or ``"state_dict"`` (timm's train.py);
    a ``module.`` prefix (a DDP module's) is taken off. Returns a description for the log.

    Raises:
        WeightsError: one line: the file cannot be read, holds no state_dict, or does
            not fit the model.
    """
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # torchvision's and timm's checkpoints: "args"
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling raises anything; the line names the file
        raise WeightsError(f"--weights {path}: cannot read it as torch.save's file of a state_dict: "
                           f"{one_line(exc)}") from None
    where = "its state_dict"
    for key in ("model", "state_dict"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded, where = loaded[key], f"its {key!r} state_dict"
            break
    if not (isinstance(loaded, dict) and loaded and all(isinstance(k, str) and torch.is_tensor(v)
                                                        for k, v in loaded.items())):
        raise WeightsError(f"--weights {path}: holds no state_dict (a dict of tensors, alone or under 'model' or "
                           "'state_dict')")
    for prefix in ("module.", "_orig_mod."):  # DDP's, torch.compile's
        if all(k.startswith(prefix) for k in loaded):
            loaded = {k[len(prefix):]: v for k, v in loaded.items()}
    own = model.state_dict()
    missing = [k for k in own if k not in loaded]
    unexpected = [k for k in loaded if k not in own]
    shapes = [f"{k} {tuple(loaded[k].shape)} for {tuple(v.shape)}" for k, v in own.items()
              if k in loaded and loaded[k].shape != v.shape]
    if missing or unexpected or shapes:
        def some(names):
            return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts = ([f"missing {some(missing)}"] if missing else []) + (
            [f"unexpected {some(unexpected)}"] if unexpected else []) + (
            [f"shapes differ: {some(shapes)}"] if shapes else [])
        raise WeightsError(f"--weights {path} does not fit the model ({'; '.join(parts)}): the file must be the "
                           "weights of this --arch with this data's number of classes")
    model.load_state_dict(loaded)
    return f"{where} from {path}"
