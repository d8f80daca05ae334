"""A range-aware pull-through cache for registry blobs: nginx with its
`slice` module in front of the registry, the experiment that tells a cache's
semantics apart from bootseer's behaviour in the scale benchmark.

Distribution 2.8's proxy mode (the `mirror` route) stores whole blobs only:
a Range request for a blob it lacks is answered with the whole blob, fetched
from upstream once to answer and once to store, and once more for every
concurrent request while it stores. This cache instead fetches and keeps
1 MiB slices: a Range request costs the registry the slices it covers, once
(`proxy_cache_lock` makes concurrent misses of a slice wait for the first),
and a whole-blob GET is assembled from slices the same way. Manifests and
everything else are passed through uncached: tags move, and they are small.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.harness.procs import Daemon, free_tcp_port, start_daemon, tcp_port_answers

SLICE = "1m"
_CONF = """\
daemon off;
{user}
worker_processes 2;
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {state}/client_body;
    proxy_temp_path {state}/proxy;
    fastcgi_temp_path {state}/fastcgi;
    uwsgi_temp_path {state}/uwsgi;
    scgi_temp_path {state}/scgi;
    proxy_cache_path {state}/cache levels=1:2 keys_zone=blobs:32m max_size=50g inactive=1h use_temp_path=off;
    upstream registry {{
        server {upstream};
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        # Blobs are content-addressed: a slice, once cached, is right forever.
        location ~ ^/v2/.+/blobs/sha256: {{
            slice {slice};
            proxy_cache blobs;
            proxy_cache_key $uri$slice_range;
            proxy_set_header Range $slice_range;
            proxy_cache_valid 200 206 1h;
            # Concurrent misses of one slice: one upstream fetch, the rest wait for it.
            proxy_cache_lock on;
            proxy_cache_lock_timeout 120s;
            proxy_cache_lock_age 120s;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_pass http://registry;
        }}
        location / {{
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_pass http://registry;
        }}
    }}
}}
"""


@dataclass
class SliceCache:
    daemon: Daemon
    state: Path
    port: int

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        """The master and its workers (whose CPU time the master's counters lack)."""
        children = Path(f"/proc/{self.daemon.pid}/task/{self.daemon.pid}/children")
        try:
            workers = [int(p) for p in children.read_text().split()]
        except (OSError, ValueError):
            workers = []
        return [self.daemon.pid, *workers]

    def stop(self) -> None:
        self.daemon.stop()
        self.daemon.kill_group()  # its worker processes
        shutil.rmtree(self.state, ignore_errors=True)


def start_slice_cache(upstream: str) -> SliceCache:
    """nginx caching the blobs of the registry at `upstream` ("HOST:PORT") slice by slice."""
    state = Path(tempfile.mkdtemp(prefix="bs-slicecache-", dir="/tmp"))
    port = free_tcp_port()
    # As root, workers would drop to `nobody`, who cannot write the cache under /tmp/bs-*.
    user = "user root root;" if os.geteuid() == 0 else ""
    conf = state / "nginx.conf"
    conf.write_text(_CONF.format(user=user, state=state, port=port, upstream=upstream, slice=SLICE))
    try:
        daemon = start_daemon(
            "nginx slice cache",
            ["nginx", "-p", str(state), "-c", str(conf), "-e", str(state / "error.log")],
            state / "nginx.out",
            ready=lambda: tcp_port_answers("127.0.0.1", port),
        )
    except BaseException:
        shutil.rmtree(state, ignore_errors=True)
        raise
    return SliceCache(daemon, state, port)
