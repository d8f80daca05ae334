"""`bootseer pull IMAGE`: a lazy pull through containerd's own services,
run by the snapshotter daemon when it serves pulls (`[snapshotter]
pull_address`), else in this process.

Nothing heavier than the standard library is imported on the way to the
daemon: this command is on the critical path of every lazy start, and the
daemon has gRPC, the registry client and their connections warm
(snapshotter.pullwire)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from bootseer import config as config_mod
from bootseer.options import CommandError, add_common_arguments, configure_events, configure_logging, read_config
from snapshotter.pullwire import (
    DEFAULT_CONTAINERD,
    DEFAULT_NAMESPACE,
    DEFAULT_SNAPSHOTTER,
    DaemonAbsent,
    PullRequest,
    RequestRefused,
    request_pull,
)


class LayerBar:
    """One tqdm bar per layer: bytes fetched, or how it was satisfied.
    enabled None: a bar only on a terminal (tqdm's own rule); with no bar
    tqdm is not even imported."""

    def __init__(self, index: int, count: int, digest: str, size: int, enabled: bool | None = None) -> None:
        if not (sys.stderr.isatty() if enabled is None else enabled):
            self.bar = None
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=size, desc=f"layer {index + 1}/{count} {digest[7:19]}", unit="B", unit_scale=True, file=sys.stderr
        )

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def done(self, how: str) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix_str(how)
        if how != "fetched":
            self.bar.update((self.bar.total or 0) - self.bar.n)
        self.bar.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _through_daemon(address: Path, request: PullRequest) -> dict[str, Any]:
    """The pull run by the daemon on `address`: its `done` event. Raises
    DaemonAbsent if no daemon serves there, RequestRefused if it does not
    take the request."""
    bars: dict[int, LayerBar] = {}
    try:
        for event in request_pull(address, request):
            kind = event["event"]
            if kind == "layer":
                bars[event["index"]] = LayerBar(event["index"], event["count"], event["digest"], event["size"])
            elif kind == "fetched" and event["index"] in bars:
                bars[event["index"]].advance(event["bytes"])
            elif kind == "layer_done" and event["index"] in bars:
                bars.pop(event["index"]).done(event["how"])
            elif kind == "error":
                raise CommandError(str(event.get("message")))
            elif kind == "done":
                return event
    except (ConnectionError, OSError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    finally:
        for bar in bars.values():
            bar.close()
    raise CommandError(f"the snapshotter on {address} ended the pull without a result")


def _in_process(cfg: config_mod.Config, request: PullRequest) -> dict[str, Any]:
    from snapshotter.containerd_client import ContainerdClient
    from snapshotter.pull import failure_message, pull_request, registry_client
    from snapshotter.registry.media import Descriptor

    configure_logging(cfg)
    configure_events(cfg, "pull")

    def bar(index: int, count: int, layer: Descriptor) -> LayerBar:
        return LayerBar(index, count, layer.digest, layer.size)

    try:
        with (
            registry_client(cfg.registry, request.plain_http, request.hosts_dir, request.docker_config) as registry,
            ContainerdClient(Path(request.address), request.namespace) as containerd,
        ):
            result = pull_request(request, registry, containerd, bar)
    except Exception as exc:
        message = failure_message(exc, request.address)
        if message is None:
            raise
        raise CommandError(message) from None
    return result.as_event()


def _run(args: argparse.Namespace) -> int:
    started = time.time()
    cfg = read_config(args)
    request = PullRequest(
        image=args.image,
        address=str(args.address),
        namespace=args.namespace,
        snapshotter=args.snapshotter,
        platform=args.platform,
        plain_http=args.plain_http,
        hosts_dir=str(args.hosts_dir or cfg.registry.config_path),
        docker_config=str(cfg.registry.credentials_file(args.docker_config)),
        started=started,
    )
    result = None
    if cfg.snapshotter.pull_address and not args.in_process:
        try:
            result = _through_daemon(Path(cfg.snapshotter.pull_address), request)
        except RequestRefused as exc:
            print(f"bootseer pull: {exc}; pulling in this process", file=sys.stderr)
        except DaemonAbsent:
            pass
    if result is None:
        result = _in_process(cfg, request)
    layers = result["layers"]
    counts = {how: sum(1 for layer in layers if layer["how"] == how) for how in ("remote", "fetched", "present")}
    fetched = sum(layer["fetched_bytes"] for layer in layers)
    print(
        f"{result['name']}: {result['manifest']} ({counts['remote']} remote, {counts['fetched']} fetched, "
        f"{counts['present']} already present; {fetched} bytes fetched)"
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "pull",
        help="pull an image into containerd, lazily where the snapshotter can",
        description=(
            "Pull IMAGE into containerd through its content, leases, snapshots, diff and images "
            "services, adding the labels a remote snapshotter needs to serve layers lazily. "
            "Afterwards `ctr run --snapshotter SNAPSHOTTER IMAGE ...` works as after `ctr images pull`. "
            "The bootseer snapshotter runs the pull when it serves [snapshotter] pull_address "
            "(with its [registry] settings and these flags on top); otherwise, or with --in-process, "
            "this command pulls itself."
        ),
    )
    add_common_arguments(parser)
    parser.add_argument("image", help="image reference, e.g. registry.example.com/team/train:v1")
    parser.add_argument(
        "--address",
        type=Path,
        default=Path(os.environ.get("CONTAINERD_ADDRESS", DEFAULT_CONTAINERD)),
        help=f"containerd's socket (default $CONTAINERD_ADDRESS or {DEFAULT_CONTAINERD})",
    )
    parser.add_argument(
        "--namespace",
        "-n",
        default=os.environ.get("CONTAINERD_NAMESPACE", DEFAULT_NAMESPACE),
        help=f"containerd namespace (default $CONTAINERD_NAMESPACE or {DEFAULT_NAMESPACE!r})",
    )
    parser.add_argument("--plain-http", action="store_true", help="talk HTTP, not HTTPS, to the registry")
    parser.add_argument("--platform", help="OS/ARCH[/VARIANT] to pick from a multi-platform image (default: this host)")
    parser.add_argument(
        "--snapshotter", default=DEFAULT_SNAPSHOTTER, help=f"snapshotter to unpack into (default {DEFAULT_SNAPSHOTTER})"
    )
    parser.add_argument(
        "--hosts-dir",
        type=Path,
        default=None,
        help="containerd-style certs.d directory with <host>/hosts.toml (default: the config's registry.config_path)",
    )
    parser.add_argument(
        "--docker-config",
        type=Path,
        default=None,
        help="registry credentials (default $DOCKER_CONFIG/config.json or ~/.docker/config.json)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="pull in this process even when the snapshotter serves pulls",
    )
    parser.set_defaults(func=_run)
