"""CPU accounting for the benchmarks, read from /proc and the containers'
cgroup: CPU seconds by role (daemons by PID, containers by their containerd
namespace's cpuacct group, the clients this process ran and reaped), and the
cores the whole machine kept busy. The arithmetic is scalemath's (pure)."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from bench import scalemath

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CGROUP_CPUACCT = Path("/sys/fs/cgroup/cpuacct")


@dataclass(frozen=True)
class CpuSnapshot:
    machine: scalemath.CpuTimes
    ticks: dict[str, int]  # by role, summed over that role's processes
    containers_ns: int
    clients_s: float


def _pid_ticks(pid: int) -> int:
    try:
        return scalemath.parse_pid_stat_ticks(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError):
        return 0  # gone: its time is lost, which the machine-wide figure still has


def snapshot(pids: dict[str, list[int]], namespace: str) -> CpuSnapshot:
    """The counters now: `pids` by role; containers of containerd namespace `namespace`."""
    usage = CGROUP_CPUACCT / namespace / "cpuacct.usage"
    try:
        containers = int(usage.read_text())
    except (OSError, ValueError):
        containers = 0  # no container has run in the namespace yet
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSnapshot(
        scalemath.parse_proc_stat(Path("/proc/stat").read_text()),
        {role: sum(_pid_ticks(p) for p in ps) for role, ps in pids.items()},
        containers,
        children.ru_utime + children.ru_stime,
    )


def delta(before: CpuSnapshot, after: CpuSnapshot) -> tuple[dict[str, float], float, float]:
    """CPU seconds by role, and the machine's busy and iowait cores, between two snapshots."""
    cpu = {role: round((after.ticks[role] - before.ticks.get(role, 0)) / CLOCK_TICKS, 2) for role in after.ticks}
    cpu["containers"] = round((after.containers_ns - before.containers_ns) / 1e9, 2)
    # Every child this process reaped meanwhile: the `ctr`/`bootseer pull` clients.
    cpu["clients"] = round(after.clients_s - before.clients_s, 2)
    busy, iowait = scalemath.busy_cores(before.machine, after.machine, os.cpu_count() or 1)
    return cpu, busy, iowait
