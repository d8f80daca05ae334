"""Which node publishes an image's first hot-block manifest, when many start
the image at once and none finds one published.

The OCI distribution API has no compare-and-swap: a tag is a register any
pusher overwrites, last writer wins, and a manifest PUT never fails because
another exists. Registers are enough for a *splitter* (Moir and Anderson,
1995): of any number of contenders, at most one comes out as the winner,
without any assumption on timing, and a contender that runs alone wins.
Two tags per image and round hold it:

    X: every contender writes a claim of its own (a nonce makes it unique)
    Y: "taken", the same bytes whoever writes it

    write X := mine; if Y exists: lose
    write Y;         if X is still mine: win, else lose

Two winners A and B would both read their own claim in X. Say A wrote X
first; B's write must then come after A read X, so after A wrote Y, and B
reads Y set and loses. Contention can leave no winner at all (the last
writer of X found Y already set): about half the time when many contenders
are released at the same instant (measured). So the winner also sets a
third tag, W ("won"), before it publishes, and a loser that finds no W
after a grace period, randomised so the second contenders rarely meet,
takes part in a second attempt: two splitters, at most two winners, and no
winner only if both attempts end empty. Rounds are windows of wall-clock
time (`election_s`), so an image whose winner never published (it crashed)
gets another election in the next round, from the next start that records
it; a node that finds a manifest published does not contend at all.

Reads go to the hosts that take pushes (the registry itself, never a
caching mirror, whose stale answer would break the argument), and any error
counts as losing: errors only ever mean fewer winners. A node without push
rights (401 or 403 at its first write) is `REFUSED`. Losers delete their
claim, the winner its own once Y and W are set; Y and W hold the same bytes
for every round and attempt, so an image keeps one small "taken" manifest,
under two tags per attempt it was contended in.
"""

from __future__ import annotations

import enum
import json
import random
import secrets
import time

import structlog

from snapshotter.registry import media
from snapshotter.registry.artifact import EMPTY_CONFIG, empty_config
from snapshotter.registry.client import RegistryClient
from snapshotter.registry.errors import NotFound, RegistryError, Unauthorized
from snapshotter.registry.reference import Reference

log = structlog.get_logger("bootseer.hotblocks")

CLAIM_ARTIFACT_TYPE = "application/vnd.bootseer.hot-blocks.claim.v1"
ATTEMPTS = 2
# A winner sets W one round trip after it read X; a loser waits this long
# (to twice as long, at random) before it concludes there was no winner.
GRACE_S = 2.0


class Outcome(enum.Enum):
    WON = "won"
    LOST = "lost"
    REFUSED = "refused"


def current_round(election_s: float, now: float | None = None) -> int:
    return int((time.time() if now is None else now) // election_s)


def claim_tags(image: str, round_: int, attempt: int = 0) -> tuple[str, str, str]:
    """The X, Y and W tags of `image`'s election in `round_`, `attempt`
    (at most 128 characters, as tags must be)."""
    hex_part = media.check_digest(image).partition(":")[2]
    base = f"bootseer-hot-{hex_part[:64]}-r{round_}-{attempt}"
    return f"{base}-x", f"{base}-y", f"{base}-w"


def _claim(image: str, nonce: str = "") -> bytes:
    """A claim (`nonce`: unique) or, without one, the "taken" marker, the
    same bytes for every node, round and attempt."""
    annotations = {"org.bootseer.hot-blocks.image": image}
    if nonce:
        annotations["org.bootseer.hot-blocks.claim"] = nonce
    doc = {
        "schemaVersion": 2,
        "mediaType": media.OCI_MANIFEST,
        "artifactType": CLAIM_ARTIFACT_TYPE,
        "config": empty_config().to_json(),
        "layers": [empty_config().to_json()],
        "annotations": annotations,
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _exists(client: RegistryClient, ref: Reference, tag: str) -> bool:
    try:
        client.fetch_manifest(ref.with_tag(tag), capability="push")
    except NotFound:
        return False
    return True


def _push_claim(client: RegistryClient, ref: Reference, claim: bytes, tag: str) -> None:
    """Push `claim` and the empty blob it names, twice if need be:
    distribution commits concurrent uploads of one blob by moving each into
    place, so a contender's manifest can briefly find the blob unknown
    (400 MANIFEST_BLOB_UNKNOWN) while another's upload lands."""
    for attempt in range(2):
        try:
            client.push_blob(ref, EMPTY_CONFIG, media_type=media.OCI_EMPTY)
            client.push_manifest(ref, claim, media.OCI_MANIFEST, tag=tag)
            return
        except Unauthorized:
            raise
        except RegistryError:
            if attempt:
                raise


def _delete(client: RegistryClient, ref: Reference, digest: str) -> None:
    try:
        client.delete_manifest(ref, digest)
    except RegistryError as exc:
        log.debug("claim not deleted", digest=digest, error=str(exc))


def run(
    client: RegistryClient, ref: Reference, image: str, round_: int, sleep: float | None = None
) -> tuple[Outcome, str]:
    """The whole election for this node: the first attempt and, if it
    found no winner, after the grace period (`sleep`, else random in
    [GRACE_S, 2 GRACE_S]), the second."""
    outcome, claim = elect(client, ref, image, round_, 0)
    if outcome is not Outcome.LOST:
        return outcome, claim
    time.sleep(random.uniform(GRACE_S, 2 * GRACE_S) if sleep is None else sleep)
    try:
        if _exists(client, ref, claim_tags(image, round_, 0)[2]):
            return Outcome.LOST, ""
    except RegistryError:
        return Outcome.LOST, ""
    log.info("publish election found no winner; trying again", image=image)
    return elect(client, ref, image, round_, 1)


def elect(client: RegistryClient, ref: Reference, image: str, round_: int, attempt: int = 0) -> tuple[Outcome, str]:
    """Take part in one attempt of `image`'s publish election of `round_`:
    the outcome, and the digest of this node's claim (for `release`)."""
    x_tag, y_tag, w_tag = claim_tags(image, round_, attempt)
    try:
        # Not part of the splitter, which is safe without it: a contender
        # arriving after the election was decided writes nothing.
        if _exists(client, ref, y_tag):
            return Outcome.LOST, ""
    except RegistryError as exc:
        log.info("publish election not held: the registry cannot be read", image=image, error=str(exc))
        return Outcome.LOST, ""
    mine = _claim(image, secrets.token_hex(16))
    digest = media.digest_of(mine)
    try:
        _push_claim(client, ref, mine, x_tag)
    except Unauthorized as exc:
        log.info("publish election: this node may not push", image=image, error=str(exc))
        return Outcome.REFUSED, ""
    except RegistryError as exc:
        log.info("publish election lost to an error", image=image, error=str(exc))
        return Outcome.LOST, ""
    won = False
    try:
        if not _exists(client, ref, y_tag):
            client.push_manifest(ref, _claim(image), media.OCI_MANIFEST, tag=y_tag)
            won = client.fetch_manifest(ref.with_tag(x_tag), capability="push")[2] == digest
            if won:
                # Losers waiting to try again look for this; failing to set
                # it only lets a second attempt elect a second winner.
                client.push_manifest(ref, _claim(image), media.OCI_MANIFEST, tag=w_tag)
    except RegistryError as exc:
        log.info("publish election lost to an error", image=image, error=str(exc))
    if not won:
        _delete(client, ref, digest)
        return Outcome.LOST, ""
    return Outcome.WON, digest


def release(client: RegistryClient, ref: Reference, claim: str) -> None:
    """The winner's claim is no longer needed once Y and W are set (every
    later contender loses at Y): remove it, best effort."""
    if claim:
        _delete(client, ref, claim)
