"""`copy`: pull a remote file or directory tree to local disk through the
striped reader, several files at a time.

Each file lands under a temporary name and is renamed into place only once
every byte arrived and its size matches the remote one, so an interrupted
copy never leaves a truncated file under the real name.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hdfs_fuse import uri as uri_mod
from hdfs_fuse.reader import Client

# Files copied at once: enough that small files keep the stripe workers busy,
# few enough that big files still get most of them each.
FILES_AT_ONCE = 4


@dataclass
class CopyReport:
    files: int = 0
    bytes: int = 0


def _walk(client: Client, location: uri_mod.Location, dest: Path) -> Iterator[tuple[uri_mod.Location, Path, int]]:
    for entry in client.list(location):
        child = location.child(entry.name)
        if entry.is_dir:
            yield from _walk(client, child, dest / entry.name)
        else:
            yield child, dest / entry.name, entry.size


def plan(client: Client, source: str, dest: Path) -> list[tuple[uri_mod.Location, Path, int]]:
    """(remote file, local path, size) for everything under `source`.

    A file copies to `dest` itself, or into it when `dest` is a directory;
    a directory's contents copy into `dest`.
    """
    location = uri_mod.parse(source)
    entry = client.stat(location)
    if not entry.is_dir:
        target = dest / location.name if dest.is_dir() else dest
        return [(location, target, entry.size)]
    return list(_walk(client, location, dest))


def copy_file(
    client: Client, location: uri_mod.Location, target: Path, size: int, progress: Callable[[int], object]
) -> int:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part-{os.getpid()}-{threading.get_ident()}")
    chunk = bytearray(client.config.stripe_size)
    view = memoryview(chunk)
    written = 0
    try:
        with client.open(location) as src, open(tmp, "wb") as out:
            if src.size != size:
                raise OSError(f"{location} changed size while copying ({size} -> {src.size})")
            while True:
                n = src.readinto(view)
                if n == 0:
                    break
                out.write(view[:n])
                written += n
                progress(n)
        if written != size:
            raise OSError(f"{location}: got {written} bytes, expected {size}")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written


def copy(client: Client, source: str, dest: Path, progress: Callable[[int], object] = lambda n: None) -> CopyReport:
    """Copy `source` (a file or a directory URI) to `dest`."""
    work = plan(client, source, dest)
    report = CopyReport()

    def copy_one(item: tuple[uri_mod.Location, Path, int]) -> int:
        location, target, size = item
        return copy_file(client, location, target, size, progress)

    with ThreadPoolExecutor(FILES_AT_ONCE, thread_name_prefix="copy") as pool:
        sizes = pool.map(copy_one, work)
        for size in sizes:
            report.files += 1
            report.bytes += size
    return report
