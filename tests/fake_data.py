"""Tiny data sets written by the tests: CIFAR-10 batches in torchvision's format and an
ImageFolder of JPEGs."""

from __future__ import annotations

import os
import pickle

import numpy as np
import torch
from PIL import Image


def write_fake_cifar(root, per_batch: int = 40, test: int = 40, seed: int = 0) -> str:
    """root/cifar-10-batches-py/{data_batch_1..5,test_batch}: learnable (label = a
    colour channel that is brighter), as pickled dicts of numpy arrays."""
    folder = os.path.join(str(root), "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)

    def batch(n):
        labels = rng.integers(0, 10, n)
        data = rng.integers(0, 128, (n, 3, 32, 32), dtype=np.uint8)
        for i, label in enumerate(labels):
            data[i, label % 3, : 8 + 2 * label] += 100
        return {b"data": data.reshape(n, -1), b"labels": labels.tolist(), b"batch_label": b"fake",
                b"filenames": [b"x.png"] * n}

    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test)]:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch(n), f, protocol=2)
    return str(root)


def write_fake_imagefolder(root, classes=("cat", "dog", "fox"), train_per_class: int = 8, val_per_class: int = 3,
                           size: int = 40) -> str:
    g = torch.Generator().manual_seed(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c, name in enumerate(classes):
            folder = os.path.join(str(root), split, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                image = torch.randint(0, 100, (size, size, 3), generator=g, dtype=torch.uint8)
                image[..., c % 3] += 120
                Image.fromarray(image.numpy()).save(os.path.join(folder, f"{i}.jpg"), quality=90)
    return str(root)
