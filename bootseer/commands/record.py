"""`bootseer record start|stop|show IMAGE`: explicit control of hot-block
recording on this node (recording also starts by itself on the first run of
an image that has no hot-block manifest)."""

from __future__ import annotations

import argparse
import sys
import time

from bootseer.config import Config
from bootseer.options import add_common_arguments, load_config
from recorder import requests
from recorder.manifest import HotManifest

# How long `record stop` waits for the layer server to publish the manifest.
STOP_WAIT_S = 60.0
SHOW_BLOCKS = 50


def _image_request(cfg: Config, image: str, plain_http: bool) -> requests.ImageRequest:
    from snapshotter.registry.config import client_from_config
    from snapshotter.registry.reference import parse as parse_reference

    ref = parse_reference(image)
    with client_from_config(cfg.registry, plain_http) as client:
        resolved = client.resolve(ref)
    existing = requests.read(cfg.fs.store, resolved.manifest_digest.split(":", 1)[1])
    return existing or requests.ImageRequest(
        ref=str(ref), image=resolved.manifest_digest, layers=[d.digest for d in resolved.manifest.layers]
    )


def _run(args: argparse.Namespace) -> int:
    from snapshotter.registry.errors import RegistryError
    from snapshotter.registry.reference import InvalidReference

    cfg = load_config(args)
    try:
        request = _image_request(cfg, args.image, args.plain_http)
    except (RegistryError, InvalidReference) as exc:
        print(f"bootseer record: {exc}", file=sys.stderr)
        return 1
    if args.action == "show":
        return _show(cfg, request.image)
    if args.action == "start":
        request.record, request.stop = True, False
    else:
        request.stop = True
    before = _runs(cfg, request.image)
    requests.write(cfg.fs.store, request)
    try:
        requests.notify(cfg.fs.mountpoint, request.name)
    except OSError as exc:
        print(f"bootseer record: the layer server at {cfg.fs.mountpoint} did not answer: {exc}", file=sys.stderr)
        return 1
    if args.action == "start":
        print(f"recording {request.image}: run the image; `bootseer record stop {args.image}` publishes")
        return 0
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline and _runs(cfg, request.image) == before:
        time.sleep(0.2)
    request.record = request.stop = False
    requests.write(cfg.fs.store, request)
    return _show(cfg, request.image)


def _local(cfg: Config, image: str) -> HotManifest | None:
    from recorder.localstore import LocalManifests

    path = cfg.fs.store / "hot.lmdb"
    if not path.exists():
        return None
    local = LocalManifests(path, readonly=True)
    try:
        return local.get(image)
    finally:
        local.close()


def _runs(cfg: Config, image: str) -> int:
    manifest = _local(cfg, image)
    return manifest.runs if manifest else 0


def _show(cfg: Config, image: str) -> int:
    manifest = _local(cfg, image)
    if manifest is None:
        print(f"{image}: no hot-block manifest on this node")
        return 1
    print(
        f"image {manifest.image}: {len(manifest.blocks)} hot blocks, {manifest.total_bytes} bytes, {manifest.runs} run(s)"
    )
    print(f"{'first access':>12}  {'size':>9}  layer / block")
    for b in manifest.blocks[:SHOW_BLOCKS]:
        print(f"{b.first_access_ms:>10}ms  {b.size:>9}  {b.layer[:19]}.../{b.block}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "record",
        help="record an image's hot blocks, or show its hot-block manifest",
        description=(
            "Control hot-block recording on this node. `start` records the next run of IMAGE "
            "(merged into its manifest if it has one), `stop` ends the recording and publishes "
            "the manifest, `show` prints the manifest this node holds."
        ),
    )
    add_common_arguments(parser)
    parser.add_argument("action", choices=("start", "stop", "show"))
    parser.add_argument("image", help="image reference")
    parser.add_argument("--plain-http", action="store_true", help="talk to the registry over HTTP")
    parser.set_defaults(func=_run)
