"""python -m mpfp16.bench.sharding: its command line, and the error line it reports."""

import json

import pytest

from dist_helpers import check, python
from mpfp16.bench import sharding as sharding_bench
from mpfp16.errors import last_error_line


@pytest.mark.slow
def test_memory_table_for_one_rank(tmp_path):
    out = tmp_path / "rows.json"
    proc = python(["-m", "mpfp16.bench.sharding", "memory", "--ranks", "1", "--model", "resnet9-w16",
                   "--optimizers", "sgd", "--image-size", "32", "--json", str(out)], merge=False)
    check(proc)
    rows = json.loads(out.read_text())
    assert {r["path"] for r in rows} == {"ddp (unfused)", "ddp (fused)", "sharded"}
    sharded = next(r for r in rows if r["path"] == "sharded")
    assert sharded["total"] == pytest.approx(12, rel=0.02)  # one rank: 4 + 4 + 4, no 16-bit copy kept
    assert "| 1 | sgd | sharded |" in proc.stdout


@pytest.mark.parametrize("argv,message", [
    (["memory", "--ranks", "x"], "expected comma-separated integers"),
    (["memory", "--optimizers", "lamb"], "optimizers are sgd and adam"),
    (["trajectory", "--json", "/nonexistent/dir/out.json"], "its folder does not exist"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    """Refused before anything runs: the command's main() in this process (its own
    command line, as a user types it: test_memory_table_for_one_rank)."""
    try:
        status = sharding_bench.main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and message in err.strip().splitlines()[-1]
    assert "Traceback" not in err


def test_error_line_of_a_torchrun_worker():
    output = "[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: bad batch\nE1130 failed\n====\n"
    assert last_error_line(output) == "ValueError: bad batch"
