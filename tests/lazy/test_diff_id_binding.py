"""Cross-image poisoning: an image whose config claims another image's
diff_id for a layer of its own (and that carries a genuine index of its own
layer) must not get its bytes committed under the chainID those diff_ids
give, where a later pull of the other image would find and reuse them.

The remote Prepare serves a layer only if chain(parent's chain, the index's
diff_id) is the chainID containerd asked for; the liar's layer takes the
normal path, which checks the real diff_id and fails the pull."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from tests.harness.lazynode import LazyNode
from tests.harness.oci import Entry, File, ImageBuilder, ImageLayout, PushedImage, busybox_layer, push, write_layout

pytestmark = pytest.mark.integration

REMOTE_LABEL = "containerd.io/snapshot/remote"


def _blob(layout: ImageLayout, digest: str) -> Path:
    return layout.directory / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _put_json(layout: ImageLayout, doc: object) -> tuple[str, int]:
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _blob(layout, digest).write_bytes(data)
    return digest, len(data)


def push_liar(images: ImageBuilder, name: str, layers: list[list[Entry]], claimed: tuple[str, ...]) -> PushedImage:
    """An image of `layers` whose config claims the diff_ids `claimed`: the
    layout written as usual, then its config (and so its manifest) rewritten."""
    layout = write_layout(images.workdir / f"{name.replace('/', '_')}-liar", layers, cmd=["/bin/cat", "/victim.txt"])
    index = json.loads((layout.directory / "index.json").read_text())
    manifest = json.loads(_blob(layout, index["manifests"][0]["digest"]).read_bytes())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_bytes())
    assert len(claimed) == len(config["rootfs"]["diff_ids"])
    config["rootfs"]["diff_ids"] = list(claimed)
    digest, size = _put_json(layout, config)
    manifest["config"].update(digest=digest, size=size)
    digest, size = _put_json(layout, manifest)
    index["manifests"][0].update(digest=digest, size=size)
    (layout.directory / "index.json").write_text(json.dumps(index))
    ref = f"{images.registry_host}/{name}:{layout.tag}"
    push(layout, ref, images.creds)
    return PushedImage(ref=ref, layout=layout)


def fallbacks(node: LazyNode, reason: str) -> list[dict[str, str]]:
    """The snapshotter's "layer takes the normal path" lines with `reason`, as key=value fields."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", node.snapshotter.daemon.log_path.read_text(errors="replace"))
    found = []
    for line in text.splitlines():
        if "layer takes the normal path" in line and f"reason={reason}" in line:
            found.append(dict(re.findall(r"(\w+)=(\S+)", line)))
    return found


def served(node: LazyNode) -> list[dict[str, str]]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", node.snapshotter.daemon.log_path.read_text(errors="replace"))
    return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in text.splitlines() if "layer served lazily" in line]


def attack(node: LazyNode, images: ImageBuilder, name: str, base: list[Entry]) -> tuple[PushedImage, PushedImage]:
    """Victim V (base + /victim.txt) and attacker A (the same base, its own
    setuid /victim.txt) claiming V's diff_ids, both indexed; A is pulled
    lazily first and must fail, then V is pulled lazily."""
    victim = images.push(f"{name}/victim", [base, [File("/victim.txt", b"victim\n")]], cmd=["/bin/cat", "/victim.txt"])
    attacker = push_liar(
        images, f"{name}/attacker", [base, [File("/victim.txt", b"attacker\n", mode=0o4755)]], victim.layout.diff_ids
    )
    # A genuine index of A's own layers: the one `bootseer index` builds.
    node.index(victim.ref)
    node.index(attacker.ref)
    c = node.containerd
    pulled = node.try_pull(attacker.ref)
    assert pulled.returncode != 0, pulled.stdout + pulled.stderr
    assert "but the config says" in pulled.stderr and victim.layout.diff_ids[1] in pulled.stderr, pulled.stderr
    # A's bytes are committed under no chainID of V's.
    assert victim.layout.chain_ids[1] not in c.snapshots()
    return victim, attacker


def test_an_image_claiming_another_images_diff_id_is_not_served_lazily_and_does_not_poison_it(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    c = lazy_node.containerd
    # A container of another image runs throughout.
    bystander = images.push(
        f"bind/bystander-{unique}", [busybox_layer(), [File("/mine.txt", b"mine\n")]], cmd=["/bin/sleep", "600"]
    )
    lazy_node.index(bystander.ref)
    lazy_node.pull(bystander.ref)
    c.run(bystander.ref, f"bystander-{unique}", "/bin/sleep", "600", detach=True)
    try:
        base = [*busybox_layer(), File(f"/base-{unique}", b"base\n")]
        victim, attacker = attack(lazy_node, images, f"bind/lazy-{unique}", base)
        chain0, chain1 = victim.layout.chain_ids
        # The base layer is what A says it is, and was served lazily; the
        # layer above it was refused by the chain check.
        [refused] = [f for f in fallbacks(lazy_node, "diff_id_mismatch") if f["target"] == chain1]
        assert refused["image"] == attacker.ref and refused["layer"] == attacker.layout.layer_digests[1]
        # Observed: containerd names a lazily served parent by our own key,
        # "<namespace>/remote/<chainID>".
        assert refused["parent"] == f"{c.namespace}/remote/{chain0}", refused
        # V, pulled lazily now, shows its own file.
        out = lazy_node.pull(victim.ref)
        # The base again or not, as containerd's GC left it after A's failed pull.
        assert re.search(r"\(\d remote, 0 fetched", out) and "0 remote" not in out, out
        info = c.ctr("snapshots", "--snapshotter", "bootseer", "info", chain1).stdout
        assert f'"{REMOTE_LABEL}": "true"' in info, info
        assert c.run(victim.ref, f"victim-{unique}") == "victim\n"
        mode = c.run(victim.ref, f"victim-mode-{unique}", "/bin/stat", "-c", "%a", "/victim.txt")
        assert mode == "644\n"
        # Everything is still up, and the bystander still reads its files.
        assert lazy_node.snapshotter.daemon.alive() and lazy_node.layers.daemon.alive()
        assert c.exec(f"bystander-{unique}", f"read-{unique}", "/bin/cat", "/mine.txt") == "mine\n"
    finally:
        c.remove_container(f"bystander-{unique}")


def test_the_binding_holds_on_a_parent_containerd_unpacked_itself(
    lazy_node: LazyNode, images: ImageBuilder, unique: str
) -> None:
    c = lazy_node.containerd
    base = [*busybox_layer(), File(f"/base-{unique}", b"base\n")]
    # An image of the base alone, not indexed: its layer takes the normal path.
    plain = images.push(f"bind/plain-{unique}", [base], cmd=["/bin/cat", f"/base-{unique}"])
    out = lazy_node.pull(plain.ref)
    assert "(0 remote, 1 fetched" in out, out
    victim, _ = attack(lazy_node, images, f"bind/normal-{unique}", base)
    chain0, chain1 = victim.layout.chain_ids
    [refused] = [f for f in fallbacks(lazy_node, "diff_id_mismatch") if f["target"] == chain1]
    # Observed: a parent containerd committed is "<namespace>/<n>/<chainID>".
    assert re.fullmatch(rf"{re.escape(c.namespace)}/\d+/{re.escape(chain0)}", refused["parent"]), refused
    # The honest image's layer binds to that parent and is served lazily.
    out = lazy_node.pull(victim.ref)
    assert "(1 remote, 0 fetched, 1 already present" in out, out
    [lazy] = [s for s in served(lazy_node) if s["target"] == chain1]
    assert lazy["parent"] == refused["parent"]
    assert c.run(victim.ref, f"victim-{unique}") == "victim\n"
    assert lazy_node.snapshotter.daemon.alive() and lazy_node.layers.daemon.alive()
