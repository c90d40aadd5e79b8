"""torchvision's reference recipe (references/classification/train.py and its README),
by its flags: they parse to the settings of the same meaning, its schedules and weight
decay groups are torchvision's own, its optimizers are built as it builds them, bad
values are one line naming the flag, and timm's models build by name."""

import argparse
import dataclasses
import math
import shlex
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from mpfp16 import distributed as mdist
from mpfp16.train import build, cli, models
from mpfp16.train.config import (BEFORE_THEY_EXISTED, EMBEDDING_KEYS, FREE_ON_RESUME, ConfigError, TrainConfig,
                                 TORCHVISION_DEFAULTS)

CPU = mdist.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
# The settings TrainConfig gained for torchvision's recipe.
RECIPE_FIELDS = ["lr_warmup_method", "lr_warmup_decay", "lr_step_size", "lr_gamma", "lr_min", "norm_weight_decay",
                 "bias_weight_decay", "transformer_embedding_decay", "auto_augment", "ra_magnitude", "augmix_severity",
                 "random_erase", "mixup_alpha", "cutmix_alpha", "val_resize_size", "val_crop_size", "interpolation",
                 "ra_sampler", "ra_reps", "model_ema", "model_ema_steps", "model_ema_decay", "weights",
                 "use_deterministic_algorithms"]


def config(task, argv):
    parser = cli.build_parser(task)
    return cli.config_from_args(task, parser.parse_args(shlex.split(argv) if isinstance(argv, str) else argv), parser)


def refusal(capsys, task, argv) -> str:
    """The one error line of ``argv``, without its pointer to --help."""
    parser = cli.build_parser(task)
    with pytest.raises(SystemExit) as exit_:
        cli.config_from_args(task, parser.parse_args(shlex.split(argv)), parser)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{parser.prog}: error: ") and err.endswith(" (see --help)\n"), err
    return err.split(": error: ", 1)[1].removesuffix(" (see --help)\n")


# ----------------------------------------------------------------- flags


@pytest.mark.parametrize("task", ["cifar", "imagenet"])
@pytest.mark.parametrize("theirs,ours", [
    ("--model {arch}", "-a {arch}"),
    ("--data-path /data/x", "/data/x"),
    ("--output-dir out", "--checkpoint-dir out"),
    ("--opt adamw", "--optimizer adamw"),
    ("--opt SGD_Nesterov", "--optimizer sgd_nesterov"),  # torchvision lowercases --opt
    ("--lr-warmup-epochs 3", "--warmup-epochs 3"),
    ("--clip-grad-norm 2", "--max-grad-norm 2"),
    ("--test-only --resume auto", "--evaluate --resume auto"),
], ids=["model", "data-path", "output-dir", "opt", "opt-case", "warmup", "clip", "test-only"])
def test_torchvisions_spellings_are_the_same_settings(task, theirs, ours):
    arch = "resnet18" if task == "cifar" else "resnet34"  # neither the default
    theirs, ours = theirs.format(arch=arch), ours.format(arch=arch)
    assert config(task, theirs) == config(task, ours) != config(task, "")


def test_train_crop_size_is_the_image_size():
    assert config("imagenet", "--train-crop-size 176") == config("imagenet", "--image-size 176")
    assert config("imagenet", "--train-crop-size 176").image_size == 176


def test_torchvisions_vit_recipe_parses_to_its_settings():
    """The ViT-B/16 command of torchvision's README (without --amp, refused: see below)."""
    cfg = config("imagenet", "--data-path /imagenet --model vit_b_16 --epochs 300 --batch-size 512 --opt adamw "
                             "--lr 0.003 --wd 0.3 --lr-scheduler cosineannealinglr --lr-warmup-method linear "
                             "--lr-warmup-epochs 30 --lr-warmup-decay 0.033 --label-smoothing 0.11 --mixup-alpha 0.2 "
                             "--auto-augment ra --clip-grad-norm 1 --ra-sampler --cutmix-alpha 1.0 --model-ema")
    expected = dict(data="/imagenet", arch="vit_b_16", epochs=300, batch_size=512, optimizer="adamw", lr=0.003,
                    weight_decay=0.3, lr_schedule="cosineannealinglr", lr_warmup_method="linear", warmup_epochs=30.0,
                    lr_warmup_decay=0.033, label_smoothing=0.11, mixup_alpha=0.2, auto_augment="ra",
                    max_grad_norm=1.0, ra_sampler=True, cutmix_alpha=1.0, model_ema=True, scale_lr=False)
    assert {k: getattr(cfg, k) for k in expected} == expected


def test_the_rest_of_the_recipe_flags_parse_to_their_settings():
    cfg = config("imagenet", "--lr-scheduler steplr --lr-step-size 2 --lr-gamma 0.973 --opt rmsprop --auto-augment "
                             "augmix --augmix-severity 5 --ra-magnitude 12 --random-erase 0.25 --val-resize-size 232 "
                             "--val-crop-size 224 --interpolation bicubic --ra-reps 4 --model-ema-steps 16 "
                             "--model-ema-decay 0.999 --norm-weight-decay 0 --bias-weight-decay 0.01 "
                             "--transformer-embedding-decay 0 --use-deterministic-algorithms --lr-warmup-method "
                             "constant --lr-warmup-epochs 2")
    expected = dict(lr_schedule="steplr", lr_step_size=2, lr_gamma=0.973, optimizer="rmsprop", auto_augment="augmix",
                    augmix_severity=5, ra_magnitude=12, random_erase=0.25, val_resize_size=232, val_crop_size=224,
                    interpolation="bicubic", ra_reps=4, model_ema_steps=16, model_ema_decay=0.999,
                    norm_weight_decay=0.0, bias_weight_decay=0.01, transformer_embedding_decay=0.0,
                    use_deterministic_algorithms=True, lr_warmup_method="constant", warmup_epochs=2.0)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert config("imagenet", "--lr-scheduler cosineannealinglr --lr-min 1e-5").lr_min == 1e-5
    assert config("imagenet", "--opt sgd_nesterov").nesterov is True


def test_cifar_takes_the_recipes_augmentation_ema_schedule_and_decay_flags(capsys):
    cfg = config("cifar", "--auto-augment cifar10 --random-erase 0.1 --mixup-alpha 0.2 --cutmix-alpha 1 --ra-sampler "
                          "--model-ema --lr-scheduler cosineannealinglr --lr-warmup-epochs 1 --norm-weight-decay 0 "
                          "--bias-weight-decay 0")
    assert (cfg.auto_augment, cfg.random_erase, cfg.mixup_alpha, cfg.cutmix_alpha, cfg.ra_sampler, cfg.model_ema,
            cfg.lr_schedule, cfg.norm_weight_decay) == ("cifar10", 0.1, 0.2, 1.0, True, True, "cosineannealinglr", 0.0)
    for flag in ("--val-resize-size 36", "--val-crop-size 32", "--train-crop-size 32",
                 "--transformer-embedding-decay 0"):
        assert refusal(capsys, "cifar", flag).startswith("unrecognized arguments")


def test_amp_is_refused_in_one_line_naming_the_flag_to_pass(capsys):
    for task in ("cifar", "imagenet"):
        assert refusal(capsys, task, "--model-ema --amp") == (
            "--amp is torch.amp's autocast over fp32 weights; this script keeps 16-bit weights and fp32 masters: "
            "pass --precision fp16 (the default; --precision fp32 for torchvision's run without --amp)")


def test_lr_is_torchvisions_with_its_schedulers_and_scaled_with_ours():
    """ImageNet's own schedules take --lr per 256 images, scaled by the global batch;
    torchvision's schedulers its --lr as given, for the global batch (its README's
    0.5 for 8 x 128 images), unless --scale-lr."""
    def lr(argv, world_size=8):
        return build.learning_rate(config("imagenet", argv), world_size)

    assert lr("-b 128 --lr 0.5") == pytest.approx(0.5 * 8 * 128 / 256)  # today's meaning
    assert lr("-b 128 --lr 0.5 --lr-scheduler cosineannealinglr") == 0.5  # torchvision's
    assert lr("-b 128 --lr 0.5 --lr-scheduler steplr --scale-lr") == pytest.approx(2.0)
    assert lr("-b 128 --lr 0.5 --no-scale-lr") == 0.5
    assert config("imagenet", "--lr-scheduler steplr").warmup_epochs == 0 == TORCHVISION_DEFAULTS["warmup_epochs"]
    assert config("imagenet", "").warmup_epochs == 5 and config("imagenet", "--lr-scheduler steplr "
                                                                 "--lr-warmup-epochs 5").warmup_epochs == 5
    assert build.learning_rate(config("cifar", "-b 64 --lr 0.4 --lr-scheduler steplr"), 8) == 0.4
    helps = {a.dest: a.help for a in cli.build_parser("imagenet")._actions}
    assert "unscaled" in helps["lr"] and "(default: scaled; not with --lr-scheduler)" in helps["scale_lr"]


# ----------------------------------------------------------------- bad values: one line each


@pytest.mark.parametrize("task,argv,message", [
    ("imagenet", "--auto-augment rand", "argument --auto-augment: invalid choice: 'rand'"),
    ("imagenet", "--lr-scheduler onecyclelr", "argument --lr-scheduler: invalid choice: 'onecyclelr'"),
    ("imagenet", "--opt lamb", "argument --optimizer/--opt: invalid choice: 'lamb'"),
    ("imagenet", "--lr-warmup-method cosine", "argument --lr-warmup-method: invalid choice: 'cosine'"),
    ("imagenet", "--interpolation lanczos", "argument --interpolation: invalid choice: 'lanczos'"),
    ("cifar", "--mixup-alpha -0.2", "argument --mixup-alpha: must be a finite number >= 0, got -0.2"),
    ("cifar", "--cutmix-alpha -1", "argument --cutmix-alpha: must be a finite number >= 0, got -1"),
    ("cifar", "--model-ema-decay 1", "argument --model-ema-decay: must be a number in (0, 1), got 1"),
    ("cifar", "--model-ema-decay 0", "argument --model-ema-decay: must be a number in (0, 1), got 0"),
    ("cifar", "--model-ema-steps 0", "argument --model-ema-steps: must be at least 1, got 0"),
    ("cifar", "--lr-warmup-decay 0", "argument --lr-warmup-decay: must be a number in (0, 1], got 0"),
    ("cifar", "--lr-warmup-decay 1.5", "argument --lr-warmup-decay: must be a number in (0, 1], got 1.5"),
    ("cifar", "--random-erase 1.5", "argument --random-erase: must be a number in [0, 1], got 1.5"),
    ("cifar", "--ra-reps 0", "argument --ra-reps: must be at least 1, got 0"),
    ("cifar", "--ra-magnitude 31", "argument --ra-magnitude: must be at most 30, got 31"),
    ("cifar", "--augmix-severity 0", "argument --augmix-severity: must be at least 1, got 0"),
    ("cifar", "--lr-step-size 0", "argument --lr-step-size: must be at least 1, got 0"),
    ("cifar", "--lr-gamma 0", "argument --lr-gamma: must be a positive finite number, got 0"),
    ("cifar", "--norm-weight-decay -1", "argument --norm-weight-decay: must be a finite number >= 0, got -1"),
    ("imagenet", "--val-resize-size 64 --val-crop-size 96",
     "--val-crop-size 96 is larger than --val-resize-size 64: the center crop must fit in the resized image"),
    ("imagenet", "--image-size 128 --val-resize-size 112", "the validation crop 128 (the training crop, without "
                                                            "--val-crop-size) is larger than --val-resize-size 112"),
    ("imagenet", "--lr-step-size 2 --lr-gamma 0.973", "--lr-step-size applies to --lr-scheduler steplr, not "
                                                      "--lr-schedule cosine; steplr is torchvision's default "
                                                      "scheduler, not this script's: pass --lr-scheduler steplr"),
    ("imagenet", "--lr-scheduler steplr --lr-min 0.01", "--lr-min applies to --lr-scheduler cosineannealinglr, not "
                                                        "--lr-scheduler steplr"),
    ("cifar", "--lr-warmup-method constant", "--lr-warmup-method applies to torchvision's --lr-scheduler"),
    ("cifar", "--lr-scheduler steplr --lr-warmup-epochs 0.5", "--lr-warmup-epochs 0.5: torchvision's schedulers "
                                                              "step once per epoch"),
    ("cifar", "--lr-scheduler cosineannealinglr --epochs 3 --lr-warmup-epochs 3",
     "--lr-warmup-epochs 3 leaves no epoch of --epochs 3 to --lr-scheduler cosineannealinglr"),
    ("cifar", "--lr-schedule linear --lr-scheduler steplr",
     "--lr-scheduler steplr contradicts --lr-schedule linear, given before it: pass one of them"),
    ("cifar", "--no-bn-wd --norm-weight-decay 0", "--no-bn-wd and --norm-weight-decay both set the decay"),
    ("imagenet", "--opt sgd_nesterov --no-nesterov", "--opt sgd_nesterov is SGD with Nesterov momentum; it "
                                                      "contradicts --no-nesterov"),
    ("imagenet", "--opt rmsprop --fused on", "--fused on: mpfp16's fused step takes SGD, Adam and AdamW, not --opt "
                                             "rmsprop"),
    ("imagenet", "--opt rmsprop --state-dtype bf16", "--state-dtype bf16 applies to SGD, Adam and AdamW"),
    ("imagenet", "--weights IMAGENET1K_V2", "--weights IMAGENET1K_V2: no such file here, and nothing is downloaded"),
    ("imagenet", "--weights ResNet50_Weights.IMAGENET1K_V1", "--weights ResNet50_Weights.IMAGENET1K_V1: no such "
                                                             "file here, and nothing is downloaded"),
    ("imagenet", "--weights https://download.pytorch.org/models/resnet50-11ad3fa6.pth",
     "--weights https://download.pytorch.org/models/resnet50-11ad3fa6.pth: no such file here, and nothing is "
     "downloaded (not a torchvision weights name, nor a URL): pass a local file"),
    ("imagenet", "--test-only", "--evaluate needs --resume PATH (or auto), or --weights FILE"),
])
def test_bad_values_stop_with_one_line_naming_the_flag(capsys, task, argv, message):
    assert refusal(capsys, task, argv).startswith(message)


@pytest.mark.parametrize("kw,message", [
    (dict(auto_augment="rand"), "unknown --auto-augment 'rand'"),
    (dict(lr_schedule="onecyclelr"), "unknown --lr-schedule 'onecyclelr'"),
    (dict(mixup_alpha=-1.0), "--mixup-alpha -1.0: must be a finite number >= 0"),
    (dict(model_ema_decay=1.0), "--model-ema-decay 1.0: must be a number in (0, 1)"),
    (dict(ra_reps=0), "--ra-reps 0: must be an integer >= 1"),
    (dict(ra_magnitude=9.5), "--ra-magnitude 9.5: must be an integer from 0 to 30"),
    (dict(interpolation="lanczos"), "unknown --interpolation 'lanczos'"),
    (dict(val_crop_size=32), "--val-crop-size applies to train_imagenet.py"),
])
def test_a_config_built_in_code_is_held_to_the_same_rules(kw, message):
    with pytest.raises(ConfigError) as err:
        TrainConfig(task="cifar", **kw).validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_config_names_the_policies_and_sizes_the_augmentation_takes():
    """The config checks the names and sizes (without importing torchvision at parse
    time); mpfp16.train.augment builds them: the two agree."""
    augment = pytest.importorskip("mpfp16.train.augment")
    from mpfp16.train.config import AUTO_AUGMENT_POLICIES, INTERPOLATIONS

    assert AUTO_AUGMENT_POLICIES == augment.AUTO_AUGMENT_POLICIES and INTERPOLATIONS == augment.INTERPOLATIONS
    for argv in ("", "--val-resize-size 232", "--val-crop-size 224 --image-size 176", "--val-resize-size 232 "
                 "--val-crop-size 224 --image-size 176", "--image-size 128"):
        cfg = config("imagenet", argv)
        assert cfg.val_sizes() == augment.val_sizes(cfg.image_size, augment.Augmentation.from_config(cfg)), argv


# ----------------------------------------------------------------- schedules


def torchvisions_lrs(cfg: TrainConfig, lr: float) -> list[float]:
    """The lr of each epoch under torchvision's train.py's scheduler for ``cfg``: its
    code, stepped once per epoch."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)
    if cfg.lr_schedule == "steplr":
        main_lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.lr_step_size, gamma=cfg.lr_gamma)
    elif cfg.lr_schedule == "cosineannealinglr":
        main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=cfg.epochs - int(cfg.warmup_epochs), eta_min=cfg.lr_min)
    else:
        main_lr_scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=cfg.lr_gamma)
    warmup = int(cfg.warmup_epochs)
    if warmup > 0:
        if cfg.lr_warmup_method == "linear":
            warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=cfg.lr_warmup_decay,
                                                                    total_iters=warmup)
        else:
            warmup_lr_scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=cfg.lr_warmup_decay,
                                                                      total_iters=warmup)
        lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
            optimizer, schedulers=[warmup_lr_scheduler, main_lr_scheduler], milestones=[warmup])
    else:
        lr_scheduler = main_lr_scheduler
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SequentialLR's deprecation of step(epoch) inside it
        for _ in range(cfg.epochs):
            lrs.append(optimizer.param_groups[0]["lr"])
            lr_scheduler.step()
    return lrs


@pytest.mark.parametrize("argv", [
    "--lr-scheduler steplr --epochs 9 --lr-step-size 3 --lr-gamma 0.5",
    "--lr-scheduler steplr --epochs 10 --lr-step-size 2 --lr-gamma 0.973 --lr-warmup-epochs 3 "
    "--lr-warmup-method constant --lr-warmup-decay 0.1",
    "--lr-scheduler cosineannealinglr --epochs 12",
    "--lr-scheduler cosineannealinglr --epochs 12 --lr-warmup-epochs 5 --lr-warmup-method linear --lr-min 0.001",
    "--lr-scheduler cosineannealinglr --epochs 8 --lr-warmup-epochs 2 --lr-warmup-method linear "
    "--lr-warmup-decay 0.033",
    "--lr-scheduler exponentiallr --epochs 7 --lr-gamma 0.8",
    "--lr-scheduler exponentiallr --epochs 7 --lr-gamma 0.9 --lr-warmup-epochs 2 --lr-warmup-method constant",
], ids=["steplr", "steplr-constant-warmup", "cosine", "cosine-linear-warmup-min", "cosine-vit-warmup",
        "exponential", "exponential-constant-warmup"])
def test_torchvisions_schedulers_give_torchvisions_lr_at_every_step(argv):
    """Our LambdaLR, stepped per optimizer step as the engine steps it, holds each
    epoch's lr through the epoch's steps, and that lr is the one torchvision's own
    scheduler objects (built as its train.py builds them, stepped per epoch) give."""
    cfg = config("imagenet", argv + " -b 4 --lr 0.5")
    steps_per_epoch = 3
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(build.param_groups(net, cfg.weight_decay, cfg.no_bn_wd), lr=build.learning_rate(cfg, 1))
    schedule = build.schedule(cfg, opt, train_samples=steps_per_epoch * cfg.batch_size)
    assert schedule.steps_per_epoch == steps_per_epoch and schedule.total_steps == cfg.epochs * steps_per_epoch
    ours = []
    for _ in range(schedule.total_steps):
        ours.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.scheduler.step()
    theirs = [lr for lr in torchvisions_lrs(cfg, 0.5) for _ in range(steps_per_epoch)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    assert len(set(theirs)) > 2  # the schedule moves


def test_our_own_schedules_are_unchanged():
    """--lr-schedule's schedules, per step, as before torchvision's existed."""
    cfg = TrainConfig(task="imagenet", epochs=2, warmup_epochs=1.0, batch_size=4)
    fn = build.lr_lambda(cfg, steps_per_epoch=4, base_lr=0.1)
    assert [fn(s) for s in range(8)] == pytest.approx([0.25, 0.5, 0.75, 1.0] + [
        0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(4)])


# ----------------------------------------------------------------- weight decay groups


def torchvisions_set_weight_decay(model, weight_decay, norm_weight_decay=None, custom_keys_weight_decay=None):
    """references/classification/utils.py's set_weight_decay, as torchvision writes it."""
    norm_classes = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm,
                    torch.nn.modules.instancenorm._InstanceNorm, torch.nn.LocalResponseNorm)
    params = {"other": [], "norm": []}
    params_weight_decay = {"other": weight_decay, "norm": norm_weight_decay}
    custom_keys = []
    if custom_keys_weight_decay is not None:
        for key, decay in custom_keys_weight_decay:
            params[key] = []
            params_weight_decay[key] = decay
            custom_keys.append(key)

    def _add_params(module, prefix=""):
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_custom_key = False
            for key in custom_keys:
                target_name = f"{prefix}.{name}" if prefix != "" and "." in key else name
                if key == target_name:
                    params[key].append(p)
                    is_custom_key = True
                    break
            if not is_custom_key:
                if norm_weight_decay is not None and isinstance(module, norm_classes):
                    params["norm"].append(p)
                else:
                    params["other"].append(p)
        for child_name, child_module in module.named_children():
            child_prefix = f"{prefix}.{child_name}" if prefix != "" else child_name
            _add_params(child_module, prefix=child_prefix)

    _add_params(model)
    return [{"params": params[key], "weight_decay": params_weight_decay[key]} for key in params if params[key]]


def tiny_vit():
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16,
                             num_classes=10)


def tiny_swin():
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[1, 1], window_size=[2, 2],
                           num_classes=10)


def as_ids(groups):
    return [([id(p) for p in g["params"]], g["weight_decay"]) for g in groups]


@pytest.mark.parametrize("make", [tiny_vit, tiny_swin, lambda: models.resnet9(4)], ids=["vit", "swin", "resnet9"])
@pytest.mark.parametrize("norm,bias,embedding", [(0.0, None, None), (None, 0.0, None), (None, None, 0.0),
                                                 (0.0, 0.01, 0.0)], ids=["norm", "bias", "embedding", "all"])
def test_weight_decay_groups_are_torchvisions_set_weight_decay(make, norm, bias, embedding):
    """torchvision's train.py: --bias-weight-decay is the custom key "bias", and
    --transformer-embedding-decay its embedding keys (class_token, position_embedding,
    relative_position_bias_table); ours adds the names torchvision's own ViT
    (pos_embedding) and timm's models give theirs (EMBEDDING_KEYS)."""
    net = make()
    custom = ([("bias", bias)] if bias is not None else []) + (
        [(key, embedding) for key in EMBEDDING_KEYS] if embedding is not None else [])
    ours = build.param_groups(net, 0.05, False, norm, bias, embedding)
    assert as_ids(ours) == as_ids(torchvisions_set_weight_decay(net, 0.05, norm, custom or None))
    assert sum(len(g["params"]) for g in ours) == len(list(net.parameters()))


def test_the_embedding_decay_reaches_the_vits_position_embedding_and_class_token():
    vit, swin = tiny_vit(), tiny_swin()
    groups = build.param_groups(vit, 0.3, False, transformer_embedding_decay=0.0)
    assert {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]} == {
        id(vit.class_token), id(vit.encoder.pos_embedding)}
    tables = [m.relative_position_bias_table for m in swin.modules() if hasattr(m, "relative_position_bias_table")]
    groups = build.param_groups(swin, 0.3, False, transformer_embedding_decay=0.0)
    assert tables and {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]} == {
        id(t) for t in tables}
    # torchvision's own keys miss its ViT's pos_embedding, which EMBEDDING_KEYS adds
    theirs = torchvisions_set_weight_decay(vit, 0.3, None, [(k, 0.0) for k in ("class_token", "position_embedding",
                                                                                 "relative_position_bias_table")])
    assert {id(p) for g in theirs if g["weight_decay"] == 0.0 for p in g["params"]} == {id(vit.class_token)}


def test_without_the_per_kind_decays_the_groups_are_as_before():
    net = models.resnet9(4)
    assert as_ids(build.param_groups(net, 5e-4, False)) == [([id(p) for p in net.parameters()], 5e-4)]
    two = build.param_groups(net, 5e-4, True)
    assert [g["weight_decay"] for g in two] == [5e-4, 0.0] and all(p.ndim > 1 for p in two[0]["params"])


# ----------------------------------------------------------------- optimizers


def test_sgd_nesterov_and_rmsprop_are_built_as_torchvision_builds_them():
    net = nn.Linear(4, 3)
    defaults = {"rmsprop": {}, "sgd_nesterov": {}}
    for opt_name in defaults:
        cfg = config("imagenet", f"--opt {opt_name} --lr 0.064 --wd 1e-5 --momentum 0.8 --lr-scheduler steplr")
        inner = build.inner_optimizer(cfg, build.param_groups(net, cfg.weight_decay, False), build.learning_rate(cfg, 1))
        # torchvision's train.py, with its parameters = set_weight_decay(...) (one group here)
        params = [{"params": list(net.parameters()), "weight_decay": cfg.weight_decay}]
        if opt_name.startswith("sgd"):
            theirs = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                     nesterov="nesterov" in opt_name)
        else:
            theirs = torch.optim.RMSprop(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                         eps=0.0316, alpha=0.9)
        assert type(inner) is type(theirs)
        strip = [{k: v for k, v in g.items() if k != "params"} for g in (inner.param_groups + theirs.param_groups)]
        assert strip[0] == strip[1]
        defaults[opt_name] = strip[0]
    assert defaults["sgd_nesterov"]["nesterov"] and defaults["rmsprop"]["alpha"] == 0.9


def test_fp16_optimizer_steps_rmsprop_unfused_as_torch_steps_the_masters():
    """RMSprop over fp16 weights: FP16Optimizer's masters take exactly the steps torch's
    RMSprop takes on fp32 copies given the unscaled gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    cfg = config("imagenet", "--opt rmsprop --lr 0.01 --wd 1e-4 --lr-scheduler steplr --fused auto")
    from mpfp16 import to_half

    to_half(net)
    reference = [p.detach().float().clone() for p in net.parameters()]  # the masters start as the 16-bit weights
    opt = build.optimizer(cfg, net, world_size=1)
    assert not opt.fused
    ref = [nn.Parameter(p) for p in reference]
    ref_opt = torch.optim.RMSprop(ref, lr=0.01, momentum=cfg.momentum, weight_decay=1e-4, eps=0.0316, alpha=0.9)
    for step in range(3):
        x = torch.randn(16, 8)
        opt.zero_grad()
        opt.backward(net(x).float().square().mean())
        scale = opt.loss_scale
        assert [id(p) for p in opt.model_params()] == [id(p) for p in net.parameters()]
        grads = [p.grad.float() / scale for p in net.parameters()]
        assert opt.step()
        for r, g in zip(ref, grads):
            r.grad = g
        ref_opt.step()
        for master, r in zip(opt.master_params(), ref):
            assert torch.equal(master, r.detach()), step
    state = opt.state_dict()["optimizer"]["state"]
    assert {"square_avg", "momentum_buffer"} <= set(next(iter(state.values())))


# ----------------------------------------------------------------- --weights


def test_weights_load_a_local_file_before_the_conversion(tmp_path):
    """A state_dict, or a torchvision checkpoint (its 'model', beside an argparse
    Namespace of its args); a DDP module's 'module.' prefix is taken off."""
    torch.manual_seed(1)
    source = models.build_cifar_model("resnet9-w4", 10)
    state = source.state_dict()
    plain, ckpt = tmp_path / "plain.pth", tmp_path / "checkpoint.pth"
    torch.save(state, plain)
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 3,
                "args": argparse.Namespace(model="resnet9-w4", lr=0.1)}, ckpt)
    for path in (plain, ckpt):
        cfg = config("cifar", f"-a resnet9-w4 --weights {path}")
        net = build.model(cfg, 10, CPU)
        for name, value in net.state_dict().items():
            assert torch.equal(value, state[name].to(value.dtype)), name
        conv = net[0][0].weight
        assert conv.dtype == torch.float16 and not torch.equal(conv, models.build_cifar_model("resnet9-w4").to(
            torch.float16)[0][0].weight)


def test_weights_that_do_not_fit_or_do_not_load_are_one_line(tmp_path):
    torch.save(models.build_cifar_model("resnet9-w4", 10).state_dict(), tmp_path / "w4.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a torch file")
    torch.save([1, 2], tmp_path / "list.pth")
    for name, message in (("w4.pth", "does not fit the model (shapes differ: 0.0.weight (4, 3, 3, 3) for (8, 3, 3, 3)"),
                          ("junk.pth", "cannot read it as torch.save's file of a state_dict"),
                          ("list.pth", "holds no state_dict")):
        with pytest.raises(models.WeightsError) as err:
            build.model(config("cifar", f"-a resnet9-w8 --weights {tmp_path / name}"), 10, CPU)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_test_only_evaluates_the_weights_without_a_checkpoint(tmp_path):
    torch.save(models.build_cifar_model("resnet9-w4", 10).state_dict(), tmp_path / "w.pth")
    cfg = config("cifar", f"--test-only --weights {tmp_path / 'w.pth'}")
    assert cfg.evaluate and cfg.resume is None


# ----------------------------------------------------------------- resume


def test_every_recipe_setting_compares_on_resume_and_older_checkpoints_compare_as_before():
    cfg = TrainConfig(task="imagenet")
    assert set(RECIPE_FIELDS) <= set(BEFORE_THEY_EXISTED)
    # The value a run had before the setting existed is the default it has now (so far).
    assert {name: BEFORE_THEY_EXISTED[name] for name in RECIPE_FIELDS} == {name: getattr(cfg, name)
                                                                          for name in RECIPE_FIELDS}
    assert set(RECIPE_FIELDS) & FREE_ON_RESUME == {"use_deterministic_algorithms"}  # how, never what, a step computes
    older = {k: v for k, v in cfg.as_dict().items() if k not in RECIPE_FIELDS}
    assert cfg.changed_on_resume(older) == []
    recipe = dataclasses.replace(cfg, auto_augment="ta_wide", mixup_alpha=0.2)
    assert recipe.changed_on_resume(older) == [("auto_augment", None, "ta_wide"), ("mixup_alpha", 0.0, 0.2)]


def test_a_checkpoint_of_the_release_before_the_recipe_resumes_unchanged_and_refuses_a_recipe():
    """A checkpoint of release 0.1 (tests/fixtures) records none of the recipe's settings:
    resumed with its own settings nothing changed; with --auto-augment, that changed."""
    import os

    path = os.path.join(os.path.dirname(__file__), "fixtures", "release-0.1", "file", "last.pt")
    saved = torch.load(path, weights_only=True)["config"]
    assert not set(RECIPE_FIELDS) & set(saved)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    same = TrainConfig(**{k: v for k, v in saved.items() if k in fields})
    assert same.changed_on_resume(saved) == []
    assert dataclasses.replace(same, auto_augment="ra", ra_reps=4).changed_on_resume(saved) == [
        ("auto_augment", None, "ra"), ("ra_reps", 3, 4)]


def test_resume_refuses_a_changed_auto_augment(tmp_path):
    """A real checkpoint, saved and resumed as the engine does (RunCheckpoints)."""
    from mpfp16 import to_half
    from mpfp16.errors import UserError
    from mpfp16.train.checkpointing import RunCheckpoints
    from mpfp16.train.state import TrainState

    def checkpoints(cfg):
        torch.manual_seed(0)
        model = to_half(nn.Linear(4, 3))
        opt = build.optimizer(cfg, model, world_size=1)
        sched = build.schedule(cfg, opt, train_samples=64).scheduler
        return RunCheckpoints(cfg, CPU, model, model, opt, sched, run_facts={"processes": 1, "training images": 64},
                              training_images=64)

    cfg = TrainConfig(task="cifar", batch_size=16, epochs=2, checkpoint_dir=str(tmp_path), auto_augment="cifar10")
    saving = checkpoints(cfg)
    saving.opt.backward(saving.model(torch.randn(2, 4)).float().sum())
    saving.opt.step()
    saving.sched.step()
    saving.save(TrainState(step=1, epoch=0, samples_done=16), elapsed=1.0)
    assert checkpoints(dataclasses.replace(cfg, resume="auto")).resume().step == 1
    with pytest.raises(UserError, match=r"saved with other settings \(auto_augment cifar10 -> ra\)"):
        checkpoints(dataclasses.replace(cfg, resume="auto", auto_augment="ra")).resume()


# ----------------------------------------------------------------- timm


def test_a_timm_model_builds_by_name_in_fp16_with_its_norms_in_fp32():
    pytest.importorskip("timm")
    for arch, norm in (("test_vit", nn.LayerNorm), ("timm/test_resnet", nn.BatchNorm2d)):
        cfg = config("imagenet", f"--model {arch} --image-size 32 --val-resize-size 32 --val-crop-size 32")
        build.check_model_fits(cfg)
        net = build.model(cfg, 10, CPU)
        assert type(net).__module__.startswith("timm.")
        norms = [m for m in net.modules() if isinstance(m, norm)]
        assert norms and all(p.dtype == torch.float32 for m in norms for p in m.parameters())
        others = [p for m in net.modules() if not isinstance(m, norm) for p in m.parameters(recurse=False)]
        assert others and all(p.dtype == torch.float16 for p in others)
        out = net(torch.randn(2, 3, 32, 32))
        assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert models.model_source("resnet50") == ("torchvision", "resnet50")
    assert models.model_source("timm/resnet50") == ("timm", "resnet50")
    assert models.has_fixed_input_size("imagenet", "test_vit")
    assert models.build_imagenet_model("test_vit", 10, image_size=48).patch_embed.img_size == (48, 48)


def test_timms_models_are_checked_before_anything_starts(capsys):
    pytest.importorskip("timm")
    with pytest.raises(models.ImageSizeError, match="test_vit cannot take 40x40 images: the size must be a multiple "
                                                    "of its patch size, 16"):
        build.check_model_fits(config("imagenet", "--model test_vit --image-size 40"))
    with pytest.raises(models.ImageSizeError, match="test_vit is built for one image size, 32, and cannot take "
                                                    "--val-crop-size 48"):
        build.check_model_fits(config("imagenet", "--model test_vit --image-size 32 --val-crop-size 48"))
    with pytest.raises(models.UnknownArchError, match="unknown torchvision arch 'no_such_net', and timm has none "
                                                      "of that name"):
        models.check_arch("imagenet", "no_such_net")
    with pytest.raises(models.UnknownArchError, match="nothing is downloaded"):
        models.check_arch("imagenet", "hf-hub:timm/vit_tiny_patch16_224")


def test_without_timm_its_names_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    for arch in ("vit_tiny_patch16_224", "timm/resnet50"):
        with pytest.raises(models.UnknownArchError) as err:
            models.check_arch("imagenet", arch)
        assert "pip install 'mpfp16[timm]'" in str(err.value) and "\n" not in str(err.value)
    models.check_arch("imagenet", "resnet18")  # torchvision's need no timm


# ----------------------------------------------------------------- deterministic algorithms


def test_an_epoch_the_ra_sampler_leaves_empty_says_why():
    from mpfp16.errors import UserError

    cfg = config("cifar", "--ra-sampler -b 8")
    with pytest.raises(UserError, match=r"--ra-sampler gives each process 0 training samples an epoch \(torchvision's "
                                        r"RASampler trains floor\(images // 256 \* 256 / processes\)"):
        build.schedule(cfg, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), train_samples=0)


def test_deterministic_algorithms_are_on_for_the_run_and_as_before_after_it():
    before = torch.are_deterministic_algorithms_enabled()
    with build.deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    assert torch.are_deterministic_algorithms_enabled() == before
    with build.deterministic_algorithms(False):
        assert torch.are_deterministic_algorithms_enabled() == before


# ----------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchvisions_resnet_recipe_runs_end_to_end(tmp_path, capsys):
    """torchvision's README ResNet command (the new recipe), shortened to tiny sizes, on
    the embedded synthetic data, with a small model of BatchNorm layers (resnet18 in fp16
    on 2 CPU cores: a minute)."""
    import train_imagenet
    from run_helpers import records, run_main

    # torchvision's RASampler trains floor(images // 256 * 256 / processes) images an epoch: 256 of them
    argv = shlex.split(
        "--model mobilenet_v3_small --batch-size 64 --lr 0.01 --lr-scheduler cosineannealinglr --lr-warmup-epochs 1 "
        "--lr-warmup-method linear --auto-augment ta_wide --epochs 2 --random-erase 0.1 --weight-decay 0.00002 "
        "--norm-weight-decay 0.0 --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --train-crop-size 32 "
        "--model-ema --model-ema-steps 2 --val-resize-size 36 --val-crop-size 32 --ra-sampler --ra-reps 2 "
        "--clip-grad-norm 5 --use-deterministic-algorithms -j 0 --print-freq 1 --no-progress --fused off "
        f"--synthetic-size 256,16 --output-dir {tmp_path}")
    status, err = run_main(train_imagenet.main, argv, capsys)
    assert status == 0, err
    assert not torch.are_deterministic_algorithms_enabled()  # the run's setting, undone after it
    recs = records(tmp_path / "metrics.jsonl")
    cfg = next(r for r in recs if r["type"] == "config")
    assert (cfg["arch"], cfg["lr_schedule"], cfg["auto_augment"], cfg["mixup_alpha"], cfg["model_ema"],
            cfg["image_size"], cfg["val_resize_size"], cfg["scale_lr"]) == ("mobilenet_v3_small", "cosineannealinglr",
                                                                            "ta_wide", 0.2, True, 32, 36, False)
    train = [r for r in recs if r["type"] == "train"]
    steps_per_epoch = len(train) // 2
    lrs = [r["lr"] for r in train]  # each record's lr is the next step's
    assert steps_per_epoch == 256 // 64  # RASampler's images, unscaled --lr: torchvision's
    assert lrs[:steps_per_epoch - 1] == pytest.approx([0.01 * 0.01] * (steps_per_epoch - 1))  # LinearLR's first
    assert lrs[steps_per_epoch - 1] == pytest.approx(0.01)  # warm-up over: cosine from --lr over the last epoch


@pytest.mark.slow
def test_timm_is_imported_only_for_a_timm_model():
    """Neither the library, the scripts' front end nor the engine imports timm; a
    torchvision model's build does not either."""
    pytest.importorskip("timm")
    from test_import_is_light import modules_added_by

    added = modules_added_by("import mpfp16, mpfp16.train.cli, mpfp16.train.engine; from mpfp16.train import models; "
                             "models.check_image_sizes('imagenet', 'resnet18', [32])")
    assert "mpfp16.train.engine" in added and not [m for m in added if m == "timm" or m.startswith("timm.")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_torchvision_schedule_resumes_mid_epoch_bit_identically(tmp_path, capsys):
    """3 steps, a resume, 5 more == 8 straight steps under --lr-scheduler steplr with a
    constant warm-up and RMSprop over the per-kind decay groups: the per-epoch lr is a
    function of the step, as the own schedules are."""
    import train_cifar
    from run_helpers import assert_same_final_state, records, run_main

    common = shlex.split("-a resnet9-w4 -b 16 --synthetic-size 64,16 --epochs 3 --no-progress -p 1 --opt rmsprop "
                         "--lr 0.01 --lr-scheduler steplr --lr-step-size 1 --lr-gamma 0.5 --lr-warmup-epochs 1 "
                         "--lr-warmup-method constant --lr-warmup-decay 0.1 --norm-weight-decay 0 "
                         "--bias-weight-decay 0")
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    assert run_main(train_cifar.main, common + ["--max-steps", "8", "--checkpoint-dir", str(straight)], capsys)[0] == 0
    assert run_main(train_cifar.main, common + ["--max-steps", "3", "--checkpoint-dir", str(parts)], capsys)[0] == 0
    assert run_main(train_cifar.main, common + ["--max-steps", "8", "--checkpoint-dir", str(parts), "--resume",
                                                "auto"], capsys)[0] == 0
    assert_same_final_state(straight / "last.pt", parts / "last.pt")
    lrs = [r["lr"] for r in records(straight / "metrics.jsonl") if r["type"] == "train"]
    assert lrs == pytest.approx([0.001] * 3 + [0.01] * 4 + [0.005])  # 4 steps an epoch; each record: the next step's
