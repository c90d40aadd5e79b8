"""Two emulated nodes on one machine: network namespaces joined by a shaped veth pair.

On loopback a collective measures memory copies, not a network. Here each "node" is a
network namespace with its own stack and one interface; the two interfaces are the
ends of a veth pair, and each end's egress is shaped by a token-bucket filter
(``tc ... tbf rate R``) so that the pair behaves as a full-duplex link of rate R, with
an optional one-way delay (``netem``, where the kernel has it). Processes run in a
node with ``ip netns exec``. Nothing leaves the namespaces: their only interfaces are
the pair and their own loopback.

    with EmulatedLink() as link:
        link.shape(rate_bps=10e9)
        proc = subprocess.Popen(link.argv("a", ["python", "-c", "..."]))
        print(link.probe_rate_gbps(), link.tx_bytes("a"))

Everything is removed on exit, failure and Ctrl-C included: every process still in a
namespace is killed, then the namespaces are deleted, which deletes the veth pair.
Namespaces left by a run that was killed outright (SIGKILL) are named after its pid
and are removed by the next run, once that pid is gone.

Needs root and iproute2's ``ip`` and ``tc``; :func:`unavailable` says, in one line,
what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

PREFIX = "mpfp16-link-"
SUBNET = "10.233.0"  # private, and only ever configured inside the two namespaces
PROBE_PORT = 29399


class LinkError(RuntimeError):
    """The emulated link could not be built or shaped."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        reason = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise LinkError(f"{' '.join(argv)}: {reason[0] if reason else f'exit status {proc.returncode}'}")
    return proc


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (one line), or None when they can."""
    if sys.platform != "linux":
        return f"emulated links need Linux network namespaces; this is {sys.platform}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated links need iproute2's {' and '.join(missing)}, not found on PATH"
    if os.geteuid() != 0:
        return "emulated links need root (network namespaces, veth pairs and tc); run as root"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or 'ip netns add failed'}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def parse_rate(text: str) -> float:
    """'1gbit' -> 1e9, '500mbit' -> 5e8, '25G' -> 25e9: bits per second (tc's units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|b|bps)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a link rate: {text!r} (use e.g. 500mbit, 1gbit, 25gbit)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    if value <= 0:
        raise ValueError(f"a link rate must be positive, got {text!r}")
    return value


def parse_delay(text: str) -> float:
    """'50us' -> 5e-5, '1ms' -> 1e-3, '0' -> 0: seconds, one way."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|ns)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a delay: {text!r} (use e.g. 0, 50us, 1ms)")
    return float(m.group(1)) * {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_and_delete(namespaces: list[str]) -> None:
    """Kill every process in each namespace, then delete it (its veth end goes with it)."""
    for ns in namespaces:
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in namespaces:
        for _ in range(50):  # a process being killed can hold the namespace for a moment
            if _run(["ip", "netns", "del", ns], check=False).returncode == 0 or ns not in _namespaces():
                break
            time.sleep(0.1)


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone; return their names."""
    stale = []
    for ns in _namespaces():
        m = re.fullmatch(re.escape(PREFIX) + r"(?:probe-)?(\d+)-?[ab]?", ns)
        if m and not _pid_alive(int(m.group(1))):
            stale.append(ns)
    _kill_and_delete(stale)
    return stale


class EmulatedLink:
    """Two namespaces, ``a`` and ``b``, joined by a veth pair; see the module docstring.

    Node ``a`` has address ``SUBNET.1`` on interface ``iface("a")``, node ``b``
    ``SUBNET.2``. Unshaped until :meth:`shape`.
    """

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns = {"a": f"{PREFIX}{pid}-a", "b": f"{PREFIX}{pid}-b"}
        self.ifaces = {"a": f"mpl{pid}a"[:15], "b": f"mpl{pid}b"[:15]}
        self.addrs = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}
        self._up = False
        self._restore: dict = {}

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> "EmulatedLink":
        reason = unavailable()
        if reason:
            raise LinkError(reason)
        remove_stale()
        self._catch_signals()
        self._up = True
        try:
            a, b = self.ns["a"], self.ns["b"]
            ia, ib = self.ifaces["a"], self.ifaces["b"]
            _run(["ip", "netns", "add", a])
            _run(["ip", "netns", "add", b])
            # Create the pair inside node a, then move one end: it never exists outside.
            _run(["ip", "-n", a, "link", "add", ia, "type", "veth", "peer", "name", ib, "netns", b])
            for node in ("a", "b"):
                ns, iface = self.ns[node], self.ifaces[node]
                _run(["ip", "-n", ns, "addr", "add", f"{self.addrs[node]}/24", "dev", iface])
                _run(["ip", "-n", ns, "link", "set", iface, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs in the nodes and delete them; safe to call twice."""
        if self._up:
            self._up = False
            _kill_and_delete([ns for ns in self.ns.values() if ns in _namespaces()])
        for sig, handler in self._restore.items():
            signal.signal(sig, handler)
        self._restore = {}

    def _catch_signals(self) -> None:
        """SIGTERM and SIGHUP raise SystemExit, so that ``finally`` and ``__exit__``
        run and the namespaces go (SIGINT already raises KeyboardInterrupt)."""
        def leave(signum, frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._restore[sig] = signal.signal(sig, leave)
            except ValueError:  # not the main thread: the caller handles signals
                pass

    # ------------------------------------------------------------------ shaping

    def shape(self, rate_bps: float | None, delay_s: float = 0.0) -> None:
        """Shape both directions: ``rate_bps`` bits per second (None: unshaped) and a
        one-way ``delay_s`` (netem; refused in one line where the kernel lacks it).

        The token bucket holds 1 ms of traffic (at least 32 KiB): smaller buckets cost
        throughput at 10 Gbit/s and more (the kernel's timers cannot refill them often
        enough: a 64 KiB bucket gave 3.0 of 10 Gbit/s here), and a full bucket lets the
        first millisecond of a transfer go faster than the rate, so messages that take
        a few milliseconds or more on the link are the ones it times faithfully.
        """
        for node in ("a", "b"):
            ns, iface = self.ns[node], self.ifaces[node]
            _run(["tc", "-n", ns, "qdisc", "del", "dev", iface, "root"], check=False)
            parent = ["root"]
            if delay_s > 0:
                made = _run(["tc", "-n", ns, "qdisc", "add", "dev", iface, "root", "handle", "1:", "netem",
                             "delay", f"{delay_s * 1e6:.0f}us", "limit", "100000"], check=False)
                if made.returncode != 0:
                    raise LinkError(f"this kernel cannot delay packets (tc netem: {made.stderr.strip()}); "
                                    "run with --delay 0 to shape the rate alone")
                parent = ["parent", "1:1"]
            if rate_bps is not None:
                burst = max(32 * 1024, int(rate_bps / 8 * 1e-3))
                _run(["tc", "-n", ns, "qdisc", "add", "dev", iface, *parent, "handle", "10:", "tbf",
                      "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "50ms"])

    # ------------------------------------------------------------------ running

    def argv(self, node: str, argv: list[str], env: dict | None = None) -> list[str]:
        """``argv`` run inside ``node``; ``env`` as ``env NAME=VALUE`` prefixes."""
        prefix = ["ip", "netns", "exec", self.ns[node]]
        if env:
            prefix += ["env", *[f"{k}={v}" for k, v in env.items()]]
        return prefix + list(argv)

    def tx_bytes(self, node: str) -> int:
        """Bytes ``node`` has sent on its link interface (headers included)."""
        out = _run(["ip", "-n", self.ns[node], "-j", "-s", "link", "show", "dev", self.ifaces[node]]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def probe(self, nbytes: int = 64 << 20, pings: int = 200) -> dict:
        """Measure the link from a to b with one TCP stream: throughput of ``nbytes``
        in Gbit/s, and the median round trip of a 1-byte ping-pong in µs."""
        server = subprocess.Popen(self.argv("b", [sys.executable, "-m", __name__, "serve", self.addrs["b"],
                                                  str(PROBE_PORT), str(nbytes), str(pings)]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            client = _run(self.argv("a", [sys.executable, "-m", __name__, "send", self.addrs["b"],
                                          str(PROBE_PORT), str(nbytes), str(pings)]))
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        gbps, rtt_us = (float(v) for v in client.stdout.split())
        return {"link_gbps": gbps, "rtt_us": rtt_us}


class WireCounter:
    """Bytes this process's node has sent on ``iface`` (headers included), read from
    sysfs: inside a namespace ``ip netns exec`` mounts the namespace's own /sys."""

    def __init__(self, iface: str) -> None:
        self.path = f"/sys/class/net/{iface}/statistics/tx_bytes"
        if not os.path.exists(self.path):
            raise LinkError(f"no network interface {iface!r} here ({self.path} is missing)")

    def read(self) -> int:
        with open(self.path) as f:
            return int(f.read())


# ---------------------------------------------------------------------- the probe's two ends


def _serve(host: str, port: int, nbytes: int, pings: int) -> None:
    with socket.create_server((host, port)) as srv:
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf, got = bytearray(1 << 20), 0
            while got < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    raise SystemExit("probe: the sender went away")
                got += n
            conn.sendall(b"k")
            for _ in range(pings):
                conn.sendall(conn.recv(1))


def _send(host: str, port: int, nbytes: int, pings: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=30)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunk = memoryview(bytearray(1 << 20))
        start = time.perf_counter()
        sent = 0
        while sent < nbytes:
            conn.sendall(chunk[: min(len(chunk), nbytes - sent)])
            sent += min(len(chunk), nbytes - sent)
        conn.recv(1)  # the receiver has everything
        seconds = time.perf_counter() - start
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            conn.sendall(b"p")
            conn.recv(1)
            rtts.append(time.perf_counter() - t)
    rtts.sort()
    print(f"{nbytes * 8 / seconds / 1e9:.4f} {rtts[len(rtts) // 2] * 1e6:.1f}")


if __name__ == "__main__":
    role, host, port, nbytes, pings = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    {"serve": _serve, "send": _send}[role](host, port, nbytes, pings)
