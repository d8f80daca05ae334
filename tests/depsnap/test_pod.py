"""Environments for unprivileged pods: real containerd + runc containers with
the daemon's socket bind-mounted and no added capability.

The "pod" image is a busybox layer; the host's /usr is bind-mounted read-only
so the pod has a Python, pip and gcc (the wheelhouse's sdist is compiled in
the pod). The pod client is the one-file zipapp (`bootseer depsnap
pod-client`), run with `python3 -I -S`: standard library only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from depsnap.client import DaemonNode
from depsnap.podclient import write_zipapp
from depsnap.pods import pod_key
from tests.depsnap.conftest import BOOTSEER, Work
from tests.harness.containerd import BindMount, Containerd, start_containerd
from tests.harness.oci import Dir, File, Symlink, busybox_layer, write_layout
from tests.harness.procs import Daemon, start_daemon, unix_socket_answers

pytestmark = pytest.mark.integration

IMAGE = "localhost/depsnap-pod:v1"
POD_SOCKET = "/run/bootseer/depsnap.sock"
TARGET = "/opt/env"
CLIENT = "python3 -I -S /input/depsnap-client.pyz"
ENSURE = f"{CLIENT} ensure -r /input/requirements.txt"
IMPORT = "/opt/env/bin/python -c 'import dsdemo, dsspeed; dsdemo.hello(); print(\"add\", dsspeed.add(2, 3))'"
CAP_SYS_ADMIN = 21
SECRET = "host secret: never in a pod"


@dataclass
class PodNode:
    containerd: Containerd
    client: Path  # the zipapp


@pytest.fixture(scope="module")
def pod_node() -> Iterator[PodNode]:
    """containerd (its own overlayfs snapshotter: the pods' images are not
    what this tests) with the pod image imported, and the client zipapp."""
    scratch = Path(tempfile.mkdtemp(prefix="ds-podimg-", dir="/tmp"))
    layer = [
        *busybox_layer(),
        Symlink("/lib", "usr/lib"),
        Symlink("/lib64", "usr/lib64"),
        Dir("/usr"),
        Dir("/opt"),
        Dir("/run"),
        Dir("/input"),
        Dir("/wheels"),
        File("/etc/passwd", b"root:x:0:0:root:/tmp:/bin/sh\n"),
        File("/etc/group", b"root:x:0:\n"),
    ]
    layout = write_layout(scratch / "layout", [layer], tag="v1")
    client = scratch / "depsnap-client.pyz"
    write_zipapp(client)
    containerd = start_containerd(scratch / "no-proxy-snapshotter.sock")
    try:
        containerd.import_layout(layout.directory, IMAGE.rsplit(":", 1)[0])
        yield PodNode(containerd, client)
    finally:
        leftovers = containerd.stop()
        subprocess.run(["rm", "-rf", str(scratch)], check=False)
        assert not leftovers, leftovers


@pytest.fixture
def pod_daemon(work: Work) -> Iterator[Path]:
    """The node daemon with /opt/env as the only pod target; yields its socket."""
    # In a directory of its own, which the pods mount (read-only), as the
    # documented pod spec does.
    socket = work.root / "socket-dir" / "depsnap.sock"
    config = work.root / "config.toml"
    config.write_text(
        "[depsnap]\n"
        f'socket = "{socket}"\n'
        f'cache_dir = "{work.root / "node-cache"}"\n'
        f'store = "{work.store}"\n'
        f'pod_targets = ["{TARGET}"]\n'
        "[events]\n"
        f'dir = "{work.root / "events"}"\n'
    )
    proc: Daemon = start_daemon(
        "depsnap-serve",
        [str(BOOTSEER), "depsnap", "serve", "--config", str(config), "--log-format", "json"],
        work.root / "daemon.log",
        ready=lambda: unix_socket_answers(socket),
        env=work.env,
    )
    try:
        yield socket
    finally:
        proc.stop()
    assert not socket.exists(), "the daemon left its socket behind"


def run_pod(node: PodNode, work: Work, wheelhouse: Path, socket: Path, script: str) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh container: the daemon's socket directory, the
    host's /usr and the inputs (all read-only) are its only mounts; ctr's default
    capabilities, which exclude CAP_SYS_ADMIN."""
    inputs = work.root / "pod-input"
    if not inputs.exists():
        inputs.mkdir()
        (inputs / "requirements.txt").write_text("dsdemo==1.0\n")
        (inputs / "depsnap-client.pyz").write_bytes(node.client.read_bytes())
    mounts = (
        BindMount(Path("/usr"), "/usr", read_only=True),
        BindMount(socket.parent, str(Path(POD_SOCKET).parent), read_only=True),
        BindMount(wheelhouse, "/wheels", read_only=True),
        BindMount(inputs, "/input", read_only=True),
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": "/wheels",
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_CACHE_DIR": "1",
        "BOOTSEER_BASE_IMAGE": "sha256:" + "cd" * 32,
    }
    name = f"dspod-{uuid.uuid4().hex[:8]}"
    return node.containerd.run_with_mounts(
        IMAGE, name, "sh", "-euc", script, mounts=mounts, env=env, snapshotter="overlayfs"
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"pod exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def key_of(stdout: str) -> str:
    line = next(line for line in stdout.splitlines() if line.startswith("depsnap: "))
    return line.split()[2]


def hostile(*requests: tuple[str, str, str]) -> str:
    """A pod script that talks to the daemon directly, as a hostile pod
    would (no client-side checks): prints one verdict line per request."""
    calls = json.dumps([{"op": op, "key": key, "target": target} for op, key, target in requests])
    return f"""python3 -I -S - <<'EOF'
import json, sys
sys.path.insert(0, "/input/depsnap-client.pyz")
from pathlib import Path
from depsnap.podclient import Daemon, PodRefused
daemon = Daemon(Path("{POD_SOCKET}"))
for call in json.loads('{calls}'):
    try:
        print(call["op"], "ACCEPTED", json.dumps(daemon.call(call)))
    except PodRefused as exc:
        print(call["op"], "REFUSED", exc)
EOF"""


def test_a_pod_gets_its_environment_on_a_miss_and_then_on_a_hit(
    pod_node: PodNode, work: Work, wheelhouse: Path, pod_daemon: Path
) -> None:
    script = f"grep CapEff /proc/self/status\n{ENSURE} --target {TARGET}\n{IMPORT}\n/opt/env/bin/dsdemo-hello"
    first = ok(run_pod(pod_node, work, wheelhouse, pod_daemon, script))
    cap_eff = int(first.split("CapEff:")[1].split()[0], 16)
    assert not cap_eff >> CAP_SYS_ADMIN & 1, "the pod must run without CAP_SYS_ADMIN"
    assert "depsnap: miss" in first and "captured to node cache, store" in first, first
    assert "hello from dsdemo 1.0" in first and "add 5" in first
    key = key_of(first)
    # Kept apart from the keys the host's CLI restores.
    image = work.root / "node-cache" / "images" / f"{pod_key(key)}.erofs"
    assert image.is_file()
    assert (work.store / f"{pod_key(key)}.dsnap").is_file()

    # A new pod: the daemon mounts the environment into its namespace.
    second_script = (
        f"{ENSURE} --target {TARGET}\n{IMPORT}\n/opt/env/bin/dsdemo-hello\n"
        f"grep ' {TARGET} ' /proc/self/mountinfo\n"
        # Writable, like a restore on the host: writes stay in the pod.
        "echo local > /opt/env/pod-wrote-this && cat /opt/env/pod-wrote-this\n"
        # A second ensure in the same pod finds it there.
        f"{ENSURE} --target {TARGET}"
    )
    second = ok(run_pod(pod_node, work, wheelhouse, pod_daemon, second_script))
    assert f"depsnap: hit {key}" in second and "mounted by the node daemon" in second, second
    assert "hello from dsdemo 1.0" in second and "add 5" in second
    assert " overlay " in second and "nosuid,nodev" in second
    assert "local" in second
    assert f"depsnap: present {key}" in second

    # The mount was built detached and moved straight into the pod: the host
    # never had it in its mount table, and nothing of the pod's write reached
    # the image.
    with open("/proc/self/mountinfo") as mountinfo:
        assert str(work.root) not in mountinfo.read()
    assert b"pod-wrote-this" not in image.read_bytes()
    stats = DaemonNode(pod_daemon).stats()
    assert stats["pod_miss"] == 1 and stats["pod_captured"] == 1 and stats["pod_hit"] == 1, stats


@pytest.mark.parametrize("link_at", ["/opt/env", "/opt"])
def test_a_symlink_to_a_host_path_is_refused(
    pod_node: PodNode, work: Work, wheelhouse: Path, pod_daemon: Path, link_at: str
) -> None:
    secret_dir = work.root / "host-secret"
    (secret_dir / "env").mkdir(parents=True)
    (secret_dir / "env" / "secret.txt").write_text(SECRET)
    (secret_dir / "secret.txt").write_text(SECRET)
    # A snapshot the daemon would mount if it followed the link.
    key = key_of(ok(run_pod(pod_node, work, wheelhouse, pod_daemon, f"{ENSURE} --target {TARGET}")))
    images_before = sorted((work.root / "node-cache" / "images").iterdir())

    host_path = secret_dir / "env" if link_at == TARGET else secret_dir
    plant = f"rm -rf /opt\nmkdir -p /opt\nrm -rf {link_at}\nln -s {host_path} {link_at}\n"
    script = plant + hostile(("pod-attach", key, TARGET), ("pod-capture", "ab" * 32, TARGET))
    out = ok(run_pod(pod_node, work, wheelhouse, pod_daemon, script))
    for op in ("pod-attach", "pod-capture"):
        line = next(line for line in out.splitlines() if line.startswith(op))
        assert " REFUSED " in line, out
        assert f"{link_at} in the pod is a symlink (to '{host_path}')" in line, line
        assert "follows no symlink in a pod" in line, line
    # Nothing was mounted on the host path, nothing read from it.
    with open("/proc/self/mountinfo") as mountinfo:
        assert str(secret_dir) not in mountinfo.read()
    assert (secret_dir / "env" / "secret.txt").read_text() == SECRET
    assert sorted((work.root / "node-cache" / "images").iterdir()) == images_before

    # The honest client stops too (it cannot even create the target), exit 2.
    refused = run_pod(pod_node, work, wheelhouse, pod_daemon, plant + f"{ENSURE} --target {TARGET}")
    assert refused.returncode == 2, refused
    assert "depsnap: error:" in refused.stderr, refused.stderr


def test_links_inside_the_target_are_captured_as_links_and_devices_are_refused(
    pod_node: PodNode, work: Work, wheelhouse: Path, pod_daemon: Path
) -> None:
    secret_dir = work.root / "host-secret"
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text(SECRET)
    links_key, device_key = "a1" * 32, "b2" * 32
    script = (
        f"mkdir -p {TARGET}/lib\necho mine > {TARGET}/lib/own.txt\n"
        f"ln -s {secret_dir}/secret.txt {TARGET}/leak\n"
        f"ln -s {secret_dir} {TARGET}/lib/leakdir\n"
        + hostile(("pod-capture", links_key, TARGET))
        + f"\nmknod {TARGET}/disk b 7 0\n"
        + hostile(("pod-capture", device_key, TARGET))
    )
    out = ok(run_pod(pod_node, work, wheelhouse, pod_daemon, script))
    lines = [line for line in out.splitlines() if line.startswith("pod-capture")]
    assert " ACCEPTED " in lines[0], out
    assert " REFUSED " in lines[1] and "disk is a device" in lines[1], out
    assert not (work.root / "node-cache" / "images" / f"{pod_key(device_key)}.erofs").exists()

    # The image holds the links' text, never what they point at on the host.
    image = work.root / "node-cache" / "images" / f"{pod_key(links_key)}.erofs"
    assert SECRET.encode() not in image.read_bytes()
    restored = ok(
        run_pod(
            pod_node,
            work,
            wheelhouse,
            pod_daemon,
            f"mkdir -p {TARGET}\n"
            + hostile(("pod-attach", links_key, TARGET))
            + f"\ncat {TARGET}/lib/own.txt\nreadlink {TARGET}/leak\ncat {TARGET}/leak || echo unreadable",
        )
    )
    assert "pod-attach ACCEPTED" in restored and "mine" in restored, restored
    assert f"{secret_dir}/secret.txt" in restored and "unreadable" in restored and SECRET not in restored


def test_a_target_outside_the_allow_list_is_refused(
    pod_node: PodNode, work: Work, wheelhouse: Path, pod_daemon: Path
) -> None:
    out = run_pod(
        pod_node,
        work,
        wheelhouse,
        pod_daemon,
        f"{ENSURE} --target /opt/other || echo exit=$?\n"
        f"test ! -e /opt/other/bin && echo not-installed\n"
        "grep -c ' /opt/other ' /proc/self/mountinfo || true\n"
        + hostile(("pod-attach", "cd" * 32, "/etc"), ("pod-capture", "cd" * 32, "/opt/env/../../etc")),
    )
    stdout = ok(out)
    assert "exit=2" in stdout and "not-installed" in stdout, stdout
    assert "target /opt/other is not among this node's pod targets (/opt/env)" in out.stderr, out.stderr
    assert "\n0\n" in stdout
    assert "pod-attach REFUSED" in stdout and "target /etc is not among" in stdout, stdout
    assert "pod-capture REFUSED" in stdout and "must not contain '.' or '..'" in stdout, stdout


def test_a_pod_marks_its_ready_point_for_the_report(
    pod_node: PodNode, work: Work, wheelhouse: Path, pod_daemon: Path
) -> None:
    """The mark a job emits from the pod reaches the node's event records
    with the pod's cgroup, which is how `bootseer report` finds its container."""
    stdout = ok(run_pod(pod_node, work, wheelhouse, pod_daemon, f"{CLIENT} mark ready\ncat /proc/self/cgroup"))
    assert "depsnap: mark ready recorded" in stdout, stdout
    pod_cgroup = stdout.strip().splitlines()[-1].split(":", 2)[2]
    records = [json.loads(line) for line in (work.root / "events" / "depsnap.jsonl").read_text().splitlines()]
    marks = [r for r in records if r["kind"] == "mark"]
    assert len(marks) == 1 and marks[0]["name"] == "ready", marks
    assert pod_cgroup in marks[0]["cgroup"].split(";"), (pod_cgroup, marks)


def test_a_mark_without_a_daemon_warns_and_the_job_goes_on(pod_node: PodNode, work: Work, wheelhouse: Path) -> None:
    nowhere = work.root / "no-daemon" / "depsnap.sock"
    nowhere.parent.mkdir()
    result = run_pod(pod_node, work, wheelhouse, nowhere, f"{CLIENT} mark ready && echo went-on")
    assert "went-on" in ok(result)
    assert "mark 'ready' not recorded: no depsnap daemon answers" in result.stderr, result.stderr


def test_only_a_privileged_caller_may_put_discard_or_name_a_store(work: Work, pod_daemon: Path) -> None:
    """A pod must not plant an image under a host key or point the daemon at
    a store of its choosing; the host's CLI (CAP_SYS_ADMIN) still may."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from depsnap.client import DaemonNode, DaemonError\n"
        f"node = DaemonNode(Path('{pod_daemon}'))\n"
        "for what, call in [('discard', lambda: node.discard('0' * 64)),\n"
        f"                   ('fetch', lambda: node.fetch('0' * 64, '{work.root / 'other-store'}'))]:\n"
        "    try:\n"
        "        call(); print(what, 'ACCEPTED')\n"
        "    except DaemonError as exc:\n"
        "        print(what, 'REFUSED', exc)\n"
    )
    unprivileged = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=work.env,
        cwd=Path(__file__).parents[2],
        check=False,
    )
    assert unprivileged.returncode == 0, unprivileged.stderr
    assert "discard REFUSED" in unprivileged.stdout and "needs a caller with CAP_SYS_ADMIN" in unprivileged.stdout
    assert "fetch REFUSED" in unprivileged.stdout
    privileged = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=work.env,
        cwd=Path(__file__).parents[2],
    )
    assert "discard ACCEPTED" in privileged.stdout and "fetch ACCEPTED" in privileged.stdout, privileged
