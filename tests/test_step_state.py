"""The step's state (mpfp16/step_state.py): every call in every phase, one table.

Each row starts from a phase reached the way users reach it, makes one call, and says
what must happen: the phase it leaves the step in, or the one-line error it raises;
then, where the call was allowed but spoils the step, what the next ``step()`` says."""

import pytest
import torch

import mpfp16
from mpfp16.step_state import Phase
from reference import batches, tiny_mlp

READY, ACCUMULATING, UNSCALED, STEPPED = Phase.READY, Phase.ACCUMULATING, Phase.UNSCALED, Phase.STEPPED
NO_BACKWARD = r"^step\(\) was called but no backward pass reached the parameters since the last step\(\)"
OUTSIDE = r"^gradients were computed outside opt\.backward\(\) while the loss scale is 128"
AFTER_UNSCALE = r"^a backward pass ran after unscale_\(\) in this step"

# phase, call -> (the phase after it, or an error; then the next step()'s error, or None when it steps)
TABLE = {
    (READY, "backward"): (ACCUMULATING, None),
    (READY, "loss.backward"): (ACCUMULATING, OUTSIDE),
    (READY, "unscale_"): (NO_BACKWARD, None),
    (READY, "step"): (NO_BACKWARD, None),
    (READY, "zero_grad"): (READY, NO_BACKWARD),
    (ACCUMULATING, "backward"): (ACCUMULATING, None),
    (ACCUMULATING, "loss.backward"): (ACCUMULATING, OUTSIDE),
    (ACCUMULATING, "unscale_"): (UNSCALED, None),
    (ACCUMULATING, "step"): (STEPPED, NO_BACKWARD),
    (ACCUMULATING, "zero_grad"): (READY, NO_BACKWARD),
    (UNSCALED, "backward"): (UNSCALED, AFTER_UNSCALE),
    (UNSCALED, "loss.backward"): (UNSCALED, AFTER_UNSCALE),
    (UNSCALED, "unscale_"): (UNSCALED, None),
    (UNSCALED, "step"): (STEPPED, NO_BACKWARD),
    (UNSCALED, "zero_grad"): (READY, NO_BACKWARD),
    (STEPPED, "backward"): (ACCUMULATING, None),
    (STEPPED, "loss.backward"): (ACCUMULATING, OUTSIDE),
    (STEPPED, "unscale_"): (NO_BACKWARD, None),
    (STEPPED, "step"): (NO_BACKWARD, None),
    (STEPPED, "zero_grad"): (READY, NO_BACKWARD),
}


def _loss(model):
    x, y = batches(1)[0]
    return torch.nn.functional.cross_entropy(model(x), y)


def _in_phase(phase):
    model = mpfp16.to_half(tiny_mlp(0))
    opt = mpfp16.FP16Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=128.0)
    opt.zero_grad()
    if phase is not READY:
        opt.backward(_loss(model))
    if phase is UNSCALED:
        opt.unscale_()
    if phase is STEPPED:
        assert opt.step()
    assert opt._guard.state.phase is phase
    return model, opt


def _call(model, opt, call):
    if call == "backward":
        opt.backward(_loss(model))
    elif call == "loss.backward":  # what torch.amp users write: no scale, and no guard on the way
        _loss(model).backward()
    else:
        getattr(opt, call)()


def test_the_table_covers_every_phase_and_call():
    calls = {call for _, call in TABLE}
    assert set(TABLE) == {(phase, call) for phase in Phase for call in calls}


@pytest.mark.parametrize("phase,call", list(TABLE), ids=[f"{p.value}-{c}" for p, c in TABLE])
def test_every_call_in_every_phase(phase, call):
    after, next_step = TABLE[(phase, call)]
    model, opt = _in_phase(phase)
    if isinstance(after, str):  # refused in one line, and nothing moved
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=after) as info:
            _call(model, opt, call)
        assert "\n" not in str(info.value)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return
    _call(model, opt, call)
    assert opt._guard.state.phase is after
    if next_step is None:
        assert opt.step() and opt._guard.state.phase is STEPPED
        return
    with pytest.raises(RuntimeError, match=next_step) as info:
        opt.step()
    assert "\n" not in str(info.value)


def test_the_public_phases_refuse_a_wrong_order():
    model, opt = _in_phase(ACCUMULATING)
    with pytest.raises(RuntimeError, match=r"^step_with_ready_grads\(\) needs prepare_grads\(\) first"):
        opt.step_with_ready_grads()
    assert opt.prepare_grads() is True
    with pytest.raises(RuntimeError, match=r"^skip_step\(\) needs prepare_grads\(\) first, and non-finite"):
        opt.skip_step()
    opt.step_with_ready_grads()
    assert opt._guard.state.phase is STEPPED and opt.iteration == 1
