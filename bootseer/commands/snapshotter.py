"""`bootseer snapshotter`, `bootseer layer-server` and `bootseer index`: the
snapshotter part's daemons, and indexing an image for lazy pulling."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bootseer.options import EXIT_USAGE, CommandError, add_common_arguments, configure_events, load_config, override
from snapshotter.layer.index import MAX_BLOCK_BYTES


def _run(args: argparse.Namespace) -> int:
    from bootseer.daemon import Daemon
    from snapshotter.server import serve
    from snapshotter.trust import TrustError

    cfg = load_config(args)
    override(
        cfg.snapshotter,
        args,
        root="root",
        address="address",
        metrics_address="metrics_address",
        lazy="lazy",
        pull_address="pull_address",
    )
    override(cfg.fs, args, store="fs_store", mountpoint="fs_mountpoint")
    override(
        cfg.cri,
        args,
        address="cri_address",
        containerd_address="cri_containerd_address",
        prefetch_roots="cri_prefetch_roots",
    )
    override(cfg.registry, args, cri_credentials="cri_credentials")
    configure_events(cfg, "snapshotter")
    status = f"serving containerd snapshots on {cfg.snapshotter.address}, state in {cfg.snapshotter.root}"
    if cfg.snapshotter.pull_address:
        status += f"; pulls on {cfg.snapshotter.pull_address}"
    if cfg.cri.address:
        status += f"; CRI image service proxy on {cfg.cri.address}"
    with Daemon("the snapshotter", status, cfg.snapshotter.metrics_address) as daemon:
        try:
            serve(
                cfg.snapshotter,
                cfg.fs,
                cfg.registry,
                cfg.cri,
                cfg.trust,
                on_started=daemon.started,
                on_ready=daemon.ready,
                on_stopping=daemon.stopping,
            )
        except TrustError as exc:
            raise CommandError(str(exc)) from None
    return 0


def _run_layer_server(args: argparse.Namespace) -> int:
    from bootseer.daemon import Daemon, Notifier
    from snapshotter.fs.server import MountpointBusy, release, serve

    cfg = load_config(args)
    override(cfg.fs, args, store="store", mountpoint="mountpoint", metrics_address="metrics_address")
    override(cfg.fs, args, holder_socket="holder_socket")
    override(cfg.registry, args, cri_credentials="cri_credentials")
    if args.release:
        release(cfg.fs, Notifier.from_environment().send)
        print(f"released the layer mount at {cfg.fs.mountpoint}")
        return 0
    configure_events(cfg, "layer-server")
    status = f"serving lazily pulled layers on {cfg.fs.mountpoint} from {cfg.fs.store}"
    with Daemon("the layer server", status, cfg.fs.metrics_address) as daemon:
        try:
            serve(
                cfg.fs,
                cfg.registry,
                on_started=daemon.started,
                on_ready=daemon.ready,
                on_stopping=daemon.stopping,
                notify=daemon.notifier.send,
            )
        except MountpointBusy as exc:
            raise CommandError(str(exc)) from None
    return 0


def _run_index(args: argparse.Namespace) -> int:
    from snapshotter.indexer import index_image
    from snapshotter.registry.config import client_from_config
    from snapshotter.registry.errors import RegistryError
    from snapshotter.registry.reference import InvalidReference
    from snapshotter.registry.reference import parse as parse_reference
    from snapshotter.trust import TrustError, signing_key

    cfg = load_config(args)
    override(cfg.trust, args, signing_key="signing_key")
    if args.span is not None and not 0 < args.span <= MAX_BLOCK_BYTES:
        raise CommandError(f"--span must be between 1 and {MAX_BLOCK_BYTES} bytes", EXIT_USAGE)
    try:
        key = signing_key(cfg.trust)
    except TrustError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    if key is None:
        print(
            "bootseer index: no [trust] signing_key: the indexes are pushed unsigned, and nodes that "
            "require signatures (the default) will not serve them lazily",
            file=sys.stderr,
        )
    client = client_from_config(cfg.registry, plain_http=args.plain_http)
    try:
        report = index_image(
            client, parse_reference(args.image), args.platform, args.span, not args.quiet, signing_key=key
        )
    except (RegistryError, InvalidReference) as exc:
        raise CommandError(str(exc)) from None
    print(f"image manifest {report.manifest_digest}")
    if report.signer:
        print(f"signing with {report.signer}")
    for digest in report.indexed:
        print(f"  indexed  {digest}")
    for digest in report.reused:
        print(f"  already  {digest}")
    for digest, why in report.skipped.items():
        print(f"  skipped  {digest}: {why}")
    if report.artifact_digest:
        print(f"pushed index artifact {report.artifact_digest}")
    else:
        print("nothing new to index")
    return 0


def _add_cri_credentials(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cri-credentials",
        help="the file of registry credentials captured from kubelet's PullImage calls "
        "([registry] cri_credentials); empty: not used",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "snapshotter",
        help="serve the containerd proxy snapshotter",
        description=(
            "Serve containerd's snapshots API on a unix socket. Register it in containerd's "
            'config.toml as [proxy_plugins.bootseer] type = "snapshot" address = SOCKET. '
            "With --cri-address (or [cri] address), also serve the CRI image-service proxy that "
            "kubelet's --image-service-endpoint points at; see docs/kubernetes.md."
        ),
    )
    add_common_arguments(parser)
    parser.add_argument("--root", type=Path, help="state directory (snapshots and metadata)")
    parser.add_argument(
        "--no-lazy",
        dest="lazy",
        action="store_false",
        default=None,
        help="never serve layers lazily; unpack every layer the normal way",
    )
    parser.add_argument("--fs-store", type=Path, help="the layer store shared with the layer server")
    parser.add_argument("--fs-mountpoint", type=Path, help="the layer server's mount")
    parser.add_argument("--address", type=Path, help="unix socket to serve on")
    parser.add_argument("--metrics-address", help="host:port to serve Prometheus metrics on; empty: off")
    parser.add_argument(
        "--pull-address",
        help="unix socket on which to run `bootseer pull` for its clients ([snapshotter] pull_address); empty: off",
    )
    parser.add_argument(
        "--cri-address",
        help="unix socket for the CRI image-service proxy (kubelet's --image-service-endpoint); empty: off",
    )
    parser.add_argument(
        "--cri-containerd-address", type=Path, help="containerd's socket, where the proxy forwards CRI image calls"
    )
    parser.add_argument(
        "--cri-prefetch-root",
        dest="cri_prefetch_roots",
        action="append",
        metavar="DIR",
        help="pods may have files of hdfs-fuse mounts below DIR prefetched at PullImage (repeatable; "
        "[cri] prefetch_roots); none: off",
    )
    _add_cri_credentials(parser)
    parser.set_defaults(func=_run)

    layers = sub.add_parser(
        "layer-server",
        help="serve lazily pulled layers through one FUSE mount",
        description=(
            "Mount the FUSE layer server: every layer in the layer store appears as a "
            "directory of the mount, its blocks fetched from the registry on first read. "
            "Runs apart from the snapshotter so that restarting it leaves containers alone, and "
            "the mount outlives it: a new layer server takes the same mount over after a crash or a "
            "restart (docs/fuse-failover.md)."
        ),
    )
    add_common_arguments(layers)
    layers.add_argument("--store", type=Path, help="layer store directory")
    layers.add_argument("--mountpoint", type=Path, help="where to mount")
    layers.add_argument("--metrics-address", help="host:port for Prometheus metrics; empty: off")
    layers.add_argument(
        "--holder-socket",
        type=Path,
        help="where the descriptor holder keeps the mount's connection when no service manager does",
    )
    layers.add_argument(
        "--release",
        action="store_true",
        help="the final stop: unmount the layer mount and let its descriptor holder go "
        "(a SIGTERM to the server leaves the mount for the next one)",
    )
    _add_cri_credentials(layers)
    layers.set_defaults(func=_run_layer_server)

    index = sub.add_parser(
        "index",
        help="index an image's layers for lazy pulling and push the index to its registry",
        description=(
            "Read each layer of IMAGE once, build its layer index (table of contents and "
            "gzip checkpoints) and push the indexes as an OCI artifact whose subject is the "
            "image manifest. Running it again only indexes what is missing."
        ),
    )
    add_common_arguments(index)
    index.add_argument("image", help="image reference, e.g. registry.example.com/team/train:v3")
    index.add_argument("--plain-http", action="store_true", help="talk to the registry over HTTP")
    index.add_argument("--platform", help="os/arch[/variant] of a multi-platform image (default: this host's)")
    index.add_argument(
        "--span",
        type=int,
        help=(
            "uncompressed bytes per block, the unit of lazy fetching, every block alike (at most 128 MiB; "
            "default: 1 MiB, and blocks of data that does not compress merged up to 4 MiB)"
        ),
    )
    index.add_argument("--quiet", action="store_true", help="no progress bars")
    index.add_argument(
        "--signing-key",
        help="the Ed25519 private key (PEM) to sign the indexes with ([trust] signing_key); "
        "nodes serve lazily only from indexes signed by a key in their [trust] keys",
    )
    index.set_defaults(func=_run_index)
