"""containerd's labels: what `bootseer pull` writes is what the remote
Prepare path reads, within containerd's size cap."""

from __future__ import annotations

import hashlib

from snapshotter import labels
from snapshotter.labels import RemoteLayerLabels, image_layers_value, remote_snapshot_labels
from snapshotter.registry.media import Descriptor


def _digest(n: int) -> str:
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


def _layers(count: int) -> list[Descriptor]:
    return [
        Descriptor(
            "application/vnd.oci.image.layer.v1.tar+gzip",
            _digest(i),
            10,
            annotations={"containerd.io/snapshot/stargz.toc": "x", "org.other": "dropped"},
        )
        for i in range(count)
    ]


def test_image_layers_value_is_truncated_to_fit_the_cap() -> None:
    digests = [_digest(i) for i in range(100)]  # 71 bytes each
    value = image_layers_value(digests)
    assert labels.label_bytes(labels.IMAGE_LAYERS, value) <= labels.MAX_LABEL_BYTES
    kept = value.split(",")
    assert kept == digests[: len(kept)] and 40 < len(kept) < 100
    assert image_layers_value(digests[:3]) == ",".join(digests[:3])


def test_remote_snapshot_labels_name_the_layer_and_what_follows() -> None:
    written = remote_snapshot_labels("reg:5000/a/b:v1", _digest(99), _layers(3), 1, "sha256:chain")
    assert written == {
        "containerd.io/snapshot.ref": "sha256:chain",
        "containerd.io/snapshot/cri.image-ref": "reg:5000/a/b:v1",
        "containerd.io/snapshot/cri.layer-digest": _digest(1),
        "containerd.io/snapshot/cri.image-layers": f"{_digest(1)},{_digest(2)}",
        "containerd.io/snapshot/cri.manifest-digest": _digest(99),
        "containerd.io/snapshot/stargz.toc": "x",
    }


def test_the_reader_reads_what_the_writer_wrote() -> None:
    written = remote_snapshot_labels("reg:5000/a/b:v1", _digest(99), _layers(4), 1, "sha256:chain")
    assert RemoteLayerLabels.parse(written) == RemoteLayerLabels(
        target="sha256:chain",
        image_ref="reg:5000/a/b:v1",
        layer_digest=_digest(1),
        manifest_digest=_digest(99),
        upcoming=(_digest(2), _digest(3)),
    )


def test_the_reader_takes_what_older_cri_versions_set() -> None:
    # containerd 1.6's CRI sets neither the manifest digest nor, for a
    # single-layer image, more than the layer itself in image-layers.
    parsed = RemoteLayerLabels.parse(
        {
            labels.TARGET_REF: "sha256:chain",
            labels.IMAGE_REF: "reg/a:v1",
            labels.LAYER_DIGEST: _digest(1),
            labels.IMAGE_LAYERS: _digest(1),
        }
    )
    assert parsed is not None
    assert parsed.manifest_digest == "" and parsed.upcoming == ()


def test_an_ordinary_prepare_is_not_a_remote_one() -> None:
    assert RemoteLayerLabels.parse({}) is None
    assert RemoteLayerLabels.parse({labels.TARGET_REF: "sha256:chain"}) is None
    assert RemoteLayerLabels.parse({labels.TARGET_REF: "x", labels.IMAGE_REF: "reg/a:v1"}) is None
