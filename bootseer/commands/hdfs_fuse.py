"""`bootseer hdfs-fuse`: mount, umount, prefetch and copy remote checkpoints."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bootseer.options import CommandError, add_common_arguments, configure_events, load_config
from hdfs_fuse.settings import HdfsFuseConfig, parse_bool, parse_size

# (config field, value parser, help) for every tunable; each becomes a flag
# --field-name overriding the [hdfs_fuse] section of the config file.
_TUNABLES: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("stripe_size", parse_size, "bytes per range read (e.g. 8M)"),
    ("streams", int, "parallel range reads"),
    ("readahead", parse_size, "read-ahead window of a sequential reader, at most (e.g. 256M)"),
    ("memory", parse_size, "memory for in-flight and buffered stripes (e.g. 512M)"),
    ("retries", int, "retries of a failed stripe read before EIO"),
    ("backoff", float, "first retry delay in seconds (doubles each retry)"),
    ("backoff_max", float, "longest retry delay in seconds"),
    ("stripe_timeout", float, "seconds before a slow stripe read gets a second, racing read"),
    ("io_timeout", float, "network timeout in seconds"),
    ("cache_dir", str, "local disk cache of stripes (default: none)"),
    ("cache_size", parse_size, "disk cache size (e.g. 20G)"),
)
_MOUNT_TUNABLES: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("attr_ttl", float, "seconds listings and attributes are cached"),
    ("kernel_readahead", parse_size, "kernel read-ahead of the mount (e.g. 32M; 0 leaves it)"),
    ("metrics_address", str, "host:port to serve Prometheus metrics on; empty: off"),
    ("page_cache_push", parse_bool, "push arriving stripes into the kernel's page cache (on/off)"),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_tunables(parser: argparse.ArgumentParser, table: tuple[tuple[str, Callable[[str], Any], str], ...]) -> None:
    for name, kind, text in table:
        parser.add_argument(_flag(name), dest=name, type=kind, help=text)


def _settings(args: argparse.Namespace, events_as: str = "") -> HdfsFuseConfig:
    cfg = load_config(args)
    if events_as:
        configure_events(cfg, events_as)
    base = cfg.hdfs_fuse
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(HdfsFuseConfig)
        if getattr(args, f.name, None) is not None
    }
    settings = dataclasses.replace(base, **overrides)
    settings.validate()
    return settings


def _mount(args: argparse.Namespace) -> int:
    from hdfs_fuse import mount

    settings = _settings(args, events_as="hdfs-fuse" if args.foreground else "")
    if args.foreground:
        from bootseer.daemon import Daemon
        from hdfs_fuse.uri import parse

        # The URI as the daemon logs it.
        status = f"serving {parse(args.uri)} read-only on {args.mountpoint.absolute()}"
        with Daemon("the hdfs-fuse mount", status, settings.metrics_address) as daemon:
            mount.run(
                args.uri,
                args.mountpoint,
                settings,
                allow_other=args.allow_other,
                on_started=daemon.started,
                on_ready=daemon.ready,
                on_stopping=daemon.stopping,
            )
        return 0
    child = ["hdfs-fuse", "mount", "--foreground", args.uri, str(args.mountpoint.absolute())]
    for f in dataclasses.fields(HdfsFuseConfig):
        child += [_flag(f.name), str(getattr(settings, f.name))]
    if args.allow_other:
        child.append("--allow-other")
    for name in ("config", "log_level", "log_format"):
        if getattr(args, name):
            child += [_flag(name), str(getattr(args, name))]
    log_path = args.log_file or mount.default_log_path(args.mountpoint)
    pid = mount.spawn(mount.foreground_argv(child), args.mountpoint, log_path)
    print(f"mounted {args.uri} on {args.mountpoint} (pid {pid}, log {log_path})")
    return 0


def _umount(args: argparse.Namespace) -> int:
    from hdfs_fuse import mount

    load_config(args)
    mount.unmount(args.mountpoint, lazy=args.lazy)
    return 0


def _copy(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from hdfs_fuse.copy import copy, plan
    from hdfs_fuse.reader import Client

    settings = _settings(args)
    with Client(settings) as client:
        total = sum(size for _, _, size in plan(client, args.uri, args.dest))
        with tqdm(total=total, unit="B", unit_scale=True, desc="copy", disable=args.quiet) as bar:
            report = copy(client, args.uri, args.dest, progress=bar.update)
    print(f"copied {report.files} files, {report.bytes} bytes to {args.dest}")
    return 0


# How often `prefetch --wait` reads the status.
_POLL_S = 0.2


def _prefetch(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from hdfs_fuse import prefetch_client

    load_config(args)
    files = list(prefetch_client.files_under(args.paths))
    started = [(path, prefetch_client.request(path)) for path in files]
    for path, state in started:
        print(f"{path}: {state.line()}")
    if not args.wait:
        return 0
    failed = 0
    total = sum(state.size for _, state in started)
    with tqdm(total=total, unit="B", unit_scale=True, desc="prefetch", disable=args.quiet) as bar:
        for path, first in started:
            state = first
            bar.update(state.pushed_bytes)
            while not state.ended:
                time.sleep(_POLL_S)
                previous, state = state.pushed_bytes, prefetch_client.status(path)
                bar.update(state.pushed_bytes - previous)
            if state.state == "failed":
                failed += 1
            print(f"{path}: {state.line()}")
    return 1 if failed else 0


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Expected failures (bad URI or option, unreachable store, mount trouble)
    as a `CommandError`: one line, exit 1."""

    def run(args: argparse.Namespace) -> int:
        from hdfs_fuse.mount import MountError

        try:
            return func(args)
        except (OSError, ValueError, MountError) as exc:
            raise CommandError(str(exc)) from None

    return run


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "hdfs-fuse",
        help="striped parallel reads of remote checkpoints (mount, copy)",
        description=(
            "Read remote files (hdfs://, s3://, gs://, http(s)://, file://) in parallel stripes "
            "with read-ahead: mount a remote prefix read-only, or copy it to local disk."
        ),
    )
    commands = parser.add_subparsers(dest="hdfs_fuse_command", required=True, metavar="COMMAND")

    mount = commands.add_parser(
        "mount",
        help="mount a remote prefix read-only",
        description="Mount URI (a directory or a single file) read-only on MOUNTPOINT.",
    )
    add_common_arguments(mount)
    mount.add_argument("uri", metavar="URI")
    mount.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path)
    mount.add_argument("--foreground", action="store_true", help="serve in this process (systemd)")
    mount.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    mount.add_argument("--log-file", type=Path, help="daemon log when not in the foreground")
    _add_tunables(mount, _TUNABLES + _MOUNT_TUNABLES)
    mount.set_defaults(func=_guarded(_mount))

    umount = commands.add_parser("umount", help="unmount", description="Unmount an hdfs-fuse mount.")
    add_common_arguments(umount)
    umount.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path)
    umount.add_argument("--lazy", action="store_true", help="detach now, clean up when no longer busy")
    umount.set_defaults(func=_guarded(_umount))

    prefetch = commands.add_parser(
        "prefetch",
        help="have a mount fetch files into the page cache ahead of their reader",
        description=(
            "Ask the hdfs-fuse mount the PATHs are on to fetch each file (every file below a directory) "
            "into the page cache now, so a later read finds it there. A pod does the same by reading "
            "the file's user.bootseer.prefetch attribute."
        ),
    )
    add_common_arguments(prefetch)
    prefetch.add_argument("paths", metavar="PATH", type=Path, nargs="+")
    prefetch.add_argument("--wait", action="store_true", help="return once every prefetch ended; exit 1 if one failed")
    prefetch.add_argument("--quiet", action="store_true", help="no progress bar")
    prefetch.set_defaults(func=_guarded(_prefetch))

    copy = commands.add_parser(
        "copy",
        help="pull a remote file or directory to local disk at full speed",
        description="Copy URI (a file or directory) to DEST through the striped reader.",
    )
    add_common_arguments(copy)
    copy.add_argument("uri", metavar="URI")
    copy.add_argument("dest", metavar="DEST", type=Path)
    copy.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_tunables(copy, _TUNABLES)
    copy.set_defaults(func=_guarded(_copy))
