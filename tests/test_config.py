"""TrainConfig: the one source of defaults, and of the rules between settings, for the
command line and for code that builds a config itself."""

import argparse
import inspect
import itertools

import pytest
import torch

from mpfp16 import options as optimizer_rules
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
    (dict(loss_scale=-1.0), "--loss-scale -1: a loss scale must be a positive normal fp32 number"),
    (dict(accumulate_dtype="fp32", precision="fp32"), "--accumulate-dtype fp32 needs 16-bit gradients"),
    (dict(accumulate_dtype="fp32", shard=True), "--accumulate-dtype fp32 is not possible for a sharded model: FSDP2 "
                                                "sums the micro-batches' unsharded gradients itself, in its "
                                                "reduce_dtype: for an fp32 sum, shard with --allreduce-dtype fp32"),
], ids=["optimizer", "precision", "loss-scale", "wire", "rounding", "evaluate", "overwrite", "bad-scale",
        "accumulate-fp32-model", "accumulate-sharded"])
def test_contradictions_and_unknown_names_are_one_error_line(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(task="cifar", **kw).validate()


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where no CUDA GPU is available")


@pytest.mark.parametrize("kw,message", [
    (dict(loss_scale=1e-45), "--loss-scale 1e-45: a loss scale must be a positive normal fp32 number, from "
                             "1.175e-38 to 3.403e+38"),  # a subnormal: its reciprocal overflows
    (dict(loss_scale=1e39), "--loss-scale 1e+39: a loss scale must be a positive normal fp32 number, from "
                            "1.175e-38 to 3.403e+38"),  # inf in fp32: every step skipped
    pytest.param(dict(device="cuda"), "--device cuda was asked for, but no CUDA GPU is available here", marks=NO_GPU),
    pytest.param(dict(dist_backend="nccl"), "--dist-backend nccl: the NCCL backend needs CUDA GPUs, and this run is "
                 "on the CPU: use gloo", marks=NO_GPU),
    (dict(dist_backend="nccl", device="cpu"), "--dist-backend nccl: the NCCL backend needs CUDA GPUs, and this run "
                                              "is on the CPU: use gloo"),
], ids=["scale-subnormal", "scale-inf", "cuda-without-gpu", "nccl-on-cpu", "nccl-with-device-cpu"])
def test_flags_the_library_refuses_are_one_line_in_flags(kw, message):
    """The loss scale's and the process set-up's rules are the library's own
    (mpfp16.scaler.check_loss_scale, mpfp16.parallel.setup.check_options), worded as flags."""
    with pytest.raises(ConfigError) as err:
        TrainConfig(task="cifar", **kw).validate()
    assert str(err.value) == message


@pytest.mark.parametrize("argv,message", [
    (["--loss-scale", "1e-45"], "--loss-scale 1e-45: a loss scale must be a positive normal fp32 number"),
    (["--loss-scale", "1e39"], "--loss-scale 1e+39: a loss scale must be a positive normal fp32 number"),
    pytest.param(["--device", "cuda"], "--device cuda was asked for, but no CUDA GPU is available here",
                 marks=NO_GPU),
    (["--dist-backend", "nccl", "--device", "cpu"], "--dist-backend nccl: the NCCL backend needs CUDA GPUs"),
], ids=["scale-subnormal", "scale-inf", "cuda-without-gpu", "nccl-on-cpu"])
@pytest.mark.parametrize("launched", [False, True], ids=["one-process", "under-torchrun"])
def test_bad_flags_are_refused_before_anything_starts(capsys, monkeypatch, tmp_path, argv, message, launched):
    """One error line and exit status 2 before any data is loaded or any process group
    is made: under torchrun's environment too (no peer is there to meet; a rendezvous
    would wait for one)."""
    import train_cifar

    if launched:
        for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": "1"}.items():
            monkeypatch.setenv(name, value)
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train_cifar.main(["--synthetic-size", "64,16", "-a", "resnet9-w4", "--max-steps", "1", "--no-progress",
                          "--dist-timeout", "5", "--checkpoint-dir", str(tmp_path), *argv])  # bounded if not refused
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and "Traceback" not in captured.err
    last = captured.err.strip().splitlines()[-1]
    assert last.split(": error: ", 1)[1].startswith(message), last
    assert "data:" not in captured.out and not any(tmp_path.iterdir())  # nothing loaded, nothing written


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
                                    grads_16bit=o["precision"] != "fp32",
                                    grad_dtypes={"fp16": ("float16",), "bf16": ("bfloat16",)}.get(o["precision"], ()))
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
                       "nesterov": False, **dict(zip(names, values))}  # Nesterov: top-k's own rule (test_wires)
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
    assert checked == 8640 // 5 * len(STRATEGIES) + 432 and 0 < refused < checked


@pytest.mark.parametrize("name,value,words", [
    ("master_weights", False, "--no-master-weights"), ("fused", True, "--fused on"), ("fused", None, "--fused auto"),
    ("rounding", "kahan", "--rounding kahan"), ("strategy", "powersgd", "--allreduce-strategy powersgd"),
    ("allreduce_dtype", None, "out --allreduce-dtype"), ("allreduce_dtype", torch.bfloat16, "--allreduce-dtype bf16"),
    ("param_dtype", torch.float32, "--precision fp32"), ("predivide_factor", 1.0, "--predivide-factor 1"),
    ("powersgd_rank", 4, "--powersgd-rank 4"), ("max_grad_norm", 0.5, "--max-grad-norm 0.5"),
    ("accumulate_dtype", torch.float32, "--accumulate-dtype fp32"), ("accumulate_dtype", None, "out --accumulate-dtype"),
])
def test_library_options_are_worded_as_flags(name, value, words):
    assert say(name, value) == words


def test_the_timeout_default_is_the_librarys():
    from mpfp16.parallel import setup

    assert TrainConfig(task="cifar").dist_timeout == setup.DEFAULT_TIMEOUT_S
    assert inspect.signature(setup.init).parameters["timeout_s"].default == setup.DEFAULT_TIMEOUT_S


# ----------------------------------------------------------------- flags that contradict each other


@pytest.mark.parametrize("argv,message", [
    (["--master-weights", "remainder", "--no-master-weights"],
     "--no-master-weights contradicts --master-weights remainder, given before it: pass one of them"),
    (["--no-master-weights", "--master-weights", "remainder"],
     "--master-weights remainder contradicts --no-master-weights, given before it: pass one of them"),
    (["--no-master-weights", "--master-weights", "fp32"],
     "--master-weights fp32 contradicts --no-master-weights, given before it: pass one of them"),
    (["--master-weights", "fp32", "--no-master-weights"],
     "--no-master-weights contradicts --master-weights fp32, given before it: pass one of them"),
    (["--nesterov", "--no-nesterov"], "--no-nesterov contradicts --nesterov, given before it: pass one of them"),
    (["--no-nesterov", "-b", "8", "--nesterov"],
     "--nesterov contradicts --no-nesterov, given before it: pass one of them"),
    (["--no-master", "--master-weights=fp32"],  # an abbreviation is the flag it abbreviates
     "--master-weights fp32 contradicts --no-master-weights, given before it: pass one of them"),
], ids=["remainder-then-none", "none-then-remainder", "none-then-fp32", "fp32-then-none", "nesterov-then-not",
        "not-then-nesterov", "abbreviated"])
@pytest.mark.parametrize("task", ["cifar", "imagenet"])
def test_flags_that_contradict_each_other_are_an_argparse_error(capsys, task, argv, message):
    """Two flags that set one setting to different meanings, in either order: one
    argparse error line (exit status 2), not the last one silently winning."""
    parser = cli.build_parser(task)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"{parser.prog}: error: {message} (see --help)\n"


@pytest.mark.parametrize("argv,expected", [
    (["--no-master-weights", "--no-master-weights"], {"master_weights": False}),
    (["--master-weights", "fp32", "--master-weights", "remainder"], {"master_weights": "remainder"}),
    (["--nesterov", "--nesterov"], {"nesterov": True}),
    (["-b", "16", "--batch-size", "32"], {"batch_size": 32}),
    (["--wd", "0.1", "--weight-decay", "0.2"], {"weight_decay": 0.2}),
])
def test_a_flag_given_again_keeps_argparses_rule_the_last_value_wins(argv, expected):
    """One flag (with its aliases) given twice is no contradiction: argparse's last value
    wins, so that a wrapper script's flags can be overridden after them."""
    assert vars(cli.build_parser("cifar").parse_args(argv)) == expected


@pytest.mark.parametrize("task", ["cifar", "imagenet"])
def test_every_setting_that_two_flags_set_refuses_their_contradiction(task):
    """The settings that flags of different meanings set are exactly these, and each such
    flag checks for the other: a new pair of flags on one setting fails here until it
    does too."""
    meanings = {}
    for action in cli.build_parser(task)._actions:
        spellings = ([[s] for s in action.option_strings] if isinstance(action, argparse.BooleanOptionalAction)
                     else [action.option_strings])
        meanings.setdefault(action.dest, []).extend((action, s) for s in spellings)
    shared = {dest: ways for dest, ways in meanings.items() if len(ways) > 1}
    # Flags of one meaning, torchvision's names of ours (given twice, the last wins): the positional
    # data and --data-path, --image-size and --train-crop-size.
    same = {"data": ["--data-path"], **({"image_size": ["--image-size", "--train-crop-size"]} if task == "imagenet"
                                        else {})}
    for dest, flags in same.items():
        ways = shared.pop(dest)
        assert sorted(s for _, spelling in ways for s in spelling) == flags and len(ways) == 2
        assert all(type(action) is argparse._StoreAction for action, _ in ways)
    assert sorted(shared) == ["lr_schedule", "master_weights", "nesterov"] + (["scale_lr"] if task == "imagenet" else [])
    assert all(isinstance(action, (cli._Meaning, cli._Switch)) for ways in shared.values() for action, _ in ways)


# ----------------------------------------------------------------- torchrun's environment


LAUNCHED = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
NOT_SET = "is not set, and WORLD_SIZE is: launch with torchrun, which sets both, or unset WORLD_SIZE to run a single " \
          "process"


def launched(**changes):
    """torchrun's variables for rank 1 of 2, with ``changes`` (None: not set)."""
    env = {**LAUNCHED, **changes}
    return {name: value for name, value in env.items() if value is not None}


@pytest.mark.parametrize("env,expected", [
    ({}, None),  # not launched: a single process
    ({"MASTER_ADDR": "somewhere"}, None),  # MASTER_* alone (set in a profile, say) launch nothing
    (launched(), (1, 2, 1)),
    (launched(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0"), (0, 1, 0)),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),  # not "RANK is not set": WORLD_SIZE is wrong
    (launched(WORLD_SIZE="0"), "WORLD_SIZE=0 must be at least 1"),
    (launched(WORLD_SIZE="two"), "WORLD_SIZE='two' is not an integer"),
    (launched(WORLD_SIZE=""), "WORLD_SIZE='' is not an integer"),
    (launched(RANK=None), f"RANK {NOT_SET}"),
    (launched(RANK="-1"), "RANK=-1 must be at least 0"),
    (launched(RANK="2"), "RANK=2 must be less than WORLD_SIZE=2"),
    (launched(RANK="1.0"), "RANK='1.0' is not an integer"),
    (launched(LOCAL_RANK=None), f"LOCAL_RANK {NOT_SET}"),
    (launched(LOCAL_RANK="junk"), "LOCAL_RANK='junk' is not an integer"),
    (launched(LOCAL_RANK="2"), "LOCAL_RANK=2 must be less than WORLD_SIZE=2"),
    (launched(MASTER_ADDR=None), f"MASTER_ADDR {NOT_SET}"),
    (launched(MASTER_ADDR=" "), "MASTER_ADDR=' ' is empty: it must name the host of rank 0"),
    (launched(MASTER_PORT=None), f"MASTER_PORT {NOT_SET}"),
    (launched(MASTER_PORT="junk"), "MASTER_PORT='junk' is not an integer"),
    (launched(MASTER_PORT="0"), "MASTER_PORT=0 must be at least 1"),
    (launched(MASTER_PORT="65536"), "MASTER_PORT=65536 must be at most 65535"),
    pytest.param(launched(), "LOCAL_RANK=1 names no GPU: this node has 0; use --nproc_per_node <= the number of GPUs",
                 marks=NO_GPU, id="cuda-without-gpu"),
])
def test_torchruns_environment_is_checked_whole_and_names_the_wrong_variable(env, expected):
    from mpfp16.parallel import setup

    device = "cuda" if isinstance(expected, str) and "GPU" in expected else "cpu"
    if isinstance(expected, str):
        with pytest.raises(ValueError) as err:
            setup.check_environment(device, environ=env)
        assert str(err.value) == f"environment variable {expected}"
    else:
        assert setup.check_environment(device, environ=env) == expected


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    (launched(MASTER_PORT="junk"), "MASTER_PORT='junk' is not an integer"),
    (launched(RANK=None), f"RANK {NOT_SET}"),
    (launched(LOCAL_RANK="junk"), "LOCAL_RANK='junk' is not an integer"),
], ids=["world-size-0", "port-junk", "no-rank", "local-rank-junk"])
def test_a_bad_environment_is_one_line_before_anything_starts(capsys, monkeypatch, tmp_path, env, message):
    """The scripts: one ``error:`` line, exit status 2, no traceback, before any data is
    loaded or any file written (it was a ValueError's traceback from init())."""
    import train_cifar

    for name in LAUNCHED:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status = train_cifar.main(["--synthetic-size", "64,16", "-a", "resnet9-w4", "--max-steps", "1", "--no-progress",
                               "--dist-timeout", "5", "--checkpoint-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert status == 2 and captured.err == f"error: environment variable {message}\n"
    assert "data:" not in captured.out and not any(tmp_path.iterdir())
