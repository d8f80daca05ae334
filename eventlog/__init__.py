"""Event records of the daemons, for `bootseer report`: one JSON object a
line, one file per daemon (`<dir>/<daemon>.jsonl`).

Every record has `ts` (wall-clock seconds, the one clock every process on
the node shares), `daemon`, `pid` and `kind`; an interval also has `start`
and `end` in the same clock. The parts call `emit(kind, **fields)`; the
application's composition root calls `configure(dir, name)` first, and
until it does (a library caller, a test) `emit` does nothing.

Bounds: when a file would pass half of `max_bytes` it becomes `<name>.jsonl.1`
(replacing the one before), so a daemon's records never take more than
`max_bytes` however long it runs. Many processes may write one file (every
`bootseer pull` writes `pull.jsonl`): each record is one `write` on an
`O_APPEND` descriptor, so records never interleave, and a rotation happens
under an exclusive `flock` on the file being rotated, so two writers never
rotate the same file twice. A record that cannot be written (full disk,
read-only filesystem, anything) is dropped and counted
(`bootseer_events_dropped_total`): the record is never worth failing the
daemon's real work for.

Standard library, with prometheus_client and structlog loaded only once
records are on: `bootseer pull` reads the `[events]` section on its way to
the snapshotter daemon and should load neither.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import Counter

SUFFIX = ".jsonl"
PREVIOUS = ".1"
# A record larger than this is a bug in its emitter, not worth a rotation.
MAX_RECORD_BYTES = 64 << 10
# A failure is logged at most this often; the rest are only counted.
_LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class _Metrics:
    written: Counter
    dropped: Counter


@cache
def _metrics() -> _Metrics:
    """Registered once, when records are first turned on."""
    from prometheus_client import Counter

    return _Metrics(
        Counter("bootseer_events_written", "Event records written to the daemon's event log."),
        Counter(
            "bootseer_events_dropped",
            "Event records dropped: the log could not be written (nospace, error) or the record was too large.",
            ["reason"],
        ),
    )


@dataclass
class _Log:
    path: Path
    name: str
    max_bytes: int
    summary_interval_s: float
    fd: int = -1
    # (st_dev, st_ino) of the file `fd` is: another writer's rotation shows as a change.
    identity: tuple[int, int] = (0, 0)


@dataclass
class _State:
    current: _Log | None = None
    last_failure_log: float = -_LOG_EVERY_S


_lock = threading.Lock()
_state = _State()


def configure(directory: Path | None, name: str, max_bytes: int = 8 << 20, summary_interval_s: float = 1.0) -> None:
    """Records from this process go to `<directory>/<name>.jsonl`; None or
    `max_bytes` <= 0 turns them off. The directory is made if missing; if it
    cannot be, records are dropped and counted like any other failure."""
    with _lock:
        if _state.current is not None:
            _close(_state.current)
        if directory is None or max_bytes <= 0:
            _state.current = None
            return
        _metrics()
        _state.current = _Log(directory / f"{name}{SUFFIX}", name, max_bytes, summary_interval_s)


def enabled() -> bool:
    return _state.current is not None


def summary_interval() -> float:
    current = _state.current
    return current.summary_interval_s if current is not None else 1.0


def now() -> float:
    """The records' clock."""
    return time.time()


def emit(kind: str, **fields: Any) -> None:
    """Append one record; never raises (a record that cannot be written is
    dropped and counted)."""
    current = _state.current
    if current is None:
        return
    record = {"ts": round(time.time(), 6), "daemon": current.name, "pid": os.getpid(), "kind": kind, **fields}
    try:
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
    except (TypeError, ValueError) as exc:
        _dropped("error", f"record not serialisable: {exc}")
        return
    if len(line) > MAX_RECORD_BYTES:
        _dropped("too_large", f"{kind} record of {len(line)} bytes")
        return
    with _lock:
        if _state.current is not current:
            return
        try:
            _write(current, line)
        except OSError as exc:
            _close(current)
            _dropped("nospace" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "error", str(exc))
            return
    _metrics().written.inc()


def _dropped(reason: str, why: str) -> None:
    _metrics().dropped.labels(reason).inc()
    if time.monotonic() - _state.last_failure_log >= _LOG_EVERY_S:
        _state.last_failure_log = time.monotonic()
        # Not even a failing log stream may turn a dropped record into the daemon's error.
        with contextlib.suppress(Exception):
            import structlog

            log = structlog.get_logger("bootseer.events")
            log.warning("event record dropped; bootseer report will miss it", reason=reason, error=why)


def _close(current: _Log) -> None:
    if current.fd >= 0:
        with contextlib.suppress(OSError):
            os.close(current.fd)
    current.fd = -1


def _open(current: _Log) -> None:
    current.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    current.fd = os.open(current.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
    st = os.fstat(current.fd)
    current.identity = (st.st_dev, st.st_ino)


def _write(current: _Log, line: bytes) -> None:
    if current.fd >= 0:
        # Another process rotated the file away: follow it to the new one.
        try:
            st = os.stat(current.path)
            moved = (st.st_dev, st.st_ino) != current.identity
        except FileNotFoundError:
            moved = True
        if moved:
            _close(current)
    if current.fd < 0:
        _open(current)
    if os.fstat(current.fd).st_size + len(line) > current.max_bytes // 2:
        _rotate(current)
    written = os.write(current.fd, line)
    if written != len(line):
        # A partial record would break the line after it: cut it off by a newline.
        with contextlib.suppress(OSError):
            os.write(current.fd, b"\n")
        raise OSError(errno.ENOSPC, f"short write of an event record: {written} of {len(line)} bytes")


def _rotate(current: _Log) -> None:
    fcntl.flock(current.fd, fcntl.LOCK_EX)
    try:
        st = os.stat(current.path)
        # Someone else rotated it while we waited for the lock: theirs stands.
        if (st.st_dev, st.st_ino) == current.identity and st.st_size > 0:
            os.replace(current.path, current.path.with_name(current.path.name + PREVIOUS))
    except FileNotFoundError:
        pass
    finally:
        fcntl.flock(current.fd, fcntl.LOCK_UN)
    _close(current)
    _open(current)


# -- reading -----------------------------------------------------------------


def files(directory: Path) -> list[Path]:
    """Every event file in `directory`, previous files first."""
    if not directory.is_dir():
        return []
    return sorted(directory.glob(f"*{SUFFIX}{PREVIOUS}")) + sorted(directory.glob(f"*{SUFFIX}"))


def read(directory: Path) -> Iterator[dict[str, Any]]:
    """Every record in `directory`, skipping lines that do not parse (a
    record cut short by a full disk)."""
    for path in files(directory):
        try:
            text = path.read_bytes()
        except OSError:
            continue
        for raw in text.splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("ts"), int | float) and "kind" in record:
                yield record


def cgroup_of(pid: int) -> str:
    """The cgroup paths of process `pid`, joined by ";": a container's id is
    in them (runc's cgroupfs driver, kubelet's pod slices), which is how
    `bootseer report` finds the container a record is for. Empty if unknown."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    paths = {line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2}
    return ";".join(sorted(p for p in paths if p and p != "/"))
