"""The step benchmark runs and reports what it promises (no timing is asserted)."""

import json

from mpfp16.bench import step as bench


def test_step_benchmark_runs(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert bench.main(["--model", "squeezenet1_1", "--rounds", "1", "--warmup", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    methods = [r["method"] for r in result["rows"]]
    assert len(methods) == 7 and methods[0].startswith("a. torch fp32 SGD foreach")
    assert methods[6] == "g. mpfp16 fused, unscale_()"
    assert result["rows"][0]["ratio"] == 1.0 and all(r["median_ms"] > 0 for r in result["rows"])
    memory = result["memory_bytes_per_param"]
    assert memory["fp16, no masters (fused)"]["total"] < memory["fp16 + fp32 masters (fused)"]["total"] \
        < memory["fp16 + fp32 masters (unfused)"]["total"]
    assert "vs a" in printed and "bytes per parameter" in printed
