"""One conformance suite for the parameter stores (mpfp16/stores/): every store runs the
same phases against plain fp32 torch (tests/conformance_workers.py: the phases, the
reference, the factories).

The phases: clean steps (the scale growing); a step whose 16-bit gradients overflow
(skipped: nothing moves, the scale backs off); ``unscale_()`` then torch's
``clip_grad_norm_(opt.master_params(), c)``; ``max_grad_norm=``; two backward calls per
step; ``state_dict()`` into a fresh optimizer, which goes on bit for bit as the one not
reloaded; a layer frozen mid-run. After every step the masters, the inner state, the
16-bit weights, the scale and the skips are compared with the reference's.

Adding a store is adding an entry to STORES: its factory (``factory(kind, seed,
**options)`` returns a conformance_workers.Built; a module-level function of
conformance_workers, or a partial of one, so that a worker process can be handed it), the
inner optimizers it takes (names of reference.make_inner), and what it must be (the
``spec``: ``store.kind``, ``fused``, how far its update may be from torch's, whose order its
gradient norm sums in; conformance_workers.TOLERANCES and NORM_RTOL). A store that needs
ranks runs all its cases in one worker group of that many ranks, launched once for the file.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import conformance_workers as W
from dist_helpers import Group


@dataclasses.dataclass(frozen=True)
class Store:
    name: str
    factory: object
    optimizers: tuple[str, ...]
    spec: dict
    ranks: int = 1


BF16 = dict(states=torch.bfloat16)  # every state kept in bf16, rounded to nearest
FUSED = dict(refuses=("amsgrad",))  # the fused kernels have no amsgrad: fused=True refuses it in one line

STORES = [
    Store("flat", functools.partial(W.flat, fused=False), ("sgd", "adamw"),
          dict(store="flat", fused=False, update="exact", norm="torch")),
    Store("flat-fused-inductor", functools.partial(W.flat, fused=True), ("sgd",),
          dict(store="flat", fused=True, update="exact", norm="own", **FUSED)),
    # AdamW's fused step on a CPU with AVX2 or AVX-512 runs mpfp16/stores/native.cpp
    # (inductor's kernels elsewhere, with the same correctly rounded sqrt).
    Store("flat-fused-native", functools.partial(W.flat, fused=True), ("adamw",),
          dict(store="flat", fused=True, update="sqrt", norm="own", **FUSED)),
    Store("per-tensor", W.per_tensor, ("sgd", "adamw"),
          dict(store="per-tensor", fused=False, update="exact", norm="torch")),
    Store("flat-bf16-states", functools.partial(W.flat_bf16_states, fused=False), ("sgd", "adamw"),
          dict(store="flat", fused=False, update="exact", norm="torch", **BF16)),
    Store("flat-fused-inductor-bf16-states", functools.partial(W.flat_bf16_states, fused=True), ("sgd",),
          dict(store="flat", fused=True, update="exact", norm="own", **BF16, **FUSED)),
    Store("flat-fused-native-bf16-states", functools.partial(W.flat_bf16_states, fused=True), ("adamw",),
          dict(store="flat", fused=True, update="sqrt", norm="own", **BF16, **FUSED)),
    Store("per-tensor-bf16-states", W.per_tensor_bf16_states, ("sgd", "adamw"),
          dict(store="per-tensor", fused=False, update="exact", norm="torch", **BF16)),
    Store("sharded", W.sharded, ("sgd", "adamw"),
          dict(store="sharded", fused=False, update="exact", norm="own"), ranks=2),
]

CASES = [pytest.param(store, kind, phase, id=f"{store.name}-{kind}-{phase}",
                      marks=[pytest.mark.slow] if store.ranks > 1 else [])
         for store in STORES for kind in store.optimizers for phase in W.PHASES
         if phase != "amsgrad" or kind != "sgd"]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """The results of the stores that need ranks: one worker group per store, launched
    when a test first asks for it, all of its cases in one process group
    (conformance_workers.distributed_case); per rank, ``{(kind, phase): failures}``."""
    launched = {}

    def results(store: Store) -> list[dict]:
        if store.name not in launched:
            group = Group(world_size=store.ranks, timeout=300)
            group.add(store.name, W.distributed_case, store.factory, store.optimizers, store.spec)
            launched[store.name] = group.run(tmp_path_factory.mktemp(store.name))(store.name)
        return launched[store.name]

    return results


@pytest.mark.parametrize("store,kind,phase", CASES)
def test_the_store_steps_as_plain_fp32_torch(store, kind, phase, request):
    if store.ranks == 1:
        failures = W.run_phase(store.factory, kind, phase, store.spec)
    else:
        per_rank = [r[kind, phase] for r in request.getfixturevalue("groups")(store)]
        assert all(r == per_rank[0] for r in per_rank), per_rank
        failures = per_rank[0]
    assert not failures, "\n".join(failures[:20])
