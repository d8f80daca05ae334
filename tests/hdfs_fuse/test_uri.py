"""URI parsing and backend selection (no store is contacted)."""

from __future__ import annotations

import pytest

from hdfs_fuse import uri as uri_mod
from hdfs_fuse.backends import backend_for
from hdfs_fuse.backends.arrow import ArrowBackend
from hdfs_fuse.backends.http import HttpBackend
from hdfs_fuse.errors import PermanentError
from hdfs_fuse.settings import HdfsFuseConfig
from hdfs_fuse.uri import Location, URIError, parse


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hdfs://nn.example:8020/ckpt/step-100/", Location("hdfs", "nn.example:8020", "/ckpt/step-100")),
        ("hdfs:///ckpt/a.pt", Location("hdfs", "default", "/ckpt/a.pt")),
        ("hdfs://alice@nn/x", Location("hdfs", "nn", "/x", "alice")),
        ("s3://bucket/run/1/model.pt", Location("s3", "bucket", "/run/1/model.pt")),
        ("gs://bucket", Location("gs", "bucket", "/")),
        ("file:///data/../data/x.bin", Location("file", "", "/data/x.bin")),
        ("/abs/path", Location("file", "", "/abs/path")),
        ("http://127.0.0.1:8080/a%20b/c", Location("http", "127.0.0.1:8080", "/a b/c")),
    ],
)
def test_parse(text: str, expected: Location) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ftp://host/x", "scheme must be one of"),
        ("relative/path", "scheme must be one of"),
        ("s3:///key", "missing bucket"),
        ("http:///x", "missing host"),
        ("file://otherhost/x", "local path"),
        ("http://h/x?a=1", "query"),
        ("hdfs://nn:99999/x", "bad port"),
        ("http://u:p@h/x", "credentials"),
    ],
)
def test_parse_rejects_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(URIError, match=message):
        parse(text)


def test_location_round_trips_and_children() -> None:
    loc = parse("http://h:1/a b/")
    assert str(loc.child("c d")) == "http://h:1/a%20b/c%20d"
    assert parse(str(loc.child("c d"))) == loc.child("c d")
    assert parse("s3://b/k/x").arrow_path == "b/k/x"
    assert parse("s3://b").arrow_path == "b"
    assert parse("hdfs://nn:9000/x").port == 9000 and parse("hdfs://nn/x").port == 0
    with pytest.raises(URIError):
        loc.child("../etc")


def test_backends_are_selected_by_scheme_without_connecting() -> None:
    config = HdfsFuseConfig()
    http = backend_for(parse("http://127.0.0.1:1/x"), config)
    assert isinstance(http, HttpBackend)
    http.close()
    for text, kind in [("file:///x", "file"), ("hdfs://nn:8020/x", "hdfs"), ("s3://b/k", "s3"), ("gs://b/k", "gs")]:
        backend = backend_for(parse(text), config)
        assert isinstance(backend, ArrowBackend) and backend.kind == kind
        assert backend._fs is None  # built on first use only


def test_hdfs_without_a_jvm_fails_with_a_clear_error() -> None:
    backend = backend_for(parse("hdfs://namenode.invalid:8020/ckpt/x.pt"), HdfsFuseConfig())
    with pytest.raises(PermanentError, match=r"cannot use hdfs: .*JAVA_HOME"):
        backend.stat(uri_mod.parse("hdfs://namenode.invalid:8020/ckpt/x.pt"))
