"""A layer without entries for its parent directories shows them as the
normal path does: containerd makes them like the lower layer's directory of
the same path, so such a layer takes the normal path when that directory is
not what the lazy tree shows, and is served lazily otherwise."""

from __future__ import annotations

import pytest

from tests.harness.lazynode import LazyNode
from tests.harness.oci import File, ImageBuilder, busybox_layer

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"


def test_implicit_parent_directories_show_as_containerd_makes_them(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    c = lazy_node.containerd
    # busybox_layer's /tmp is 1777; nothing below has /opt.
    over_tmp = images.push(f"implicit/tmp-{unique}", [busybox_layer(), [File(f"/tmp/{unique}/x", b"x\n")]])
    new_dir = images.push(f"implicit/opt-{unique}", [busybox_layer(), [File(f"/opt/{unique}/x", b"y\n")]])
    for image in (over_tmp, new_dir):
        lazy_node.index(image.ref)
        lazy_node.pull(image.ref)

    top = over_tmp.layout.layer_digests[1]
    [refused] = lazy_node.fallbacks("implicit_dirs", top)
    assert "/tmp" in refused and "mode 1777" in refused, refused
    info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", over_tmp.layout.chain_ids[1]).stdout
    assert REMOTE_LABEL not in info, info
    shown = c.run(over_tmp.ref, f"tmp-{unique}", "/bin/stat", "-c", "%n %a %u %g", "/tmp", f"/tmp/{unique}")
    assert shown == f"/tmp 1777 0 0\n/tmp/{unique} 755 0 0\n"

    # A directory no lower layer has is made 0755 by root either way: lazily served.
    info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", new_dir.layout.chain_ids[1]).stdout
    assert f'"{REMOTE_LABEL}": "true"' in info, info
    shown = c.run(new_dir.ref, f"opt-{unique}", "/bin/stat", "-c", "%n %a %u %g", "/opt", f"/opt/{unique}")
    assert shown == f"/opt 755 0 0\n/opt/{unique} 755 0 0\n"
    assert c.run(new_dir.ref, f"opt-cat-{unique}", "/bin/cat", f"/opt/{unique}/x") == "y\n"
