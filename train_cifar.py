"""Train a ResNet on CIFAR-10 with fp16 weights, fp32 master weights and loss scaling.

One process (the embedded synthetic data, about two minutes on a 2-core CPU):

    python train_cifar.py

Real CIFAR-10 (torchvision's cifar-10-batches-py folder, or its parent), on 8 GPUs:

    torchrun --nproc_per_node 8 train_cifar.py /data/cifar10 -a resnet9 --epochs 24 -b 64

Several machines: torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d
--rdzv-endpoint HOST:29400 train_cifar.py ... on each of them.

Measured times and accuracies: docs/BENCHMARKS.md.
"""

import sys

from mpfp16.train.cli import run


def main(argv=None) -> int:
    return run("cifar", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
