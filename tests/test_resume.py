"""The resume decisions (mpfp16/train/resume.py) over their whole matrix, without
training: which checkpoint --resume auto takes, what an earlier run in the folder
means for a fresh start, which changed settings are refused or warned about, and what
happens to a communication hook's state."""

import itertools

import pytest

from mpfp16.errors import CheckpointError, UserError
from mpfp16.train import resume as R
from mpfp16.train.config import FREE_ON_RESUME, TrainConfig

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


@pytest.mark.parametrize("resume,continues,checkpoints,metrics,overwrite,outcome", [
    (None, False, [], None, False, []),  # an empty folder
    (None, False, [CK], None, False, "refused"),  # a forgotten --resume auto
    (None, False, [], METRICS, False, "refused"),  # only the metrics of a run that never saved
    (None, False, [CK], METRICS, True, [CK]),  # --overwrite: the checkpoints go, the metrics are truncated
    ("auto", True, [CK], METRICS, False, []),  # continues its folder
    ("auto", False, ["run/best.pt"], None, False, "refused"),  # no last to continue, a best to lose
    ("auto", False, [], METRICS, False, []),  # the metrics are appended to
    ("other/last.pt", False, [CK], None, False, "refused"),  # another run's checkpoint into this run's folder
    ("other/last.pt", False, [], METRICS, False, []),
    ("run/last.pt", True, [CK], METRICS, False, []),  # --resume naming this folder's own last
])
def test_what_an_earlier_run_means(resume, continues, checkpoints, metrics, overwrite, outcome):
    call = dict(resume=resume, continues=continues, checkpoints=checkpoints, metrics=metrics, overwrite=overwrite,
                folder="run")
    if outcome == "refused":
        with pytest.raises(UserError) as err:
            R.earlier_run(**call)
        listed = checkpoints + ([metrics] if metrics and resume is None else [])
        assert str(err.value) == (f"run holds an earlier run ({', '.join(listed)}): continue it with --resume auto, "
                                  "start elsewhere with another --checkpoint-dir, or replace it with --overwrite")
    else:
        assert R.earlier_run(**call) == outcome


def test_an_earlier_run_over_the_whole_matrix():
    """Nothing is ever deleted without --overwrite or when the run continues; the
    metrics file is never deleted; a refusal names every file of the earlier run."""
    for resume, continues, checkpoints, metrics, overwrite in itertools.product(
            [None, "auto", "x/last.pt"], [False, True], [[], [CK], [CK, "run/best.dcp"]], [None, METRICS],
            [False, True]):
        earlier = checkpoints + ([metrics] if metrics and resume is None else [])
        try:
            removed = R.earlier_run(resume=resume, continues=continues, checkpoints=checkpoints, metrics=metrics,
                                    overwrite=overwrite, folder="run")
        except UserError as exc:
            assert not continues and not overwrite and earlier
            assert all(path in str(exc) for path in earlier)
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


@pytest.mark.parametrize("done,saved_b,b,accum,expected", [
    (6, 16, 16, 1, 6), (6, 16, 8, 1, 12), (3, 16, 8, 1, 6), (5, 8, 16, 1, 2), (6, 16, 8, 2, 12), (7, 16, 8, 4, 12),
    (0, 16, 8, 1, 0),
])
def test_the_position_is_kept_in_samples_when_the_batch_changes(done, saved_b, b, accum, expected):
    assert R.batches_done_after_change(done, saved_b, b, accum) == expected
    assert expected * b <= done * saved_b and expected % accum == 0  # never a sample skipped


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
