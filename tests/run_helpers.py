"""How the script tests run a script in-process, and what they read back from a run: its
metrics records and its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time

import torch


class Result(tuple):
    """(exit status, stderr), with .out for stdout."""


def run_main(main, argv, capsys) -> Result:
    """Run a script's main() in-process; return (exit status, stderr) with .out."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code
    captured = capsys.readouterr()
    result = Result((status, captured.err))
    result.out = captured.out
    return result


def records(path) -> list[dict]:
    """The metrics file's records."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def checkpoint_tensors(path) -> tuple[dict, dict]:
    """(the checkpoint, every tensor that decides how training goes on: the model's,
    the masters and the optimizer state)."""
    ckpt = torch.load(path, weights_only=True)
    tensors = {f"model.{k}": v for k, v in ckpt["model"].items()}
    for key, entry in ckpt["optimizer"]["params"].items():
        if entry["master"] is not None:
            tensors[f"master.{key}"] = entry["master"]
    for i, state in ckpt["optimizer"]["optimizer"]["state"].items():
        for k, v in state.items():
            tensors[f"state.{i}.{k}"] = v
    return ckpt, tensors


def assert_same_final_state(a_path, b_path) -> None:
    """Two checkpoints at the same step with bit-identical tensors."""
    (a_ckpt, a), (b_ckpt, b) = checkpoint_tensors(a_path), checkpoint_tensors(b_path)
    assert a_ckpt["step"] == b_ckpt["step"] and a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def sharded_checkpoint_tensors(path, tmp_dir) -> tuple[dict, dict]:
    """What :func:`checkpoint_tensors` gives for a sharded checkpoint (a DCP folder),
    its DTensors gathered whole (torch's dcp_to_torch_save), keyed by name."""
    import os

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(str(tmp_dir), f"whole-{abs(hash(str(path)))}.pt")
    dcp_to_torch_save(str(path), out)
    whole = torch.load(out, weights_only=True)
    meta = torch.load(os.path.join(str(path), "meta.pt"), weights_only=True)["state"]
    tensors = {f"whole.{k}": v for k, v in whole.items()}
    buffers = {k: v for k, v in meta["model"].items() if torch.is_tensor(v)}
    tensors.update({f"model.{k}": v for k, v in buffers.items()})
    for name, state in meta["optimizer"]["optimizer"]["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"state.{name}.{k}"] = v
    return meta, tensors


def assert_same_sharded_state(a_path, b_path, tmp_dir) -> None:
    (a_meta, a), (b_meta, b) = (sharded_checkpoint_tensors(p, tmp_dir) for p in (a_path, b_path))
    assert a_meta["step"] == b_meta["step"] and a.keys() == b.keys()
    assert any(k.startswith("whole.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def children(pid) -> list[int]:
    """PIDs whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def kill_a_worker_once_saved(proc, checkpoint, timeout: float = 120) -> str:
    """Wait until a torchrun run (``proc``, 2 workers, output piped) has written
    ``checkpoint``, SIGKILL its second worker, and return the run's output once it
    ended, successfully: torchrun's restart must have resumed it."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(checkpoint):
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint appeared"
        time.sleep(0.02)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out  # the group restarted and resumed from the checkpoint
    return out


def poison_step(monkeypatch, step: int = 1) -> None:
    """Make the training scripts' step ``step`` (0-based) see one NaN image in its
    batch, so that its gradients overflow and the step is skipped."""
    from mpfp16.train import engine

    prepare = engine.Trainer._prepare

    def poisoned(self, images):
        images = prepare(self, images)
        if self.model.training and self.step == step:
            images = images.clone()
            images[0] = float("nan")
        return images

    monkeypatch.setattr(engine.Trainer, "_prepare", poisoned)
