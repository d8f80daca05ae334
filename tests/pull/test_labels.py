"""The pure part of `bootseer pull`: chain ids and the labels it sets."""

from __future__ import annotations

import hashlib
import json

import pytest

from snapshotter.pull import (
    LABEL_IMAGE_LAYERS,
    PullError,
    chain_ids,
    diff_ids_of,
    image_layers_label,
    snapshot_labels,
    unpack_key,
)
from snapshotter.registry.media import Descriptor


def _digest(n: int) -> str:
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


def test_chain_ids_follow_the_oci_definition() -> None:
    a, b, c = _digest(1), _digest(2), _digest(3)
    ab = "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()
    abc = "sha256:" + hashlib.sha256(f"{ab} {c}".encode()).hexdigest()
    assert chain_ids([a, b, c]) == [a, ab, abc]
    assert chain_ids([]) == []


def test_image_layers_label_is_truncated_to_fit_4096_bytes() -> None:
    digests = [_digest(i) for i in range(100)]  # 71 bytes each
    value = image_layers_label(digests)
    assert len(LABEL_IMAGE_LAYERS) + len(value) <= 4096
    kept = value.split(",")
    assert kept == digests[: len(kept)] and 40 < len(kept) < 100
    assert image_layers_label(digests[:3]) == ",".join(digests[:3])


def test_snapshot_labels_name_the_layer_and_what_follows() -> None:
    layers = [
        Descriptor(
            "application/vnd.oci.image.layer.v1.tar+gzip",
            _digest(i),
            10,
            annotations={"containerd.io/snapshot/stargz.toc": "x", "org.other": "dropped"},
        )
        for i in range(3)
    ]
    labels = snapshot_labels("reg:5000/a/b:v1", _digest(99), layers, 1, "sha256:chain")
    assert labels == {
        "containerd.io/snapshot.ref": "sha256:chain",
        "containerd.io/snapshot/cri.image-ref": "reg:5000/a/b:v1",
        "containerd.io/snapshot/cri.layer-digest": _digest(1),
        "containerd.io/snapshot/cri.image-layers": f"{_digest(1)},{_digest(2)}",
        "containerd.io/snapshot/cri.manifest-digest": _digest(99),
        "containerd.io/snapshot/stargz.toc": "x",
    }


def test_unpack_keys_are_unique_and_end_with_the_chain_id() -> None:
    keys = {unpack_key("sha256:abc") for _ in range(100)}
    assert len(keys) == 100
    assert all(k.startswith("extract-") and k.endswith(" sha256:abc") for k in keys)


def test_config_diff_ids_must_match_the_layers() -> None:
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [_digest(1), _digest(2)]}}).encode()
    assert diff_ids_of(config, 2) == [_digest(1), _digest(2)]
    with pytest.raises(PullError, match="2 diff_ids for 3 layers"):
        diff_ids_of(config, 3)
    with pytest.raises(PullError, match="no rootfs.diff_ids"):
        diff_ids_of(b"{}", 1)
