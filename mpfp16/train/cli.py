"""Command-line front end of train_cifar.py and train_imagenet.py: flags -> TrainConfig.

Flag names follow pytorch/examples' ImageNet script where one exists, and torchvision's
reference recipe (references/classification/train.py) is taken by its own names and
meanings, so that a command from its README runs here. ``--model`` (``--arch``),
``--output-dir`` (``--checkpoint-dir``), ``--opt`` (``--optimizer``), ``--lr-warmup-epochs``
(``--warmup-epochs``), ``--clip-grad-norm`` (``--max-grad-norm``) and ``--test-only``
(``--evaluate``) are other spellings of one flag; ``--data-path`` and
``--train-crop-size`` are flags of the same meaning as the positional data and
``--image-size`` (given with them, the last one wins). ``--lr-scheduler`` takes
torchvision's schedulers beside ``--lr-schedule``'s own (given both, they contradict
each other); with it, ``--lr`` is torchvision's, for the global batch as given
(``--scale-lr`` scales it), and the warm-up is ``--lr-warmup-epochs``' alone
(torchvision's default, none). ``--amp`` is refused, in one line that says what to pass.

Every help text ends with its default. A bad value is an argparse error; a problem found
later (a missing data folder, a corrupt checkpoint, a stuck loss scale, a dead peer) is
one line on stderr and a non-zero exit, never a traceback.

A flag given twice keeps argparse's rule: the last value wins (``-b 16 -b 32`` is
``-b 32``; ``--wd`` and ``--weight-decay`` are one flag), so that a wrapper script's
flags can be overridden after them. Two different flags that set one setting to
different meanings (``--master-weights remainder`` and ``--no-master-weights``,
``--nesterov`` and ``--no-nesterov``) contradict each other: given together, in either
order, they are an argparse error, not settled by whichever came last (:class:`_Meaning`).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import sys

import torch.distributed as dist

from ..parallel.hooks import STRATEGIES
from ..parallel.setup import MAX_TIMEOUT_S, check_environment
from ..errors import FusedStepUnavailable, ReplicaDivergenceError, UserError, escape_breaks, one_line
from ..options import STATE_ROUNDINGS
from ..rounding import ROUNDINGS
from ..scaler import LossScaleStuckError
from .config import (AUTO_AUGMENT_POLICIES, BAD_IMAGE_POLICIES, FUSED_CHOICES, INTERPOLATIONS, OPTIMIZERS, PRECISIONS,
                     RECIPE_LIMITS, STATE_DTYPE_CHOICES, SYNTHETIC_SIZES, WIRE_DTYPES,
                     ConfigError, TrainConfig, default_text, say)
from .preemption import Stopped
from .schedule import OWN_SCHEDULES, TORCHVISION_SCHEDULES, WARMUP_METHODS

__all__ = ["build_parser", "config_from_args", "run"]


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
# Data loader processes per training process: beyond a few per core they only cost
# memory, and a mistyped huge number would fork until the machine gives out.
MAX_WORKERS = max(8, 4 * (os.cpu_count() or 1))
MAX_STEPS = 10**9  # far beyond any run; a larger number is a typo, not a plan
MAX_SEED = 2**32 - 1  # every generator the run seeds takes it (torch, Python, the samplers)


def _float_in(low: float, high: float, low_open: bool = False):
    if high == math.inf:
        wanted = "a positive finite number" if low_open and low == 0 else f"a finite number >= {low:g}"
    else:
        wanted = f"a number in {'(' if low_open else '['}{low:.10g}, {high:.10g}]"

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


def _open_interval(low: float, high: float):
    """A number strictly between ``low`` and ``high``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low < value < high:
            raise argparse.ArgumentTypeError(f"must be a number in ({low:g}, {high:g}), got {text}")
        return value
    return parse


def _limited(name: str):
    """The parser of setting ``name``'s range in :data:`RECIPE_LIMITS` (config's, which
    validate() checks again for code that builds a config)."""
    limits = RECIPE_LIMITS[name]
    if len(limits) == 2:
        return _int_at_least(*limits)
    low, high, low_open, high_open = limits
    return _open_interval(low, high) if high_open else _float_in(low, high, low_open=low_open)


class _Refused(argparse.Action):
    """A flag of torchvision's recipe that this trainer does not take: an argparse error,
    one line saying what to pass instead."""

    def __init__(self, option_strings, dest, message, **kwargs):
        self.message = message
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise argparse.ArgumentError(None, self.message)


AMP_REFUSED = ("--amp is torch.amp's autocast over fp32 weights; this script keeps 16-bit weights and fp32 masters: "
               "pass --precision fp16 (the default; --precision fp32 for torchvision's run without --amp)")


def _loss_scale(text: str):
    """'dynamic' or a number; which numbers make a loss scale is the library's rule
    (:func:`mpfp16.scaler.check_loss_scale`, called by TrainConfig.validate)."""
    if text == "dynamic":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'dynamic' or a positive number, got {text!r}") from None


def _master_weights(text: str):
    """'fp32' or 'remainder', as FP16Optimizer's ``master_weights`` takes them."""
    if text not in ("fp32", "remainder"):
        raise argparse.ArgumentTypeError(f"must be fp32 or remainder, got {text!r}")
    return True if text == "fp32" else text


_ABSENT = object()


class _Meaning(argparse.Action):
    """A flag that gives its setting one of the meanings that another flag gives it
    otherwise. Where the setting already holds a value that this flag cannot give, the
    other flag gave it, and the two contradict each other: an argparse error naming
    both, in whichever order they came. A value this flag can give was given by this
    flag itself, and argparse's rule holds: the last one wins.

    ``gives``: the values this flag can set, or, with ``nargs=0`` (a flag without a
    value), the one it sets; ``words(value)``: the flag that gives ``value``, as the
    user typed it.
    """

    def __init__(self, option_strings, dest, gives, words, nargs=None, **kwargs):
        self.gives, self.words = tuple(gives), words
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = self.gives[0] if self.nargs == 0 else values
        _refuse_contradiction(namespace, self.dest, value, self.gives, self.words)
        setattr(namespace, self.dest, value)


class _Switch(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x`` (:class:`argparse.BooleanOptionalAction`), the two spellings
    two flags of opposite meaning: given together they contradict each other
    (:class:`_Meaning`); either one given again is no contradiction."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = not option_string.startswith("--no-")
        _refuse_contradiction(namespace, self.dest, value, (value,), lambda v: self.option_strings[0 if v else 1])
        super().__call__(parser, namespace, values, option_string)


def _refuse_contradiction(namespace, dest: str, value, gives: tuple, words) -> None:
    previous = getattr(namespace, dest, _ABSENT)
    if previous is not _ABSENT and previous != value and previous not in gives:
        raise argparse.ArgumentError(None, f"{words(value)} contradicts {words(previous)}, given before it: "
                                           "pass one of them")


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


class OneLineParser(argparse.ArgumentParser):
    """argparse with each error in one line, ``<prog>: error: <message> (see --help)``,
    exit status 2, as the scripts' own errors are: no usage block before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {escape_breaks(message)} (see --help)\n")


def build_parser(task: str, description: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``task``'s script. Only the flags given reach the config: every
    default lives in :class:`TrainConfig`, and ``--help`` shows it from there."""
    cifar = task == "cifar"
    p = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                      argument_default=argparse.SUPPRESS)

    def default(name: str, text: str | None = None) -> str:
        return f" (default: {text if text is not None else default_text(task, name)})"

    g = p.add_argument_group("data")
    g.add_argument("data", nargs="?",
                   help=("CIFAR-10 in torchvision's format: the cifar-10-batches-py folder or its parent" if cifar
                         else "ImageFolder root with train/ and val/") + default("data", "embedded synthetic data"))
    g.add_argument("--data-path", dest="data", metavar="PATH",
                   help="the data, as the positional argument (torchvision's flag)" + default("data", "embedded synthetic data"))
    g.add_argument("-j", "--workers", type=_int_at_least(0, MAX_WORKERS),
                   help=f"data loading processes per training process, at most {MAX_WORKERS} here (4 per core, or 8)"
                        + default("workers"))
    if not cifar:
        sizes = _int_at_least(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE)
        g.add_argument("--image-size", type=sizes,
                       help=f"training crop size, {MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE}; a ViT or MaxViT is built "
                            "for it" + default("image_size"))
        g.add_argument("--train-crop-size", dest="image_size", type=sizes, metavar="SIZE",
                       help="--image-size, by torchvision's name" + default("image_size"))
        g.add_argument("--val-resize-size", type=_int_at_least(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE), metavar="SIZE",
                       help="validation images are resized to this (their shorter side), then center-cropped"
                            + default("val_resize_size", "the crop * 256/224"))
        g.add_argument("--val-crop-size", type=_int_at_least(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE), metavar="SIZE",
                       help="the validation images' center crop, at most --val-resize-size; torchvision's default is "
                            "224 whatever --train-crop-size is: pass it with a recipe that trains at another size"
                            + default("val_crop_size", "the training crop, --image-size"))
        g.add_argument("--interpolation", choices=INTERPOLATIONS,
                       help="of the training crop's resize, the validation resize and the --auto-augment policy"
                            + default("interpolation"))
        g.add_argument("--bad-images", choices=BAD_IMAGE_POLICIES,
                       help="an image that fails to decode: fail the run, or skip it with a warning naming "
                            "the file" + default("bad_images"))
    g.add_argument("--synthetic-size", type=_pair, metavar="TRAIN,VAL",
                   help="images in the embedded synthetic set"
                        + default("synthetic_size", ",".join(map(str, SYNTHETIC_SIZES[task]))))

    g = p.add_argument_group("model")
    g.add_argument("-a", "--arch", "--model", dest="arch",
                   help=("resnet9 (Page's DAWNBench ResNet), resnet9-wN (N prep channels) or resnet18"
                         if cifar else "any torchvision model name; or timm's (a name torchvision does not have, or "
                                       "timm/NAME), with timm installed (pip install 'mpfp16[timm]')")
                        + default("arch"))
    g.add_argument("--weights", metavar="FILE",
                   help="start from the weights in a local file: a state_dict, or a checkpoint with a 'model' key "
                        "(torchvision's, this script's); nothing is downloaded, so torchvision's weight names "
                        "and URLs are refused" + default("weights", "random initialization"))
    g.add_argument("--channels-last", action="store_true",
                   help="channels_last memory format" + default("channels_last"))
    g.add_argument("--zero-init-residual", action="store_true",
                   help="zero the last BatchNorm gamma of each residual block" + default("zero_init_residual"))

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=_positive_int, help="epochs; the lr schedule spans them" + default("epochs"))
    g.add_argument("--max-steps", type=_int_at_least(1, MAX_STEPS),
                   help=f"stop after N optimizer steps, before --epochs ends the run (it only shortens a run); at most "
                        f"{MAX_STEPS:,}"
                        + default("max_steps", "none"))
    g.add_argument("-b", "--batch-size", type=_positive_int,
                   help="images per process per micro-batch" + default("batch_size"))
    g.add_argument("--accum-steps", type=_positive_int,
                   help="micro-batches per optimizer step; the allreduce runs once per step" + default("accum_steps"))
    g.add_argument("--optimizer", "--opt", dest="optimizer", type=str.lower, choices=OPTIMIZERS,
                   help="inner optimizer, as torchvision's --opt builds it: sgd (Nesterov as --nesterov says), "
                        "sgd_nesterov, rmsprop (alpha 0.9, eps 0.0316), adamw" + default("optimizer"))
    g.add_argument("--lr", type=_positive_float,
                   help=("peak learning rate" if cifar else
                         "learning rate per 256 images of global batch, scaled linearly; with --lr-scheduler (a "
                         "torchvision recipe) the lr of the global batch as given, unscaled, as torchvision's --lr")
                        + default("lr"))
    g.add_argument("--momentum", type=_float_in(0.0, 1.0), help="SGD momentum" + default("momentum"))
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=_non_negative_float,
                   help="weight decay" + default("weight_decay"))
    g.add_argument("--nesterov", action=_Switch,
                   help="Nesterov momentum" + default("nesterov"))
    g.add_argument("--label-smoothing", type=_float_in(0.0, 1.0), help="label smoothing" + default("label_smoothing"))
    g.add_argument("--warmup-epochs", "--lr-warmup-epochs", dest="warmup_epochs", type=_non_negative_float,
                   help="lr warm-up epochs: --lr-schedule's linear one, per step (onecycle warms up over 30%% of "
                        "the run when 0), or --lr-scheduler's --lr-warmup-method, whole epochs"
                        + default("warmup_epochs", None if cifar else
                                  f"{default_text(task, 'warmup_epochs')}; 0 with --lr-scheduler"))
    schedules = {"dest": "lr_schedule", "action": _Meaning, "words": lambda value: say("lr_schedule", value)}
    g.add_argument("--lr-schedule", choices=OWN_SCHEDULES, gives=OWN_SCHEDULES, **schedules,
                   help="lr schedule after warm-up, per optimizer step" + default("lr_schedule"))
    g.add_argument("--lr-scheduler", type=str.lower, choices=TORCHVISION_SCHEDULES, gives=TORCHVISION_SCHEDULES,
                   **schedules,
                   help="torchvision's lr scheduler in place of --lr-schedule, stepped per epoch as torchvision steps "
                        "it (the lr is constant through an epoch): steplr (x --lr-gamma every --lr-step-size epochs), "
                        "cosineannealinglr (to --lr-min), exponentiallr (x --lr-gamma each epoch); its --lr is not "
                        "scaled by the batch, and it warms up only with --lr-warmup-epochs"
                        + default("lr_schedule", "none: --lr-schedule"))
    g.add_argument("--lr-warmup-method", choices=WARMUP_METHODS,
                   help="with --lr-scheduler: linear (LinearLR from --lr-warmup-decay to 1) or constant (ConstantLR "
                        "at --lr-warmup-decay) over the warm-up epochs; torchvision's default is constant"
                        + default("lr_warmup_method"))
    g.add_argument("--lr-warmup-decay", type=_limited("lr_warmup_decay"),
                   help="with --lr-scheduler: the warm-up's factor on the lr, in (0, 1]" + default("lr_warmup_decay"))
    g.add_argument("--lr-step-size", type=_limited("lr_step_size"),
                   help="with --lr-scheduler steplr: epochs between decays" + default("lr_step_size"))
    g.add_argument("--lr-gamma", type=_limited("lr_gamma"),
                   help="with --lr-scheduler steplr or exponentiallr: the factor of each decay" + default("lr_gamma"))
    g.add_argument("--lr-min", type=_limited("lr_min"),
                   help="with --lr-scheduler cosineannealinglr: the lr it ends at (eta_min)" + default("lr_min"))
    g.add_argument("--no-bn-wd", action="store_true",
                   help="no weight decay on normalization layers and biases" + default("no_bn_wd"))
    g.add_argument("--norm-weight-decay", type=_limited("norm_weight_decay"),
                   help="weight decay of normalization layers' parameters (torchvision's)"
                        + default("norm_weight_decay", "--wd"))
    g.add_argument("--bias-weight-decay", type=_limited("bias_weight_decay"),
                   help="weight decay of every bias (torchvision's)" + default("bias_weight_decay", "--wd"))
    if not cifar:
        g.add_argument("--transformer-embedding-decay", type=_limited("transformer_embedding_decay"),
                       help="weight decay of transformers' class token, position embedding and relative position "
                            "bias tables (torchvision's)" + default("transformer_embedding_decay", "--wd"))
    if not cifar:
        g.add_argument("--resize-phases", type=_resize_phases, metavar="EPOCH:SIZE,...",
                       help="progressive resizing: the training crop size from each start epoch, e.g. "
                            "0:128,13:224,25:288" + default("resize_phases", "--image-size throughout"))
        g.add_argument("--scale-lr", action=_Switch,
                       help="--lr per 256 images of global batch, scaled linearly; --no-scale-lr: --lr as given "
                            "(to paste a torchvision --lr with this script's schedules)"
                            + default("scale_lr", "scaled; not with --lr-scheduler"))
    g.add_argument("--seed", type=_int_at_least(0, MAX_SEED), help=f"random seed, 0 to {MAX_SEED}" + default("seed"))
    g.add_argument("--use-deterministic-algorithms", action="store_true",
                   help="torch's deterministic kernels only (torch.use_deterministic_algorithms, cuDNN benchmark "
                        "off; on CUDA CUBLAS_WORKSPACE_CONFIG=:4096:8 where unset)"
                        + default("use_deterministic_algorithms"))

    g = p.add_argument_group("augmentation (torchvision's recipe)")
    g.add_argument("--auto-augment", choices=AUTO_AUGMENT_POLICIES,
                   help="a policy after the crop and flip: ra (RandAugment), ta_wide (TrivialAugmentWide), augmix, "
                        "or AutoAugment's imagenet, cifar10, svhn" + default("auto_augment", "none"))
    g.add_argument("--ra-magnitude", type=_limited("ra_magnitude"),
                   help="with --auto-augment ra: RandAugment's magnitude, 0 to 30" + default("ra_magnitude"))
    g.add_argument("--augmix-severity", type=_limited("augmix_severity"),
                   help="with --auto-augment augmix: its severity, 1 to 10" + default("augmix_severity"))
    g.add_argument("--random-erase", type=_limited("random_erase"),
                   help="random erasing's probability, in [0, 1]" + default("random_erase"))
    g.add_argument("--mixup-alpha", type=_limited("mixup_alpha"),
                   help="mixup's alpha; 0: no mixup" + default("mixup_alpha"))
    g.add_argument("--cutmix-alpha", type=_limited("cutmix_alpha"),
                   help="CutMix's alpha; 0: no CutMix" + default("cutmix_alpha"))
    g.add_argument("--ra-sampler", action="store_true",
                   help="repeated augmentation: each image --ra-reps times per epoch, over the processes "
                        "(torchvision's RASampler)" + default("ra_sampler"))
    g.add_argument("--ra-reps", type=_limited("ra_reps"),
                   help="with --ra-sampler: repetitions of each image" + default("ra_reps"))

    g = p.add_argument_group("EMA of the weights (torchvision's recipe)")
    g.add_argument("--model-ema", action="store_true",
                   help="keep an exponential moving average of the weights, evaluated beside the model"
                        + default("model_ema"))
    g.add_argument("--model-ema-steps", type=_limited("model_ema_steps"),
                   help="optimizer steps between EMA updates" + default("model_ema_steps"))
    g.add_argument("--model-ema-decay", type=_limited("model_ema_decay"),
                   help="the EMA's decay, in (0, 1), as torchvision's" + default("model_ema_decay"))

    g = p.add_argument_group("precision")
    g.add_argument("--precision", choices=PRECISIONS, help="weights and activations" + default("precision"))
    masters = {"dest": "master_weights", "action": _Meaning, "words": lambda value: say("master_weights", value)}
    g.add_argument("--no-master-weights", nargs=0, gives=(False,), **masters,
                   help="step the 16-bit weights directly, with no fp32 copy" + default("master_weights", "fp32 masters"))
    g.add_argument("--master-weights", type=_master_weights, gives=(True, "remainder"), **masters,
                   metavar="{fp32,remainder}",
                   help="remainder (bf16): the fp32 masters held exactly as the bf16 weights and a 16-bit remainder "
                        "each, 2 bytes per parameter less" + default("master_weights", "fp32"))
    g.add_argument("--rounding", choices=ROUNDINGS,
                   help="with --no-master-weights: how new weights are rounded to 16 bits" + default("rounding"))
    g.add_argument("--loss-scale", type=_loss_scale, help="'dynamic' or a static scale; fp16 only"
                   + default("loss_scale"))
    g.add_argument("--amp", action=_Refused, message=AMP_REFUSED,
                   help="torchvision's torch.amp autocast: refused; --precision fp16, this script's default, is "
                        "its mixed precision" + default("amp", "off"))
    g.add_argument("--max-grad-norm", "--clip-grad-norm", dest="max_grad_norm", type=_positive_float,
                   help="clip the global norm of the unscaled gradients" + default("max_grad_norm", "no clipping"))
    g.add_argument("--accumulate-dtype", choices=["fp32"],
                   help="with --accum-steps N: sum the micro-batches' 16-bit gradients in fp32, sent in the step's "
                        "one allreduce" + default("accumulate_dtype", "the parameters' dtype, as apex"))
    g.add_argument("--state-dtype", choices=STATE_DTYPE_CHOICES,
                   help="the optimizer's states (SGD's momentum, AdamW's moments) between steps: bf16 halves their "
                        "memory, each step computing in fp32 (docs/MEMORY.md)" + default("state_dtype"))
    g.add_argument("--state-rounding", choices=STATE_ROUNDINGS,
                   help="with --state-dtype bf16: how new states are rounded" + default("state_rounding"))
    g.add_argument("--fused", choices=FUSED_CHOICES,
                   help="the compiled one-pass optimizer step: auto uses it for SGD/Adam/AdamW from 1M "
                        "parameters" + default("fused"))

    g = p.add_argument_group("distributed")
    g.add_argument("--shard", action="store_true",
                   help="shard fp32 masters, gradients and optimizer state across ranks (FSDP2)" + default("shard"))
    g.add_argument("--allreduce-dtype", choices=WIRE_DTYPES,
                   help="dtype of the gradient allreduce" + default("allreduce_dtype", "the parameters' dtype"))
    g.add_argument("--allreduce-strategy", choices=STRATEGIES,
                   help="allreduce; fp32_accumulate: 16-bit on the wire, fp32 sums; fp16_compress, bf16_compress, "
                        "powersgd: torch's compression hooks, with --precision fp32; fp8_compress, int8_compress: "
                        "8-bit codes, a scale per 256 elements, fp32 sums; topk: Deep Gradient Compression's top-k, "
                        "with --momentum applied in the exchange (docs/BANDWIDTH.md)" + default("allreduce_strategy"))
    g.add_argument("--fp8-format", choices=["e4m3", "e5m2"],
                   help="with --allreduce-strategy fp8_compress: the fp8 format on the wire" + default("fp8_format"))
    g.add_argument("--error-feedback", action="store_true",
                   help="with fp8_compress or int8_compress: keep what the encoding dropped (fp32) and add it back "
                        "next step" + default("error_feedback"))
    g.add_argument("--topk-ratio", type=_open_interval(0.0, 1.0), metavar="R",
                   help="with --allreduce-strategy topk: the share of each parameter's entries sent, in (0, 1)"
                        + default("topk_ratio"))
    g.add_argument("--powersgd-rank", type=_positive_int, metavar="N",
                   help="rank of PowerSGD's low-rank approximation" + default("powersgd_rank"))
    g.add_argument("--powersgd-start-iter", type=_int_at_least(2), metavar="N",
                   help="optimizer steps of plain allreduce before PowerSGD compresses" + default("powersgd_start_iter"))
    g.add_argument("--predivide-factor", type=_positive_float,
                   help="divide gradients by F before the allreduce and by world/F after" + default("predivide_factor"))
    g.add_argument("--bucket-mb", type=_positive_float, help="DDP bucket size in MiB" + default("bucket_mb"))
    g.add_argument("--dist-backend", choices=["nccl", "gloo"],
                   help="process group backend" + default("dist_backend", "nccl on GPU, gloo on CPU"))
    g.add_argument("--dist-timeout", type=_float_in(0.0, MAX_TIMEOUT_S, low_open=True),
                   help=f"seconds a collective waits for a peer before failing, at most {MAX_TIMEOUT_S:.0f} (30 days)"
                        + default("dist_timeout"))
    g.add_argument("--device", choices=["cpu", "cuda"], help="where to train" + default("device", "cuda when available"))
    g.add_argument("--check-replicas", type=_non_negative_int, metavar="N",
                   help="check that every rank holds bit-identical weights, masters and optimizer state every N "
                        "optimizer steps, before each checkpoint and at the end; 0: never" + default("check_replicas"))

    g = p.add_argument_group("checkpoints and logs")
    g.add_argument("--checkpoint-dir", "--output-dir", dest="checkpoint_dir", metavar="DIR",
                   help="where last.pt and best.pt go" + default("checkpoint_dir"))
    g.add_argument("--save-every", type=_non_negative_int,
                   help="also save every N optimizer steps; 0: only at the end of each epoch" + default("save_every"))
    g.add_argument("--resume", metavar="PATH|auto",
                   help="resume from a checkpoint; auto: DIR/last.pt if it exists" + default(
                       "resume", "start fresh, which refuses to replace the checkpoints of an earlier run in DIR"))
    g.add_argument("--overwrite", action="store_true",
                   help="start fresh even where DIR holds an earlier run's checkpoints and metrics, replacing them"
                        + default("overwrite"))
    g.add_argument("--allow-changed-config", action="store_true",
                   help="resume even if settings that decide the sample order, the schedule or the step differ "
                        "from the checkpoint's; the run is then no longer bit-identical" + default("allow_changed_config"))
    g.add_argument("--metrics", metavar="PATH", help="JSON-lines metrics file" + default("metrics", "DIR/metrics.jsonl"))
    g.add_argument("--tensorboard", metavar="DIR",
                   help="also log to TensorBoard, if installed" + default("tensorboard", "off"))
    g.add_argument("-p", "--print-freq", type=_positive_int,
                   help="log metrics every N optimizer steps" + default("print_freq"))
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar" + default("progress", "a bar on rank 0 when stderr is a terminal"))
    g.add_argument("-e", "--evaluate", "--test-only", dest="evaluate", action="store_true",
                   help="evaluate the --resume checkpoint (or the --weights) on the validation set and exit"
                        + default("evaluate"))
    return p


def config_from_args(task: str, args: argparse.Namespace, parser: argparse.ArgumentParser) -> TrainConfig:
    """The config of the flags given (the rest are TrainConfig's defaults); a
    contradiction between them is an argparse error."""
    try:
        return TrainConfig(task=task, **vars(args)).validate()
    except ConfigError as exc:
        parser.error(one_line(exc))


# How gloo and NCCL word a lost or silent peer in the RuntimeErrors they raise
# (seen: "Connection closed by peer", "Timed out waiting 8000ms for recv",
# "Application timeout caused pair closure").
_COMM_FAILURE = re.compile(r"gloo|nccl|connection|timed out|timeout|pair closure|process ?group", re.I)


def run(task: str, argv=None, description: str | None = None) -> int:
    """Parse, train, and turn known failures into one line on stderr and an exit status."""
    parser = build_parser(task, description)
    args = parser.parse_args(argv)
    cfg = config_from_args(task, args, parser)
    try:  # torchrun's variables, before any data is loaded or any peer waited for
        check_environment(cfg.device)
    except ValueError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    from .build import deterministic_algorithms
    from .engine import train  # after parsing: --help and flag errors need neither torchvision nor the engine

    with deterministic_algorithms(cfg.use_deterministic_algorithms):
        status = _train_and_report(train, cfg)
    gc.collect()  # what the error's traceback held (a DDP module and its process group) goes before exit
    return status


def _train_and_report(train, cfg: TrainConfig) -> int:
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
            print(escape_breaks(str(exc)), file=sys.stderr)
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
