"""Multi-node for real: two emulated nodes (network namespaces joined by a shaped veth
pair), torchrun's c10d rendezvous across them, and the bandwidth tool on the link.

Skipped, with the reason, where namespaces cannot be made (not root, no ip/tc)."""

import json
import os
import subprocess

import pytest

from dist_helpers import python, torchrun
from mpfp16.bench import links, netem
from run_helpers import assert_same_final_state, records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHY_NOT = links.unavailable()
_skip = pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated nodes here: {WHY_NOT}")


def needs_namespaces(test):
    """Skipped where namespaces cannot be made; slow where they can (they launch processes)."""
    return pytest.mark.slow(_skip(test))


def namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_namespaces
def test_link_is_shaped_to_the_rate_and_removed(tmp_path):
    with links.EmulatedLink() as link:
        names = list(link.ns.values())
        assert all(n in namespaces() for n in names)
        link.shape(links.parse_rate("1gbit"))
        probe = link.probe(nbytes=16 << 20, pings=20)
        sent = link.tx_bytes("a")
    assert 0.8 < probe["link_gbps"] < 1.05, probe  # tbf at 1 Gbit/s; one TCP stream gets close to it
    assert sent >= 16 << 20
    assert not any(n in namespaces() for n in names)


@needs_namespaces
def test_link_is_removed_after_a_failure():
    with pytest.raises(ZeroDivisionError):
        with links.EmulatedLink() as link:
            names = list(link.ns.values())
            server = subprocess.Popen(link.argv("b", ["sleep", "600"]))
            1 / 0
    assert server.wait(timeout=10) != 0  # killed with its namespace
    assert not any(n in namespaces() for n in names)


@needs_namespaces
def test_stale_namespaces_of_a_dead_run_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{links.PREFIX}{dead.pid}-a"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in links.remove_stale()
    assert name not in namespaces()


@needs_namespaces
def test_a_delay_the_kernel_cannot_make_is_refused_in_one_line():
    with links.EmulatedLink() as link:
        try:
            link.shape(1e9, delay_s=50e-6)
        except links.LinkError as exc:  # this kernel has no netem
            assert "--delay 0" in str(exc) and "\n" not in str(exc)
        else:  # it has: the round trip grows by about twice the one-way delay
            assert link.probe(nbytes=1 << 20, pings=50)["rtt_us"] > 80


@pytest.mark.slow
def test_rates_and_delays_parse_or_fail_in_one_line():
    assert links.parse_rate("1gbit") == 1e9 and links.parse_rate("500mbit") == 5e8
    assert links.parse_delay("50us") == pytest.approx(5e-5) and links.parse_delay("0") == 0
    for bad in ("fast", "-1gbit", "0gbit"):
        with pytest.raises(ValueError):
            links.parse_rate(bad)
    proc = python(["-m", "mpfp16.bench.netem", "--rates", "fast"], timeout=60, merge=False)
    assert proc.returncode == 2 and "not a link rate" in proc.stderr and "Traceback" not in proc.stderr


def test_without_root_it_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in links.unavailable()
    monkeypatch.setattr(links.shutil, "which", lambda tool: None)
    assert "ip and tc" in links.unavailable()


def test_stops_mattering_is_the_lowest_rate_from_which_the_gain_stays_small():
    def row(key, rate, step_s, exposed_ms):
        return {"key": key, "rate_gbps": rate, "its_per_s": 1 / step_s, "exposed_ms": exposed_ms, "processes": 2}

    rows = [row("fp32", 1, 1.0, 500), row("fp32-fp16-compress", 1, 0.75, 250),  # saves 25% of the step
            row("fp32", 10, 0.5, 40), row("fp32-fp16-compress", 10, 0.5, 25),   # 3%
            row("fp32", 25, 0.5, 20), row("fp32-fp16-compress", 25, 0.55, 15),  # 1%, slower by noise
            row("fp32", 50, 0.5, 10)]                                            # no pair: ignored
    (pair,) = netem.stops_mattering(rows, accum=1)
    assert pair["stops_mattering_gbps"] == 10
    assert pair["gain_by_rate"][1] == pytest.approx(0.25)
    assert pair["speedup_by_rate"][1] == pytest.approx(1 / 0.75 - 1)
    assert 50 not in pair["gain_by_rate"]


@needs_namespaces
@pytest.mark.timeout(1200)  # two trainings, each bounded at 600 s
def test_two_nodes_train_identically_and_write_the_checkpoint_once(cifar_root, tmp_path):
    """train_cifar.py on two nodes (c10d rendezvous across the link, one process per
    node), 10 steps: each node is given its own checkpoint folder, as on machines
    without a shared file system; exactly one folder, rank 0's, gets a checkpoint, the
    replica checks pass, and the weights equal those of the same run on one node with
    two processes, bit for bit."""
    args = ["train_cifar.py", cifar_root, "-a", "resnet9-w4", "-b", "16", "--no-progress", "-p", "5",
            "--max-steps", "10", "--save-every", "5", "--check-replicas", "5"]
    with links.EmulatedLink() as link:
        link.shape(links.parse_rate("10gbit"))
        netem.run_job(link, [os.path.join(REPO, args[0]), *args[1:]], str(tmp_path), "train", timeout_s=600,
                      threads=1, node_argv=lambda node: ["--checkpoint-dir", str(tmp_path / f"node-{node}")])
    written = [n for n in ("a", "b") if os.path.exists(tmp_path / f"node-{n}" / "last.pt")]
    assert len(written) == 1, written
    other = "b" if written == ["a"] else "a"
    assert not os.path.exists(tmp_path / f"node-{other}") or not os.listdir(tmp_path / f"node-{other}")
    logs = (tmp_path / "train-a.log").read_text() + (tmp_path / "train-b.log").read_text()
    assert "replicas: identical at" in logs
    final = [r for r in records(tmp_path / f"node-{written[0]}" / "metrics.jsonl") if r.get("type") == "final"]
    assert len(final) == 1 and final[0]["step"] == 10

    one_node = torchrun([*args, "--checkpoint-dir", str(tmp_path / "one-node")], timeout=600)
    assert one_node.returncode == 0, one_node.stderr[-2000:]
    assert_same_final_state(tmp_path / f"node-{written[0]}" / "last.pt", tmp_path / "one-node" / "last.pt")


@needs_namespaces
def test_netem_tool_sweeps_across_the_link_and_cleans_up(tmp_path):
    out, png = tmp_path / "netem.json", tmp_path / "netem.png"
    proc = python(["-m", "mpfp16.bench.netem", "--rates", "1gbit,4gbit", "--sizes", "4M", "--wires", "none",
                   "--iters", "2", "--json", str(out), "--plot", str(png)], merge=False)  # wires: test_bench_wires
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {r["rate_gbps"] for r in data["rows"]} == {1.0, 4.0}
    for r in data["rows"]:
        for key in ("rate_gbps", "dtype", "count", "size_bytes", "time_us", "algbw_gbps", "busbw_gbps"):
            assert key in r
        # what the node sent on its interface: at least the payload a 2-rank allreduce
        # sends (half the message, twice), headers on top
        assert r["wire_bytes"] >= r["size_bytes"]
    fp32_1g = next(r for r in data["rows"] if r["rate_gbps"] == 1.0 and r["dtype"] == "fp32")
    # the link, not memory, bounds it: 1 Gbit/s is 0.125 GB/s (loopback: over 1 GB/s)
    assert 0.08 < fp32_1g["busbw_gbps"] < 0.13
    assert png.stat().st_size > 0
    assert links.PREFIX not in namespaces()  # the tool removed its nodes


@pytest.mark.slow
def test_the_compression_table_joins_the_accuracy_cost(tmp_path):
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"steps": 57, "seeds": [0, 1, 2], "methods": [
        {"method": "powersgd-r1", "val_acc1": 80.0, "val_acc1_spread": 1.5, "val_loss": 0.6, "val_loss_spread": 0.05}]}))
    rows = [{"key": "fp32-powersgd-r1", "setup": "fp32, PowerSGD rank 1", "rate_gbps": 1.0, "processes": 2,
             "its_per_s": 4.0, "bytes_per_step": 800_000, "wire_bytes_per_step": 900_000, "comm_ms": 30.0,
             "exposed_ms": 10.0},
            {"key": "fp16-fp32-allreduce", "setup": "fp16, fp32 allreduce", "rate_gbps": 1.0, "processes": 2,
             "its_per_s": 1.0, "bytes_per_step": 8e6, "wire_bytes_per_step": 8.1e6, "comm_ms": 70.0,
             "exposed_ms": 20.0},
            {"key": "fp32", "setup": "fp32 model", "rate_gbps": 1.0, "processes": 1, "its_per_s": 9.0,
             "bytes_per_step": 0, "comm_ms": 0.0, "exposed_ms": 0.0}]
    table = netem.compression_rows(rows, netem.load_accuracy(str(acc)), accum=2)
    assert len(table) == 2  # the 1-process row is not a compression method
    assert table[0]["val_acc1"] == 80.0 and table[0]["step_s"] == 0.5 and table[0]["payload_mb"] == 0.8
    assert "val_acc1" not in table[1]  # no accuracy run for this set-up: shown as "-"
    text = netem.compression_text(table)
    assert "80.00 ± 1.50" in text and text.splitlines()[2].split()[-1] == "-"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = python(["-m", "mpfp16.bench.netem", "--model", "resnet18", "--accuracy", str(bad)], timeout=60,
                  merge=False)
    assert proc.returncode == 2 and "not a JSON file written by mpfp16.bench.compression" in proc.stderr


@pytest.mark.parametrize("output,expected", [
    ("noise\nerror: --rates: not a link rate\ntorchrun's summary", "error: --rates: not a link rate"),
    ("train_cifar.py: error: argument -b: invalid int value\n", "train_cifar.py: error: argument -b: invalid int value"),
    ("Traceback (most recent call last):\n  File \"x\"\nRuntimeError: Connection refused\nsummary", "RuntimeError: Connection refused"),
    ("[W socket.cpp] The hostname of the client socket cannot be retrieved\nlast", "last"),
    ("[W socket.cpp] The hostname of the client socket cannot be retrieved\n", "no output"),
])
def test_a_failed_node_is_explained_by_its_error_line(tmp_path, output, expected):
    log = tmp_path / "node.log"
    log.write_text(output)
    assert netem._log_error_line(str(log)) == expected
