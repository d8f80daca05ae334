"""`ensure` from inside an unprivileged pod, through the node daemon.

The pod computes the key itself (the same inputs as `bootseer depsnap
ensure`: its requirement files, interpreter, installer, environment) and
asks the daemon to mount the environment on its target. On a miss it
installs as usual, in the pod, and asks the daemon to capture the result.
The pod needs no capability and no host path: only the daemon's socket.

Standard library only, and only modules that are too (`POD_MODULES`), so a
pod's image can carry it as one file: `bootseer depsnap pod-client -o
depsnap-client.pyz` writes a zipapp that any Python 3.11+ runs:

    python3 depsnap-client.pyz ensure -r requirements.txt --target /opt/env
    python3 depsnap-client.pyz mark ready    # before the first step, for `bootseer report`
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from depsnap import installer, layout
from depsnap.inputs import EnvRequest, InputError, for_env
from depsnap.installer import InstallerError
from depsnap.key import compute
from depsnap.outcome import Outcome
from depsnap.requirements import RequirementsError
from depsnap.wire import recv_message, send_message

DEFAULT_SOCKET = Path("/run/bootseer/depsnap.sock")
SOCKET_ENV = "BOOTSEER_DEPSNAP_SOCKET"
# Everything the client imports, for the zipapp (a test checks that it runs
# with nothing else on the path).
POD_MODULES = (
    "__init__.py",
    "inputs.py",
    "installer.py",
    "key.py",
    "layout.py",
    "outcome.py",
    "podclient.py",
    "requirements.py",
    "wire.py",
)
_CAP_SYS_ADMIN = 21
EXIT_USAGE = 2


class PodRefused(Exception):
    """The daemon refused the request; the message says why."""


class DaemonUnavailable(Exception):
    """No daemon answers on the socket, or it failed the request."""


def can_mount() -> bool:
    """Whether this process may mount by itself (CAP_SYS_ADMIN); a pod may not."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return False


@dataclass(frozen=True)
class Daemon:
    socket: Path

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(self.socket))
                send_message(sock, message)
                reply, fds = recv_message(sock)
        except (OSError, ValueError) as exc:
            raise DaemonUnavailable(f"no depsnap daemon answers on {self.socket}: {exc}") from None
        for fd in fds:
            os.close(fd)
        if reply.get("ok"):
            return reply
        if reply.get("error") == "refused":
            raise PodRefused(f"the node's depsnap daemon refused: {reply.get('message', '')}")
        raise DaemonUnavailable(f"depsnap daemon: {reply.get('error')}: {reply.get('message', '')}")


def _warn(message: str) -> None:
    print(f"depsnap: warning: {message}", file=sys.stderr)


def _mark(target: Path, key: str) -> None:
    """Record the key beside the target, so the next ensure finds it present;
    where the pod may not write there, the next ensure asks the daemon again."""
    try:
        layout.write_key(target, key)
    except OSError as exc:
        _warn(f"cannot record the key beside {target}: {exc.strerror}")


def pod_ensure(request: EnvRequest, daemon: Daemon) -> Outcome:
    """The environment at `request.target`, mounted by the daemon on a hit,
    installed here and captured by the daemon on a miss.

    Raises PodRefused when the daemon will not serve this target (not in its
    allow-list, a symlink on the way): a setup error to fix, not a reason to
    install silently. A daemon that does not answer costs only the capture:
    the install runs and the job starts.
    """
    started = time.monotonic()
    inputs = for_env(request, os.environ, Path.cwd())
    key = compute(inputs)
    target = Path(os.path.normpath(request.target.absolute()))

    def done(status: str, detail: str, rc: int = 0) -> Outcome:
        return Outcome(status, key, time.monotonic() - started, detail, rc)

    if layout.present_key(target) == key and not layout.is_empty_or_missing(target):
        return done("present", f"already at {target}")
    if not layout.is_empty_or_missing(target):
        raise InputError(f"{target} exists and holds something else; remove it first")
    # The daemon never creates anything in a pod: the mount point is ours to make.
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create {target}: {exc.strerror}") from None
    reachable = True
    try:
        reply = daemon.call({"op": "pod-attach", "key": key, "target": str(target)})
    except DaemonUnavailable as exc:
        _warn(f"{exc}; installing without depsnap")
        reachable = False
    else:
        if reply.get("found"):
            _mark(target, key)
            where = "node cache" if reply.get("source") == "cache" else "store"
            return done("hit", f"{reply.get('size')} image bytes from {where}, mounted by the node daemon")

    steps = installer.plan(request.installer, request.python, target, request.requirements)
    rc = installer.run(steps)
    if rc != 0:
        # A failed install leaves no half-built environment for the next try.
        for entry in list(target.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        return done("failed", f"{request.installer} exited with status {rc}; nothing captured", rc)
    _mark(target, key)
    if not reachable:
        return done("miss", f"installed with {request.installer}, not captured (no daemon)")
    try:
        captured = daemon.call({"op": "pod-capture", "key": key, "target": str(target)})
    except (DaemonUnavailable, PodRefused) as exc:
        # The environment is installed and works: the job goes on; the next
        # start installs again.
        _warn(f"the node daemon did not capture {target}: {exc}")
        return done("miss", f"installed with {request.installer}, not captured")
    return done("miss", f"installed with {request.installer}, {captured.get('detail', 'captured')}")


def add_ensure_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-r", "--requirement", type=Path, action="append", required=True, help="requirements file (repeatable)"
    )
    parser.add_argument("--target", type=Path, required=True, help="the environment's directory (an allowed target)")
    parser.add_argument("--python", type=Path, default=Path(sys.executable), help="interpreter for the environment")
    parser.add_argument("--installer", choices=installer.INSTALLERS, default="pip")
    parser.add_argument("--base-image", help="digest of the container image this runs in (or BOOTSEER_BASE_IMAGE)")
    add_socket_argument(parser)


def add_socket_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        type=Path,
        default=Path(os.environ.get(SOCKET_ENV, DEFAULT_SOCKET)),
        help=f"the node daemon's socket, bind-mounted into the pod (default {DEFAULT_SOCKET} or ${SOCKET_ENV})",
    )


def _send_mark(name: str, daemon: Daemon) -> int:
    """A mark is worth a warning, never a failed job: without a daemon the
    report only lacks the mark."""
    try:
        daemon.call({"op": "mark", "name": name})
    except (DaemonUnavailable, PodRefused) as exc:
        _warn(f"mark {name!r} not recorded: {exc}")
        return 0
    print(f"depsnap: mark {name} recorded", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="depsnap-client",
        description="Dependency snapshots for a pod, through the node's depsnap daemon (no capability needed).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ensure = commands.add_parser(
        "ensure", help="mount the environment from the node, or install it and have it captured"
    )
    add_ensure_arguments(ensure)
    mark = commands.add_parser(
        "mark", help="record that the job reached NAME (e.g. ready), for `bootseer report` on the node"
    )
    mark.add_argument("name", metavar="NAME", nargs="?", default="ready")
    add_socket_argument(mark)
    args = parser.parse_args(argv)
    if args.command == "mark":
        return _send_mark(args.name, Daemon(args.socket))
    request = EnvRequest(args.requirement, args.target, args.python, args.installer, args.base_image)
    try:
        outcome = pod_ensure(request, Daemon(args.socket))
    except (PodRefused, InputError, InstallerError, RequirementsError) as exc:
        print(f"depsnap: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(outcome.line(), flush=True)
    return outcome.returncode


_MAIN = """import sys

from depsnap.podclient import main

sys.exit(main(sys.argv[1:]))
"""


def write_zipapp(out: Path) -> None:
    """The client as one file a pod's image can carry (`python3 FILE ensure ...`)."""
    here = Path(__file__).parent
    temp = out.with_name(f".{out.name}.tmp")
    with open(temp, "wb") as raw:
        raw.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("__main__.py", _MAIN)
            for name in POD_MODULES:
                archive.write(here / name, f"depsnap/{name}")
    temp.chmod(0o755)
    os.rename(temp, out)
