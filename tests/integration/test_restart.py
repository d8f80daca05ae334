"""The snapshotter crashes (kill -9) and comes back on the same root and socket.

containerd keeps its own metadata across the crash; what must hold is that
the snapshotter's state still matches it, and that running containers,
whose rootfs the kernel holds, never notice.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.containerd import Containerd
from tests.harness.oci import File, ImageBuilder, PushedImage, busybox_layer
from tests.harness.snapshotter import Snapshotter

pytestmark = pytest.mark.integration


def _marked_image(images: ImageBuilder, name: str, marker: str) -> PushedImage:
    return images.push(name, [busybox_layer(), [File("/marker", f"{marker}\n".encode())]])


def _marker_in_new_container(containerd: Containerd, image: PushedImage, container_id: str) -> str:
    return containerd.run(image.ref, container_id, "/bin/cat", "/marker")


@pytest.fixture
def crashable(snapshotter: Snapshotter, containerd: Containerd) -> Iterator[Snapshotter]:
    """The session snapshotter, guaranteed running again after the test
    whatever the test did to it, so later tests are unaffected."""
    yield snapshotter
    if not snapshotter.daemon.alive():
        snapshotter.start()
    containerd.wait_snapshotter()


def test_pull_after_crash_between_pulls(
    containerd: Containerd, crashable: Snapshotter, images: ImageBuilder, unique: str
) -> None:
    first = _marked_image(images, f"restart/first-{unique}", f"first {unique}")
    second = _marked_image(images, f"restart/second-{unique}", f"second {unique}")
    containerd.pull(first.ref)

    crashable.kill9()
    crashable.start()
    containerd.wait_snapshotter()

    containerd.pull(second.ref)
    assert _marker_in_new_container(containerd, second, f"second-{unique}") == f"second {unique}\n"
    assert _marker_in_new_container(containerd, first, f"first-{unique}") == f"first {unique}\n"


def test_running_container_survives_crash(
    containerd: Containerd, crashable: Snapshotter, images: ImageBuilder, unique: str
) -> None:
    image = _marked_image(images, f"restart/running-{unique}", f"running {unique}")
    container_id = f"survivor-{unique}"
    containerd.pull(image.ref)
    containerd.run(image.ref, container_id, "/bin/sleep", "600", detach=True)
    try:
        before = containerd.snapshots()
        crashable.kill9()

        read = containerd.exec(container_id, f"read-while-down-{unique}", "/bin/cat", "/marker")
        assert read == f"running {unique}\n"
        write = ("/bin/sh", "-c", "echo w > /tmp/w && cat /tmp/w")
        assert containerd.exec(container_id, f"write-while-down-{unique}", *write) == "w\n"

        crashable.start()
        containerd.wait_snapshotter()

        after = containerd.snapshots()
        missing = {key: row for key, row in before.items() if after.get(key) != row}
        assert not missing, f"lost over the restart: {missing}"
        # `ls` reads containerd's own metadata; `usage` asks the snapshotter
        # for every key, so it proves the restarted process knows them too.
        containerd.ctr("snapshots", "--snapshotter", "bootseer", "usage", *before)

        fresh = _marked_image(images, f"restart/fresh-{unique}", f"fresh {unique}")
        containerd.pull(fresh.ref)
        assert _marker_in_new_container(containerd, fresh, f"fresh-{unique}") == f"fresh {unique}\n"
        files = ("/marker", "/tmp/w")
        read = containerd.exec(container_id, f"read-after-{unique}", "/bin/cat", *files)
        assert read == f"running {unique}\nw\n"
    finally:
        containerd.remove_container(container_id)
    # Removing the container removes its active snapshot, through the
    # restarted snapshotter.
    assert container_id not in containerd.snapshots()
