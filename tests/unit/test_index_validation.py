"""Hostile layers and hostile indexes: what `bootseer index` makes of a tar
layer no layer server could serve, what the decoder refuses in an index, and
the tree containerd's applier would lay down where a layer leads through a
symlink or links to what it does not hold."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import stat
import struct
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import zstandard

from snapshotter.fs.layers import LayerStore
from snapshotter.indexer import index_image
from snapshotter.layer.build import UnsupportedLayer, build_index
from snapshotter.layer.index import (
    FORMAT_VERSION,
    LAYER_ANNOTATION,
    MAGIC,
    MAX_DEPTH,
    MAX_MTIME,
    MEDIA_TYPE,
    VERSION_ANNOTATION,
    EntryType,
    IndexFormatError,
    LayerIndex,
)
from snapshotter.layer.tree import ROOT, LayerTree, Node, build_tree
from snapshotter.registry import artifact as registry_artifact
from snapshotter.registry import media
from snapshotter.registry.client import RegistryClient, ResolvedImage
from snapshotter.registry.media import Descriptor, Manifest, Platform
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.remote import NotLazy, Reason, RemoteLayers
from tests.harness.trust import index_trust, signed

Member = tuple[tarfile.TarInfo, bytes]


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **attrs: Any) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data)
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def layer(members: list[Member], fmt: int = tarfile.PAX_FORMAT, gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), 6, mtime=0) if gz else buf.getvalue()


def digest_of(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def index_of(blob: bytes, tmp_path: Path) -> LayerIndex:
    path = tmp_path / "blob"
    path.write_bytes(blob)
    return build_index(path, digest_of(blob), span=64 << 10)


def served(blob: bytes, tmp_path: Path) -> LayerTree:
    """The tree the layer server builds from what `bootseer index` pushed."""
    return build_tree(LayerIndex.decode(index_of(blob, tmp_path).encode()).entries)


def walk(tree: LayerTree, path: str) -> Node | None:
    """What the kernel finds looking `path` up one name at a time (it
    follows symlinks itself, through the whole overlay)."""
    node = tree.nodes[ROOT]
    for part in path.split("/"):
        found = tree.lookup(node.ino, part.encode("utf-8", "surrogateescape"))
        if found is None:
            return None
        node = found
    return node


# -- tar layers containerd can apply ------------------------------------------


def test_a_file_under_a_symlinked_directory_lands_where_containerd_puts_it(tmp_path: Path) -> None:
    tree = served(
        layer(
            [
                member("esc", tarfile.SYMTYPE, linkname="/tmp/x"),
                member("esc/pwned", data=b"p"),
                member("a", tarfile.DIRTYPE),
                member("a/up", tarfile.SYMTYPE, linkname="../../../etc"),
                member("a/up/passwd", data=b"root"),
            ]
        ),
        tmp_path,
    )
    esc = walk(tree, "esc")
    assert esc is not None and stat.S_ISLNK(esc.mode) and esc.target == b"/tmp/x"
    # Followed within the layer, as fs.RootPath does; missing parents made.
    pwned = walk(tree, "tmp/x/pwned")
    assert pwned is not None and stat.S_ISREG(pwned.mode) and pwned.size == 1
    tmp = walk(tree, "tmp")
    assert tmp is not None and tmp.is_dir and stat.S_IMODE(tmp.mode) == 0o755
    # `..` stops at the layer root.
    passwd = walk(tree, "etc/passwd")
    assert passwd is not None and passwd.size == 4
    assert walk(tree, "esc/pwned") is None and walk(tree, "a/up/passwd") is None


def test_a_hardlink_through_a_symlinked_directory_links_the_file_there(tmp_path: Path) -> None:
    tree = served(
        layer(
            [
                member("d", tarfile.DIRTYPE),
                member("d/f", data=b"data"),
                member("s", tarfile.SYMTYPE, linkname="d"),
                member("l", tarfile.LNKTYPE, linkname="s/f"),
            ]
        ),
        tmp_path,
    )
    file, link = walk(tree, "d/f"), walk(tree, "l")
    assert file is link and file is not None and file.nlink == 2


def test_a_path_a_thousand_levels_deep_is_served(tmp_path: Path) -> None:
    deep = "d/" * 999 + "f"
    tree = served(layer([member(deep, data=b"deep")]), tmp_path)
    node = walk(tree, deep)
    assert node is not None and node.size == 4


def test_tar_times_are_bounded_as_containerd_bounds_them(tmp_path: Path) -> None:
    tree = served(
        layer([member("future", mtime=1e300), member("past", mtime=-5), member("now", mtime=1_700_000_000)]),
        tmp_path,
    )
    mtimes = {name: node.mtime for name in ("future", "past", "now") if (node := walk(tree, name)) is not None}
    assert mtimes == {"future": 0.0, "past": 0.0, "now": 1_700_000_000.0}


def test_xattrs_containerd_does_not_set_are_left_out(tmp_path: Path) -> None:
    file, link = member("f", data=b"x"), member("s", tarfile.SYMTYPE, linkname="f")
    file[0].pax_headers = {
        "SCHILY.xattr.user.team": "ml",
        "SCHILY.xattr.security.capability": "\x01\x00\x00\x02",
        "SCHILY.xattr.trusted.overlay.redirect": "/etc",
        "SCHILY.xattr.nonamespace": "x",
    }
    link[0].pax_headers = {"SCHILY.xattr.user.team": "ml"}
    tree = served(layer([file, link]), tmp_path)
    f, s = walk(tree, "f"), walk(tree, "s")
    assert f is not None and f.xattrs == {"user.team": b"ml", "security.capability": b"\x01\x00\x00\x02"}
    assert s is not None and s.xattrs == {}


def test_names_that_are_not_utf8_keep_their_bytes(tmp_path: Path) -> None:
    tree = served(layer([member("caf\udce9", data=b"x")], fmt=tarfile.GNU_FORMAT), tmp_path)
    assert list((tree.nodes[ROOT].children or {}).keys()) == [b"caf\xe9"]


# -- tar layers containerd cannot apply: the normal path, which fails too ----


@pytest.mark.parametrize(
    ("members", "message"),
    [
        (
            [member("usr/bin", tarfile.DIRTYPE), member("usr/bin/py", tarfile.LNKTYPE, linkname="usr/bin/python3")],
            "no file to link to",
        ),
        ([member("l", tarfile.LNKTYPE, linkname="nothing")], "no file to link to"),
        ([member("d", tarfile.DIRTYPE), member("l", tarfile.LNKTYPE, linkname="d")], "directory cannot be hardlinked"),
        ([member("f"), member("f", tarfile.LNKTYPE, linkname="f")], "no file to link to"),
        ([member("f"), member("s", tarfile.SYMTYPE, linkname="f"), member("s/x")], "non-directory"),
        ([member("f"), member("f/x")], "non-directory"),
        (
            [
                member("l1", tarfile.SYMTYPE, linkname="l2"),
                member("l2", tarfile.SYMTYPE, linkname="l1"),
                member("l1/x"),
            ],
            "more than 255 symlinks",
        ),
        ([member("d/.wh.")], "names no file"),
    ],
    ids=[
        "hardlink-to-lower-layer",
        "hardlink-to-nothing",
        "hardlink-to-dir",
        "hardlink-to-itself",
        "symlink-to-file",
        "file-parent",
        "symlink-loop",
        "empty-whiteout",
    ],
)
def test_a_layer_containerd_cannot_apply_is_left_to_the_normal_path(
    tmp_path: Path, members: list[Member], message: str
) -> None:
    with pytest.raises(UnsupportedLayer, match=message):
        index_of(layer(members), tmp_path)


@pytest.mark.parametrize(
    ("attrs", "kind"),
    [
        ({"uid": 2**40}, tarfile.REGTYPE),
        ({"gid": 2**40}, tarfile.REGTYPE),
        ({"uid": 2**32 - 1}, tarfile.REGTYPE),
        ({"devmajor": 2**40}, tarfile.CHRTYPE),
        ({"devminor": 2**40}, tarfile.BLKTYPE),
        ({"devmajor": 4096}, tarfile.CHRTYPE),
    ],
    ids=["uid", "gid", "uid-no-owner", "devmajor", "devminor", "devmajor-beyond-12-bits"],
)
def test_tar_values_the_kernel_cannot_take_leave_the_layer_to_the_normal_path(
    tmp_path: Path, attrs: dict[str, int], kind: bytes
) -> None:
    # GNU base-256 numbers hold what an ustar field cannot.
    blob = layer([member("ok", data=b"fine"), member("evil", kind, **attrs)], fmt=tarfile.GNU_FORMAT)
    with pytest.raises(UnsupportedLayer, match="out of range"):
        index_of(blob, tmp_path)


# -- hostile indexes: a valid one with one value changed ----------------------


@pytest.fixture
def valid(tmp_path: Path) -> LayerIndex:
    blob = layer(
        [
            member("d", tarfile.DIRTYPE),
            member("d/f", data=b"hello"),
            member("d/s", tarfile.SYMTYPE, linkname="f"),
            member("d/l", tarfile.LNKTYPE, linkname="d/f"),
            member("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3),
        ]
    )
    index = index_of(blob, tmp_path)
    assert LayerIndex.decode(index.encode()).entries == index.entries
    return index


def changed(index: LayerIndex, which: str, **values: Any) -> bytes:
    entries = [msgspec.structs.replace(e, **values) if e.name == which else e for e in index.entries]
    return dataclasses.replace(index, entries=entries).encode()


@pytest.mark.parametrize(
    ("which", "values", "message"),
    [
        ("d/f", {"uid": 2**40}, "uid out of range"),
        ("d/f", {"gid": 2**40}, "gid out of range"),
        ("d/f", {"uid": -1}, "uid out of range"),
        ("d/f", {"gid": 2**32 - 1}, "gid out of range"),
        ("d/f", {"mode": 2**40}, "mode out of range"),
        ("d/f", {"mode": stat.S_IFCHR | 0o644}, "mode out of range"),
        ("dev/null", {"devmajor": 2**40}, "devmajor out of range"),
        ("dev/null", {"devminor": 2**40}, "devminor out of range"),
        ("dev/null", {"devmajor": 4096}, "devmajor out of range"),
        ("d/f", {"mtime": 1e300}, "mtime outside"),
        ("d/f", {"mtime": float("nan")}, "mtime outside"),
        ("d/f", {"mtime": float("inf")}, "mtime outside"),
        ("d/f", {"mtime": -1.0}, "mtime outside"),
        ("d/f", {"mtime": MAX_MTIME + 1}, "mtime outside"),
        ("d/f", {"size": -1}, "size out of range"),
        ("d/f", {"offset": 2**62}, "offset out of range"),
        ("d/f", {"size": 10**6}, "data outside the layer"),
        ("d/f", {"name": "a/" * 4999 + "a"}, "longer than 4095 bytes"),
        ("d/f", {"name": "a/" * MAX_DEPTH + "a"}, f"deeper than {MAX_DEPTH} levels"),
        ("d/f", {"name": "d/" + "x" * 256}, "longer than 255 bytes"),
        ("d/f", {"name": "d/" + "é" * 128}, "longer than 255 bytes"),
        ("d/f", {"name": "d/a\x00b"}, "NUL"),
        ("d/f", {"name": "d//f"}, "not normalised"),
        ("d/f", {"name": "d/./f"}, "not normalised"),
        ("d/f", {"name": "../f"}, "not normalised"),
        ("d/f", {"name": "/etc/f"}, "not normalised"),
        ("d/f", {"name": "d/\ud800"}, "neither UTF-8 nor escaped bytes"),
        ("d/s", {"linkname": "x" * 5000}, "link target longer"),
        ("d/s", {"linkname": "a\x00b"}, "NUL"),
        ("d/s", {"linkname": ""}, "empty target"),
        ("d/l", {"linkname": "../d/f"}, "not normalised"),
        ("d/f", {"xattrs": {"trusted.overlay.redirect": b"/etc"}}, "outside the namespaces"),
        ("d/f", {"xattrs": {"user." + "x" * 300: b""}}, "xattr name longer than 255"),
        ("d/f", {"xattrs": {"user.": b""}}, "outside the namespaces"),
        ("d/f", {"xattrs": {"user.big": b"x" * 65537}}, "larger than 65536"),
        ("d/f", {"xattrs": {f"user.{n:0200}": b"" for n in range(400)}}, "longer than 65536 bytes in all"),
    ],
)
def test_a_hostile_index_is_refused(valid: LayerIndex, which: str, values: dict[str, Any], message: str) -> None:
    with pytest.raises(IndexFormatError, match=message):
        LayerIndex.decode(changed(valid, which, **values))


def document(data: bytes) -> tuple[dict[str, Any], bytes]:
    payload = zstandard.ZstdDecompressor().decompress(data[len(MAGIC) :])
    (length,) = struct.unpack(">I", payload[:4])
    return json.loads(payload[4 : 4 + length]), payload[4 + length :]


def blob_of(doc: Any, checkpoints: bytes = b"", text: str | None = None) -> bytes:
    body = (json.dumps(doc) if text is None else text).encode()
    return MAGIC + zstandard.ZstdCompressor().compress(struct.pack(">I", len(body)) + body + checkpoints)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        target: Any = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set(("entries", 1, 1), "socket"), "malformed"),
        (_set(("entries", 1, 3), True), "uid out of range"),
        (_set(("entries", 1, 6), 1.5), "size out of range"),
        (_set(("entries", 1, 5), "1700000000"), "mtime outside"),
        (_set(("entries", 1, 0), ["d", "f"]), "not a string"),
        (_set(("entries", 1, 11), {"user.x": "not base64!"}), "malformed"),
        (_set(("entries", 1), ["d/f"]), "malformed"),
        (_set(("blocks", 0, 1), float("inf")), "malformed"),
        (_set(("blocks", 0, 4), "z" * 64), "malformed digest"),
        (_set(("compressed_size",), 2**70), "compressed size"),
        (_set(("uncompressed_size",), 1.0e6), "malformed"),
        (_set(("span",), 0), "span"),
        (_set(("part",), 3), "part 3 is neither 0 nor a power of two"),
        (_set(("part",), 1 << 30), "part 1073741824 is neither"),
        (_set(("part",), 2048), "part 2048 is neither"),
        (_set(("part",), "16384"), "malformed"),
        (_set(("layer_digest",), "sha256:" + "../" * 21 + "x"), "bad layer digest"),
        (_set(("entries",), [["f", "reg", 0, 0, 0, 0, 0, 0, "", 0, 0, {}]] * 1_000_001), "at most 1000000"),
    ],
    ids=[
        "type",
        "bool-uid",
        "float-size",
        "string-mtime",
        "list-name",
        "xattr-not-base64",
        "short-row",
        "infinite-block",
        "block-digest",
        "huge-layer",
        "float-size-of-layer",
        "zero-span",
        "odd-part",
        "huge-part",
        "small-part",
        "string-part",
        "digest-path",
        "too-many-entries",
    ],
)
def test_a_malformed_document_is_refused(
    valid: LayerIndex, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    doc, checkpoints = document(valid.encode())
    edit(doc)
    with pytest.raises(IndexFormatError, match=message):
        LayerIndex.decode(blob_of(doc, checkpoints))


def test_a_document_that_lies_about_itself_is_refused(valid: LayerIndex) -> None:
    doc, checkpoints = document(valid.encode())
    with pytest.raises(IndexFormatError, match="corrupt"):
        LayerIndex.decode(blob_of(doc, checkpoints, text="[" * 100_000 + "]" * 100_000))
    body = json.dumps(doc).encode()
    claims_more = MAGIC + zstandard.ZstdCompressor().compress(struct.pack(">I", len(body) + 10) + body)
    with pytest.raises(IndexFormatError, match="corrupt"):
        LayerIndex.decode(claims_more)


def test_checkpoints_claiming_more_than_an_index_holds_are_refused(valid: LayerIndex) -> None:
    header = struct.Struct("<5sBBQQIII")
    fields = list(header.unpack_from(valid.checkpoints))
    for position, value in ((7, 2**32 - 1), (6, 1 << 20)):
        claims = fields.copy()
        claims[position] = value
        bomb = header.pack(*claims) + valid.checkpoints[header.size :]
        with pytest.raises(IndexFormatError, match="more than an index holds"):
            LayerIndex.decode(dataclasses.replace(valid, checkpoints=bomb).encode())


def test_a_plain_block_is_served_from_where_it_lies(tmp_path: Path) -> None:
    index = index_of(layer([member("f", data=b"x" * 1000)], gz=False), tmp_path)
    moved = msgspec.structs.replace(index.blocks[0], cstart=1)
    with pytest.raises(IndexFormatError, match="not where it lies"):
        LayerIndex.decode(dataclasses.replace(index, blocks=[moved, *index.blocks[1:]]).encode())


def test_a_hostile_tree_is_refused_by_the_tree(valid: LayerIndex) -> None:
    """Decodable, but containerd could not lay it down: no tree."""
    cases = {
        "no file to link to": changed(valid, "d/l", linkname="lower/file"),
        "directory cannot be hardlinked": changed(valid, "d/l", linkname="d"),
        "non-directory": changed(valid, "dev/null", name="d/f/null"),
    }
    for message, data in cases.items():
        entries = LayerIndex.decode(data).entries
        with pytest.raises(IndexFormatError, match=message):
            build_tree(entries)


# -- `bootseer index` keeps going --------------------------------------------


class FakeRegistry:
    """The registry calls `bootseer index` makes, over blobs in memory."""

    def __init__(self, layers: list[tuple[str, bytes]]) -> None:
        self.blobs = {digest_of(data): data for _, data in layers}
        config = Descriptor(media.OCI_CONFIG, digest_of(b"{}"), 2)
        descs = tuple(Descriptor(kind, digest_of(data), len(data)) for kind, data in layers)
        self.manifest = Manifest(media.OCI_MANIFEST, config, descs)
        self.pushed: dict[str, bytes] = {}
        self.artifacts: list[Manifest] = []

    def resolve(self, ref: Reference, platform: str | None = None) -> ResolvedImage:
        return ResolvedImage(
            ref, digest_of(b"manifest"), b"manifest", media.OCI_MANIFEST, self.manifest, Platform("linux", "amd64")
        )

    def referrers(self, ref: Reference, subject_digest: str, artifact_type: str | None = None) -> list[Descriptor]:
        return []

    def fetch_blob(
        self, ref: Reference, digest: str, dest: io.BufferedWriter, progress: Callable[[int], None] | None = None
    ) -> None:
        dest.write(self.blobs[digest])

    def push_blob(self, ref: Reference, data: bytes, media_type: str = "application/octet-stream") -> Descriptor:
        self.pushed[digest_of(data)] = data
        return Descriptor(media_type, digest_of(data), len(data))

    def push_referrer(self, ref: Reference, artifact_manifest: bytes, media_type: str, subject_digest: str) -> str:
        parsed = media.parse(artifact_manifest, media_type)
        assert isinstance(parsed, Manifest)
        self.artifacts.append(parsed)
        return digest_of(artifact_manifest)


def test_bootseer_index_indexes_the_layers_it_can_and_reports_the_others() -> None:
    good = layer([member("ok", data=b"fine")])
    hostile = layer([member("evil", uid=2**40)], fmt=tarfile.GNU_FORMAT)
    unapplicable = layer([member("l", tarfile.LNKTYPE, linkname="lower/file")])
    corrupt = bytearray(layer([member("big", data=os.urandom(1 << 20))]))
    corrupt[100:400] = bytes(300)
    registry = FakeRegistry(
        [
            (media.OCI_LAYER_GZIP, good),
            (media.OCI_LAYER_GZIP, hostile),
            (media.OCI_LAYER_GZIP, unapplicable),
            (media.OCI_LAYER_GZIP, bytes(corrupt)),
            ("application/vnd.oci.image.layer.v1.tar+zstd", b"zstd"),
        ]
    )
    client = cast(RegistryClient, registry)
    report = index_image(client, parse_reference("registry.example/team/app:v1"), show_progress=False)
    assert report.indexed == [digest_of(good)]
    assert set(report.skipped) == {
        digest_of(hostile),
        digest_of(unapplicable),
        digest_of(bytes(corrupt)),
        digest_of(b"zstd"),
    }
    assert "out of range" in report.skipped[digest_of(hostile)]
    assert "no file to link to" in report.skipped[digest_of(unapplicable)]
    # The gzip stream's own fault is the reason, not indexed_gzip's error on it.
    assert "not a readable gzip stream" in report.skipped[digest_of(bytes(corrupt))]
    # The artifact is pushed for the layer that was indexed, and what it
    # holds decodes.
    assert report.artifact_digest and len(registry.artifacts) == 1
    (blob,) = registry.artifacts[0].layers
    assert LayerIndex.decode(registry.pushed[blob.digest]).layer_digest == digest_of(good)
    assert {e.type for e in LayerIndex.decode(registry.pushed[blob.digest]).entries} == {EntryType.REG}


# -- format versions: version 1 has no diff_id --------------------------------


def version_1(index: LayerIndex) -> bytes:
    """The index as a bootseer before version 2 encoded it."""
    doc, checkpoints = document(index.encode())
    doc["version"] = 1
    del doc["diff_id"]
    return blob_of(doc, checkpoints)


def test_a_version_1_index_still_decodes_without_a_diff_id(valid: LayerIndex) -> None:
    # The layer server goes on serving the layers committed from one.
    old = LayerIndex.decode(version_1(valid))
    assert old.diff_id == "" and old.entries == valid.entries


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set(("version",), 5), "version 5 is not supported.*re-run `bootseer index`"),
        (_set(("version",), True), "version True is not supported"),
        (_set(("diff_id",), ""), "bad diff_id"),
        (_set(("diff_id",), "sha256:" + "A" * 64), "bad diff_id"),
        (_set(("diff_id",), 7), "malformed"),
    ],
    ids=["version-5", "bool-version", "empty-diff-id", "upper-case-diff-id", "int-diff-id"],
)
def test_a_version_or_diff_id_this_bootseer_cannot_use_is_refused(
    valid: LayerIndex, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    doc, checkpoints = document(valid.encode())
    edit(doc)
    with pytest.raises(IndexFormatError, match=message):
        LayerIndex.decode(blob_of(doc, checkpoints))


def test_a_version_1_index_is_refused_for_the_lazy_path_with_the_re_index_message(
    valid: LayerIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = version_1(valid)
    blob = signed(Descriptor(MEDIA_TYPE, digest_of(old), len(old), annotations={LAYER_ANNOTATION: valid.layer_digest}))
    config = Descriptor(media.OCI_CONFIG, digest_of(b"{}"), 2)
    monkeypatch.setattr(registry_artifact, "referrers", lambda *_: [Manifest(media.OCI_MANIFEST, config, (blob,))])

    class Registry:
        def fetch_blob(self, ref: Reference, digest: str, dest: io.BytesIO) -> None:
            assert digest == blob.digest
            dest.write(old)

    remote = RemoteLayers(
        LayerStore(tmp_path / "layers"), tmp_path / "m", lambda: cast(RegistryClient, Registry()), 0, index_trust()
    )
    ref = parse_reference("registry.example/team/app:v1")
    with pytest.raises(NotLazy, match=r"format version 1.*re-run `bootseer index registry.example/team/app:v1`") as no:
        remote._store_index(ref, "sha256:" + "2" * 64, valid.layer_digest)
    assert no.value.reason is Reason.INDEX_REFUSED
    # Nothing the lazy path refuses is kept in the node's layer store.
    assert not remote.store.has(valid.layer_digest)


def test_bootseer_index_rebuilds_the_indexes_an_older_bootseer_built(monkeypatch: pytest.MonkeyPatch) -> None:
    old, current = layer([member("old", data=b"1")]), layer([member("new", data=b"2")])
    registry = FakeRegistry([(media.OCI_LAYER_GZIP, old), (media.OCI_LAYER_GZIP, current)])
    # An artifact from before: the first layer's blob has no version annotation.
    existing = (
        Descriptor(MEDIA_TYPE, "sha256:" + "e" * 64, 10, annotations={LAYER_ANNOTATION: digest_of(old)}),
        Descriptor(
            MEDIA_TYPE,
            "sha256:" + "f" * 64,
            10,
            annotations={LAYER_ANNOTATION: digest_of(current), VERSION_ANNOTATION: str(FORMAT_VERSION)},
        ),
    )
    config = Descriptor(media.OCI_CONFIG, digest_of(b"{}"), 2)
    monkeypatch.setattr(registry_artifact, "referrers", lambda *_: [Manifest(media.OCI_MANIFEST, config, existing)])
    client = cast(RegistryClient, registry)
    report = index_image(client, parse_reference("registry.example/team/app:v1"), show_progress=False)
    assert report.indexed == [digest_of(old)] and report.reused == [digest_of(current)]
    rebuilt, kept = registry.artifacts[-1].layers
    assert rebuilt.annotations[VERSION_ANNOTATION] == str(FORMAT_VERSION) and kept == existing[1]
    assert (
        LayerIndex.decode(registry.pushed[rebuilt.digest]).diff_id
        == "sha256:" + hashlib.sha256(gzip.decompress(old)).hexdigest()
    )


# -- gzip streams containerd's normal path refuses ---------------------------
#
# containerd 1.6 (Go's compress/gzip, multistream; the applier reads the
# stream to EOF after the tar): a truncated blob fails with "unexpected EOF",
# junk or zero padding after the last member with "gzip: invalid header", and
# a second member is read like the first (tests/lazy/test_gzip_parity.py).


def _parity_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in [member("d", tarfile.DIRTYPE), member("d/a", data=os.urandom(200_000))]:
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


PARITY_TAR = _parity_tar()
PARITY_GZIP = gzip.compress(PARITY_TAR, 6, mtime=0)


@pytest.mark.parametrize(
    "length",
    # Mid-stream; inside the deflate data's last bytes; without all of the
    # trailer, its ISIZE, its last byte.
    [len(PARITY_GZIP) // 2, len(PARITY_GZIP) - 12, len(PARITY_GZIP) - 8, len(PARITY_GZIP) - 4, len(PARITY_GZIP) - 1],
    ids=["mid-stream", "end-of-deflate", "no-trailer", "no-isize", "last-byte"],
)
def test_bootseer_index_refuses_a_truncated_gzip_layer(tmp_path: Path, length: int) -> None:
    blob = PARITY_GZIP[:length]
    with pytest.raises(UnsupportedLayer, match=r"ends in the middle of a member.*truncated"):
        index_of(blob, tmp_path)


@pytest.mark.parametrize(
    "tail",
    [b"this is not a gzip member, just junk\n", b"xy", bytes(512), bytes(3), b"\x1f\x8b" + bytes(30)],
    ids=["junk", "short-junk", "zeros", "few-zeros", "bad-second-header"],
)
def test_bootseer_index_refuses_trailing_bytes_after_the_gzip_stream(tmp_path: Path, tail: bytes) -> None:
    with pytest.raises(UnsupportedLayer, match=f"at byte {len(PARITY_GZIP)} .*trailing data|middle of a member"):
        index_of(PARITY_GZIP + tail, tmp_path)


def test_bootseer_index_takes_a_multi_member_gzip_layer_as_containerd_does(tmp_path: Path) -> None:
    half = len(PARITY_TAR) // 2
    blob = gzip.compress(PARITY_TAR[:half], 6, mtime=0) + gzip.compress(PARITY_TAR[half:], 6, mtime=0)
    index = index_of(blob + gzip.compress(b"", mtime=0), tmp_path)
    assert index.diff_id == digest_of(PARITY_TAR) and index.uncompressed_size == len(PARITY_TAR)
    assert index.blocks[-1].cend == index.compressed_size == len(blob) + 20
    assert [e.name for e in index.entries] == ["d", "d/a"]


@pytest.mark.parametrize("extra", [1, 37])
def test_an_index_whose_blocks_stop_short_of_the_blob_is_refused(tmp_path: Path, extra: int) -> None:
    """An index of a blob's readable part, claiming the whole blob (junk after it)."""
    index = index_of(PARITY_GZIP, tmp_path)
    with pytest.raises(IndexFormatError, match=f"blocks end at byte {len(PARITY_GZIP)}, not at the end"):
        LayerIndex.decode(dataclasses.replace(index, compressed_size=len(PARITY_GZIP) + extra).encode())


def _image_manifest(index: LayerIndex, layer_size: int) -> bytes:
    """An image manifest listing the index's layer with `layer_size` bytes."""
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media.OCI_MANIFEST,
            "config": {"mediaType": media.OCI_CONFIG, "digest": digest_of(b"{}"), "size": 2},
            "layers": [{"mediaType": media.OCI_LAYER_GZIP, "digest": index.layer_digest, "size": layer_size}],
        }
    ).encode()


def _remote_with(index: LayerIndex, layer_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RemoteLayers:
    encoded = index.encode()
    blob = signed(
        Descriptor(MEDIA_TYPE, digest_of(encoded), len(encoded), annotations={LAYER_ANNOTATION: index.layer_digest})
    )
    config = Descriptor(media.OCI_CONFIG, digest_of(b"{}"), 2)
    monkeypatch.setattr(registry_artifact, "referrers", lambda *_: [Manifest(media.OCI_MANIFEST, config, (blob,))])
    image = _image_manifest(index, layer_size)

    class Registry:
        def fetch_blob(self, ref: Reference, digest: str, dest: io.BytesIO) -> None:
            assert digest == blob.digest
            dest.write(encoded)

        def fetch_manifest(self, ref: Reference) -> tuple[bytes, str, str]:
            assert ref.object == digest_of(image)
            return image, media.OCI_MANIFEST, digest_of(image)

    return RemoteLayers(
        LayerStore(tmp_path / "layers"), tmp_path / "m", lambda: cast(RegistryClient, Registry()), 0, index_trust()
    )


@pytest.mark.parametrize("layer_size", [len(PARITY_GZIP) // 2, len(PARITY_GZIP) + 512])
def test_the_lazy_prepare_refuses_an_index_not_ending_at_the_layers_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layer_size: int
) -> None:
    """The layer blob is truncated (smaller than the index says) or carries
    trailing bytes (larger): the index describes its readable part."""
    index = dataclasses.replace(index_of(PARITY_GZIP, tmp_path), layer_digest="sha256:" + "5" * 64)
    remote = _remote_with(index, layer_size, tmp_path, monkeypatch)
    manifest_digest = digest_of(_image_manifest(index, layer_size))
    ref = parse_reference("registry.example/team/app:v1")
    with pytest.raises(NotLazy, match=f"blob of {len(PARITY_GZIP)} bytes, the image manifest's layer has {layer_size}"):
        remote._store_index(ref, manifest_digest, index.layer_digest)
    assert not remote.store.has(index.layer_digest)


def test_the_lazy_prepare_takes_an_index_of_the_whole_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = dataclasses.replace(index_of(PARITY_GZIP, tmp_path), layer_digest="sha256:" + "5" * 64)
    remote = _remote_with(index, len(PARITY_GZIP), tmp_path, monkeypatch)
    ref = parse_reference("registry.example/team/app:v1")
    stored = remote._store_index(ref, digest_of(_image_manifest(index, len(PARITY_GZIP))), index.layer_digest)
    assert stored.compressed_size == len(PARITY_GZIP) and remote.store.has(index.layer_digest)
