"""Train a torchvision model on ImageNet (an ImageFolder root) with fp16 weights and fp32
master weights.

One process, on the embedded synthetic data (a smoke test):

    python train_imagenet.py -a resnet18 --image-size 64 --epochs 1

ImageNet on 8 GPUs, with the "ImageNet in 18 minutes" recipe (progressive resizing,
zero-init of the last BN gamma of each block, no BN weight decay, linear warm-up with
the lr scaled by the global batch):

    torchrun --nproc_per_node 8 train_imagenet.py /data/imagenet -a resnet50 -b 256 \\
        --epochs 30 --resize-phases 0:128,13:224,25:288 --zero-init-residual --no-bn-wd \\
        --warmup-epochs 2 --lr 0.1 --channels-last

Several machines: the same command under torchrun --nnodes N --rdzv-backend c10d
--rdzv-endpoint HOST:29400 on each of them.
"""

import sys

from mpfp16.train.cli import run


def main(argv=None) -> int:
    return run("imagenet", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
