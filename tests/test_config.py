"""TrainConfig: the one source of defaults, and of the rules between settings, for the
command line and for code that builds a config itself."""

import argparse
import inspect
import itertools

import pytest
import torch

from mpfp16 import optimizer as optimizer_rules
from mpfp16.parallel import ddp as ddp_rules
from mpfp16.parallel import fsdp as fsdp_rules
from mpfp16.parallel.hooks import STRATEGIES
from mpfp16.train import cli
from mpfp16.train.config import ConfigError, TrainConfig, say


@pytest.mark.parametrize("task", ["cifar", "imagenet"])
@pytest.mark.parametrize("data", [None, "/data/somewhere"], ids=["embedded", "real"])
def test_the_command_line_without_flags_is_the_dataclass(task, data):
    parser = cli.build_parser(task)
    from_flags = cli.config_from_args(task, parser.parse_args([] if data is None else [data]), parser)
    assert from_flags == TrainConfig(task=task, data=data)


def test_task_and_data_decide_the_defaults():
    assert TrainConfig(task="cifar").weight_decay == 5e-4 and TrainConfig(task="imagenet").weight_decay == 1e-4
    assert TrainConfig(task="cifar").nesterov and not TrainConfig(task="imagenet").nesterov
    assert TrainConfig(task="cifar").arch == "resnet9-w8" and TrainConfig(task="cifar", data="x").arch == "resnet9"
    assert TrainConfig(task="imagenet", arch="resnet18", lr=0.5).lr == 0.5  # given values stay


@pytest.mark.parametrize("task", ["cifar", "imagenet"])
def test_every_help_ends_with_the_default_the_config_uses(task):
    parser = cli.build_parser(task)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help.endswith(")") and "(default: " in action.help, action.dest
    helps = {a.dest: a.help for a in parser._actions}
    expected_wd = TrainConfig(task=task, data="x").weight_decay
    assert helps["weight_decay"].endswith(f"(default: {expected_wd})")
    assert helps["arch"].endswith(f"(default: {TrainConfig(task=task, data='x').arch}; "
                                  f"{TrainConfig(task=task).arch} on the embedded data)")


@pytest.mark.parametrize("kw,message", [
    (dict(optimizer="adam"), "unknown --optimizer 'adam'; choose one of sgd, adamw"),
    (dict(precision="fp8"), "unknown --precision 'fp8'"),
    (dict(precision="bf16", loss_scale=128.0), "--loss-scale applies to fp16 only, not --precision bf16"),
    (dict(allreduce_strategy="fp32_accumulate", allreduce_dtype="fp32"), "leave out --allreduce-dtype"),
    (dict(rounding="kahan"), "--rounding kahan needs --no-master-weights"),
    (dict(evaluate=True), "--evaluate needs --resume PATH"),
    (dict(overwrite=True, resume="auto"), "cannot be combined with --resume"),
    (dict(loss_scale=-1.0), "--loss-scale must be 'dynamic' or a positive number"),
], ids=["optimizer", "precision", "loss-scale", "wire", "rounding", "evaluate", "overwrite", "bad-scale"])
def test_contradictions_and_unknown_names_are_one_error_line(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(task="cifar", **kw).validate()


def test_the_library_path_refuses_an_unknown_optimizer_too(capsys, monkeypatch):
    """Code that builds a TrainConfig and calls train() gets the same one line: any
    name but sgd no longer silently becomes AdamW."""
    from mpfp16.train import engine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="unknown --optimizer 'lamb'"):
        engine.train(TrainConfig(task="cifar", optimizer="lamb", synthetic_size=(64, 16), max_steps=1))


DTYPES = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def library_verdict(o: dict) -> str | None:
    """What the library itself says of the options the engine passes it for these
    settings: FP16Optimizer's rules, and FSDP2's (--shard) or DDP's."""
    try:
        optimizer_rules.check_options(master_weights=o["master_weights"], rounding=o["rounding"],
                                      max_grad_norm=o["max_grad_norm"],
                                      fused={"auto": None, "on": True, "off": False}[o["fused"]], sharded=o["shard"])
        if o["shard"]:
            fsdp_rules.check_options(DTYPES[o["precision"]], DTYPES[o["allreduce_dtype"]])
        else:
            ddp_rules.check_options(strategy=o["allreduce_strategy"], allreduce_dtype=DTYPES[o["allreduce_dtype"]],
                                    predivide_factor=o["predivide_factor"], bucket_mb=25.0,
                                    powersgd_rank=o["powersgd_rank"], powersgd_start_iter=2,
                                    grads_16bit=o["precision"] != "fp32")
    except ValueError as exc:
        return str(exc)
    return None


def test_the_config_refuses_exactly_what_the_library_refuses():
    """Over a matrix of the options the library has rules on, TrainConfig.validate()
    refuses a combination if and only if the library's own validators do, in one line
    that names flags instead of the library's keywords."""
    axes = {"precision": ["fp16", "bf16", "fp32"], "master_weights": [True, False],
            "rounding": ["nearest", "stochastic", "kahan"], "fused": ["auto", "on", "off"],
            "max_grad_norm": [None, 1.0], "allreduce_dtype": [None, "fp16", "bf16", "fp32"]}
    ddp_axes = {"allreduce_strategy": list(STRATEGIES), "predivide_factor": [1.0, 2.0], "powersgd_rank": [1, 2]}
    checked = refused = 0
    for shard in (False, True):
        names = list(axes) + ([] if shard else list(ddp_axes))  # DDP's flags with --shard: the config's own rule
        for values in itertools.product(*[{**axes, **ddp_axes}[n] for n in names]):
            options = {"shard": shard, "allreduce_strategy": "allreduce", "predivide_factor": 1.0, "powersgd_rank": 1,
                       **dict(zip(names, values))}
            verdict = library_verdict(options)
            try:
                TrainConfig(task="cifar", **options).validate()
                said = None
            except ConfigError as exc:
                said = str(exc)
            assert (said is None) == (verdict is None), (options, said, verdict)
            if said is not None:
                refused += 1
                assert "\n" not in said and "=" not in said.split(":")[0], said  # flags, not keywords
            checked += 1
    assert checked == 8640 + 432 and 0 < refused < checked


@pytest.mark.parametrize("name,value,words", [
    ("master_weights", False, "--no-master-weights"), ("fused", True, "--fused on"), ("fused", None, "--fused auto"),
    ("rounding", "kahan", "--rounding kahan"), ("strategy", "powersgd", "--allreduce-strategy powersgd"),
    ("allreduce_dtype", None, "out --allreduce-dtype"), ("allreduce_dtype", torch.bfloat16, "--allreduce-dtype bf16"),
    ("param_dtype", torch.float32, "--precision fp32"), ("predivide_factor", 1.0, "--predivide-factor 1"),
    ("powersgd_rank", 4, "--powersgd-rank 4"), ("max_grad_norm", 0.5, "--max-grad-norm 0.5"),
])
def test_library_options_are_worded_as_flags(name, value, words):
    assert say(name, value) == words


def test_the_timeout_default_is_the_librarys():
    from mpfp16.parallel import setup

    assert TrainConfig(task="cifar").dist_timeout == setup.DEFAULT_TIMEOUT_S
    assert inspect.signature(setup.init).parameters["timeout_s"].default == setup.DEFAULT_TIMEOUT_S
