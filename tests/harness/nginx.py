"""A real nginx serving a directory on 127.0.0.1: Range requests, a
per-connection rate limit, optionally a JSON autoindex and PUT/DELETE. Stopped
(and restarted on the same port, to play a server failing mid-read) by PID.
Used by the hdfs_fuse and depsnap tests and by bench/checkpoint.py and
bench/depsnap.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness.procs import Daemon, free_tcp_port, start_daemon, tcp_port_answers

_CONF = """\
daemon off;
{user}
worker_processes {workers};
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {access_log};
    client_body_temp_path {state}/client_body;
    proxy_temp_path {state}/proxy;
    fastcgi_temp_path {state}/fastcgi;
    uwsgi_temp_path {state}/uwsgi;
    scgi_temp_path {state}/scgi;
    default_type application/octet-stream;
    sendfile on;
    keepalive_requests 100000;
    server {{
        listen {host}:{port};
        root {root};
        location / {{
{directives}
        }}
    }}
}}
"""


@dataclass
class Nginx:
    root: Path
    port: int
    state: Path
    limit_rate: str
    host: str = "127.0.0.1"
    # A network namespace to serve from (`ip netns exec`), listening on `host` there.
    netns: str = ""
    daemon: Daemon | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.state / "access.log"

    def start(self) -> None:
        conf = self.state / "nginx.conf"
        within = ["ip", "netns", "exec", self.netns] if self.netns else []
        self.daemon = start_daemon(
            "nginx",
            [*within, "nginx", "-p", str(self.state), "-c", str(conf), "-e", str(self.state / "error.log")],
            self.state / "nginx.out",
            ready=lambda: tcp_port_answers(self.host, self.port),
        )

    def stop(self) -> None:
        """SIGTERM to the master's PID: a fast shutdown that drops open connections."""
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon.kill_group()
            self.daemon = None

    def restart(self) -> None:
        self.stop()
        self.start()


def start_nginx(
    root: Path,
    limit_rate: str | int = "0",
    workers: int = 1,
    ranges: bool = True,
    access_log: bool = True,
    autoindex: bool = True,
    writable: bool = False,
    parent: Path | None = None,
    host: str = "127.0.0.1",
    netns: str = "",
) -> Nginx:
    """nginx serving `root`. `limit_rate` per connection ("0": unlimited,
    "25m", or bytes/s); `autoindex`: directories as JSON listings;
    `writable`: PUT and DELETE (with parent directories made on PUT); the
    config, logs and pid live in a new directory under `parent` (/tmp);
    `netns`: served from that network namespace, on its address `host`."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="bs-nginx-", dir=parent or "/tmp"))
    port = free_tcp_port()
    directives = [f"limit_rate {limit_rate};"]
    if autoindex:
        directives += ["autoindex on;", "autoindex_format json;"]
    if not ranges:
        directives.append("max_ranges 0;")
    if writable:
        directives += ["dav_methods PUT DELETE;", "create_full_put_path on;", "client_max_body_size 0;"]
    # As root, workers would drop to `nobody`, who can neither enter pytest's
    # private temp dirs nor write PUT bodies there.
    user = "user root root;" if os.geteuid() == 0 else ""
    (state / "nginx.conf").write_text(
        _CONF.format(
            user=user,
            workers=workers,
            state=state,
            host=host,
            port=port,
            root=root.absolute(),
            directives="\n".join(" " * 12 + d for d in directives),
            access_log=f"{state}/access.log" if access_log else "off",
        )
    )
    server = Nginx(root=root, port=port, state=state, limit_rate=str(limit_rate), host=host, netns=netns)
    try:
        server.start()
    except BaseException:
        shutil.rmtree(state, ignore_errors=True)
        raise
    return server


def remove(server: Nginx) -> None:
    server.stop()
    shutil.rmtree(server.state, ignore_errors=True)
