"""The pure parts of mirrors that fail well: backoff periods (exponential,
capped, one probe when a period ends), their settings, and hosts.toml read
again when it changes (in place, by rename, appearing, vanishing, broken)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bootseer.config import parse
from snapshotter.registry import hosts as hosts_module
from snapshotter.registry.config import mirror_policy
from snapshotter.registry.health import Backoffs, MirrorPolicy
from snapshotter.registry.hosts import HostsConfigError, HostsFiles


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_its_cap_and_a_success_forgets_it() -> None:
    policy = MirrorPolicy(backoff_s=2.0, backoff_max_s=10.0)
    assert [policy.period(n) for n in (1, 2, 3, 4, 5)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    clock = Clock()
    backoffs = Backoffs(policy, clock)
    assert backoffs.usable("m")
    assert backoffs.failed("m") == 2.0
    assert not backoffs.usable("m")
    clock.now += 2.0
    # The period is over: one caller probes, the others keep skipping.
    assert backoffs.usable("m")
    assert not backoffs.usable("m")
    assert backoffs.failed("m") == 4.0
    clock.now += 3.9
    assert not backoffs.usable("m")
    clock.now += 0.1
    assert backoffs.usable("m")
    assert backoffs.succeeded("m")
    assert backoffs.usable("m") and backoffs.usable("m")
    assert not backoffs.succeeded("m")
    assert backoffs.failed("m") == 2.0  # counted from the start again


def test_a_probe_that_never_reports_does_not_block_the_key_for_good() -> None:
    clock = Clock()
    backoffs = Backoffs(MirrorPolicy(backoff_s=1.0, backoff_max_s=4.0), clock)
    backoffs.failed("m")
    clock.now += 1.0
    assert backoffs.usable("m")  # the probe, whose outcome never comes
    clock.now += 1.9
    assert not backoffs.usable("m")
    clock.now += 0.1
    assert backoffs.usable("m")


def test_mirror_settings_come_from_the_registry_section() -> None:
    cfg = parse(
        "[registry]\nmirror_connect_timeout_s = 1\nmirror_response_timeout_s = 4.5\n"
        "mirror_backoff_s = 0.5\nmirror_backoff_max_s = 60\n"
    )
    assert mirror_policy(cfg.registry) == MirrorPolicy(1.0, 4.5, 0.5, 60.0)
    assert mirror_policy(parse("").registry) == MirrorPolicy()
    with pytest.raises(ValueError, match="mirror_backoff_max_s must be >="):
        MirrorPolicy(backoff_s=10, backoff_max_s=1)
    with pytest.raises(ValueError, match="mirror_connect_timeout_s must be > 0"):
        MirrorPolicy(connect_timeout_s=0)


def _urls(files: HostsFiles, host: str = "r:5000") -> list[str]:
    return [e.base_url for e in files.endpoints(host)]


def _write(path: Path, text: str, *, rename: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if rename:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.rename(path)
    else:
        path.write_text(text)


def test_hosts_toml_is_read_again_when_it_changes(tmp_path: Path) -> None:
    files = HostsFiles(tmp_path, plain_http=True)
    hosts = tmp_path / "r:5000" / "hosts.toml"
    assert _urls(files) == ["http://r:5000/v2"]
    _write(hosts, 'server = "http://r:5000"\n[host."http://m1:1"]\n', rename=False)
    assert _urls(files) == ["http://m1:1/v2", "http://r:5000/v2"]
    # Same size, same inode, written at once: the content check catches it.
    _write(hosts, 'server = "http://r:5000"\n[host."http://m2:1"]\n', rename=False)
    assert _urls(files) == ["http://m2:1/v2", "http://r:5000/v2"]
    _write(hosts, 'server = "http://r:5000"\n[host."http://m3:1"]\n[host."http://m4:1"]\n', rename=True)
    assert _urls(files) == ["http://m3:1/v2", "http://m4:1/v2", "http://r:5000/v2"]
    # A broken edit keeps what was in use; the next good one applies.
    _write(hosts, '[host."http://m5:1"\n', rename=False)
    assert _urls(files) == ["http://m3:1/v2", "http://m4:1/v2", "http://r:5000/v2"]
    _write(hosts, 'server = "http://r:5000"\n', rename=False)
    assert _urls(files) == ["http://r:5000/v2"]
    hosts.unlink()
    _write(tmp_path / "_default" / "hosts.toml", '[host."http://any:1"]\n', rename=True)
    assert _urls(files) == ["http://any:1/v2", "http://r:5000/v2"]
    (tmp_path / "_default" / "hosts.toml").unlink()
    assert _urls(files) == ["http://r:5000/v2"]


def test_an_unchanged_hosts_toml_is_stat_ed_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts_module, "RACY_S", 0.0)  # as if written long ago
    hosts = tmp_path / "r:5000" / "hosts.toml"
    _write(hosts, '[host."http://m1:1"]\n', rename=False)
    reads: list[Path] = []
    read_text = Path.read_text

    def counting(self: Path, *args: Any, **kwargs: Any) -> str:
        reads.append(self)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting)
    files = HostsFiles(tmp_path)
    for _ in range(5):
        assert _urls(files) == ["http://m1:1/v2", "https://r:5000/v2"]
    assert reads == [hosts]


def test_a_broken_hosts_toml_at_start_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path / "r:5000" / "hosts.toml", "server = [\n", rename=False)
    with pytest.raises(HostsConfigError, match=r"r:5000/hosts\.toml: not valid TOML"):
        HostsFiles(tmp_path).endpoints("r:5000")
