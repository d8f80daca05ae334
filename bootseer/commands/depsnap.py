"""`bootseer depsnap`: ensure, run, key, release, serve, pod-client."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bootseer.options import EXIT_USAGE, CommandError, add_common_arguments, configure_events, load_config, override
from depsnap.settings import DepsnapConfig

if TYPE_CHECKING:
    from depsnap.client import Node
    from depsnap.inputs import EnvRequest

STORE_ENV = "BOOTSEER_DEPSNAP_STORE"
# The [depsnap] fields that `ensure`, `run` and `serve` all take as flags of the same name.
_NODE_FLAGS = ("store", "cache_dir", "cache_max_bytes", "socket")


def _settings(args: argparse.Namespace, *flags: str, events_as: str = "") -> DepsnapConfig:
    """The [depsnap] config section with $BOOTSEER_DEPSNAP_STORE and then the
    command's `flags` (each named as its field) applied; with `events_as`,
    the event log set up under that name."""
    cfg = load_config(args)
    if events_as:
        configure_events(cfg, events_as)
    settings = cfg.depsnap
    if os.environ.get(STORE_ENV):
        settings.store = os.environ[STORE_ENV]
    override(settings, args, **{flag: flag for flag in flags})
    return settings


def _node(settings: DepsnapConfig, no_daemon: bool) -> Node:
    from depsnap import client
    from depsnap.cache import Cache
    from depsnap.progress import byte_progress

    if no_daemon:
        return client.LocalNode(Cache(settings.cache_dir, settings.cache_max_bytes), byte_progress())
    return client.connect(settings.socket, settings.cache_dir, settings.cache_max_bytes, byte_progress())


def _env_request(args: argparse.Namespace) -> EnvRequest:
    from depsnap.inputs import EnvRequest

    return EnvRequest(
        requirements=args.requirement,
        target=args.target,
        python=args.python,
        installer=args.installer,
        base_image=args.base_image,
    )


def _input_errors() -> tuple[type[Exception], ...]:
    from depsnap.image import ImageError
    from depsnap.inputs import InputError
    from depsnap.installer import InstallerError
    from depsnap.requirements import RequirementsError
    from depsnap.snapshot import RestoreError
    from depsnap.store import StoreUnavailable

    return (
        InputError,
        InstallerError,
        RequirementsError,
        RestoreError,
        ImageError,
        StoreUnavailable,
    )


def _pod_ensure(args: argparse.Namespace, settings: DepsnapConfig) -> int:
    from depsnap.podclient import Daemon, PodRefused, pod_ensure

    refusals: tuple[type[Exception], ...] = (PodRefused, *_input_errors())
    try:
        outcome = pod_ensure(_env_request(args), Daemon(settings.socket))
    except refusals as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    print(outcome.line())
    return outcome.returncode


def _ensure(args: argparse.Namespace) -> int:
    from depsnap.ensure import ensure
    from depsnap.podclient import can_mount
    from depsnap.wire import daemon_answers

    settings = _settings(args, *_NODE_FLAGS, "lazy_min_bytes", events_as="depsnap-ensure")
    # A caller that cannot mount (a pod) has the daemon mount for it.
    if args.pod or (not args.no_daemon and not can_mount() and daemon_answers(settings.socket)):
        return _pod_ensure(args, settings)
    try:
        outcome = ensure(
            _env_request(args),
            _node(settings, args.no_daemon),
            settings.store or None,
            args.restore,
            lazy_min_bytes=settings.lazy_min_bytes if settings.lazy_min_bytes >= 0 else None,
        )
    except _input_errors() as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    print(outcome.line())
    return outcome.returncode


def _run(args: argparse.Namespace) -> int:
    from depsnap.inputs import RunRequest
    from depsnap.run import memoise

    settings = _settings(args, *_NODE_FLAGS)
    command = args.command_argv
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CommandError("run needs a command after --", EXIT_USAGE)
    if not args.path:
        raise CommandError("run needs at least one --path to capture", EXIT_USAGE)
    request = RunRequest(command, args.input or [], args.path, args.base_image)
    try:
        outcome = memoise(request, _node(settings, args.no_daemon), settings.store or None)
    except _input_errors() as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    print(outcome.line(), file=sys.stderr)
    return outcome.returncode


def _key(args: argparse.Namespace) -> int:
    from depsnap import inputs as inputs_mod
    from depsnap.key import compute, describe

    load_config(args)
    try:
        if args.command_argv:
            command = args.command_argv[1:] if args.command_argv[0] == "--" else args.command_argv
            request = inputs_mod.RunRequest(command, args.input or [], args.path or [], args.base_image)
            gathered = inputs_mod.for_run(request, os.environ, Path.cwd())
        else:
            if not args.requirement or args.target is None:
                raise CommandError("key needs -r and --target (an environment), or -- COMMAND (a run)", EXIT_USAGE)
            gathered = inputs_mod.for_env(_env_request(args), os.environ, Path.cwd())
    except _input_errors() as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    print(describe(compute(gathered), gathered))
    return 0


def _pod_client(args: argparse.Namespace) -> int:
    from depsnap.podclient import write_zipapp

    load_config(args)
    try:
        write_zipapp(args.output)
    except OSError as exc:
        raise CommandError(f"cannot write {args.output}: {exc.strerror}") from None
    print(f"wrote {args.output}: run it in a pod as `python3 {args.output.name} ensure -r REQ --target DIR`")
    return 0


def _release(args: argparse.Namespace) -> int:
    from depsnap.snapshot import release

    load_config(args)
    release(args.target.absolute())
    return 0


def _serve(args: argparse.Namespace) -> int:
    from bootseer.daemon import Daemon
    from depsnap.daemon import AlreadyServing, serve
    from depsnap.pods import PodConfigError

    settings = _settings(args, *_NODE_FLAGS, "metrics_address", events_as="depsnap")
    status = f"serving dependency snapshots on {settings.socket}, node cache in {settings.cache_dir}"
    # An empty metrics host is every interface here, as it always was for depsnap.
    with Daemon("the depsnap daemon", status, settings.metrics_address, default_host="0.0.0.0") as daemon:
        try:
            serve(settings, on_started=daemon.started, on_ready=daemon.ready, on_stopping=daemon.stopping)
        except AlreadyServing as exc:
            raise CommandError(str(exc)) from None
        except PodConfigError as exc:
            raise CommandError(str(exc), EXIT_USAGE) from None
    return 0


def _add_env_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument(
        "-r",
        "--requirement",
        type=Path,
        action="append",
        required=required,
        help="requirements file (repeatable; -r/-c files it includes count too)",
    )
    parser.add_argument("--target", type=Path, required=required, help="the environment's directory")
    parser.add_argument(
        "--python",
        type=Path,
        default=Path(sys.executable),
        help="interpreter for the environment (default: the one running bootseer)",
    )
    parser.add_argument("--installer", choices=("uv", "pip"), default="uv")


def _add_base_image(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-image", help="digest of the container image this runs in (or BOOTSEER_BASE_IMAGE)")


def _add_node_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", help=f"snapshot store: directory or pyarrow.fs URI (or {STORE_ENV})")
    parser.add_argument("--cache-dir", type=Path, help="node cache directory (used without the daemon)")
    parser.add_argument("--cache-max-bytes", type=int, help="node cache size cap")
    parser.add_argument("--socket", type=Path, help="the node daemon's unix socket")
    parser.add_argument("--no-daemon", action="store_true", help="use the node cache directly")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "depsnap",
        help="snapshot installed dependencies once, restore them by key",
        description=(
            "Capture what an installer wrote once and restore it by key on every later start with the same inputs."
        ),
    )
    commands = parser.add_subparsers(dest="depsnap_command", required=True, metavar="COMMAND")

    ensure = commands.add_parser("ensure", help="restore the environment for requirements, or install and capture it")
    add_common_arguments(ensure)
    _add_env_arguments(ensure, required=True)
    _add_base_image(ensure)
    _add_node_arguments(ensure)
    ensure.add_argument(
        "--restore",
        choices=("mount", "copy"),
        default="mount",
        help="mount the image with a writable overlay (default), or copy its files",
    )
    ensure.add_argument(
        "--lazy-min-bytes",
        type=int,
        help="read images at least this large lazily from the store when mounting (default 256 MiB; negative: never)",
    )
    ensure.add_argument(
        "--pod",
        action="store_true",
        help="have the node daemon mount the environment into this process's namespace "
        "(the default when this process cannot mount and the daemon answers)",
    )
    ensure.set_defaults(func=_ensure)

    pod_client = commands.add_parser(
        "pod-client",
        help="write the pod client: one file, standard library only, for images without bootseer",
        description="Write a zipapp a pod runs as `python3 FILE ensure -r REQ --target DIR`: "
        "the environment from the node daemon, with no capability and only its socket.",
    )
    add_common_arguments(pod_client)
    pod_client.add_argument("-o", "--output", type=Path, required=True, help="where to write it")
    pod_client.set_defaults(func=_pod_client)

    run = commands.add_parser(
        "run",
        help="memoise any install command's effects under the given paths",
        description="Run COMMAND once and capture what it changed under each --path; "
        "later runs with the same command line and inputs restore that instead.",
    )
    add_common_arguments(run)
    run.add_argument("--input", type=Path, action="append", help="file the command reads (repeatable)")
    run.add_argument("--path", type=Path, action="append", help="directory it writes (repeatable)")
    _add_base_image(run)
    _add_node_arguments(run)
    run.add_argument("command_argv", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    run.set_defaults(func=_run)

    key = commands.add_parser(
        "key",
        help="print the key and every input that goes into it",
        description="For an environment give -r and --target; for a run give --input/--path and -- COMMAND.",
    )
    add_common_arguments(key)
    _add_env_arguments(key, required=False)
    _add_base_image(key)
    key.add_argument("--input", type=Path, action="append", help="run: an input file")
    key.add_argument("--path", type=Path, action="append", help="run: a captured path")
    key.add_argument("command_argv", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    key.set_defaults(func=_key)

    release = commands.add_parser("release", help="unmount and remove an environment that ensure put at TARGET")
    add_common_arguments(release)
    release.add_argument("--target", type=Path, required=True)
    release.set_defaults(func=_release)

    serve = commands.add_parser("serve", help="run the node daemon (node cache behind a unix socket)")
    add_common_arguments(serve)
    serve.add_argument("--store", help="default snapshot store for requests that name none")
    serve.add_argument("--cache-dir", type=Path, help="node cache directory")
    serve.add_argument("--cache-max-bytes", type=int, help="evict least recently used images above this")
    serve.add_argument("--socket", type=Path, help="unix socket to serve on")
    serve.add_argument("--metrics-address", help="host:port for Prometheus metrics; empty: off")
    serve.set_defaults(func=_serve)
