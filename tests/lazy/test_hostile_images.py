"""Hostile images, written with tarfile and pushed to the real registry,
indexed by `bootseer index` and pulled through containerd while a container
of another image runs: each gets containerd's own answer (its files where
containerd's applier puts them, or its pull refused), the layer server and
the snapshotter stay up, the running container still reads, and the next
good pull works."""

from __future__ import annotations

import pytest

from tests.harness.lazynode import LazyNode
from tests.harness.oci import Entry, File, Hardlink, ImageBuilder, PushedImage, Symlink, busybox_layer

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"
DEEP = "/" + "d/" * 1000 + "f"


def test_hostile_images_get_containerds_answer_and_the_node_carries_on(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    c = lazy_node.containerd

    def pushed(name: str, top: list[Entry]) -> PushedImage:
        image = images.push(f"hostimg/{name}-{unique}", [busybox_layer(), top])
        lazy_node.index(image.ref)
        return image

    with lazy_node.bystander(images, f"hostimg-{unique}") as bystander:
        # A file under a symlinked directory lands where the link leads,
        # inside the snapshot (continuity's RootPath), and is served lazily.
        escape = pushed("escape", [Symlink("/esc", "/opt/x"), File("/esc/pwned", b"inside\n")])
        lazy_node.pull(escape.ref)
        info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", escape.layout.chain_ids[-1]).stdout
        assert f'"{REMOTE_LABEL}": "true"' in info, info
        shown = c.run(escape.ref, f"escape-{unique}", "/bin/cat", "/opt/x/pwned")
        assert shown == "inside\n"
        bystander.still_fine("symlinked directory")

        # Hardlinks to a lower layer's file or to nothing: containerd's
        # applier refuses them, so the pull fails, as on any node.
        for case, target in [("lower", "/bin/busybox"), ("missing", "/nowhere")]:
            link = pushed(f"link-{case}", [File("/mine", b"m\n"), Hardlink("/link", target, dangling=True)])
            failed = lazy_node.try_pull(link.ref)
            assert failed.returncode != 0, failed.stdout
            bystander.still_fine(f"hardlink to {case}")

        # A path 1,000 levels deep: served lazily, read in full.
        deep = pushed("deep", [File(DEEP, b"deep\n")])
        lazy_node.pull(deep.ref)
        assert c.run(deep.ref, f"deep-{unique}", "/bin/cat", DEEP) == "deep\n"
        bystander.still_fine("1,000 levels")

        # And a new good image afterwards, without a restart.
        after = pushed("after", [File("/after.txt", b"after\n")])
        lazy_node.pull(after.ref)
        info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", after.layout.chain_ids[-1]).stdout
        assert f'"{REMOTE_LABEL}": "true"' in info, info
        assert c.run(after.ref, f"after-{unique}", "/bin/cat", "/after.txt") == "after\n"
