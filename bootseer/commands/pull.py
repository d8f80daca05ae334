"""`bootseer pull IMAGE`: a lazy pull through containerd's own services."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

from bootseer.options import CommandError, add_common_arguments, configure_events, load_config
from snapshotter.containerd_client import DEFAULT_ADDRESS, ContainerdClient
from snapshotter.pull import DEFAULT_SNAPSHOTTER, Puller, PullError
from snapshotter.registry.config import client_from_config
from snapshotter.registry.errors import RegistryError
from snapshotter.registry.reference import InvalidReference


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    configure_events(cfg, "pull")
    try:
        with (
            client_from_config(cfg.registry, args.plain_http, args.hosts_dir, args.docker_config) as registry,
            ContainerdClient(args.address, args.namespace) as containerd,
        ):
            result = Puller(registry, containerd, args.snapshotter).pull(args.image, args.platform)
    except (InvalidReference, RegistryError, PullError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    except grpc.RpcError as exc:
        detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        raise CommandError(f"containerd at {args.address}: {detail}") from None
    counts = {how: sum(1 for layer in result.layers if layer.how == how) for how in ("remote", "fetched", "present")}
    print(
        f"{result.name}: {result.manifest_digest} ({counts['remote']} remote, {counts['fetched']} fetched, "
        f"{counts['present']} already present; {result.fetched_bytes} bytes fetched)"
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "pull",
        help="pull an image into containerd, lazily where the snapshotter can",
        description=(
            "Pull IMAGE into containerd through its content, leases, snapshots, diff and images "
            "services, adding the labels a remote snapshotter needs to serve layers lazily. "
            "Afterwards `ctr run --snapshotter SNAPSHOTTER IMAGE ...` works as after `ctr images pull`."
        ),
    )
    add_common_arguments(parser)
    parser.add_argument("image", help="image reference, e.g. registry.example.com/team/train:v1")
    parser.add_argument(
        "--address",
        type=Path,
        default=Path(os.environ.get("CONTAINERD_ADDRESS", DEFAULT_ADDRESS)),
        help=f"containerd's socket (default $CONTAINERD_ADDRESS or {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--namespace",
        "-n",
        default=os.environ.get("CONTAINERD_NAMESPACE", "default"),
        help="containerd namespace (default $CONTAINERD_NAMESPACE or 'default')",
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
    parser.set_defaults(func=_run)
