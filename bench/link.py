"""The shaped link between a node and its registry.

The registry runs in a network namespace of its own, reached from the host
over a veth pair; only that pair is shaped, so other work on this machine's
loopback is untouched. Bandwidth: a `tc htb` class on the registry side of
the pair (the download direction). Latency: `netem` does not work on these
kernels, so a delay-line proxy on 127.0.0.1 holds every chunk for half the
round trip in each direction (and one round trip before a new connection
goes through, for the TCP handshake). The proxy can also pace bandwidth
itself (`--shaper proxy`), which `calibrate` compares against tc.

The proxy shares this machine's cores with the node under test, which a
link on a real node never does, so it moves the bytes in the kernel:
splice(2) from one socket into a pipe and, half a round trip later, from
the pipe into the other socket, never copying them through Python. Relaying
200 MB at 1 Gbit/s costs it about 0.2 CPU seconds this way, against about
0.5 through asyncio streams.

Run as `python -m bench.link proxy ...` it is the proxy process.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import queue
import re
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.harness.procs import (
    Daemon,
    free_tcp_port,
    pid_alive,
    start_daemon,
    tcp_port_answers,
)

NETNS_PREFIX = "bsbench-"
# The delay line's pipe: what one direction of a connection holds in flight
# at most (the link's rate times half its round trip is well under it:
# 125 KB at 1 Gbit/s and 2 ms, 250 KB at 200 Mbit/s and 20 ms); a full pipe
# pushes back on the sender, as a real link's queue does.
PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = 1031
SPLICE_FLAGS = os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE
# How often a relay's receiving thread, waiting, checks that its connection
# is still wanted.
RECHECK_MS = 200
REGISTRY_PORT = 5000
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LinkSpec:
    name: str
    rate_mbit: float
    rtt_ms: float

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8


LINKS = {
    "1gbit-2ms": LinkSpec("1gbit-2ms", 1000, 2),
    "200mbit-20ms": LinkSpec("200mbit-20ms", 200, 20),
}


def _ip(*args: str, ns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    subprocess.run([*prefix, *args], check=True, capture_output=True, text=True)


def remove_stale_namespaces() -> None:
    """Namespaces an earlier benchmark run created and could not remove (killed)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    for name in re.findall(rf"^({NETNS_PREFIX}(\d+))\b", listing, re.MULTILINE):
        if not pid_alive(int(name[1])):
            subprocess.run(["ip", "netns", "del", name[0]], check=False)


@dataclass
class Netns:
    """A namespace `bsbench-<pid>` joined to the host by a veth pair."""

    name: str = field(default_factory=lambda: f"{NETNS_PREFIX}{os.getpid()}")
    subnet: int = field(default_factory=lambda: 16 + os.getpid() % 224)

    @property
    def host_if(self) -> str:
        return f"bsb{os.getpid()}h"

    @property
    def ns_if(self) -> str:
        return f"bsb{os.getpid()}n"

    @property
    def host_addr(self) -> str:
        return f"10.213.{self.subnet}.1"

    @property
    def ns_addr(self) -> str:
        return f"10.213.{self.subnet}.2"

    def create(self) -> None:
        in_use = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        if f"10.213.{self.subnet}." in in_use:
            raise RuntimeError(f"10.213.{self.subnet}.0/30 is already in use on this host")
        _ip("ip", "netns", "add", self.name)
        _ip(
            "ip",
            "link",
            "add",
            self.host_if,
            "type",
            "veth",
            "peer",
            "name",
            self.ns_if,
            "netns",
            self.name,
        )
        _ip("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
        _ip("ip", "link", "set", self.host_if, "up")
        _ip("ip", "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if, ns=self.name)
        _ip("ip", "link", "set", self.ns_if, "up", ns=self.name)
        _ip("ip", "link", "set", "lo", "up", ns=self.name)

    def shape(self, rate_mbit: float) -> None:
        """Limit registry -> host traffic to `rate_mbit` (replaces any earlier limit)."""
        self.unshape()
        rate = f"{rate_mbit}mbit"
        dev = ["dev", self.ns_if]
        _ip(
            "tc",
            "qdisc",
            "add",
            *dev,
            "root",
            "handle",
            "1:",
            "htb",
            "default",
            "10",
            ns=self.name,
        )
        _ip(
            "tc",
            "class",
            "add",
            *dev,
            "parent",
            "1:",
            "classid",
            "1:10",
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
            ns=self.name,
        )

    def unshape(self) -> None:
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.name,
                "tc",
                "qdisc",
                "del",
                "dev",
                self.ns_if,
                "root",
            ],
            capture_output=True,
            check=False,  # nothing to remove is fine
        )

    def rx_bytes(self) -> int:
        """Bytes the host has received from the registry side so far."""
        return int(Path(f"/sys/class/net/{self.host_if}/statistics/rx_bytes").read_text())

    def destroy(self) -> None:
        # Deleting the namespace deletes its end of the pair, and with it the pair.
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)


@dataclass
class NsRegistry:
    """docker-registry inside the namespace, listening on its veth address."""

    daemon: Daemon
    netns: Netns
    workdir: Path

    @property
    def host(self) -> str:
        return f"{self.netns.ns_addr}:{REGISTRY_PORT}"


def start_ns_registry(netns: Netns, workdir: Path) -> NsRegistry:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "registry.yml"
    # JSON is valid YAML.
    config.write_text(
        '{"version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": true}},'
        f' "storage": {{"filesystem": {{"rootdirectory": "{workdir / "storage"}"}}}},'
        f' "http": {{"addr": "{netns.ns_addr}:{REGISTRY_PORT}"}}}}'
    )
    daemon = start_daemon(
        "docker-registry (bench netns)",
        ["ip", "netns", "exec", netns.name, "docker-registry", "serve", str(config)],
        workdir / "registry.log",
        ready=lambda: tcp_port_answers(netns.ns_addr, REGISTRY_PORT),
    )
    return NsRegistry(daemon, netns, workdir)


@dataclass
class DelayProxy:
    daemon: Daemon
    port: int

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.daemon.stop()


def start_proxy(upstream: str, rtt_ms: float, rate_mbit: float, log: Path) -> DelayProxy:
    """The delay line in front of `upstream`; `rate_mbit` > 0 also paces downloads."""
    port = free_tcp_port()
    argv = [
        sys.executable,
        "-m",
        "bench.link",
        "proxy",
        "--port",
        str(port),
        "--upstream",
        upstream,
        "--rtt-ms",
        str(rtt_ms),
        "--rate-mbit",
        str(rate_mbit),
    ]
    daemon = start_daemon(
        f"delay proxy {rtt_ms} ms",
        argv,
        log,
        ready=lambda: tcp_port_answers("127.0.0.1", port),
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return DelayProxy(daemon, port)


@dataclass(frozen=True)
class Calibration:
    shaper: str
    rate_mbit_measured: float
    rtt_ms_measured: float
    first_request_ms: float

    def describe(self, spec: LinkSpec) -> dict[str, float | str]:
        return {
            "shaper": self.shaper,
            "rate_mbit": round(self.rate_mbit_measured, 1),
            "rate_vs_configured": round(self.rate_mbit_measured / spec.rate_mbit, 3),
            "rtt_ms": round(self.rtt_ms_measured, 2),
            "new_connection_request_ms": round(self.first_request_ms, 2),
        }


def calibrate(shaper: str, proxy_host: str, blob_url_path: str, spec: LinkSpec) -> Calibration:
    """Measure what the link gives: rate on one big download, RTT on small requests."""
    base = f"http://{proxy_host}"
    fresh = []
    for _ in range(3):
        start = time.perf_counter()
        httpx.get(f"{base}/v2/", timeout=30)
        fresh.append(time.perf_counter() - start)
    with httpx.Client(timeout=60) as client:
        client.get(f"{base}/v2/")
        kept = []
        for _ in range(5):
            start = time.perf_counter()
            client.get(f"{base}/v2/")
            kept.append(time.perf_counter() - start)
        # About two seconds of transfer at the configured rate.
        size = int(spec.bytes_per_s * 2)
        start = time.perf_counter()
        got = 0
        with client.stream("GET", base + blob_url_path, headers={"Range": f"bytes=0-{size - 1}"}) as response:
            response.raise_for_status()
            for chunk in response.iter_raw():
                got += len(chunk)
        seconds = time.perf_counter() - start
    return Calibration(
        shaper,
        got * 8 / seconds / 1e6,
        statistics.median(kept) * 1000,
        statistics.median(fresh) * 1000,
    )


class _Pacer:
    """One token bucket for all connections: the link is shared."""

    def __init__(self, rate_mbit: float) -> None:
        self.bytes_per_s = rate_mbit * 1e6 / 8
        self.next_free = 0.0
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / self.bytes_per_s
        if start > now:
            time.sleep(start - now)


def _wait(fd: int, events: int, timeout_ms: int | None = None) -> bool:
    """Whether `fd` became ready for `events` (or failed) in time."""
    poller = select.poll()
    poller.register(fd, events | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(timeout_ms))


def _relay(src: socket.socket, dst: socket.socket, one_way_s: float, pacer: _Pacer | None) -> None:
    """One direction of a connection until its end: what arrives on `src`
    goes out on `dst` `one_way_s` later. A thread receives into the pipe,
    this one delivers from it. Non-blocking throughout: a splice blocked on
    a socket holds the pipe's lock, and with it the other end. The pipe is
    closed only once the receiving thread is gone, so that it never splices
    into a descriptor number reused meanwhile."""
    out, into = os.pipe2(os.O_NONBLOCK)
    with contextlib.suppress(OSError):
        fcntl.fcntl(into, F_SETPIPE_SZ, PIPE_BYTES)
    # (due, bytes): 0 bytes is the sender's end, -1 a broken connection.
    line: queue.SimpleQueue[tuple[float, int]] = queue.SimpleQueue()
    stop = threading.Event()

    def receive() -> None:
        try:
            while not stop.is_set():
                if not _wait(src.fileno(), select.POLLIN, RECHECK_MS):
                    continue
                try:
                    n = os.splice(src.fileno(), into, PIPE_BYTES, flags=SPLICE_FLAGS)
                except BlockingIOError:
                    # Nothing to read after all, or the pipe is full.
                    _wait(into, select.POLLOUT, RECHECK_MS)
                    continue
                if pacer is not None and n:
                    pacer.take(n)
                line.put((time.monotonic() + one_way_s, n))
                if n == 0:
                    return
        except OSError:
            line.put((0.0, -1))

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    try:
        while True:
            due, n = line.get()
            if n < 0:
                return
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if n == 0:
                dst.shutdown(socket.SHUT_WR)
                return
            while n:
                try:
                    n -= os.splice(out, dst.fileno(), n, flags=SPLICE_FLAGS)
                except BlockingIOError:
                    _wait(dst.fileno(), select.POLLOUT)
    except OSError:
        return
    finally:
        stop.set()
        receiver.join()
        os.close(out)
        os.close(into)


def _connect(client: socket.socket, upstream: tuple[str, int], one_way_s: float, pacer: _Pacer | None) -> None:
    try:
        # The TCP handshake costs a round trip before the first byte moves.
        time.sleep(2 * one_way_s)
        server = socket.create_connection(upstream)
    except OSError:
        client.close()
        return
    for sock in (client, server):
        # As asyncio sets it: a small request or answer goes out at once
        # instead of waiting on Nagle for the ack of the last one.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
    up = threading.Thread(target=_relay, args=(client, server, one_way_s, None), daemon=True)
    up.start()
    _relay(server, client, one_way_s, pacer)
    up.join()
    client.close()
    server.close()


def _serve(port: int, upstream: str, rtt_ms: float, rate_mbit: float) -> None:
    host, up_port = upstream.rsplit(":", 1)
    pacer = _Pacer(rate_mbit) if rate_mbit > 0 else None
    listener = socket.create_server(("127.0.0.1", port), backlog=256)
    while True:
        client, _ = listener.accept()
        threading.Thread(
            target=_connect, args=(client, (host, int(up_port)), rtt_ms / 2000, pacer), daemon=True
        ).start()


def main() -> None:
    parser = argparse.ArgumentParser(description="bench.link: the delay-line proxy")
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy")
    proxy.add_argument("--port", type=int, required=True)
    proxy.add_argument("--upstream", required=True, help="HOST:PORT")
    proxy.add_argument("--rtt-ms", type=float, required=True)
    proxy.add_argument(
        "--rate-mbit",
        type=float,
        default=0.0,
        help="pace downloads too (0: tc does it)",
    )
    args = parser.parse_args()
    _serve(args.port, args.upstream, args.rtt_ms, args.rate_mbit)


if __name__ == "__main__":
    main()
