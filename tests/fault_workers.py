"""Code that runs inside the fault-injection tests (tests/test_faults.py): spawned
training processes whose data or whose peer misbehaves on purpose."""

from __future__ import annotations

import contextlib
import io
import os
import time

import torch

from mpfp16.train import cli, engine


def poison(from_step: int, until_step: int | None = None, ranks=(0, 1)):
    """Make Trainer._prepare return NaN images on the given ranks for optimizer steps
    from_step..until_step (1-based), as a corrupt batch would."""
    original = engine.Trainer._prepare

    def prepare(self, images):
        out = original(self, images)
        step = self.step + 1
        if self.info.rank in ranks and step >= from_step and (until_step is None or step <= until_step):
            out = out.clone()
            out[0, 0, 0, 0] = float("nan")
        return out

    engine.Trainer._prepare = prepare


def run_cli(argv) -> dict:
    """cli.run, with what it printed to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.run("cifar", argv)
    return {"status": status, "stderr": err.getvalue()}


def nan_batch_on_one_rank(rank, argv):
    poison(3, 3, ranks=(1,))
    parser = cli.build_parser("cifar")
    cfg = cli.config_from_args("cifar", parser.parse_args(argv), parser)
    summary = engine.train(cfg)
    return {"skipped": summary["skipped_steps"], "step": summary["step"]}


def nan_forever(rank, argv, from_step):
    poison(from_step)
    return run_cli(argv)


def peer_dies(rank, argv, mode):
    """Rank 1 exits (or hangs) at its third optimizer step."""
    if rank == 1:
        original = engine.Trainer.train_step

        def train_step(self, batches):
            if self.step == 2:
                if mode == "exit":
                    os._exit(3)
                time.sleep(3600)
            return original(self, batches)

        engine.Trainer.train_step = train_step
    started = time.monotonic()
    result = run_cli(argv)
    result["elapsed"] = time.monotonic() - started
    return result


def write_checkpoints_forever(path: str, numel: int) -> None:
    """Save ever newer checkpoints to `path`, printing each one's number once it is on disk."""
    from mpfp16.checkpoint.file import save_atomic

    for i in range(1, 1_000_000):
        save_atomic({"i": i, "payload": torch.full((numel,), float(i))}, path)
        print(i, flush=True)


if __name__ == "__main__":
    import sys

    write_checkpoints_forever(sys.argv[1], int(sys.argv[2]))
