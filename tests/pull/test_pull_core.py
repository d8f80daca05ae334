"""The pure part of `bootseer pull`: chain ids, unpack keys, diff ids, progress bars, the pull socket's request."""

from __future__ import annotations

import hashlib
import json

import pytest

from bootseer.commands.pull import LayerBar
from snapshotter.pull import PullError, chain_ids, diff_ids_of, unpack_key
from snapshotter.pullwire import PullRequest, RequestError


def _digest(n: int) -> str:
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


def test_chain_ids_follow_the_oci_definition() -> None:
    a, b, c = _digest(1), _digest(2), _digest(3)
    ab = "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()
    abc = "sha256:" + hashlib.sha256(f"{ab} {c}".encode()).hexdigest()
    assert chain_ids([a, b, c]) == [a, ab, abc]
    assert chain_ids([]) == []


def test_unpack_keys_are_unique_and_end_with_the_chain_id() -> None:
    keys = {unpack_key("sha256:abc") for _ in range(100)}
    assert len(keys) == 100
    assert all(k.startswith("extract-") and k.endswith(" sha256:abc") for k in keys)


def test_config_diff_ids_must_match_the_layers() -> None:
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [_digest(1), _digest(2)]}}).encode()
    assert diff_ids_of(config, 2) == [_digest(1), _digest(2)]
    with pytest.raises(PullError, match="2 diff_ids for 3 layers"):
        diff_ids_of(config, 3)
    with pytest.raises(PullError, match=r"no rootfs\.diff_ids"):
        diff_ids_of(b"{}", 1)


def test_layer_bar_draws_a_bar_only_where_asked() -> None:
    quiet = LayerBar(0, 1, "sha256:" + "a" * 64, 1000, enabled=False)
    quiet.advance(10)
    quiet.done("fetched")
    assert quiet.bar is None
    # enabled None follows stderr: pytest's capture is no terminal.
    assert LayerBar(0, 1, "sha256:" + "a" * 64, 1000).bar is None


def test_layer_bar_shows_how_a_layer_was_satisfied(capsys: pytest.CaptureFixture[str]) -> None:
    bar = LayerBar(1, 2, "sha256:" + "b" * 64, 1000, enabled=True)
    bar.done("remote")
    shown = capsys.readouterr().err
    assert "layer 2/2 bbbbbbbbbbbb" in shown and "remote" in shown


def test_a_pull_request_survives_its_encoding() -> None:
    request = PullRequest(
        image="registry.example/team/train:v1",
        address="/run/containerd/containerd.sock",
        namespace="k8s.io",
        snapshotter="bootseer",
        platform="linux/amd64",
        plain_http=True,
        hosts_dir="/etc/containerd/certs.d",
        docker_config="/root/.docker/config.json",
        started=1765000000.25,
    )
    line = request.encode()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert PullRequest.decode(line) == request
    minimal = PullRequest(image="busybox", address="/c.sock", namespace="default", snapshotter="overlayfs")
    assert PullRequest.decode(minimal.encode()) == minimal


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"not json\n", "not a JSON request"),
        (b"[1, 2]\n", "must be a JSON object"),
        (b'{"image": "a", "address": "/c", "namespace": "n"}\n', "snapshotter must be a non-empty string"),
        (b'{"image": "", "address": "/c", "namespace": "n", "snapshotter": "s"}\n', "image must be"),
        (b'{"image": "a", "address": "/c", "namespace": "n", "snapshotter": "s", "rm": "-rf"}\n', "unknown request"),
        (b'{"image": "a", "address": "/c", "namespace": "n", "snapshotter": "s", "plain_http": "yes"}\n', "plain_http"),
        (b'{"image": "a", "address": "/c", "namespace": "n", "snapshotter": "s", "platform": 3}\n', "platform"),
        (b'{"image": "a", "address": "/c", "namespace": "n", "snapshotter": "s", "started": true}\n', "started"),
    ],
)
def test_a_malformed_pull_request_is_refused_with_the_reason(line: bytes, why: str) -> None:
    with pytest.raises(RequestError, match=why):
        PullRequest.decode(line)
