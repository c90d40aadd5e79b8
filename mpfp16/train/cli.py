"""Command-line front end of train_cifar.py and train_imagenet.py: flags -> TrainConfig.

Flag names follow pytorch/examples' ImageNet script where one exists. Every help text
ends with its default. A bad value is an argparse error; a problem found later (a
missing data folder, a corrupt checkpoint, a stuck loss scale, a dead peer) is one
line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

import torch.distributed as dist

from ..comm import STRATEGIES
from ..errors import FusedStepUnavailable, ReplicaDivergenceError, UserError, one_line
from ..scaler import LossScaleStuckError
from . import data as data_mod
from .config import TrainConfig
from .preemption import Stopped
from .schedule import SCHEDULES

__all__ = ["build_parser", "config_from_args", "run"]

# Defaults that differ between real data and the embedded synthetic set, which must
# train on a 2-core CPU in fp16 in about two minutes.
DEFAULTS = {
    "cifar": {
        "real": {"arch": "resnet9", "epochs": 24, "batch_size": 512, "lr": 0.4},
        "embedded": {"arch": "resnet9-w8", "epochs": 3, "batch_size": 128, "lr": 0.4},
    },
    "imagenet": {
        "real": {"arch": "resnet50", "epochs": 90, "batch_size": 256, "lr": 0.1},
        "embedded": {"arch": "resnet18", "epochs": 2, "batch_size": 32, "lr": 0.1},
    },
}


def _int_at_least(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
MIN_IMAGE_SIZE = 8  # below it, torchvision's antialiased resize of the validation images fails
MAX_IMAGE_SIZE = 4096
_non_negative_int = _int_at_least(0)


def _float_in(low: float, high: float, low_open: bool = False):
    if high == math.inf:
        wanted = "a positive finite number" if low_open and low == 0 else f"a finite number >= {low:g}"
    else:
        wanted = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value
    return parse


_positive_float = _float_in(0.0, float("inf"), low_open=True)
_non_negative_float = _float_in(0.0, float("inf"))


def _loss_scale(text: str):
    if text == "dynamic":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'dynamic' or a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be 'dynamic' or a positive number, got {text!r}")
    return value


def _resize_phases(text: str) -> list[tuple[int, int]]:
    """'0:128,10:224,20:288' -> [(0, 128), (10, 224), (20, 288)]."""
    phases = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+):(\d+)\s*", part)
        if not match or not MIN_IMAGE_SIZE <= int(match.group(2)) <= MAX_IMAGE_SIZE:
            raise argparse.ArgumentTypeError(f"expected EPOCH:SIZE[,EPOCH:SIZE...] with sizes from {MIN_IMAGE_SIZE} "
                                             f"to {MAX_IMAGE_SIZE}, got {text!r}")
        phases.append((int(match.group(1)), int(match.group(2))))
    if [p[0] for p in phases] != sorted({p[0] for p in phases}):
        raise argparse.ArgumentTypeError(f"phase start epochs must increase, got {text!r}")
    return phases


def _pair(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not match or min(int(match.group(1)), int(match.group(2))) < 1:
        raise argparse.ArgumentTypeError(f"expected TRAIN,VAL image counts, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def build_parser(task: str, description: str | None = None) -> argparse.ArgumentParser:
    real, demo = DEFAULTS[task]["real"], DEFAULTS[task]["embedded"]
    cifar = task == "cifar"
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def by_data(key):
        return f"{real[key]}; {demo[key]} on the embedded data"

    g = p.add_argument_group("data")
    if cifar:
        g.add_argument("data", nargs="?", default=None,
                       help="CIFAR-10 in torchvision's format: the cifar-10-batches-py folder or its parent "
                            "(default: embedded synthetic data)")
    else:
        g.add_argument("data", nargs="?", default=None,
                       help="ImageFolder root with train/ and val/ (default: embedded synthetic data)")
    g.add_argument("-j", "--workers", type=_non_negative_int, default=0 if cifar else 4,
                   help=f"data loading processes per training process (default: {0 if cifar else 4})")
    if not cifar:
        g.add_argument("--image-size", type=_int_at_least(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE), default=224,
                       help=f"training crop size, {MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE} (default: 224)")
        g.add_argument("--bad-images", choices=data_mod.BAD_IMAGE_POLICIES, default="fail",
                       help="an image that fails to decode: fail the run, or skip it with a warning naming "
                            "the file (default: fail)")
    g.add_argument("--synthetic-size", type=_pair, default=None, metavar="TRAIN,VAL",
                   help="images in the embedded synthetic set (default: "
                        f"{'5000,1000' if cifar else '2000,400'})")

    g = p.add_argument_group("model")
    g.add_argument("-a", "--arch", default=None,
                   help=("resnet9 (Page's DAWNBench ResNet), resnet9-wN (N prep channels) or resnet18"
                         if cifar else "any torchvision model name") + f" (default: {by_data('arch')})")
    g.add_argument("--channels-last", action="store_true", help="channels_last memory format (default: off)")
    g.add_argument("--zero-init-residual", action="store_true", default=False,
                   help="zero the last BatchNorm gamma of each residual block (default: off)")

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=_positive_int, default=None,
                   help=f"epochs; the lr schedule spans them (default: {by_data('epochs')})")
    g.add_argument("--max-steps", type=_positive_int, default=None,
                   help="stop after N optimizer steps, whatever --epochs says (default: none)")
    g.add_argument("-b", "--batch-size", type=_positive_int, default=None,
                   help=f"images per process per micro-batch (default: {by_data('batch_size')})")
    g.add_argument("--accum-steps", type=_positive_int, default=1,
                   help="micro-batches per optimizer step; the allreduce runs once per step (default: 1)")
    g.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="inner optimizer (default: sgd)")
    g.add_argument("--lr", type=_positive_float, default=None,
                   help=("peak learning rate" if cifar else
                         "learning rate per 256 images of global batch, scaled linearly")
                   + f" (default: {by_data('lr')})")
    g.add_argument("--momentum", type=_float_in(0.0, 1.0), default=0.9, help="SGD momentum (default: 0.9)")
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=_non_negative_float,
                   default=5e-4 if cifar else 1e-4, help=f"weight decay (default: {5e-4 if cifar else 1e-4})")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=cifar,
                   help=f"Nesterov momentum (default: {'on' if cifar else 'off'})")
    g.add_argument("--label-smoothing", type=_float_in(0.0, 1.0), default=0.0,
                   help="label smoothing (default: 0.0)")
    g.add_argument("--warmup-epochs", type=_non_negative_float, default=0.0 if cifar else 5.0,
                   help="linear lr warm-up; onecycle warms up over 30%% of the run when 0 "
                        f"(default: {0.0 if cifar else 5.0})")
    g.add_argument("--lr-schedule", choices=SCHEDULES, default="onecycle" if cifar else "cosine",
                   help=f"lr schedule after warm-up (default: {'onecycle' if cifar else 'cosine'})")
    g.add_argument("--no-bn-wd", action="store_true", help="no weight decay on normalization layers and biases "
                                                          "(default: off)")
    if not cifar:
        g.add_argument("--resize-phases", type=_resize_phases, default=[], metavar="EPOCH:SIZE,...",
                       help="progressive resizing: the training crop size from each start epoch, e.g. "
                            "0:128,13:224,25:288 (default: --image-size throughout)")
        g.add_argument("--no-scale-lr", dest="scale_lr", action="store_false",
                       help="use --lr as given, not scaled by the global batch (default: scaled)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")

    g = p.add_argument_group("precision")
    g.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16",
                   help="weights and activations (default: fp16)")
    g.add_argument("--no-master-weights", dest="master_weights", action="store_false",
                   help="step the 16-bit weights directly, with no fp32 copy (default: fp32 masters)")
    g.add_argument("--rounding", choices=["nearest", "stochastic", "kahan"], default="nearest",
                   help="with --no-master-weights: how new weights are rounded to 16 bits (default: nearest)")
    g.add_argument("--loss-scale", type=_loss_scale, default="dynamic",
                   help="'dynamic' or a static scale; fp16 only (default: dynamic)")
    g.add_argument("--max-grad-norm", type=_positive_float, default=None,
                   help="clip the global norm of the unscaled gradients (default: no clipping)")
    g.add_argument("--fused", choices=["auto", "on", "off"], default="auto",
                   help="the compiled one-pass optimizer step: auto uses it for SGD/Adam/AdamW from 1M "
                        "parameters (default: auto)")

    g = p.add_argument_group("distributed")
    g.add_argument("--allreduce-dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="dtype of the gradient allreduce (default: the parameters' dtype)")
    g.add_argument("--allreduce-strategy", choices=STRATEGIES, default="allreduce",
                   help="allreduce, or fp32_accumulate: 16-bit on the wire, fp32 sums (default: allreduce)")
    g.add_argument("--predivide-factor", type=_positive_float, default=1.0,
                   help="divide gradients by F before the allreduce and by world/F after (default: 1.0)")
    g.add_argument("--bucket-mb", type=_positive_float, default=25.0, help="DDP bucket size in MiB (default: 25)")
    g.add_argument("--dist-backend", choices=["nccl", "gloo"], default=None,
                   help="process group backend (default: nccl on GPU, gloo on CPU)")
    g.add_argument("--dist-timeout", type=_positive_float, default=600.0,
                   help="seconds a collective waits for a peer before failing (default: 600)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where to train (default: cuda when available)")
    g.add_argument("--check-replicas", type=_non_negative_int, default=100, metavar="N",
                   help="check that every rank holds bit-identical weights, masters and optimizer state every N "
                        "optimizer steps, before each checkpoint and at the end; 0: never (default: 100)")

    g = p.add_argument_group("checkpoints and logs")
    g.add_argument("--checkpoint-dir", default="checkpoints",
                   help="where last.pt and best.pt go (default: ./checkpoints)")
    g.add_argument("--save-every", type=_non_negative_int, default=0,
                   help="also save every N optimizer steps; 0: only at the end of each epoch (default: 0)")
    g.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="resume from a checkpoint; auto: DIR/last.pt if it exists (default: start fresh, which "
                        "refuses to replace the checkpoints of an earlier run in DIR)")
    g.add_argument("--overwrite", action="store_true",
                   help="start fresh even where DIR holds an earlier run's checkpoints and metrics, replacing them "
                        "(default: off)")
    g.add_argument("--allow-changed-config", action="store_true",
                   help="resume even if settings that decide the sample order, the schedule or the step differ "
                        "from the checkpoint's; the run is then no longer bit-identical (default: off)")
    g.add_argument("--metrics", default=None, metavar="PATH",
                   help="JSON-lines metrics file (default: DIR/metrics.jsonl)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also log to TensorBoard, if installed (default: off)")
    g.add_argument("-p", "--print-freq", type=_positive_int, default=10,
                   help="log metrics every N optimizer steps (default: 10)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (default: a bar on rank 0 when stderr is a terminal)")
    g.add_argument("-e", "--evaluate", action="store_true",
                   help="evaluate the --resume checkpoint on the validation set and exit (default: off)")
    return p


def config_from_args(task: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> TrainConfig:
    defaults = DEFAULTS[task]["embedded" if args.data is None else "real"]
    values = vars(args).copy()
    for key, value in defaults.items():
        if values.get(key) is None:
            values[key] = value
    if values["precision"] != "fp16" and args.loss_scale != "dynamic":
        parser.error(f"--loss-scale applies to fp16 only, not --precision {values['precision']}")
    if args.allreduce_strategy == "fp32_accumulate" and args.allreduce_dtype is not None:
        parser.error("--allreduce-strategy fp32_accumulate sends the parameters' own dtype; drop --allreduce-dtype")
    if args.rounding != "nearest" and args.master_weights:
        parser.error(f"--rounding {args.rounding} needs --no-master-weights")
    if args.evaluate and args.resume is None:
        parser.error("--evaluate needs --resume PATH (or auto)")
    if args.overwrite and args.resume is not None:
        parser.error("--overwrite starts a new run in place of the old one; it cannot be combined with --resume")
    if task == "cifar":
        values.setdefault("image_size", 32)
    return TrainConfig(task=task, **values)


# How gloo and NCCL word a lost or silent peer in the RuntimeErrors they raise
# (seen: "Connection closed by peer", "Timed out waiting 8000ms for recv",
# "Application timeout caused pair closure").
_COMM_FAILURE = re.compile(r"gloo|nccl|connection|timed out|timeout|pair closure|process ?group", re.I)


def run(task: str, argv=None, description: str | None = None) -> int:
    """Parse, train, and turn known failures into one line on stderr and an exit status."""
    from .engine import train  # after parsing, so that --help is instant

    parser = build_parser(task, description)
    args = parser.parse_args(argv)
    cfg = config_from_args(task, args, parser)
    try:
        train(cfg)
    except UserError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except (LossScaleStuckError, ReplicaDivergenceError, FusedStepUnavailable) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    except Stopped as exc:
        if exc.announce:
            print(exc, file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:  # before the handlers of mpfp16/train/preemption.py were installed
        print("interrupted", file=sys.stderr)
        return 130
    except (dist.DistError, RuntimeError) as exc:
        if isinstance(exc, dist.DistError) or _COMM_FAILURE.search(str(exc)):
            print(f"error: communication with another process failed: {one_line(exc)}", file=sys.stderr)
            return 1
        raise
    return 0
