"""Publishing hot-block manifests against a real registry (distribution 2.8,
no referrers API: the `sha256-<hex>` tag fallback, deletes enabled): the
publish election elects at most one node however many contend, refuses a
node without push rights, and a merged manifest replaces what it merges,
leaving one artifact and one referrers index in the repository."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from recorder import election, publish
from recorder import manifest as hot
from recorder.election import Outcome
from recorder.manifest import HotBlock, HotManifest
from snapshotter.registry import artifact, media
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.media import Descriptor
from snapshotter.registry.reference import Reference
from snapshotter.registry.reference import parse as parse_reference
from tests.harness import faultproxy
from tests.harness.oci import File, ImageBuilder
from tests.harness.registry import Registry, stored_manifests

CONTENDERS = 8
ROUNDS = 6
OTHER_TYPE = "application/vnd.bootseer.test.other.v1"


@pytest.fixture
def subject(images: ImageBuilder, unique: str) -> Iterator[tuple[Reference, str]]:
    image = images.push(f"publish/{unique}", [[File("/a.txt", unique.encode())]])
    ref = parse_reference(image.ref)
    with RegistryClient(plain_http=True) as client:
        yield ref, client.resolve(ref).manifest_digest


def contend(ref: Reference, image: str, round_: int, contenders: int, whole: bool = False) -> list[Outcome]:
    """`contenders` clients, each with its own connections, released at once
    into one attempt (or, `whole`, into the election with its second attempt)."""
    barrier = threading.Barrier(contenders)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def one() -> None:
        with RegistryClient(plain_http=True) as client:
            barrier.wait()
            if whole:
                outcome, _ = election.run(client, ref, image, round_, sleep=random.uniform(0.2, 0.4))
            else:
                outcome, _ = election.elect(client, ref, image, round_)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=one) for _ in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def claims_in(registry: Registry, ref: Reference) -> list[bytes]:
    return [
        data
        for data in stored_manifests(registry, ref.repository).values()
        if election.CLAIM_ARTIFACT_TYPE.encode() in data
    ]


def test_an_attempt_has_at_most_one_winner_and_a_lone_contender_wins(
    registry: Registry, subject: tuple[Reference, str]
) -> None:
    ref, image = subject
    winners = 0
    for round_ in range(ROUNDS):
        counts = Counter(contend(ref, image, round_, CONTENDERS))
        assert sum(counts.values()) == CONTENDERS
        assert counts[Outcome.WON] <= 1, counts
        assert counts[Outcome.REFUSED] == 0, counts
        winners += counts[Outcome.WON]
    with RegistryClient(plain_http=True) as client:
        # A decided attempt stays decided; a new round is won by whoever runs alone.
        assert election.elect(client, ref, image, 0)[0] is Outcome.LOST
        outcome, claim = election.run(client, ref, image, ROUNDS)
        assert outcome is Outcome.WON
        election.release(client, ref, claim)
    # Losers delete their claims, a released winner its own; the "taken"
    # marker is one manifest however many rounds (the winners above, never
    # released, keep theirs).
    assert len(claims_in(registry, ref)) <= 1 + winners


def test_an_election_has_at_most_two_winners(registry: Registry, subject: tuple[Reference, str]) -> None:
    ref, image = subject
    for round_ in range(ROUNDS // 2):
        counts = Counter(contend(ref, image, round_, CONTENDERS, whole=True))
        assert sum(counts.values()) == CONTENDERS
        assert counts[Outcome.WON] <= 2, counts


def test_a_node_whose_writes_are_refused_does_not_win(registry: Registry, subject: tuple[Reference, str]) -> None:
    ref, image = subject
    with faultproxy.running(registry.port) as proxy:
        for method in ("PUT", "POST", "DELETE"):
            proxy.plan("status", method=method, status=403, times=1000)
        behind = parse_reference(f"{proxy.host}/{ref.repository}:{ref.tag}")
        with RegistryClient(plain_http=True) as client:
            assert election.run(client, behind, image, 0)[0] is Outcome.REFUSED
    with RegistryClient(plain_http=True) as client:
        # Nothing was claimed: a node that may push still wins the round.
        assert election.run(client, ref, image, 0)[0] is Outcome.WON


def index_manifests(registry: Registry, ref: Reference) -> set[str]:
    stored = stored_manifests(registry, ref.repository)
    return {d for d, m in stored.items() if media.OCI_INDEX.encode() in m and b'"manifests"' in m}


def manifest_of(image: str, layer: str, blocks: range, runs: int = 1) -> HotManifest:
    return HotManifest(image, runs, [HotBlock(layer, n, f"{n:064x}", 10 * n, 100) for n in blocks])


def attach_old_style(client: RegistryClient, ref: Reference, image: str, manifest: HotManifest) -> str:
    """What every node used to do: push one more artifact, superseding nothing."""
    return publish.push(client, ref, image, manifest)


def test_a_merged_manifest_replaces_every_manifest_it_merges(
    registry: Registry, subject: tuple[Reference, str]
) -> None:
    ref, image = subject
    layer = "sha256:" + "a" * 64
    with RegistryClient(plain_http=True) as client:
        piled = [attach_old_style(client, ref, image, manifest_of(image, layer, range(i, i + 3))) for i in range(3)]
        # Another kind of referrer sharing the tag index must survive pruning.
        data, media_type, _ = client.fetch_manifest(ref.with_digest(image))
        other_blob = client.push_blob(ref, b"not a hot-block manifest")
        other = artifact.push(
            client,
            ref,
            Descriptor(media_type, image, len(data)),
            OTHER_TYPE,
            [Descriptor("application/octet-stream", other_blob.digest, other_blob.size)],
        )
        found = publish.find(client, ref, image)
        assert [p.digest for p in found] == piled
        merged, includes = publish.combine(None, found, (), lambda m: None)
        assert merged is not None and merged.runs == 3 and set(includes) == set(piled)
        assert {b.block for b in merged.blocks} == set(range(5))
        indexes_before = index_manifests(registry, ref)
        digest = publish.publish(client, ref, image, merged, found)

        assert [p.digest for p in publish.find(client, ref, image)] == [digest]
        assert [d.digest for d in client.referrers(ref, image, artifact_type=OTHER_TYPE)] == [other]
        stored = stored_manifests(registry, ref.repository)
        for old in piled:
            assert old not in stored
        hot_artifacts = [d for d, m in stored.items() if hot.ARTIFACT_TYPE.encode() in m and b'"subject"' in m]
        assert hot_artifacts == [digest]
        # Of the referrers index versions it wrote and replaced, one stays
        # (those the old-style pushes left behind cannot be found by the API).
        final = client.referrers_index_digest(ref, image)
        assert index_manifests(registry, ref) - indexes_before == {final}
        assert len(indexes_before - index_manifests(registry, ref)) == 1

        # Publishing again from a node whose copy already includes it changes nothing.
        again, included = publish.combine(merged, publish.find(client, ref, image), (digest,), lambda m: None)
        assert again is merged and included == (digest,)


def test_stale_published_manifests_are_not_merged_but_pruned(
    registry: Registry, subject: tuple[Reference, str]
) -> None:
    ref, image = subject
    layer = "sha256:" + "b" * 64
    with RegistryClient(plain_http=True) as client:
        stale = attach_old_style(client, ref, image, manifest_of(image, layer, range(2)))

        def check(m: HotManifest) -> None:
            raise hot.ManifestError("stale")

        own = manifest_of(image, layer, range(4, 6))
        found = publish.find(client, ref, image)
        merged, includes = publish.combine(own, found, (), check)
        assert merged is own and includes == ()
        digest = publish.publish(client, ref, image, own, found)
        assert [p.digest for p in publish.find(client, ref, image)] == [digest]
        assert stale not in stored_manifests(registry, ref.repository)
