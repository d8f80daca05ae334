"""Forged layer indexes end to end: pushed beside a real image by someone who
can push to the repository but holds no trusted key, they never change what a
container of that image sees. The node serves lazily only from an index a
key in `[trust] keys` signed; a forgery, unsigned, signed by a stranger's key
or carrying a genuine signature copied from another blob, is passed over for
the signed index, or leaves the layer to the normal path."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
from collections.abc import Callable

import msgspec
import pytest

from snapshotter.layer.artifact import index_blobs
from snapshotter.layer.build import build_index
from snapshotter.layer.index import (
    ARTIFACT_TYPE,
    FORMAT_VERSION,
    LAYER_ANNOTATION,
    MEDIA_TYPE,
    VERSION_ANNOTATION,
    Entry,
    LayerIndex,
)
from snapshotter.layer.signature import generate as generate_key
from snapshotter.layer.signature import load_private_key, sign
from snapshotter.registry import artifact
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import parse as parse_reference
from tests.harness.lazynode import LazyNode
from tests.harness.oci import File, ImageBuilder, PushedImage, busybox_layer

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"
TOOL = File("/tool", b"#!/bin/sh\necho tool\n", mode=0o755)
DATA = File("/data.txt", b"the genuine data\n" * 64)
OTHER = File("/other.txt", b"what the forger wants read instead\n" * 64)
CAPABILITY = b"\x01\x00\x00\x02\xff\xff\xff\xff\x00\x00\x00\x00"


def _entry(index: LayerIndex, name: str) -> Entry:
    [entry] = [e for e in index.entries if e.name == name]
    return entry


def _edit(name: str, **changes: object) -> Callable[[LayerIndex, LayerIndex], LayerIndex]:
    def forge(top: LayerIndex, base: LayerIndex) -> LayerIndex:
        entries = [msgspec.structs.replace(e, **changes) if e.name == name else e for e in top.entries]
        return dataclasses.replace(top, entries=entries)

    return forge


def _setuid(top: LayerIndex, base: LayerIndex) -> LayerIndex:
    return _edit("tool", mode=0o4755)(top, base)


def _moved_offset(top: LayerIndex, base: LayerIndex) -> LayerIndex:
    return _edit("data.txt", offset=_entry(top, "other.txt").offset)(top, base)


def _other_layers_index(top: LayerIndex, base: LayerIndex) -> LayerIndex:
    return dataclasses.replace(base, layer_digest=top.layer_digest)


FORGERIES: dict[str, Callable[[LayerIndex, LayerIndex], LayerIndex]] = {
    "setuid bit": _setuid,
    "owner": _edit("data.txt", uid=4242, gid=4242),
    "capability xattr": _edit("tool", xattrs={"security.capability": CAPABILITY}),
    "offset moved": _moved_offset,
    "another layer's index": _other_layers_index,
    "diff_id": lambda top, base: dataclasses.replace(top, diff_id="sha256:" + "d" * 64),
}


def _genuine(image: PushedImage) -> dict[str, LayerIndex]:
    blobs = image.layout.directory / "blobs" / "sha256"
    return {d: build_index(blobs / d.split(":")[1], d) for d in image.layout.layer_digests}


def publish_forgeries(image: PushedImage, signed_blob: Descriptor) -> int:
    """Push, as artifacts newer than the genuine one, every forgery of the
    image's top layer index in three guises: unsigned, signed by a stranger's
    key, and carrying `signed_blob`'s genuine signature. Returns how many."""
    reference = parse_reference(image.ref)
    base_digest, top_digest = image.layout.layer_digests
    genuine = _genuine(image)
    stranger = load_private_key(generate_key().private_pem, "stranger")
    copied = {k: v for k, v in signed_blob.annotations.items() if k.startswith("dev.bootseer.layer-index.sig")}
    assert len(copied) == 2, signed_blob.annotations
    pushed_count = 0
    with RegistryClient(plain_http=True) as client:
        data, media_type, digest = client.fetch_manifest(reference)
        subject = Descriptor(media_type, digest, len(data))
        for forge in FORGERIES.values():
            encoded = forge(genuine[top_digest], genuine[base_digest]).encode()
            blob = client.push_blob(reference, encoded, media_type=MEDIA_TYPE)
            plain = {LAYER_ANNOTATION: top_digest, VERSION_ANNOTATION: str(FORMAT_VERSION)}
            guises = [
                plain,
                plain | sign(stranger, top_digest, blob.digest).annotations(),
                plain | copied,
            ]
            for annotations in guises:
                desc = Descriptor(MEDIA_TYPE, blob.digest, blob.size, annotations=annotations)
                artifact.push(client, reference, subject, ARTIFACT_TYPE, [desc])
                pushed_count += 1
    return pushed_count


def _trusted_blob(image: PushedImage, layer: str) -> Descriptor:
    reference = parse_reference(image.ref)
    with RegistryClient(plain_http=True) as client:
        _, _, digest = client.fetch_manifest(reference)
        return index_blobs(artifact.referrers(client, reference, digest, ARTIFACT_TYPE))[layer]


def _what_a_container_sees(node: LazyNode, image: PushedImage, name: str) -> tuple[str, str, str]:
    c = node.containerd
    modes = c.run(image.ref, f"{name}-stat", "/bin/stat", "-c", "%n %a %u %g", "/tool", "/data.txt")
    data = c.run(image.ref, f"{name}-data", "/bin/sha256sum", "/data.txt").split()[0]
    tool = c.run(image.ref, f"{name}-tool", "/tool")
    return modes, data, tool


GENUINE_VIEW = ("/tool 755 0 0\n/data.txt 644 0 0\n", hashlib.sha256(DATA.data).hexdigest(), "tool\n")


def test_forged_indexes_beside_a_signed_one_change_nothing_a_container_sees(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    image = images.push(
        f"forged/signed-{unique}",
        [busybox_layer(), [TOOL, DATA, OTHER, File(f"/marker-{unique}", b"x")]],
        cmd=["/tool"],
    )
    lazy_node.index(image.ref)
    top = image.layout.layer_digests[1]
    assert publish_forgeries(image, _trusted_blob(image, top)) == 3 * len(FORGERIES)
    lazy_node.pull(image.ref)
    # The top layer served lazily, from the signed index.
    info = lazy_node.containerd.ctr("snapshots", "--snapshotter", "bootseer", "info", image.layout.chain_ids[1]).stdout
    assert f'"{REMOTE_LABEL}": "true"' in info, info
    assert _what_a_container_sees(lazy_node, image, f"signed-{unique}") == GENUINE_VIEW
    # No forged xattr on the served file either (busybox cannot show them).
    served = lazy_node.layers.config.mountpoint / top.split(":")[1] / "tool"
    with pytest.raises(OSError) as absent:
        os.getxattr(served, "security.capability")
    assert absent.value.errno == errno.ENODATA


def test_forged_indexes_alone_leave_the_layer_to_the_normal_path(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    signed_image = images.push(f"forged/donor-{unique}", [busybox_layer(), [File(f"/donor-{unique}", b"d")]])
    lazy_node.index(signed_image.ref)
    donor = _trusted_blob(signed_image, signed_image.layout.layer_digests[1])
    # Never indexed by the trusted indexer: only forgeries are attached, one
    # with a genuine signature of another layer's index.
    image = images.push(
        f"forged/unsigned-{unique}",
        [busybox_layer(), [TOOL, DATA, OTHER, File(f"/marker-{unique}", b"y")]],
        cmd=["/tool"],
    )
    publish_forgeries(image, donor)
    with lazy_node.bystander(images, f"forged-{unique}") as bystander:
        out = lazy_node.pull(image.ref)
        top = image.layout.layer_digests[1]
        refused = lazy_node.fallbacks("index_untrusted", top)
        assert refused, lazy_node.snapshotter.daemon.log_tail()
        info = lazy_node.containerd.ctr(
            "snapshots", "--snapshotter", "bootseer", "info", image.layout.chain_ids[1]
        ).stdout
        assert REMOTE_LABEL not in info, (out, info)
        assert _what_a_container_sees(lazy_node, image, f"unsigned-{unique}") == GENUINE_VIEW
        bystander.still_fine("forged indexes alone")
