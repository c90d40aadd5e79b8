"""The resume decisions (mpfp16/train/resume.py) over their whole matrix, without
training: which checkpoint --resume auto takes, what an earlier run in the folder
means for a fresh start, which changed settings are refused or warned about, and what
happens to a communication hook's state."""

import itertools

import pytest
import torch

from mpfp16.errors import CheckpointError, UserError
from mpfp16.train import resume as R
from mpfp16.train.config import BEFORE_THEY_EXISTED, FREE_ON_RESUME, TrainConfig

OWN, OTHER = "run/last.dcp", "run/last.pt"


# ----------------------------------------------------------------- --resume auto


@pytest.mark.parametrize("found,expected", [
    ({}, None),
    ({OWN: 4}, OWN),
    ({OTHER: 4}, OTHER),  # a plain run's checkpoint, resumed with --shard
    ({OWN: 4, OTHER: 7}, OTHER),  # the newer one, whichever format
    ({OWN: 9, OTHER: 7}, OWN),
    ({OWN: 7, OTHER: 7}, OWN),  # a tie: the one that needs no conversion
    ({OWN: None, OTHER: 1}, OTHER),
    ({OWN: 1, OTHER: None}, OWN),
])
def test_auto_picks_the_newest_last_checkpoint(found, expected):
    assert R.pick_last(found, own=OWN) == expected
    if len(found) == 2:  # the order they were found in does not matter
        assert R.pick_last(dict(reversed(list(found.items()))), own=OWN) == expected


def test_auto_over_every_pair_of_steps():
    for own_step, other_step in itertools.product([None, 0, 1, 5], repeat=2):
        picked = R.pick_last({OWN: own_step, OTHER: other_step}, own=OWN)
        steps = {OWN: -1 if own_step is None else own_step, OTHER: -1 if other_step is None else other_step}
        assert steps[picked] == max(steps.values())
        assert picked == OWN or steps[OTHER] > steps[OWN]


# ----------------------------------------------------------------- an earlier run in the folder


CK, METRICS = "run/last.pt", "run/metrics.jsonl"
BEST, DCP, GONE = "run/best.pt", "run/last.dcp", "run/sharded-step8-ab12"
FRESH = ("run holds an earlier run ({}): continue it with --resume auto, start elsewhere with another "
         "--checkpoint-dir, or replace it with --overwrite")
ELSEWHERE = "continue from {0} in another folder with --resume {0} --checkpoint-dir OTHER"
AUTO_HERE = "continue the run in run from its last checkpoint with --resume auto, or "


@pytest.mark.parametrize("resume,continues,checkpoints,metrics,overwrite,outcome", [
    (None, False, [], None, False, []),  # an empty folder
    (None, False, [CK], None, False, FRESH.format(CK)),  # a forgotten --resume auto
    (None, False, [], METRICS, False, FRESH.format(METRICS)),  # only the metrics of a run that never saved
    (None, False, [CK], METRICS, True, [CK]),  # --overwrite: the checkpoints go, the metrics are truncated
    ("auto", True, [CK], METRICS, False, []),  # continues its folder
    # no last to continue, a best to lose: not "use --resume auto", which it does
    ("auto", False, [BEST], None, False,
     f"--resume auto found nothing to continue in run (no last.pt or last.dcp; it holds {BEST}): "
     f"{ELSEWHERE.format(BEST)}, or start afresh in run with --overwrite and without --resume"),
    ("auto", False, [], METRICS, False, []),  # the metrics are appended to
    # another run's checkpoint into this run's folder: no --overwrite, which --resume refuses
    ("other/last.pt", False, [CK], None, False,
     f"run holds an earlier run ({CK}): {AUTO_HERE}{ELSEWHERE.format('other/last.pt')}"),
    ("other/last.pt", False, [BEST], None, False,  # and no --resume auto where it finds nothing
     f"run holds an earlier run ({BEST}): {ELSEWHERE.format('other/last.pt')}"),
    ("other/last.pt", False, [], METRICS, False, []),
    ("run/last.pt", True, [CK], METRICS, False, []),  # --resume naming this folder's own last
], ids=["empty", "forgotten-resume", "metrics-only", "overwrite", "continues", "auto-without-last",
        "auto-metrics-only", "other-run", "other-run-no-last", "other-run-metrics-only", "own-last"])
def test_what_an_earlier_run_means(resume, continues, checkpoints, metrics, overwrite, outcome):
    call = dict(resume=resume, continues=continues, checkpoints=checkpoints, metrics=metrics, overwrite=overwrite,
                folder="run")
    if isinstance(outcome, str):
        with pytest.raises(UserError) as err:
            R.earlier_run(**call)
        assert str(err.value) == outcome
    else:
        assert R.earlier_run(**call) == outcome


@pytest.mark.parametrize("checkpoints,dangling,resume,own,message", [
    ([DCP], {DCP: GONE}, "auto", False,  # a sharded run's link, its folder deleted
     f"--resume auto found nothing to continue in run ({DCP} names {GONE}, which is gone; it holds {DCP}): "
     "start afresh in run with --overwrite and without --resume, or in another --checkpoint-dir"),
    ([DCP, "run/best.dcp"], {DCP: GONE}, "auto", False,
     f"--resume auto found nothing to continue in run ({DCP} names {GONE}, which is gone; it holds {DCP}, "
     f"run/best.dcp): {ELSEWHERE.format('run/best.dcp')}, or start afresh in run with --overwrite and without "
     "--resume"),
    ([CK, BEST], {}, BEST, True,  # DIR/best.pt into DIR: its later last.pt would be replaced
     f"{BEST} is a checkpoint of the run in run ({CK}, {BEST}); continuing from it there would replace that run's "
     f"later checkpoints and mix two histories in its metrics: {AUTO_HERE}{ELSEWHERE.format(BEST)}"),
    ([BEST], {}, BEST, True,
     f"{BEST} is a checkpoint of the run in run ({BEST}); continuing from it there would replace that run's "
     f"later checkpoints and mix two histories in its metrics: {ELSEWHERE.format(BEST)}"),
    ([DCP, BEST], {DCP: GONE}, None, False,  # a fresh start there: not "--resume auto", which finds nothing
     f"run holds an earlier run ({DCP}, {BEST}; {DCP} names {GONE}, which is gone) with no last checkpoint to "
     f"continue: {ELSEWHERE.format(BEST)}, start elsewhere with another --checkpoint-dir, or replace it with "
     "--overwrite"),
], ids=["dangling-last-dcp", "dangling-last-dcp-and-best", "own-best", "own-best-no-last", "fresh-dangling"])
def test_the_advice_names_what_is_there_and_what_is_missing(checkpoints, dangling, resume, own, message):
    with pytest.raises(UserError) as err:
        R.earlier_run(resume=resume, continues=False, checkpoints=checkpoints, metrics=None, overwrite=False,
                      folder="run", dangling=dangling, own_checkpoint=own)
    assert str(err.value) == message


def test_an_earlier_run_over_the_whole_matrix():
    """Nothing is ever deleted without --overwrite or when the run continues; the
    metrics file is never deleted; a refusal names every file of the earlier run, and
    only advice that works: --overwrite only without --resume (the config refuses the
    two together), --resume auto only where a "last" checkpoint loads."""
    for resume, continues, checkpoints, metrics, overwrite, gone in itertools.product(
            [None, "auto", "x/last.pt", BEST], [False, True], [[], [CK], [CK, "run/best.dcp"], [DCP, BEST]],
            [None, METRICS], [False, True], [False, True]):
        dangling = {DCP: GONE} if gone and DCP in checkpoints else {}
        earlier = checkpoints + ([metrics] if metrics and resume is None else [])
        try:
            removed = R.earlier_run(resume=resume, continues=continues, checkpoints=checkpoints, metrics=metrics,
                                    overwrite=overwrite, folder="run", dangling=dangling,
                                    own_checkpoint=resume == BEST and BEST in checkpoints)
        except UserError as exc:
            said = str(exc)
            assert not continues and not overwrite and earlier
            assert all(path in said for path in earlier)
            if resume is not None:
                assert "--overwrite" not in said.replace("--overwrite and without --resume", "")
            loads_a_last = any(p.startswith("run/last") and p not in dangling for p in checkpoints)
            if not loads_a_last and (checkpoints or resume is not None):
                assert "with --resume auto" not in said
            if resume in (None, "auto"):
                assert all(f"{link} names {target}, which is gone" in said for link, target in dangling.items())
            continue
        assert continues or overwrite or not earlier
        assert METRICS not in removed
        assert removed == ([] if continues else checkpoints)
        assert not removed or overwrite


# ----------------------------------------------------------------- changed settings


def saved_config(**changes):
    return TrainConfig(task="cifar", **changes).as_dict()


RUN = {"processes": 2, "training images": 200}


@pytest.mark.parametrize("now,saved,saved_run,expected", [
    ({}, {}, RUN, []),
    ({"shard": True}, {}, RUN, []),  # how a step is computed: free
    ({"fused": "off", "workers": 3, "max_steps": 9, "checkpoint_dir": "elsewhere"}, {}, RUN, []),
    ({"batch_size": 8}, {}, RUN, [("batch_size", 128, 8)]),
    ({"lr": 0.1, "seed": 3}, {}, RUN, [("lr", 0.4, 0.1), ("seed", 0, 3)]),
    ({"shard": True, "precision": "bf16"}, {}, RUN, [("precision", "fp16", "bf16")]),
    ({}, {}, {"processes": 1, "training images": 200}, [("processes", 1, 2)]),
    ({}, {}, None, [("processes", 4, 2)]),  # an early checkpoint: its RNG states count its processes
])
def test_changed_settings_list_what_changes_the_run(now, saved, saved_run, expected):
    cfg = TrainConfig(task="cifar", **now)
    assert R.changed_settings(cfg, saved_config(**saved), saved_run, RUN, saved_processes=4) == expected


def test_every_free_setting_is_free_and_every_other_is_named():
    base = TrainConfig(task="cifar")
    for name, value in base.as_dict().items():
        other = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v * 2 + 1,
                 str: lambda v: v + "x"}.get(type(value), lambda v: "changed")(value)
        saved = {**base.as_dict(), name: other}
        changes = R.changed_settings(base, saved, RUN, RUN, saved_processes=2)
        assert changes == ([] if name in FREE_ON_RESUME else [(name, other, value)]), name
    assert "shard" in FREE_ON_RESUME and "fused" in FREE_ON_RESUME


def test_a_setting_the_checkpoint_does_not_record_is_not_compared():
    saved = {k: v for k, v in saved_config().items() if k != "label_smoothing"}
    assert R.changed_settings(TrainConfig(task="cifar", label_smoothing=0.1), saved, RUN, RUN, 2) == []
    assert R.changed_settings(TrainConfig(task="cifar"), "not a dict", RUN, RUN, 2) == []


def test_a_setting_added_since_the_checkpoint_is_compared_with_what_runs_did_before_it():
    """The previous release's checkpoints record no state_dtype (its runs kept every
    state in fp32): resuming one with --state-dtype bf16 is the same change as on a
    checkpoint that records fp32, refused alike."""
    import os

    path = os.path.join(os.path.dirname(__file__), "fixtures", "release-0.1", "file", "last.pt")
    saved = torch.load(path, weights_only=True)["config"]
    assert "state_dtype" not in saved and "state_rounding" not in saved
    assert {"state_dtype", "state_rounding"} <= set(BEFORE_THEY_EXISTED)
    bf16 = TrainConfig(task=saved["task"], state_dtype="bf16")
    assert [c for c in R.changed_settings(bf16, saved, None, RUN, saved_processes=1) if c[0] == "state_dtype"] == [
        ("state_dtype", "fp32", "bf16")]
    assert R.changed_settings(bf16, saved_config(), RUN, RUN, 2) == [("state_dtype", "fp32", "bf16")]


@pytest.mark.parametrize("allow", [False, True])
def test_changes_are_refused_or_warned_about(allow):
    assert R.judge_changes([], allow, "run/last.pt") is None
    changes = [("batch_size", 16, 8), ("lr", 0.4, 0.1)]
    if allow:
        assert R.judge_changes(changes, True, "run/last.pt") == (
            "resuming run/last.pt with changed settings (batch_size 16 -> 8, lr 0.4 -> 0.1): the run is no longer "
            "bit-identical to an uninterrupted one")
    else:
        with pytest.raises(UserError) as err:
            R.judge_changes(changes, False, "run/last.pt")
        assert str(err.value) == ("checkpoint run/last.pt was saved with other settings (batch_size 16 -> 8, "
                                  "lr 0.4 -> 0.1): resume with the same ones, or pass --allow-changed-config to "
                                  "continue anyway, no longer bit-identically")


# ----------------------------------------------------------------- the communication hook's state


STATE = {"iter": 3}


@pytest.mark.parametrize("has_state,saved,changed,expected", [
    (False, None, False, ("none", None)),  # one process, a sharded model or a hook without state
    (False, [STATE, STATE], True, ("none", None)),
    (True, [STATE, STATE], False, ("load", None)),
    (True, [STATE, STATE], True, ("load", None)),
    (True, None, False, "refused"),
    (True, [STATE], False, "refused"),  # saved by one process
    (True, [STATE, "x"], False, "refused"),
    (True, None, True, ("fresh", "run/last.pt: no powersgd state for 2 processes in the checkpoint; it starts afresh")),
    (True, [STATE], True, ("fresh", "run/last.pt: no powersgd state for 2 processes in the checkpoint; it starts "
                                    "afresh")),
])
def test_the_comm_state_decision(has_state, saved, changed, expected):
    call = dict(hook_has_state=has_state, saved=saved, world_size=2, changed=changed, strategy="powersgd",
                path="run/last.pt")
    if expected == "refused":
        with pytest.raises(CheckpointError, match="^checkpoint run/last.pt holds no powersgd state for 2 processes$"):
            R.comm_state(**call)
    else:
        assert R.comm_state(**call) == expected


def test_an_inexact_comm_state_is_refused_unless_allowed():
    assert R.judge_inexact_comm_state(None, False, "p") is None and R.judge_inexact_comm_state("", True, "p") is None
    with pytest.raises(CheckpointError, match="^checkpoint p cannot be resumed bit-identically: layout unknown; "):
        R.judge_inexact_comm_state("layout unknown", False, "p")
    assert R.judge_inexact_comm_state("layout unknown", True, "p") == (
        "resuming p: layout unknown; the run is no longer bit-identical to an uninterrupted one")


# ----------------------------------------------------------------- the position in the epoch, in samples


def trained_keys(size, world, batch, accum, start, steps, epoch=0, seed=0, last_step=()):
    """The samples ``steps`` full optimizer steps from ``start`` on take, then a shorter
    last step of the micro-batches ``last_step`` (per process), as the run's samplers and
    loaders deal them (:class:`mpfp16.train.data.StepBatches`): each rank's
    micro-batches of the step in turn."""
    from mpfp16.train.data import ResumableDistributedSampler, StepBatches

    sizes = [batch] * (steps * accum) + list(last_step)
    shares = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(range(size), world, rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch, start)
        shares.append([[index for _, index in micro] for micro in StepBatches(sampler, sizes)])
    assert all(len(share) == len(sizes) for share in shares)  # every micro-batch filled on every rank
    step_ends = list(range(0, steps * accum + 1, accum)) + ([len(sizes)] if last_step else [])
    return [i for first, end in zip(step_ends, step_ends[1:]) for share in shares
            for micro in share[first:end] for i in micro]


def rest_of(position, size, layout) -> R.EpochRest:
    world, batch, accum = layout
    return R.epoch_rest(position, dataset_size=size, world_size=world, batch_size=batch, accum_steps=accum)


LAYOUTS = [(1, 16, 1), (2, 8, 1), (2, 6, 1), (1, 12, 1), (2, 4, 2), (3, 5, 1), (4, 3, 2), (1, 32, 1), (2, 2, 3)]


@pytest.mark.parametrize("size", [200, 203])
def test_the_position_is_global_for_any_change_of_processes_batch_and_accumulation(size):
    """Over every pair of (processes, -b, --accum-steps), both ways: an epoch begun on
    one and resumed on the other trains each of its samples at most once, takes them
    in the one order of the epoch (the same for every world size), and trains what an
    uninterrupted epoch of the resumed run's shape trains: up to the order's sample
    ``size - size % S`` (S samples a step), with a shorter last step where its full
    steps stop before that. Left out beyond it, and counted, only what cannot be split:
    fewer than one sample per process, and, with -b above 1, one per process where a
    micro-batch of one sample would be left. The same shape again never needs a shorter
    step."""
    from mpfp16.train.data import ResumableDistributedSampler

    order = ResumableDistributedSampler(range(size), 1, 0, shuffle=True, seed=0).order()
    shorter = 0
    for (w1, b1, a1), (w2, b2, a2) in itertools.product(LAYOUTS, repeat=2):
        first = rest_of(0, size, (w1, b1, a1))
        assert not first.last_step and first.untrained == first.tail == size % (w1 * b1 * a1)
        for steps in (1, first.full_steps // 2, first.full_steps - 1):
            before = trained_keys(size, w1, b1, a1, 0, steps)
            saved = {"batches_done": steps * a1, "config": {"batch_size": b1}, "run": {"processes": w1}}
            position = R.samples_done(saved, batch_size=b2)  # a checkpoint that recorded only its own batches
            assert position == len(before) == steps * b1 * a1 * w1
            assert R.samples_done({**saved, "samples_done": position}, batch_size=b2) == position
            rest = rest_of(position, size, (w2, b2, a2))
            after = trained_keys(size, w2, b2, a2, position, rest.full_steps, last_step=rest.last_step)
            trained = before + after
            case = ((w1, b1, a1), (w2, b2, a2), steps)
            assert len(set(trained)) == len(trained), case  # none twice
            assert sorted(trained) == sorted(order[:len(trained)]), case  # none skipped: the order's first samples
            uninterrupted = size - size % (w2 * b2 * a2)  # where an uninterrupted epoch of the new shape ends
            assert len(trained) == size - rest.untrained >= uninterrupted - rest.uneven - rest.single, case
            if rest.last_step or rest.uneven or rest.single:  # it stops there, less only what cannot be split
                assert len(trained) == uninterrupted - rest.uneven - rest.single, case
            else:  # full steps to the end, or past it (taken in smaller ones, whose end is later)
                assert rest.untrained <= rest.tail, case
            assert rest.uneven < w2 and rest.single in ((0, w2) if b2 > 1 else (0,)), case
            assert rest.steps == R.steps_left_in_epoch(position, dataset_size=size, world_size=w2, batch_size=b2,
                                                       accum_steps=a2)
            assert len(rest.last_step) <= a2 and all(min(2, b2) <= n <= b2 for n in rest.last_step), case
            assert max(rest.last_step, default=0) - min(rest.last_step, default=0) <= 1  # as even as possible
            if (w1, b1, a1) == (w2, b2, a2):
                assert not rest.last_step and rest.untrained == rest.tail
            assert rest_of(len(trained), size, (w2, b2, a2)).steps == 0, case  # the epoch is over
            shorter += bool(rest.last_step)
    assert shorter > 30  # the matrix holds shorter last steps, not only whole ones


def test_a_resume_on_two_processes_trains_the_rest_of_the_epoch():
    """1 process x -b 16 stops at sample 48 of 128; 2 processes x -b 16 take 2 full steps
    (64 samples) and a shorter last one of 16 (8 per process): the epoch's 128, as an
    uninterrupted epoch of 2 processes trains. It ended after 64, and 16 were never
    trained."""
    assert R.steps_left_in_epoch(48, dataset_size=128, world_size=2, batch_size=16, accum_steps=1) == 3
    rest = rest_of(48, 128, (2, 16, 1))
    assert rest == R.EpochRest(full_steps=2, last_step=(8,), untrained=0, tail=0, uneven=0, single=0)
    after = trained_keys(128, 2, 16, 1, 48, rest.full_steps, last_step=rest.last_step)
    assert sorted(trained_keys(128, 1, 16, 1, 0, 3) + after) == list(range(128))
    assert R.describe_rest(rest, epoch=0, samples_done=48, dataset_size=128, world_size=2) == (
        "info", "epoch 1 resumed at sample 48 of 128: 2 full steps, then a shorter last step of 16 samples (8 per "
                "process, in one micro-batch) up to sample 128, where an uninterrupted epoch of this shape ends")


@pytest.mark.parametrize("position,size,layout,expected,line", [
    (0, 203, (2, 8, 1), R.EpochRest(12, (), 11, 11, 0, 0), None),  # uninterrupted: its tail, said nowhere
    (96, 203, (2, 8, 1), R.EpochRest(6, (), 11, 11, 0, 0), None),  # resumed with the same shape
    (36, 200, (2, 4, 2), R.EpochRest(10, (), 4, 8, 0, 0), None),  # went past where the new shape ends: fewer left
    (36, 200, (2, 4, 3), R.EpochRest(6, (3, 3), 8, 8, 0, 0),
     ("info", "epoch 1 resumed at sample 36 of 200: 6 full steps, then a shorter last step of 12 samples (6 per "
              "process, in micro-batches of 3, 3) up to sample 192, where an uninterrupted epoch of this shape ends")),
    (45, 128, (4, 16, 1), R.EpochRest(1, (4,), 3, 0, 3, 0),
     ("warning", "epoch 1 resumed at sample 45 of 128: 1 full step, then a shorter last step of 16 samples (4 per "
                 "process, in one micro-batch) up to sample 125; 3 samples of its order are not trained in this "
                 "epoch, 3 more than an uninterrupted epoch of this shape leaves (it ends at sample 128): 3 that do "
                 "not split evenly across 4 processes")),
    (10, 128, (2, 2, 1), R.EpochRest(29, (), 2, 0, 0, 2),
     ("warning", "epoch 1 resumed at sample 10 of 128: 2 samples of its order are not trained in this epoch, 2 more "
                 "than an uninterrupted epoch of this shape leaves (it ends at sample 128): 2 that would make "
                 "micro-batches of one sample")),
    (10, 128, (2, 1, 2), R.EpochRest(29, (1,), 0, 0, 0, 0),  # -b 1: every micro-batch is of one sample
     ("info", "epoch 1 resumed at sample 10 of 128: 29 full steps, then a shorter last step of 2 samples (1 per "
              "process, in one micro-batch) up to sample 128, where an uninterrupted epoch of this shape ends")),
    (0, 10, (1, 16, 1), R.EpochRest(0, (), 10, 10, 0, 0), None),  # no full step at all (build.schedule refuses it)
], ids=["uninterrupted", "same-shape", "past-the-end", "shorter-accumulated", "uneven", "single", "batch-of-one",
        "no-step"])
def test_how_an_epoch_ends_and_what_is_said(position, size, layout, expected, line):
    rest = rest_of(position, size, layout)
    assert rest == expected
    assert R.describe_rest(rest, epoch=0, samples_done=position, dataset_size=size, world_size=layout[0]) == line


def test_the_shorter_last_step_is_the_mean_over_its_samples():
    """The engine's step over micro-batches of 3 and 2 samples (the shorter last step of
    a resumed epoch): each one's loss weighted by its share, so that the update is the
    one of the mean loss over the 5 samples, as a full step's is over its own."""
    import torch
    import torch.nn as nn

    from mpfp16.flat_buffers import flatten_parameters
    from mpfp16.optimizer import FP16Optimizer
    from mpfp16.train.engine import Trainer
    from mpfp16.train.state import TrainState

    torch.manual_seed(0)
    images, labels = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    reference = nn.Linear(4, 3)
    trainer = Trainer.__new__(Trainer)  # the step alone: a model, its optimizer and schedule, no run around them
    trainer.cfg, trainer.device = TrainConfig(task="cifar", accum_steps=4), torch.device("cpu")
    trainer.state = TrainState()
    trainer.model = trainer.ddp = flatten_parameters(nn.Linear(4, 3))
    trainer.model.load_state_dict(reference.state_dict())
    trainer.opt = FP16Optimizer(torch.optim.SGD(trainer.model.parameters(), lr=1.0), loss_scale=None,
                                model=trainer.model)
    trainer.sched = torch.optim.lr_scheduler.LambdaLR(trainer.opt, lambda step: 1.0)
    trainer._prepare = lambda x: x
    batches = iter([(images[:3], labels[:3]), (images[3:], labels[3:])])
    loss = trainer.train_step(batches, (3, 2))
    expected = nn.functional.cross_entropy(reference(images), labels)
    expected.backward()
    assert torch.allclose(loss, expected.detach(), rtol=1e-6)
    for p, q in zip(trainer.model.parameters(), reference.parameters()):
        assert torch.allclose(p.detach(), q.detach() - q.grad, rtol=1e-5, atol=1e-7)


def test_the_checkpoints_take_the_runs_parts_and_state_and_return_the_state_they_load(tmp_path):
    """RunCheckpoints is given the run's parts and a TrainState, and its resume returns
    the TrainState it loaded, the parts loaded through their own load_state_dict: no
    trainer to write into. With --allow-changed-config a new lr reaches the scheduler
    through its load_state_dict, as the schedule of a run started with it has it at
    that step (the base rate, the last rate, each group's rate, and the next step's)."""
    import dataclasses

    import torch
    import torch.nn as nn

    from mpfp16 import distributed as mdist
    from mpfp16.convert import to_half
    from mpfp16.train import build
    from mpfp16.train.checkpointing import RunCheckpoints
    from mpfp16.train.state import TrainState

    info = mdist.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)

    def checkpoints(cfg, seed, steps=0):  # a tiny model, its optimizer and schedule as the scripts build them
        torch.manual_seed(seed)
        model = to_half(nn.Linear(4, 3))
        opt = build.optimizer(cfg, model, world_size=1)
        sched = build.schedule(cfg, opt, train_samples=64).scheduler
        for _ in range(steps):
            opt.zero_grad()
            opt.backward(model(torch.randn(2, 4, dtype=torch.float16)).float().sum())
            opt.step()
            sched.step()
        return RunCheckpoints(cfg, info, model, model, opt, sched, run_facts={"processes": 1, "training images": 64},
                              training_images=64)

    cfg = TrainConfig(task="cifar", batch_size=16, epochs=2, checkpoint_dir=str(tmp_path))
    assert checkpoints(dataclasses.replace(cfg, resume="auto"), 0).resume() == TrainState()  # nothing to resume
    saving = checkpoints(cfg, 0, steps=3)
    saving.save(TrainState(step=3, epoch=0, samples_done=48, best_acc1=12.5, best_epoch=1, elapsed_before=1.0),
                elapsed=2.5)
    expected = TrainState(step=3, epoch=0, samples_done=48, best_acc1=12.5, best_epoch=1, elapsed_before=2.5)
    same = checkpoints(dataclasses.replace(cfg, resume="auto"), seed=1)
    assert same.resume() == expected
    assert same.sched.state_dict() == saving.sched.state_dict()
    torch.testing.assert_close(same.model.state_dict(), saving.model.state_dict(), rtol=0, atol=0)

    faster = dataclasses.replace(cfg, resume="auto", lr=2 * cfg.lr, allow_changed_config=True)
    changed, reference = checkpoints(faster, seed=1), checkpoints(faster, seed=0, steps=3)
    assert changed.resume() == expected
    assert changed.sched.state_dict() == reference.sched.state_dict()
    assert changed.sched.base_lrs == [2 * cfg.lr] and changed.sched.get_last_lr() == reference.sched.get_last_lr()
    assert [g["lr"] for g in changed.opt.param_groups] == [g["lr"] for g in reference.opt.param_groups]
    changed.sched.step()
    reference.sched.step()
    assert [g["lr"] for g in changed.opt.param_groups] == [g["lr"] for g in reference.opt.param_groups]


def test_the_position_of_an_early_checkpoint_counts_its_processes_by_its_rng_states():
    assert R.samples_done({"batches_done": 3, "config": {"batch_size": 8}, "rng": [{}, {}]}, batch_size=16) == 48
    assert R.samples_done({"batches_done": 3, "rng": [{}]}, batch_size=16) == 48  # no config: -b now
    assert R.samples_done({"batches_done": 0, "samples_done": 0, "run": {"processes": 4}}, batch_size=16) == 0


def test_the_epoch_order_is_one_permutation_sharded_across_ranks():
    """With no start, each rank's share is DistributedSampler's (drop_last); the ranks'
    i-th samples are the order's i-th group of world samples, for any world size."""
    from torch.utils.data import DistributedSampler

    from mpfp16.train.data import ResumableDistributedSampler

    for size, world, epoch in itertools.product([200, 203, 7], [1, 2, 3, 4], [0, 5]):
        order = ResumableDistributedSampler(range(size), 1, 0, seed=3).order()
        for rank in range(world):
            ours = ResumableDistributedSampler(range(size), world, rank, seed=3)
            ours.set_epoch(epoch)
            theirs = DistributedSampler(range(size), num_replicas=world, rank=rank, seed=3, drop_last=True)
            theirs.set_epoch(epoch)
            assert [i for _, i in ours] == list(theirs) and len(ours) == len(theirs)
            if epoch == 0:
                assert [i for _, i in ours] == order[rank: size // world * world: world]
