"""The replica-check benchmark runs and reports what it promises (no timing is asserted)."""

import json

from mpfp16.bench import replicas as bench


def test_replica_benchmark_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "replicas.json"
    assert bench.main(["--model", "squeezenet1_1", "--rounds", "1", "--warmup", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["method"] for r in result["rows"]] == [
        "a. optimizer step", "b. mpfp16 checksums (local)", "c. Megatron-style SHA-256"]
    assert all(r["median_ms"] > 0 for r in result["rows"])
    ours = result["rows"][1]
    assert ours["bytes"] == result["bytes"] > result["rows"][2]["bytes"]  # masters and momentum too
    assert 0 < ours["share_at_interval"] < 1
    assert "share at 100" in printed
