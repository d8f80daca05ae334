"""The training job the jobstart benchmark's image runs (copied to /app/job.py).

What a job does from the moment its container starts to its first step:
get its dependencies, import them, build the model, load the checkpoint,
run one step. How it gets each is the only thing the modes change, through
the environment (the job itself is the same everywhere):

- JOB_DEPS: `pip` (a venv at /opt/env and `pip install -r`, as a job's
  entry point would), `depsnap` (the pod client the image carries:
  the node's snapshot on a hit, pip and a capture on a miss), or
  `present` (already at /opt/env: the warm node);
- JOB_CHECKPOINT: an `http://` URL (read in one stream, as `wget` or a
  plain loader would) or a path (a file, or the host's hdfs-fuse mount);
- JOB_PREFETCH_XATTR: when set, the job's first act is to read that
  attribute of the checkpoint, which has the host's hdfs-fuse mount fetch
  it while the job gets its dependencies and imports.

Every phase prints `PHASE name epoch-seconds` (the host shares the clock);
before the step, a `depsnap` job sends its ready mark for `bootseer report`.
Standard library and torch only: it runs inside the image.
"""

import hashlib
import os
import subprocess
import sys
import time
import urllib.request

ENV = "/opt/env"
REQUIREMENTS = "/app/requirements.txt"
CLIENT = ["/usr/bin/python3", "-I", "-S", "/app/depsnap-client.pyz"]
CHUNK = 4 << 20


def mark(phase: str) -> None:
    print(f"PHASE {phase} {time.time():.6f}", flush=True)


def run(argv: list[str]) -> None:
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    # The tool's own last lines (depsnap's outcome line among them) for the benchmark's log.
    for line in done.stdout.splitlines()[-3:]:
        print(f"  | {line}", flush=True)
    if done.returncode != 0:
        print(done.stdout, flush=True)
        sys.exit(f"{argv[0]} exited {done.returncode}")


def dependencies(how: str) -> None:
    if how == "pip":
        run(["/usr/bin/python3", "-m", "venv", ENV])
        run([f"{ENV}/bin/python", "-m", "pip", "install", "--quiet", "-r", REQUIREMENTS])
    elif how == "depsnap":
        run([*CLIENT, "ensure", "-r", REQUIREMENTS, "--target", ENV, "--installer", "pip"])
    elif how != "present":
        sys.exit(f"JOB_DEPS={how!r}: pip, depsnap or present")
    # The environment's packages first, the image's torch after them.
    sys.path.insert(0, f"{ENV}/lib/python3.11/site-packages")


def read_checkpoint(where: str, size: int) -> bytearray:
    """The whole checkpoint into one buffer, 4 MiB at a time."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    if where.startswith("http://"):
        with urllib.request.urlopen(where, timeout=120) as response:
            while got < size and (n := response.readinto(view[got : got + CHUNK])):
                got += n
    else:
        with open(where, "rb", buffering=0) as f:
            while got < size and (n := f.readinto(view[got : got + CHUNK])):
                got += n
    if got != size:
        sys.exit(f"checkpoint {where}: {got} of {size} bytes")
    return buffer


def prefetch(where: str) -> None:
    xattr = os.environ.get("JOB_PREFETCH_XATTR")
    if xattr:
        print(f"  | prefetch {where}: {os.getxattr(where, xattr).decode()}", flush=True)


def main() -> None:
    mark("container")
    prefetch(os.environ["JOB_CHECKPOINT"])
    dependencies(os.environ["JOB_DEPS"])
    mark("deps")
    import importlib

    for name in os.environ["JOB_IMPORTS"].split(","):
        importlib.import_module(name)
    mark("imports")
    import torch

    mark("torch")
    hidden = int(os.environ.get("JOB_HIDDEN", "1024"))
    model = torch.nn.Sequential(
        torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
    )
    mark("model")
    size = int(os.environ["JOB_CHECKPOINT_BYTES"])
    buffer = read_checkpoint(os.environ["JOB_CHECKPOINT"], size)
    weights = torch.frombuffer(buffer, dtype=torch.float32)
    # The first layer's weights come from the checkpoint; the benchmark
    # checks the digest of its head against the file it served.
    with torch.no_grad():
        first = model[0].weight
        first.copy_(weights[: first.numel()].reshape(first.shape))
    digest = hashlib.sha256(buffer[: 64 << 20]).hexdigest()[:16]
    mark("checkpoint")
    if os.environ["JOB_DEPS"] == "depsnap":
        run([*CLIENT, "mark", "ready"])
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = model(torch.randn(32, hidden)).pow(2).mean()
    loss.backward()
    optimiser.step()
    mark("step")
    print(f"STEP loss={loss.item():.6f} checkpoint_bytes={size} head_sha256={digest}", flush=True)


if __name__ == "__main__":
    main()
