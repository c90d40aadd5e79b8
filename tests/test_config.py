"""TrainConfig: the one source of defaults, and of the rules between settings, for the
command line and for code that builds a config itself."""

import argparse

import pytest

from mpfp16.train import cli
from mpfp16.train.config import ConfigError, TrainConfig


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
    (dict(allreduce_strategy="fp32_accumulate", allreduce_dtype="fp32"), "drop --allreduce-dtype"),
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
