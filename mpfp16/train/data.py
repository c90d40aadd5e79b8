"""Data sets, samplers and loaders for the two training scripts.

Sources: CIFAR-10 in torchvision's on-disk format (``cifar-10-batches-py``), an
ImageFolder root with ``train/`` and ``val/``, or an embedded synthetic data set that
is generated in memory and needs no file at all. Nothing is ever downloaded.

Every random choice a sample's augmentation makes is seeded by (seed, epoch, index):
the sampler yields ``(epoch, index)`` keys, and the data set seeds the transform from
them. The data order comes from :class:`ResumableDistributedSampler`. So a run that
resumes mid-epoch sees exactly the samples, in exactly the order and with exactly the
crops, that the uninterrupted run saw, whatever the number of loader workers. With
repeated augmentation (:class:`mpfp16.train.sampler.RepeatedAugmentationSampler`) the
keys are ``(epoch, index, position)``: the seed includes the position in the epoch's
order, so that the repeats of an image are augmented differently.

The transforms are torchvision's reference recipe (:mod:`mpfp16.train.augment`), with
the settings of :class:`mpfp16.train.augment.Augmentation`; without any, the pipelines
are the ones before the recipe existed.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms import v2

from ..errors import DataError, one_line
from . import augment
from .augment import Augmentation
from .config import BAD_IMAGE_POLICIES
from .sampler import RepeatedAugmentationSampler

__all__ = ["DataSpec", "synthetic_images", "load_cifar10", "ImageFolderSplit", "InMemoryImages",
           "ResumableDistributedSampler", "RepeatedAugmentationSampler", "ShardSampler", "StepBatches", "make_loader",
           "train_sampler", "cifar_data", "imagenet_data", "imagenet_transforms", "sample_seed", "Augmentation",
           "check_no_link_loop", "single_class_warning"]

logger = logging.getLogger("mpfp16")

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class DataSpec:
    """What the engine needs to know about a data set."""

    train: Dataset
    val: Dataset
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    description: str
    # size -> the (train, val) transforms at training crop ``size`` (the resize phases);
    # None where they never change (CIFAR)
    make_transforms: Callable[[int], tuple] | None = None


def sample_seed(seed: int, epoch: int, index: int, position: int | None = None) -> int:
    """A 63-bit seed for one sample's augmentation (int-tuple hashing is stable across
    processes; only str and bytes hashes are randomized). ``position``, the sample's
    place in the epoch's order, where the order repeats indices (repeated
    augmentation): each repeat gets its own draw. Without it, the seed of before."""
    key = (seed, epoch, index) if position is None else (seed, epoch, index, position)
    return hash(key) & 0x7FFF_FFFF_FFFF_FFFF


def _key_seed(seed: int, key) -> int:
    """The seed of a sampler's key: ``(epoch, index)`` or ``(epoch, index, position)``."""
    return sample_seed(seed, *key)


def _apply_transform(transform, image: torch.Tensor, seed: int | None) -> torch.Tensor:
    if transform is None:
        return image
    if seed is None:
        return transform(image)
    return augment.seeded(transform, seed, image)  # the CPU generator only, restored after


# ----------------------------------------------------------------- synthetic data


def _class_prototypes(num_classes: int, size: int, seed: int) -> torch.Tensor:
    """One smooth colour pattern per class: three oriented cosine waves, each with its
    own colour, of 1 to 3 cycles across the image."""
    g = torch.Generator().manual_seed(seed)
    coords = torch.arange(size, dtype=torch.float32) / size
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    protos = []
    for _ in range(num_classes):
        image = torch.zeros(3, size, size)
        for _ in range(3):
            freq, angle, phase = (1 + 2 * torch.rand(1, generator=g).item(), math.pi * torch.rand(1, generator=g).item(),
                                  2 * math.pi * torch.rand(1, generator=g).item())
            wave = torch.cos(2 * math.pi * freq * (xx * math.cos(angle) + yy * math.sin(angle)) + phase)
            image += torch.randn(3, generator=g)[:, None, None] * wave
        protos.append(image / image.abs().amax())
    return torch.stack(protos)


def synthetic_images(n: int, size: int = 32, num_classes: int = 10, seed: int = 0,
                     noise: float = 0.5, distractor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic, learnable image classification set, generated in memory.

    Each class is a fixed smooth colour pattern (the same for every ``seed``); a sample
    is its class pattern shifted by up to 1/8 of the image, with random contrast and
    Gaussian noise. A small CNN learns it in a few epochs; noise keeps it from being
    trivial.

    Returns:
        uint8 images (n, 3, size, size) and int64 labels (n,).
    """
    protos = _class_prototypes(num_classes, size, seed=1234)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    # A distractor: another class's pattern, weaker, shifted independently.
    others = (labels + torch.randint(1, num_classes, (n,), generator=g)) % num_classes
    weight = distractor * torch.rand(n, generator=g)
    shift = size // 8
    shifts = torch.randint(-shift, shift + 1, (n, 4), generator=g).tolist()
    images = torch.stack([torch.roll(protos[c], s[:2], (1, 2)) + w * torch.roll(protos[o], s[2:], (1, 2))
                          for c, o, w, s in zip(labels.tolist(), others.tolist(), weight.tolist(), shifts)])
    images = images * (0.5 + 0.7 * torch.rand(n, 1, 1, 1, generator=g)) + noise * torch.randn(images.shape, generator=g)
    return ((images * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8), labels


# ----------------------------------------------------------------- CIFAR-10 files


class _ArraysOnly(pickle.Unpickler):
    """CIFAR-10's batches are pickles; load them without running arbitrary code by
    allowing only what a numpy array needs."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"),
               ("_codecs", "encode")}  # how protocol-2 pickles written by Python 3 spell bytes

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _read_cifar_batch(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with open(path, "rb") as f:
            batch = _ArraysOnly(f, encoding="bytes").load()
        data, labels = batch[b"data"], batch[b"labels"]
        images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
        labels = torch.as_tensor(labels, dtype=torch.int64)
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise DataError(f"{path} is not a CIFAR-10 batch file ({type(exc).__name__}: {exc})") from None
    if images.dtype != torch.uint8 or len(images) != len(labels):
        raise DataError(f"{path} is not a CIFAR-10 batch file (unexpected array type or size)")
    return images, labels


def load_cifar10(root: str) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Read CIFAR-10 from ``root``: the ``cifar-10-batches-py`` folder or its parent."""
    if not os.path.exists(root):
        raise DataError(f"data path {root} does not exist")
    folder = root if os.path.exists(os.path.join(root, "data_batch_1")) else os.path.join(root, "cifar-10-batches-py")
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise DataError(f"{root} holds no CIFAR-10 data in torchvision's format: expected "
                        f"cifar-10-batches-py/ with data_batch_1..5 and test_batch (missing {', '.join(missing)})")
    train = [_read_cifar_batch(os.path.join(folder, n)) for n in names[:5]]
    test = _read_cifar_batch(os.path.join(folder, "test_batch"))
    train_images, train_labels = torch.cat([t[0] for t in train]), torch.cat([t[1] for t in train])
    for name, labels in (("training", train_labels), ("test", test[1])):
        if len(labels) and (labels.min() < 0 or labels.max() > 9):
            raise DataError(f"CIFAR-10 {name} labels must be 0..9, found {labels.min()}..{labels.max()}")
    return (train_images, train_labels), test


# ----------------------------------------------------------------- data sets


class InMemoryImages(Dataset):
    """uint8 images held in memory, transformed per sample with a seeded RNG."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform=None, seed: int = 0) -> None:
        self.images, self.labels, self.transform, self.seed = images, labels, transform, seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key):
        index = key[1]
        image = _apply_transform(self.transform, self.images[index], _key_seed(self.seed, key))
        return image, self.labels[index]


def check_no_link_loop(folder: str) -> None:
    """Refuse a link under ``folder`` that leads to a folder the walk reaches anyway:
    one that holds the link (``train/cat/loop -> ..``), or one found elsewhere in the
    split. ImageFolder follows links, and would count those images again: round a loop
    until the path grows too long (48 images became 2,928), or twice.

    Raises:
        DataError: one line naming the link and the folder it leads to.
    """
    seen: dict[str, str] = {}
    for here, _, _ in os.walk(folder, followlinks=True):
        real = os.path.realpath(here)
        if real not in seen:
            seen[real] = here
            continue
        first = seen[real]
        link = _first_link(here, folder) or _first_link(first, folder) or here
        if here.startswith(first.rstrip(os.sep) + os.sep):
            raise DataError(f"{link} is a link to {os.path.realpath(link)}, and following it leads back to {first}: "
                            "a loop, which would count its images again at every turn; remove the link")
        raise DataError(f"{link} is a link to {os.path.realpath(link)}, which {folder} holds already "
                        f"({first if link != first else here}): its images would count twice; remove the link")


def _first_link(path: str, root: str) -> str | None:
    """The outermost link on the way from ``root`` down to ``path``, or None."""
    walked = root
    for part in os.path.relpath(path, root).split(os.sep):
        walked = os.path.join(walked, part)
        if part not in (".", "") and os.path.islink(walked):
            return walked
    return None


def single_class_warning(spec: DataSpec) -> str | None:
    """The warning for a data set of one class, or None: every prediction is then
    right, and the run reports 100% accuracy whatever it learned."""
    if spec.num_classes != 1:
        return None
    classes = getattr(spec.train, "classes", None)
    name = f"class folder {classes[0]!r}" if classes else "class"
    folder = getattr(spec.train, "folder", None)
    split = f"training split {folder}" if folder else "training split"
    return (f"the {split} holds a single {name}: every prediction is right and accuracy will read 100% whatever "
            "the model learns; a classifier needs two classes or more")


class ImageFolderSplit(Dataset):
    """One split (``train/`` or ``val/``) of an ImageFolder root, decoded with Pillow
    into uint8 tensors.

    ``bad_images`` decides what an image that fails to decode does: ``"fail"`` stops
    the run with an error naming the file; ``"skip"`` logs a warning naming it and
    uses the next image of the split that decodes instead, so batches keep their size.
    """

    def __init__(self, folder: str, transform=None, seed: int = 0, bad_images: str = "fail",
                 class_to_idx: dict[str, int] | None = None) -> None:
        if bad_images not in BAD_IMAGE_POLICIES:
            raise ValueError(f"bad_images must be one of {BAD_IMAGE_POLICIES}")
        if not os.path.isdir(folder):
            raise DataError(f"{folder} is not a folder (an ImageFolder root needs train/ and val/)")
        check_no_link_loop(folder)  # torchvision follows links: a loop would count its images again at every turn
        try:
            index = torchvision.datasets.ImageFolder(folder, loader=lambda p: p)
        except (FileNotFoundError, RuntimeError) as exc:
            raise DataError(f"{folder}: {one_line(exc)}") from None
        if class_to_idx is not None and index.class_to_idx != class_to_idx:
            raise DataError(f"{folder} has other class folders than the training split")
        self.folder = folder
        self.samples = index.samples
        self.classes = index.classes
        self.class_to_idx = index.class_to_idx
        self.transform, self.seed, self.bad_images = transform, seed, bad_images
        if not self.samples:
            raise DataError(f"{folder} holds no images")
        # Which bad files were reported, shared with the data loader's worker processes
        # (new ones every epoch), so that each is reported once per run.
        self._warned = torch.zeros(len(self.samples), dtype=torch.bool).share_memory_()
        self._first_image()

    def _first_image(self) -> None:
        """Decode an image now, before training, so that a folder of files that are not
        images is reported as such, not as a batch-size problem later."""
        try:
            self._decode(self.samples[0][0])
        except DataError:
            if self.bad_images == "fail":
                raise
            self._load(0)  # skip: some image of the split must decode

    def __len__(self) -> int:
        return len(self.samples)

    def _decode(self, path: str) -> torch.Tensor:
        try:
            with Image.open(path) as image:
                return v2.functional.pil_to_tensor(image.convert("RGB"))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise DataError(f"cannot decode image {path}: {one_line(exc)}") from None

    def _load(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index``, or with ``bad_images="skip"`` the next one that decodes."""
        for attempt in range(len(self.samples)):
            position = (index + attempt) % len(self.samples)
            path, label = self.samples[position]
            try:
                return self._decode(path), label
            except DataError as exc:
                if self.bad_images == "fail":
                    raise
                if not self._warned[position]:
                    self._warned[position] = True
                    logger.warning("skipping %s", exc)
        raise DataError(f"no image of the {len(self.samples)} in {os.path.dirname(os.path.dirname(path))} decodes")

    def __getitem__(self, key):
        image, label = self._load(key[1])
        return _apply_transform(self.transform, image, _key_seed(self.seed, key)), label


# ----------------------------------------------------------------- samplers


class ResumableDistributedSampler(Sampler):
    """This process's share of an epoch's sample order, from any point of it; it yields
    ``(epoch, index)`` keys.

    The order is one permutation of the data set, drawn from seed and epoch alone, as
    ``DistributedSampler`` draws it, so it is the same for any number of processes.
    ``set_epoch(epoch, start)`` skips its first ``start`` samples, counted over all
    processes; of the rest, rank r takes samples r, r + world, r + 2 world, ... and
    every rank the same number of them (the last ``< world`` are dropped). The ranks'
    next batches are thus always the next samples of the one order: after any number
    of steps, of any batch size, on any number of processes, the samples trained are
    exactly its first ``start`` (:func:`mpfp16.train.resume.samples_done`), and a run
    resumed with another world size or batch continues it without repeating or
    skipping one (how far it takes the rest: :func:`mpfp16.train.resume.epoch_rest`,
    in :class:`StepBatches`). With ``start`` 0 it yields what
    ``DistributedSampler(drop_last=True)`` yields.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of {num_replicas} processes")
        self.size, self.num_replicas, self.rank = len(dataset), num_replicas, rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.start = 0, 0

    @property
    def epoch_size(self) -> int:
        """The samples of an epoch's order, over all ranks: the data set's size."""
        return self.size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Reshuffle for ``epoch`` and begin after its first ``start`` samples (all ranks')."""
        self.epoch, self.start = epoch, start

    def order(self) -> list[int]:
        """The epoch's sample order, the same on every rank and for every world size."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # as DistributedSampler seeds it
        return torch.randperm(self.size, generator=g).tolist()

    def __iter__(self):
        rest = self.order()[self.start:]
        for index in rest[self.rank: len(self) * self.num_replicas: self.num_replicas]:
            yield self.epoch, index

    def __len__(self) -> int:
        return max(0, self.size - self.start) // self.num_replicas


def train_sampler(dataset, num_replicas: int, rank: int, *, seed: int = 0, ra_sampler: bool = False,
                  ra_reps: int = 3):
    """The training sampler: :class:`ResumableDistributedSampler`, or with ``ra_sampler``
    torchvision's repeated augmentation, ``ra_reps`` repeats of each sample
    (:class:`RepeatedAugmentationSampler`). Both yield this rank's keys of one order
    dealt round the ranks, from ``set_epoch(epoch, start)``'s position on, and tell its
    length over all ranks as ``epoch_size``."""
    if ra_sampler:
        return RepeatedAugmentationSampler(dataset, num_replicas, rank, shuffle=True, seed=seed, repetitions=ra_reps)
    return ResumableDistributedSampler(dataset, num_replicas, rank, shuffle=True, seed=seed)


class ShardSampler(Sampler):
    """Rank r gets samples r, r + world, r + 2 world, ...: every sample exactly once
    across ranks, none repeated to even the shards out (evaluation)."""

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        self.indices = range(rank, length, num_replicas)

    def __iter__(self):
        return ((0, i) for i in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class StepBatches(Sampler):
    """The micro-batches of an epoch's rest: the keys ``sampler`` yields, in batches of
    the sizes given, in turn, and no more (:func:`mpfp16.train.resume.epoch_rest`: its
    full steps' micro-batches of ``-b``, then those of a shorter last step). A batch the
    sampler cannot fill is not yielded."""

    def __init__(self, sampler, sizes: list[int]) -> None:
        self.sampler, self.sizes = sampler, list(sizes)

    def __iter__(self):
        keys = iter(self.sampler)
        for size in self.sizes:
            batch = list(itertools.islice(keys, size))
            if len(batch) < size:
                return
            yield batch

    def __len__(self) -> int:
        return len(self.sizes)


def make_loader(dataset, sampler, batch_size: int, workers: int, pin_memory: bool, drop_last: bool,
                batch_sizes: list[int] | None = None) -> DataLoader:
    """Batches of ``batch_size`` of what ``sampler`` yields, or, with ``batch_sizes``, the
    batches of those sizes in turn (:class:`StepBatches`; ``batch_size`` and
    ``drop_last`` then unused)."""
    # Its own generator: creating an iterator must not draw from the global RNG, or a
    # run resumed mid-epoch would draw once more than the uninterrupted run did.
    common = dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=False,
                  generator=torch.Generator().manual_seed(0))
    if batch_sizes is not None:
        return DataLoader(dataset, batch_sampler=StepBatches(sampler, batch_sizes), **common)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **common)


# ----------------------------------------------------------------- the two recipes


def _cifar_train_transform(size: int, aug: Augmentation | None = None, mean=(0.5, 0.5, 0.5)):
    return augment.cifar_train_transform(size, aug, mean)


def cifar_data(root: str | None, seed: int, synthetic_size: tuple[int, int],
               augmentation: Augmentation | None = None) -> DataSpec:
    """CIFAR-10 from ``root``, or the embedded synthetic set (32x32, 10 classes).
    ``augmentation``: the recipe's policy, erasing and validation resize/crop
    (:func:`mpfp16.train.augment.cifar_train_transform`); None: none of them."""
    if root is None:
        (xtr, ytr), (xva, yva) = synthetic_images(synthetic_size[0], 32, 10, seed=1), \
            synthetic_images(synthetic_size[1], 32, 10, seed=2)
        desc = (f"embedded synthetic data: {len(ytr)} training and {len(yva)} validation images, "
                "32x32, 10 classes (pass a CIFAR-10 folder to train on real data)")
        mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    else:
        (xtr, ytr), (xva, yva) = load_cifar10(root)
        desc = f"CIFAR-10 from {root}: {len(ytr)} training and {len(yva)} test images"
        mean, std = CIFAR_MEAN, CIFAR_STD
    if len(ytr) == 0 or len(yva) == 0:
        raise DataError(f"{root}: the training or the test split is empty")
    return DataSpec(InMemoryImages(xtr, ytr, _cifar_train_transform(32, augmentation, mean), seed),
                    InMemoryImages(xva, yva, augment.cifar_val_transform(augmentation)), 10, mean, std, desc)


def imagenet_transforms(size: int, augmentation: Augmentation | None = None, mean=IMAGENET_MEAN):
    """The (train, val) transforms at training crop ``size``: torchvision's
    ``ClassificationPresetTrain`` and ``ClassificationPresetEval`` less the Normalize the
    engine does (:mod:`mpfp16.train.augment`); ``mean`` is the erasing's value. Without
    ``augmentation``: RandomResizedCrop and flip; Resize(size * 256/224), CenterCrop."""
    return (augment.imagenet_train_transform(size, augmentation, mean),
            augment.imagenet_val_transform(size, augmentation))


def imagenet_data(root: str | None, image_size: int, seed: int, bad_images: str,
                  synthetic_size: tuple[int, int], synthetic_classes: int = 10,
                  augmentation: Augmentation | None = None) -> DataSpec:
    """An ImageFolder root with ``train/`` and ``val/``, or the embedded synthetic set.
    ``augmentation``: the recipe's settings (:func:`imagenet_transforms`); the spec's
    ``make_transforms(size)`` builds them again at another training crop."""
    if root is None:
        mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
        stored = max(64, image_size)
        recipe = functools.partial(imagenet_transforms, augmentation=augmentation, mean=mean)
        train_tf, val_tf = recipe(image_size)
        (xtr, ytr), (xva, yva) = synthetic_images(synthetic_size[0], stored, synthetic_classes, seed=1), \
            synthetic_images(synthetic_size[1], stored, synthetic_classes, seed=2)
        desc = (f"embedded synthetic data: {len(ytr)} training and {len(yva)} validation images, "
                f"{stored}x{stored}, {synthetic_classes} classes (pass an ImageFolder root to train on real data)")
        return DataSpec(InMemoryImages(xtr, ytr, train_tf, seed), InMemoryImages(xva, yva, val_tf), synthetic_classes,
                        mean, std, desc, make_transforms=recipe)
    if not os.path.exists(root):
        raise DataError(f"data path {root} does not exist")
    recipe = functools.partial(imagenet_transforms, augmentation=augmentation, mean=IMAGENET_MEAN)
    train_tf, val_tf = recipe(image_size)
    train = ImageFolderSplit(os.path.join(root, "train"), train_tf, seed, bad_images)
    val = ImageFolderSplit(os.path.join(root, "val"), val_tf, seed, bad_images, class_to_idx=train.class_to_idx)
    desc = f"ImageFolder {root}: {len(train)} training and {len(val)} validation images, {len(train.classes)} classes"
    return DataSpec(train, val, len(train.classes), IMAGENET_MEAN, IMAGENET_STD, desc, make_transforms=recipe)
