"""A small OCI image writer, so tests control every byte of every layer.

`docker build` is not available here and umoci cannot express whiteouts,
opaque directories, device nodes or xattrs directly; writing the tar
ourselves can. Images are written as an OCI image layout and pushed with
skopeo.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# A fixed mtime keeps layer digests stable across runs.
MTIME = 1_700_000_000
BUSYBOX = Path("/bin/busybox")
# Applets the tests call; each is a relative symlink to /bin/busybox.
BUSYBOX_APPLETS = (
    "sh",
    "sleep",
    "cat",
    "ls",
    "stat",
    "test",
    "echo",
    "rm",
    "touch",
    "mkdir",
    "sha256sum",
    "wc",
    "head",
    "readlink",
    "find",
    "id",
    "true",
    "grep",
    "sync",
)

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


@dataclass(frozen=True)
class File:
    path: str
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = MTIME
    # "user.foo" -> value; written as PAX "SCHILY.xattr.user.foo".
    xattrs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Dir:
    path: str
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    mtime: int = MTIME
    xattrs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Symlink:
    path: str
    target: str
    uid: int = 0
    gid: int = 0
    mtime: int = MTIME


@dataclass(frozen=True)
class Hardlink:
    """A second name for `target`, a File that comes earlier in the same layer.

    The tar entry repeats the target's mode and owner, as real tar writers
    do: appliers chmod/chown the shared inode with whatever the link carries.
    """

    path: str
    target: str
    # A link to no earlier file of the layer (a lower layer's, or nothing):
    # what a hostile layer can hold; the entry then says mode 0644, owner root.
    dangling: bool = False


@dataclass(frozen=True)
class CharDevice:
    path: str
    major: int
    minor: int
    mode: int = 0o666
    uid: int = 0
    gid: int = 0
    mtime: int = MTIME


@dataclass(frozen=True)
class Whiteout:
    """Deletes `path` (inherited from a lower layer) via a `.wh.NAME` entry."""

    path: str


@dataclass(frozen=True)
class Opaque:
    """Hides everything lower layers put in directory `path` (`.wh..wh..opq`).

    The directory itself must also be an entry of the same layer.
    """

    path: str


Entry = File | Dir | Symlink | Hardlink | CharDevice | Whiteout | Opaque
Layer = Sequence[Entry]


@dataclass(frozen=True)
class Blob:
    digest: str
    data: bytes


@dataclass(frozen=True)
class ImageLayout:
    """An OCI image layout on disk holding one tagged image."""

    directory: Path
    tag: str
    diff_ids: tuple[str, ...]
    # Digests and sizes of the compressed layer blobs, bottom first.
    layer_digests: tuple[str, ...] = ()
    layer_sizes: tuple[int, ...] = ()

    @property
    def chain_ids(self) -> tuple[str, ...]:
        """Snapshot names containerd gives the committed layers, bottom first."""
        chain: list[str] = []
        for diff_id in self.diff_ids:
            chain.append(_digest(f"{chain[-1]} {diff_id}".encode()) if chain else diff_id)
        return tuple(chain)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.strip("/").rpartition("/")
    return parent, name


def _header(
    name: str,
    kind: bytes,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: int = MTIME,
    xattrs: Mapping[str, str] | None = None,
) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name.strip("/"))
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = kind, mode, uid, gid, mtime
    # Numeric ids only: the applier must not map names through /etc/passwd.
    ti.uname = ti.gname = ""
    ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in (xattrs or {}).items()}
    return ti


def _tarinfo(entry: Entry, files: Mapping[str, File]) -> tuple[tarfile.TarInfo, bytes | None]:
    """The tar header (and data) for one entry; `files` are the layer's files so far."""
    match entry:
        case File(path, data, mode, uid, gid, mtime, xattrs):
            ti = _header(path, tarfile.REGTYPE, mode, uid, gid, mtime, xattrs)
            ti.size = len(data)
            return ti, data
        case Dir(path, mode, uid, gid, mtime, xattrs):
            return _header(path, tarfile.DIRTYPE, mode, uid, gid, mtime, xattrs), None
        case Symlink(path, target, uid, gid, mtime):
            ti = _header(path, tarfile.SYMTYPE, 0o777, uid, gid, mtime)
            ti.linkname = target
            return ti, None
        case Hardlink(path, target_path, dangling):
            target = files.get(target_path)
            if dangling:
                target = File(target_path)
            elif target is None:
                raise ValueError(f"hardlink {path}: no file {target_path} earlier in the layer")
            ti = _header(path, tarfile.LNKTYPE, target.mode, target.uid, target.gid, target.mtime)
            ti.linkname = target_path.strip("/")
            return ti, None
        case CharDevice(path, major, minor, mode, uid, gid, mtime):
            ti = _header(path, tarfile.CHRTYPE, mode, uid, gid, mtime)
            ti.devmajor, ti.devminor = major, minor
            return ti, None
        case Whiteout(path):
            parent, name = _split(path)
            return _header(f"{parent}/.wh.{name}", tarfile.REGTYPE), None
        case Opaque(path):
            return _header(f"{path.strip('/')}/.wh..wh..opq", tarfile.REGTYPE), None
    raise TypeError(f"not a layer entry: {entry!r}")


def layer_tar(layer: Layer) -> bytes:
    """The uncompressed tar of a layer, in PAX format (long and UTF-8 names, xattrs)."""
    buf = io.BytesIO()
    files: dict[str, File] = {}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
        for entry in layer:
            if isinstance(entry, File):
                files[entry.path] = entry
            ti, data = _tarinfo(entry, files)
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _gzip(data: bytes) -> bytes:
    buf = io.BytesIO()
    # mtime=0 and no file name keep the compressed digest reproducible.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return buf.getvalue()


def _descriptor(media_type: str, blob: Blob) -> dict[str, object]:
    return {"mediaType": media_type, "digest": blob.digest, "size": len(blob.data)}


def _json_blob(obj: object) -> Blob:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return Blob(_digest(data), data)


def write_layout(
    directory: Path,
    layers: Sequence[Layer],
    cmd: Sequence[str] = ("/bin/sh",),
    tag: str = "latest",
) -> ImageLayout:
    """Write an amd64/linux image of gzip-compressed `layers` (bottom first)."""
    layer_blobs: list[Blob] = []
    diff_ids: list[str] = []
    for layer in layers:
        tar = layer_tar(layer)
        compressed = _gzip(tar)
        layer_blobs.append(Blob(_digest(compressed), compressed))
        diff_ids.append(_digest(tar))

    config = _json_blob(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": list(cmd), "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    )
    manifest = _json_blob(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": _descriptor(MEDIA_CONFIG, config),
            "layers": [_descriptor(MEDIA_LAYER_GZIP, blob) for blob in layer_blobs],
        }
    )
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                **_descriptor(MEDIA_MANIFEST, manifest),
                "annotations": {"org.opencontainers.image.ref.name": tag},
                "platform": {"architecture": "amd64", "os": "linux"},
            }
        ],
    }

    blob_dir = directory / "blobs" / "sha256"
    blob_dir.mkdir(parents=True, exist_ok=True)
    for blob in [*layer_blobs, config, manifest]:
        (blob_dir / blob.digest.removeprefix("sha256:")).write_bytes(blob.data)
    (directory / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (directory / "index.json").write_text(json.dumps(index))
    return ImageLayout(
        directory=directory,
        tag=tag,
        diff_ids=tuple(diff_ids),
        layer_digests=tuple(b.digest for b in layer_blobs),
        layer_sizes=tuple(len(b.data) for b in layer_blobs),
    )


def push(layout: ImageLayout, reference: str, creds: str = "") -> None:
    """Copy the layout's image to `reference` ("HOST/NAME:TAG") over plain
    HTTP, logging in with `creds` ("user:password") if given."""
    login = ["--dest-creds", creds] if creds else []
    result = subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            *login,
            f"oci:{layout.directory}:{layout.tag}",
            f"docker://{reference}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"skopeo copy to {reference} failed ({result.returncode}):\n{result.stderr}")


def busybox_layer() -> list[Entry]:
    """A base layer with a static busybox, so containers can run commands."""
    entries: list[Entry] = [
        Dir("/bin"),
        Dir("/tmp", mode=0o1777),
        Dir("/proc"),
        Dir("/sys"),
        Dir("/dev"),
        Dir("/etc"),
        File("/bin/busybox", BUSYBOX.read_bytes(), mode=0o755),
    ]
    entries += [Symlink(f"/bin/{applet}", "busybox") for applet in BUSYBOX_APPLETS]
    return entries


@dataclass(frozen=True)
class PushedImage:
    ref: str  # "HOST/NAME:TAG", what ctr pulls
    layout: ImageLayout


@dataclass
class ImageBuilder:
    """Builds images under `workdir` and pushes them to one registry."""

    registry_host: str
    workdir: Path
    creds: str = ""  # "user:password" for a registry that wants a login

    def push(
        self,
        name: str,
        layers: Sequence[Layer],
        cmd: Sequence[str] = ("/bin/sh",),
        tag: str = "v1",
    ) -> PushedImage:
        directory = self.workdir / name.replace("/", "_") / tag
        layout = write_layout(directory, layers, cmd=cmd, tag=tag)
        ref = f"{self.registry_host}/{name}:{tag}"
        push(layout, ref, self.creds)
        return PushedImage(ref=ref, layout=layout)
