"""The CRI credentials store: what an AuthConfig becomes, the file (modes,
atomic replacement, another process picking up changes), matching by host
and repository, and its place before the docker config in the keychain."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest
import structlog

from snapshotter.cri.credentials import (
    CriCredentialStore,
    InvalidAuth,
    PullSecret,
    secret_from_auth,
    server_matches,
)
from snapshotter.registry.auth import Keychain
from snapshotter.registry.config import client_from_config
from snapshotter.registry.settings import RegistryConfig


def test_auth_config_fields_in_containerd_order() -> None:
    assert secret_from_auth(username="u", password="p", identity_token="t") == PullSecret("u", "p")
    assert secret_from_auth(identity_token="t", auth="eDp5") == PullSecret(identity_token="t")
    encoded = base64.b64encode(b"alice:pa:ss").decode()
    assert secret_from_auth(auth=encoded) == PullSecret("alice", "pa:ss")
    assert secret_from_auth(registry_token="r") == PullSecret(registry_token="r")
    assert secret_from_auth() is None
    with pytest.raises(InvalidAuth) as info:
        secret_from_auth(auth=base64.b64encode(b"no-separator-secret").decode())
    assert "no-separator-secret" not in str(info.value)
    with pytest.raises(InvalidAuth):
        secret_from_auth(auth="!!")


def test_secrets_stay_out_of_reprs() -> None:
    secret = PullSecret("u", "hunter2", "idtok", "regtok")
    assert all(word not in repr(secret) for word in ("hunter2", "idtok", "regtok"))
    creds = secret.credentials()
    assert creds is not None and "hunter2" not in repr(creds)
    token = PullSecret(identity_token="idtok").credentials()
    assert token is not None and (token.username, token.password) == ("<token>", "idtok")
    bearer = PullSecret(registry_token="regtok").credentials()
    assert bearer is not None and bearer.registry_token == "regtok" and "regtok" not in repr(bearer)


def test_server_address_must_name_the_image_registry() -> None:
    assert server_matches("", "reg.example.com")
    assert server_matches("https://reg.example.com", "reg.example.com")
    assert server_matches("reg.example.com:5000/v2/", "reg.example.com:5000")
    assert server_matches("https://index.docker.io/v1/", "docker.io")
    assert not server_matches("https://other.example.com", "reg.example.com")


def test_store_file_modes_and_atomic_replacement(tmp_path: Path) -> None:
    path = tmp_path / "state" / "cri" / "credentials.json"
    store = CriCredentialStore(path)
    assert store.lookup("reg", "team/app") is None  # no file yet
    assert store.put("reg", "team/app", PullSecret("u", "p"))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["entries"]["reg/team/app"]["password"] == "p"
    inode = path.stat().st_ino
    assert not store.put("reg", "team/app", PullSecret("u", "p"))  # unchanged: not rewritten
    assert path.stat().st_ino == inode
    assert store.put("reg", "team/app", PullSecret("u", "p2"))
    assert path.stat().st_ino != inode  # replaced by rename, never rewritten in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["credentials.json", "credentials.json.lock"]


def test_most_specific_entry_first(tmp_path: Path) -> None:
    store = CriCredentialStore(tmp_path / "c.json")
    store.put("reg", "team", PullSecret("team", "t"))
    store.put("reg", "team/app", PullSecret("app", "a"))
    store.put("reg", "", PullSecret("host", "h"))

    def user(repository: str) -> str | None:
        creds = store.lookup("reg", repository)
        return creds.username if creds else None

    assert user("team/app") == "app"
    assert user("team/app/sub") == "app"
    assert user("team/other") == "team"
    assert user("elsewhere/x") == "host"
    assert store.lookup("other-reg", "team/app") is None


def test_another_process_picks_up_new_credentials(tmp_path: Path) -> None:
    """The layer server holds its own store object on the same file."""
    path = tmp_path / "c.json"
    writer, reader = CriCredentialStore(path), CriCredentialStore(path)
    assert reader.lookup("reg", "a/b") is None
    writer.put("reg", "a/b", PullSecret("u", "one"))
    found = reader.lookup("reg", "a/b")
    assert found is not None and found.password == "one"
    writer.put("reg", "a/b", PullSecret("u", "two"))
    found = reader.lookup("reg", "a/b")
    assert found is not None and found.password == "two"


def test_broken_file_is_ignored_with_a_warning_that_holds_no_secret(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"version": 1, "entries": {"reg/a": {"password": 7, "username": "hunter2"}}}')
    with structlog.testing.capture_logs() as logs:
        assert CriCredentialStore(path).lookup("reg", "a") is None
    assert [e["event"] for e in logs] == ["CRI credentials file unusable; ignoring it"]
    assert "hunter2" not in repr(logs)
    # A writer replaces what it cannot read.
    CriCredentialStore(path).put("reg", "a", PullSecret("u", "p"))
    assert CriCredentialStore(path).lookup("reg", "a") is not None


def test_keychain_asks_the_store_before_the_docker_config(tmp_path: Path) -> None:
    docker = tmp_path / "config.json"
    docker.write_text(json.dumps({"auths": {"reg": {"username": "docker", "password": "d"}}}))
    store = CriCredentialStore(tmp_path / "cri.json")
    store.put("reg", "team/app", PullSecret("cri", "c"))
    keychain = Keychain(docker, [store])
    creds = keychain.get("reg", "team/app")
    assert creds is not None and creds.username == "cri" and keychain.path == store.path
    other = keychain.get("reg", "team/other")
    assert other is not None and other.username == "docker" and keychain.path == docker


def test_every_configured_client_consults_the_store(tmp_path: Path) -> None:
    cfg = RegistryConfig(config_path=tmp_path / "certs.d", cri_credentials=str(tmp_path / "cri.json"))
    CriCredentialStore(tmp_path / "cri.json").put("reg", "team/app", PullSecret("cri", "c"))
    with client_from_config(cfg) as client:
        keychain = client.transport.auth.keychain
        creds = keychain.get("reg", "team/app")
        assert creds is not None and creds.username == "cri"
    with client_from_config(RegistryConfig(config_path=tmp_path, cri_credentials="")) as client:
        assert client.transport.auth.keychain.sources == ()
