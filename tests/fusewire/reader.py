"""A container's reader, as its own process:
`python -m tests.fusewire.reader FILE SHA256 OUT STOPFILE`.

Hashes FILE in 1 MiB reads, again and again, until STOPFILE exists. Each
pass appends one JSON line to OUT: when it began and ended, whether the
hash was right, the error if a read failed, and its slowest read (the
stall a restart of the server causes shows there).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

CHUNK = 1 << 20


def one_pass(path: Path, expected: str) -> dict[str, object]:
    began = time.monotonic()
    slowest = 0.0
    slowest_at = began
    digest = hashlib.sha256()
    error = None
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            while True:
                t0 = time.monotonic()
                chunk = os.read(fd, CHUNK)
                spent = time.monotonic() - t0
                if spent > slowest:
                    slowest, slowest_at = spent, t0
                if not chunk:
                    break
                digest.update(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        error = f"{exc.errno}:{exc.strerror}"
    ok = error is None and digest.hexdigest() == expected
    return {
        "began": began,
        "ended": time.monotonic(),
        "ok": ok,
        "error": error,
        "wrong_bytes": error is None and not ok,
        "slowest_read_s": slowest,
        "slowest_read_at": slowest_at,
    }


def main() -> int:
    path, expected, out, stop = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    n = 0
    with out.open("a") as log:
        while not stop.exists():
            record = one_pass(path, expected)
            record["pass"] = n
            n += 1
            log.write(json.dumps(record) + "\n")
            log.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
