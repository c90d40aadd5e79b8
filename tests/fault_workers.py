"""Code that runs inside the fault-injection tests (tests/test_faults.py): worker
training processes whose data or whose peer misbehaves on purpose."""

from __future__ import annotations

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
    """train_cifar's command line, with what it printed (dist_helpers.run_captured)."""
    from dist_helpers import run_captured

    return run_captured("train_cifar", argv)


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


def main(argv) -> int:
    """``fault_workers.py PATH NUMEL``: :func:`write_checkpoints_forever` (run as a child
    by tests/test_faults.py)."""
    write_checkpoints_forever(argv[0], int(argv[1]))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))


def recording_getitem(log_path: str):
    """``InMemoryImages.__getitem__`` that also appends the (epoch, index) key of every
    training sample it loads to ``log_path``, one "epoch index" line each (the training
    set is the one with a transform; with -j 0 what is loaded is what is trained)."""
    from mpfp16.train import data

    original = data.InMemoryImages.__getitem__

    def getitem(self, key):
        if self.transform is not None:
            with open(log_path, "a") as f:
                f.write(f"{key[0]} {key[1]}\n")
        return original(self, key)

    return getitem


def script_recording_samples(rank, argv, log_dir):
    """train_cifar's command line on this rank, each training sample it loads written
    to ``log_dir/rank{rank}.txt`` (:func:`recording_getitem`)."""
    from mpfp16.train import data

    data.InMemoryImages.__getitem__ = recording_getitem(os.path.join(log_dir, f"rank{rank}.txt"))
    return run_cli(argv)
