"""The unit files in systemd/ and the sd_notify helper they rely on.

`systemd-analyze verify` checks every unit (an hdfs-fuse instance too), and
then all of them at once beside containerd's unit and a kubelet unit ordered
as kubelet's own is, each enabled as its [Install] section says: a start job
for each must be creatable, so an ordering cycle fails the test. The verify
needs the ExecStart binaries to exist, so the copies run the virtualenv's
`bootseer` instead of /usr/local/bin/bootseer; nothing else is changed.

The sd_notify helper is tested against real AF_UNIX datagram sockets, a path
and an abstract one, including a file descriptor passed along (SCM_RIGHTS).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bootseer.daemon import NOTIFY_SOCKET, Notifier
from snapshotter.fs.server import layer_mounts
from snapshotter.fs.settings import FsConfig
from tests.harness.snapshotter import BOOTSEER_BIN

ROOT = Path(__file__).resolve().parents[2]
UNITS_DIR = ROOT / "systemd"
UNITS = sorted(p.name for p in UNITS_DIR.iterdir() if p.suffix == ".service")
INSTALLED_BIN = "/usr/local/bin/bootseer"
HDFS_INSTANCE = "bootseer-hdfs-fuse@mnt-ckpt.service"
# Where Debian's containerd package puts its unit; a stand-in with the same
# ordering is used where it is not installed.
CONTAINERD_UNIT = Path("/lib/systemd/system/containerd.service")
CONTAINERD_STAND_IN = """[Unit]
Description=containerd (stand-in with the Debian unit's ordering)
After=network.target local-fs.target

[Service]
Type=notify
ExecStart=/bin/true
"""
# kubeadm's kubelet unit waits for the network; distributions add containerd.
KUBELET_UNIT = """[Unit]
Description=kubelet, ordered as its own unit orders it
After=network-online.target containerd.service
Wants=network-online.target containerd.service

[Service]
Type=notify
ExecStart=/bin/true
"""


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections of KEY=VALUE lines; a key may repeat."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    return parse_unit((UNITS_DIR / name).read_text())


def words(section: dict[str, list[str]], key: str) -> set[str]:
    return {word for value in section.get(key, []) for word in value.split()}


@pytest.fixture
def unit_dir() -> Iterator[Path]:
    """Copies of the units, running the virtualenv's bootseer."""
    assert BOOTSEER_BIN.exists(), f"{BOOTSEER_BIN} is missing: run `make setup` first"
    directory = Path(tempfile.mkdtemp(prefix="bs-units-", dir="/tmp"))
    try:
        for name in UNITS:
            text = (UNITS_DIR / name).read_text()
            (directory / name).write_text(text.replace(INSTALLED_BIN, str(BOOTSEER_BIN)))
        shutil.copy(directory / "bootseer-hdfs-fuse@.service", directory / HDFS_INSTANCE)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def verify(directory: Path, *names: str) -> str:
    """Run `systemd-analyze verify`; return what it printed, failing on a non-zero exit."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing (package systemd)"
    result = subprocess.run(
        [analyze, "verify", *(f"./{name}" for name in names)],
        cwd=directory,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def about_ours(output: str) -> list[str]:
    """Lines of verify's output about our units, or about cycles anywhere."""
    return [line for line in output.splitlines() if "bootseer" in line or "cycle" in line.lower()]


def test_every_unit_runs_the_installed_bootseer() -> None:
    # Verified with the binary swapped, so check what is swapped.
    for name in UNITS:
        exec_start = unit(name)["Service"]["ExecStart"]
        assert [value.split()[0] for value in exec_start] == [INSTALLED_BIN], name


@pytest.mark.parametrize("name", [*UNITS, HDFS_INSTANCE])
def test_systemd_analyze_verify_passes(unit_dir: Path, name: str) -> None:
    assert about_ours(verify(unit_dir, name)) == []


def test_verify_catches_what_it_should(unit_dir: Path) -> None:
    """The check above is not vacuous: a typo and a missing binary fail it."""
    broken = unit_dir / "bootseer-broken.service"
    broken.write_text(
        (unit_dir / "bootseer-depsnap.service").read_text().replace("Type=notify", "Type=notify\nNotifyAcess=main")
    )
    assert about_ours(verify(unit_dir, broken.name))
    missing = unit_dir / "bootseer-missing.service"
    missing.write_text((UNITS_DIR / "bootseer-depsnap.service").read_text().replace(INSTALLED_BIN, "/nonexistent/bs"))
    with pytest.raises(AssertionError, match="is not executable"):
        verify(unit_dir, missing.name)


def _enable(directory: Path, name: str, template: str | None = None) -> None:
    """What `systemctl enable` does from the unit's [Install] section."""
    source = template or name
    for target in words(parse_unit((directory / source).read_text()).get("Install", {}), "WantedBy"):
        wants = directory / f"{target}.wants"
        wants.mkdir(exist_ok=True)
        (wants / name).symlink_to(f"../{source}")


def test_enabled_units_form_no_ordering_cycle_with_containerd_and_kubelet(unit_dir: Path) -> None:
    if CONTAINERD_UNIT.exists():
        shutil.copy(CONTAINERD_UNIT, unit_dir / "containerd.service")
    else:
        (unit_dir / "containerd.service").write_text(CONTAINERD_STAND_IN)
    (unit_dir / "kubelet.service").write_text(KUBELET_UNIT)
    for name in UNITS:
        if not name.endswith("@.service"):
            _enable(unit_dir, name)
    (unit_dir / HDFS_INSTANCE).unlink()
    _enable(unit_dir, HDFS_INSTANCE, template="bootseer-hdfs-fuse@.service")
    names = ["kubelet.service", "containerd.service", *(n for n in UNITS if not n.endswith("@.service"))]
    assert about_ours(verify(unit_dir, *names)) == []
    # The enabling was real: containerd pulls in the layer server and the snapshotter.
    assert {p.name for p in (unit_dir / "containerd.service.wants").iterdir()} == {
        "bootseer-layer-server.service",
        "bootseer-snapshotter.service",
    }


def test_every_daemon_tells_systemd_when_it_is_ready() -> None:
    for name in UNITS:
        service = unit(name)["Service"]
        assert service["Type"] == ["notify"], name
        assert service.get("NotifyAccess", ["main"]) == ["main"], name


def test_ordering_against_containerd() -> None:
    layers, snapshots = unit("bootseer-layer-server.service"), unit("bootseer-snapshotter.service")
    assert {"containerd.service", "bootseer-snapshotter.service"} <= words(layers["Unit"], "Before")
    assert "containerd.service" in words(snapshots["Unit"], "Before")
    assert "bootseer-layer-server.service" in words(snapshots["Unit"], "After")
    assert "bootseer-layer-server.service" in words(snapshots["Unit"], "Wants")
    for u in (layers, snapshots):
        assert "containerd.service" in words(u["Install"], "WantedBy")
    for name in UNITS:
        after = words(unit(name)["Unit"], "After")
        assert not after & {"containerd.service", "kubelet.service"}, f"{name} would order after what it precedes"


def test_layer_server_is_protected_from_the_oom_killer() -> None:
    (score,) = unit("bootseer-layer-server.service")["Service"]["OOMScoreAdjust"]
    assert -1000 < int(score) <= -900


def test_layer_server_keeps_its_mount_across_restarts() -> None:
    """systemd keeps every FUSE connection's descriptor (the layer mount's
    and its plain twin's), and restarts the server whatever ended it; the
    unit no longer warns against restarts."""
    service = unit("bootseer-layer-server.service")["Service"]
    (store_max,) = service["FileDescriptorStoreMax"]
    assert int(store_max) == len(layer_mounts(FsConfig()))
    assert service["Restart"] == ["always"]
    assert "lose their files" not in (UNITS_DIR / "bootseer-layer-server.service").read_text()


# -- sd_notify ---------------------------------------------------------------


@pytest.fixture
def path_socket() -> Iterator[tuple[socket.socket, str]]:
    # A short path: sun_path holds 108 bytes, pytest's tmp_path may not fit.
    directory = tempfile.mkdtemp(prefix="bs-ntf-", dir="/tmp")
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"bs-test-notify-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        yield sock, "@" + name
    finally:
        sock.close()


def test_notify_to_a_path_socket(path_socket: tuple[socket.socket, str]) -> None:
    sock, address = path_socket
    assert Notifier(address).send("READY=1", "STATUS=serving things")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving things"


def test_notify_to_an_abstract_socket(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    assert Notifier(address).send("STOPPING=1")
    assert sock.recv(4096) == b"STOPPING=1"


def test_notify_passes_file_descriptors(abstract_socket: tuple[socket.socket, str]) -> None:
    """What FDSTORE=1 will need: descriptors travel with the message."""
    sock, address = abstract_socket
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"kept across a restart")
        assert Notifier(address).send("FDNAME=test", fds=[read_end])
        message, fds, _, _ = socket.recv_fds(sock, 4096, 4)
        assert message == b"FDNAME=test"
        assert len(fds) == 1
        with os.fdopen(fds[0], "rb") as received:
            assert received.read(21) == b"kept across a restart"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_notify_socket_is_taken_out_of_the_environment() -> None:
    environ = {NOTIFY_SOCKET: "@somewhere", "PATH": "/bin"}
    notifier = Notifier.from_environment(environ)
    assert notifier.address == "@somewhere"
    assert environ == {"PATH": "/bin"}  # children do not speak for the daemon
    assert not Notifier.from_environment({}).enabled


def test_notify_without_a_manager_does_nothing() -> None:
    assert not Notifier(None).send("READY=1")
    # A manager that has gone away is logged, never fatal.
    assert not Notifier(f"@bs-nobody-{uuid.uuid4().hex}").send("READY=1")
    assert not Notifier("/nonexistent/notify").send("READY=1")


def test_notify_refuses_what_would_corrupt_the_message() -> None:
    with pytest.raises(ValueError, match="KEY=VALUE"):
        Notifier("@x").send("STATUS=two\nlines")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        Notifier("@x").send("READY")
