"""A gzip layer blob that is truncated, carries trailing garbage or trailing
zero bytes, or holds a second gzip member: the lazy path (`bootseer pull`)
must give the answer containerd's normal path (`ctr images pull`) gives.

Observed with containerd 1.6 here (no unpigz, so Go's compress/gzip, which
reads every member in turn; the applier reads the stream to its end after
the tar's end-of-archive marker): truncation fails with "unexpected EOF",
trailing garbage and trailing zeros fail with "gzip: invalid header", a
second member is applied.

`bootseer index` refuses the first three; the index pushed for them here is
the one a compromised or buggy indexer could push, describing the readable
part of the blob, which the remote Prepare must refuse because its blocks do
not end at the end of the blob the manifest names."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import random
from pathlib import Path

import pytest

from snapshotter.layer.build import build_index
from snapshotter.layer.index import ARTIFACT_TYPE, FORMAT_VERSION, LAYER_ANNOTATION, MEDIA_TYPE, VERSION_ANNOTATION
from snapshotter.registry import artifact
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import parse as parse_reference
from tests.harness.lazynode import LazyNode
from tests.harness.oci import File, ImageBuilder, ImageLayout, PushedImage, busybox_layer, layer_tar, push, write_layout
from tests.harness.trust import signed

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"
# What the normal path says, per case (Go's compress/gzip through containerd's applier).
NORMAL_ERRORS = {
    "truncated": "unexpected EOF",
    "garbage": "gzip: invalid header",
    "zeros": "gzip: invalid header",
}


def _gzip(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return buf.getvalue()


def _top() -> list[File]:
    # Incompressible data, so the blob has several blocks and a cut lands mid-stream.
    data = random.Random(7).randbytes(300_000)
    return [File("/parity/a", data), File("/parity/b", b"hello\n")]


def _variant(case: str, tar: bytes) -> tuple[bytes, bytes]:
    """(the blob pushed for the top layer, the complete single-member gzip it comes from)."""
    clean = _gzip(tar)
    if case == "truncated":
        return clean[: len(clean) // 2], clean
    if case == "garbage":
        return clean + b"this is not a gzip member, just junk\n", clean
    if case == "zeros":
        return clean + bytes(512), clean
    assert case == "multi"
    return _gzip(tar[: len(tar) // 2]) + _gzip(tar[len(tar) // 2 :]), clean


def _blob_path(layout: ImageLayout, digest: str) -> Path:
    return layout.directory / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _put(layout: ImageLayout, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _blob_path(layout, digest).write_bytes(data)
    return digest, len(data)


def push_with_top(images: ImageBuilder, name: str, base: list[File], case: str) -> tuple[PushedImage, bytes]:
    """An image of `base` and the case's top layer: written as usual, then
    the top layer's blob replaced (the config keeps the tar's diff_id)."""
    top = _top()
    layout = write_layout(images.workdir / name.replace("/", "_"), [[*busybox_layer(), *base], top], cmd=["/bin/sh"])
    blob, clean = _variant(case, layer_tar(top))
    index = json.loads((layout.directory / "index.json").read_text())
    manifest = json.loads(_blob_path(layout, index["manifests"][0]["digest"]).read_bytes())
    digest, size = _put(layout, blob)
    manifest["layers"][1].update(digest=digest, size=size)
    mdigest, msize = _put(layout, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    index["manifests"][0].update(digest=mdigest, size=msize)
    (layout.directory / "index.json").write_text(json.dumps(index))
    layout = dataclasses.replace(
        layout,
        layer_digests=(layout.layer_digests[0], digest),
        layer_sizes=(layout.layer_sizes[0], size),
    )
    ref = f"{images.registry_host}/{name}:{layout.tag}"
    push(layout, ref, images.creds)
    return PushedImage(ref=ref, layout=layout), clean


def publish_readable_part_index(image: PushedImage, clean: bytes, case: str, workdir: Path) -> None:
    """Index the base honestly and the top layer from its readable part (the
    complete gzip stream), claiming the pushed blob: what an indexer that
    stops at the end of the first member, or ignores a truncation, pushes
    (signed by the trusted key: a buggy indexer is trusted)."""
    reference = parse_reference(image.ref)
    base_digest, top_digest = image.layout.layer_digests
    clean_path = workdir / f"clean-{case}"
    clean_path.write_bytes(clean)
    top = dataclasses.replace(build_index(clean_path, top_digest), layer_digest=top_digest)
    if case == "garbage":
        # The blob's own size, the blocks stopping short of it.
        top = dataclasses.replace(top, compressed_size=image.layout.layer_sizes[1])
    indexes = [build_index(_blob_path(image.layout, base_digest), base_digest), top]
    with RegistryClient(plain_http=True) as client:
        data, media_type, digest = client.fetch_manifest(reference)
        blobs = []
        for index in indexes:
            pushed = client.push_blob(reference, index.encode(), media_type=MEDIA_TYPE)
            annotations = {LAYER_ANNOTATION: index.layer_digest, VERSION_ANNOTATION: str(FORMAT_VERSION)}
            blobs.append(signed(Descriptor(MEDIA_TYPE, pushed.digest, pushed.size, annotations=annotations)))
        artifact.push(client, reference, Descriptor(media_type, digest, len(data)), ARTIFACT_TYPE, blobs)


@pytest.mark.parametrize("case", ["truncated", "garbage", "zeros", "multi"])
def test_the_lazy_path_answers_a_gzip_layer_as_the_normal_path_does(
    lazy_node: LazyNode, images: ImageBuilder, unique: str, tmp_path: Path, case: str
) -> None:
    c = lazy_node.containerd
    # Different bases, so the top layer gets another chainID in each image
    # and neither pull finds what the other committed.
    normal, _ = push_with_top(
        images, f"parity/normal-{case}-{unique}", [File("/which", f"normal {unique}\n".encode())], case
    )
    lazy, clean = push_with_top(
        images, f"parity/lazy-{case}-{unique}", [File("/which", f"lazy {unique}\n".encode())], case
    )
    assert normal.layout.layer_digests[1] == lazy.layout.layer_digests[1]
    top = lazy.layout.layer_digests[1]

    by_ctr = c.ctr("images", "pull", "--plain-http", "--snapshotter", "bootseer", normal.ref, check=False)

    report = lazy_node.index(lazy.ref)
    if case != "multi":
        publish_readable_part_index(lazy, clean, case, tmp_path)
    pulled = lazy_node.try_pull(lazy.ref)

    outcome = f"ctr:\n{by_ctr.stdout}{by_ctr.stderr}\nbootseer pull:\n{pulled.stdout}{pulled.stderr}\n{report}"
    assert (by_ctr.returncode == 0) == (pulled.returncode == 0), outcome
    if case == "multi":
        assert by_ctr.returncode == 0, outcome
        # Served lazily, and the same files as containerd unpacked.
        info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", lazy.layout.chain_ids[1]).stdout
        assert f'"{REMOTE_LABEL}": "true"' in info, info
        argv = ("/bin/sha256sum", "/parity/a", "/parity/b")
        from_normal = c.run(normal.ref, f"parity-n-{unique}", *argv)
        assert c.run(lazy.ref, f"parity-l-{unique}", *argv) == from_normal
        assert "/parity/a" in from_normal
    else:
        assert by_ctr.returncode != 0, outcome
        assert NORMAL_ERRORS[case] in by_ctr.stderr, outcome
        assert NORMAL_ERRORS[case] in pulled.stderr, outcome
        # The readable-part index was refused; the layer took the normal path.
        assert lazy_node.fallbacks("index_refused", top), lazy_node.snapshotter.daemon.log_tail()
        assert lazy.layout.chain_ids[1] not in c.snapshots()
    assert lazy_node.snapshotter.daemon.alive() and lazy_node.layers.daemon.alive(), lazy_node.layers.logs()
