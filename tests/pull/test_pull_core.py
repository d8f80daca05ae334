"""The pure part of `bootseer pull`: chain ids, unpack keys, diff ids, progress bars."""

from __future__ import annotations

import hashlib
import json

import pytest

from snapshotter.pull import LayerProgress, PullError, chain_ids, diff_ids_of, unpack_key
from snapshotter.registry.media import Descriptor


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


def test_layer_progress_draws_a_bar_only_where_asked() -> None:
    layer = Descriptor("application/vnd.oci.image.layer.v1.tar+gzip", "sha256:" + "a" * 64, 1000)
    quiet = LayerProgress(0, 1, layer, enabled=False)
    quiet.advance(10)
    quiet.done("fetched")
    assert quiet.bar is None
    # enabled None follows stderr: pytest's capture is no terminal.
    assert LayerProgress(0, 1, layer, enabled=None).bar is None


def test_layer_progress_shows_how_a_layer_was_satisfied(capsys: pytest.CaptureFixture[str]) -> None:
    layer = Descriptor("application/vnd.oci.image.layer.v1.tar+gzip", "sha256:" + "b" * 64, 1000)
    bar = LayerProgress(1, 2, layer, enabled=True)
    bar.done("remote")
    shown = capsys.readouterr().err
    assert "layer 2/2 bbbbbbbbbbbb" in shown and "remote" in shown
