"""How long a start waits on its FUSE daemon, from the kernel's own record:
the `fuse_request_send` and `fuse_request_end` tracepoints (in recent
kernels: 6.18 here), in a tracefs instance of the benchmark's own, with the monotonic
clock so that its times line up with the run's. A request is outstanding
from the moment its task queues it to the moment the daemon's answer
reaches the kernel: the round trip the task waits out, whoever the daemon
is (bootseer's layer server or stargz's), with nothing added to either.

Parsing and summing are pure (tests/bench/test_fusewait.py); `FuseTrace` is
the I/O around them. A kernel without the tracepoints gives no figure.
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = ("fuse/fuse_request_send", "fuse/fuse_request_end")
# Per CPU: a cold lazy start makes tens of thousands of requests, two
# events of about 100 bytes each.
BUFFER_KB = 16384
# A request answered within this is the FUSE round trip itself; a slower
# one waited on something more (a block still on its way, a busy daemon).
SLOW_S = 0.001

# `<task>-<pid> [<cpu>] <flags> <seconds>: <event>: connection <n> req <id> ...`
_LINE = re.compile(
    r"^\s*(?P<task>.+?)-\d+\s+\[\d+\]\s+\S+\s+(?P<ts>\d+\.\d+): "
    r"(?P<event>fuse_request_send|fuse_request_end): connection (?P<conn>\d+) req (?P<req>\d+)"
    r"(?: opcode \d+ \((?P<op>\w+)\))?"
)


@dataclass(frozen=True)
class Request:
    sent: float  # time.monotonic() seconds
    ended: float
    opcode: str  # "LOOKUP", "READ", ...
    task: str  # the name of the task that sent it

    @property
    def seconds(self) -> float:
        return self.ended - self.sent


def parse(lines: Iterable[str]) -> list[Request]:
    """The answered requests of a trace, in the order they were answered.
    A request sent before the trace began or unanswered at its end is left
    out; so is a line that is not one of the two events."""
    sent: dict[tuple[str, str], tuple[float, str, str]] = {}
    done: list[Request] = []
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        key = (m["conn"], m["req"])
        if m["event"] == "fuse_request_send":
            sent[key] = (float(m["ts"]), (m["op"] or "?").removeprefix("FUSE_"), m["task"].strip())
            continue
        begun = sent.pop(key, None)
        if begun is not None:
            done.append(Request(begun[0], float(m["ts"]), begun[1], begun[2]))
    return done


@dataclass(frozen=True)
class FuseWait:
    requests: int
    # Wall time with at least one request outstanding: what a start waits
    # out, if no two of its tasks wait at once.
    outstanding_s: float
    latency_sum_s: float
    slow_requests: int  # over SLOW_S
    slow_sum_s: float
    by_opcode_s: dict[str, float]


def summarise(requests: Iterable[Request]) -> FuseWait:
    """What `requests` kept their tasks waiting, summed."""
    chosen = sorted(requests, key=lambda r: r.sent)
    by_opcode: dict[str, float] = defaultdict(float)
    outstanding = 0.0
    start = end = None
    for r in chosen:
        by_opcode[r.opcode] += r.seconds
        if end is None or r.sent > end:
            if start is not None and end is not None:
                outstanding += end - start
            start, end = r.sent, r.ended
        else:
            end = max(end, r.ended)
    if start is not None and end is not None:
        outstanding += end - start
    slow = [r.seconds for r in chosen if r.seconds > SLOW_S]
    return FuseWait(
        requests=len(chosen),
        outstanding_s=outstanding,
        latency_sum_s=sum(r.seconds for r in chosen),
        slow_requests=len(slow),
        slow_sum_s=sum(slow),
        by_opcode_s=dict(by_opcode),
    )


class FuseTrace:
    """The two tracepoints on, in an instance named `name`, from `start()`
    until `stop()` returns what they recorded and removes the instance."""

    def __init__(self, name: str) -> None:
        self.dir = TRACEFS / "instances" / name
        self.lost = False

    @staticmethod
    def available() -> bool:
        """Whether this kernel has the tracepoints (tracefs mounted by the
        benchmark if it is not: it runs as root)."""
        if not (TRACEFS / "events").is_dir():
            subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], capture_output=True, check=False)
        return all((TRACEFS / "events" / e).is_dir() for e in EVENTS)

    def start(self) -> Self:
        if self.dir.exists():
            self.dir.rmdir()  # left by a benchmark that was killed
        self.dir.mkdir()
        (self.dir / "trace_clock").write_text("mono")
        (self.dir / "buffer_size_kb").write_text(str(BUFFER_KB))
        for event in EVENTS:
            (self.dir / "events" / event / "enable").write_text("1")
        (self.dir / "tracing_on").write_text("1")
        return self

    def stop(self) -> list[str]:
        """What was recorded; `lost` tells whether the buffer overflowed."""
        try:
            (self.dir / "tracing_on").write_text("0")
            self.lost = any(
                line.startswith("overrun:") and line.split()[1] != "0"
                for stats in (self.dir / "per_cpu").glob("cpu*/stats")
                for line in stats.read_text().splitlines()
            )
            with (self.dir / "trace").open() as f:
                return f.readlines()
        finally:
            for event in EVENTS:
                (self.dir / "events" / event / "enable").write_text("0")
            self.dir.rmdir()
