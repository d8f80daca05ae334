"""Prometheus metrics of hot-block publication (the layer server's registry)."""

from __future__ import annotations

from prometheus_client import Counter

PUSHED = Counter(
    "bootseer_hot_manifests_pushed",
    "Hot-block manifests this node pushed to the registry.",
)
NOT_PUSHED = Counter(
    "bootseer_hot_manifests_not_pushed",
    "Recordings kept on this node only, by reason: never (hot_blocks_publish), "
    "published (the image has a manifest), lost (another node won the publish "
    "election), refused (the registry refused this node's writes), failed.",
    ["reason"],
)
PRUNED = Counter(
    "bootseer_hot_manifests_pruned",
    "Superseded hot-block manifests removed from the registry when a merged one replaced them.",
)
ELECTIONS = Counter(
    "bootseer_hot_manifest_elections",
    "Publish elections this node took part in, by outcome (won, lost, refused).",
    ["outcome"],
)
