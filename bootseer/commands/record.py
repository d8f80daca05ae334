"""`bootseer record start|stop|show|publish IMAGE`: explicit control of
hot-block recording on this node (recording also starts by itself on the
first run of an image that has no hot-block manifest), and publishing this
node's manifest from a designated recorder or a CI run."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from bootseer.config import Config
from bootseer.options import CommandError, add_common_arguments, load_config
from recorder.manifest import HotManifest
from snapshotter.fs import control
from snapshotter.fs.layers import LayerStore

if TYPE_CHECKING:
    from recorder.localstore import LocalManifest

# How long `record stop` waits for the layer server to publish the manifest.
STOP_WAIT_S = 60.0
SHOW_BLOCKS = 50


def _image_request(cfg: Config, store: LayerStore, image: str, plain_http: bool) -> control.ImageRequest:
    from snapshotter.registry.config import client_from_config
    from snapshotter.registry.errors import RegistryError
    from snapshotter.registry.reference import InvalidReference
    from snapshotter.registry.reference import parse as parse_reference

    try:
        ref = parse_reference(image)
        with client_from_config(cfg.registry, plain_http) as client:
            resolved = client.resolve(ref)
    except (RegistryError, InvalidReference) as exc:
        raise CommandError(str(exc)) from None
    existing = control.read_request(store, resolved.manifest_digest.split(":", 1)[1])
    return existing or control.ImageRequest(
        ref=str(ref), image=resolved.manifest_digest, layers=[d.digest for d in resolved.manifest.layers]
    )


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    store = LayerStore(cfg.fs.store)
    request = _image_request(cfg, store, args.image, args.plain_http)
    if args.action == "show":
        return _show(store, request.image)
    if args.action == "publish":
        return _publish(cfg, store, request, args.plain_http)
    if args.action == "start":
        request.record, request.stop = True, False
    else:
        request.stop = True
    before = _runs(store, request.image)
    control.write_request(store, request)
    try:
        control.notify(cfg.fs.mountpoint, request.name)
    except OSError as exc:
        raise CommandError(f"the layer server at {cfg.fs.mountpoint} did not answer: {exc}") from None
    if args.action == "start":
        print(f"recording {request.image}: run the image; `bootseer record stop {args.image}` publishes")
        return 0
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline and _runs(store, request.image) == before:
        time.sleep(0.2)
    request.record = request.stop = False
    control.write_request(store, request)
    return _show(store, request.image)


def _entry(store: LayerStore, image: str) -> LocalManifest | None:
    from recorder.localstore import LocalManifests

    if not store.hot_manifests_path.exists():
        return None
    local = LocalManifests(store.hot_manifests_path, readonly=True)
    try:
        return local.entry(image)
    finally:
        local.close()


def _local(store: LayerStore, image: str) -> HotManifest | None:
    entry = _entry(store, image)
    return entry.manifest if entry is not None else None


def _publish(cfg: Config, store: LayerStore, request: control.ImageRequest, plain_http: bool) -> int:
    """Push this node's manifest, merged with the published ones it does
    not include yet, and prune those it replaces. The layer server keeps its
    local copy as it is (this process cannot write its LMDB): a manifest
    published here is picked up by every node, this one included, on its
    next start."""
    from recorder import manifest as hot
    from recorder import publish
    from snapshotter.registry.config import client_from_config
    from snapshotter.registry.errors import RegistryError
    from snapshotter.registry.reference import parse as parse_reference

    entry = _entry(store, request.image)
    if entry is None:
        raise CommandError(f"{request.image}: no hot-block manifest on this node; record a run first")
    indexes = {}
    for layer in {b.layer for b in entry.manifest.blocks} | set(request.layers):
        try:
            if store.has(layer):
                indexes[layer] = store.load(layer.split(":", 1)[1])[0]
        except (OSError, ValueError):
            continue  # not a layer this node can check: check() refuses its blocks

    def check(manifest: HotManifest) -> None:
        # Blocks of layers this node does not hold cannot be checked: such a
        # manifest is left out (and pruned) rather than trusted.
        hot.check(manifest, request.image, indexes)

    ref = parse_reference(request.ref)
    try:
        check(entry.manifest)
        with client_from_config(cfg.registry, plain_http) as client:
            found = publish.find(client, ref, request.image)
            merged, _ = publish.combine(entry.manifest, found, entry.includes, check)
            assert merged is not None
            digest = publish.publish(client, ref, request.image, merged, found)
    except hot.ManifestError as exc:
        raise CommandError(f"this node's hot-block manifest does not match {request.image}: {exc}") from None
    except RegistryError as exc:
        raise CommandError(str(exc)) from None
    superseded = len([p for p in found if p.digest != digest])
    print(
        f"published {request.image}'s hot-block manifest as {digest}: {len(merged.blocks)} blocks, "
        f"{merged.runs} run(s); {superseded} superseded manifest(s) pruned"
    )
    return 0


def _runs(store: LayerStore, image: str) -> int:
    manifest = _local(store, image)
    return manifest.runs if manifest else 0


def _show(store: LayerStore, image: str) -> int:
    manifest = _local(store, image)
    if manifest is None:
        print(f"{image}: no hot-block manifest on this node")
        return 1
    blocks = len(manifest.blocks)
    print(f"image {manifest.image}: {blocks} hot blocks, {manifest.total_bytes} bytes, {manifest.runs} run(s)")
    entry = _entry(store, image)
    if entry is not None and entry.published:
        print(f"published as {entry.published}")
    else:
        print("this node's own (not published: see `bootseer record publish`)")
    print(f"{'first access':>12}  {'size':>9}  layer / block (+: its first parts only)")
    for b in manifest.blocks[:SHOW_BLOCKS]:
        print(f"{b.first_access_ms:>10}ms  {b.size:>9}  {b.layer[:19]}.../{b.block}{' +' if b.partial else ''}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "record",
        help="record an image's hot blocks, or show its hot-block manifest",
        description=(
            "Control hot-block recording on this node. `start` records the next run of IMAGE "
            "(merged into its manifest if it has one), `stop` ends the recording and publishes "
            'the manifest (unless [fs] hot_blocks_publish is "never"), `show` prints the manifest '
            "this node holds, `publish` pushes it to the registry merged with the published ones, "
            "which it replaces (from a designated recorder or a CI run)."
        ),
    )
    add_common_arguments(parser)
    parser.add_argument("action", choices=("start", "stop", "show", "publish"))
    parser.add_argument("image", help="image reference")
    parser.add_argument("--plain-http", action="store_true", help="talk to the registry over HTTP")
    parser.set_defaults(func=_run)
