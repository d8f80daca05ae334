"""The daemon's wire format: one JSON line per message, descriptors beside it.

Standard library only, like every module the pod client carries
(`depsnap.podclient`): a pod's image holds a Python, not bootseer's
dependencies.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_MAX_MESSAGE = 1 << 16
# At most this many descriptors travel with one message; more are a protocol error.
_MAX_FDS = 4


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One JSON line and any descriptors that came with it."""
    buffer = b""
    fds: list[int] = []
    while not buffer.endswith(b"\n"):
        data, new_fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
        fds += new_fds
        if not data or len(buffer) + len(data) > _MAX_MESSAGE:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("connection closed mid-message" if not data else "message too long")
        buffer += data
    message = json.loads(buffer)
    if not isinstance(message, dict):
        for fd in fds:
            os.close(fd)
        raise ValueError("a message must be a JSON object")
    return message, fds


def daemon_answers(address: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(address))
        except OSError:
            return False
    return True
