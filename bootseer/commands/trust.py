"""`bootseer trust keygen`: the key pair `bootseer index` signs layer indexes
with, and nodes verify them by ([trust], docs/layer-index.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bootseer.options import CommandError

PRIVATE = "index-signing.key"
PUBLIC = "index-signing.pub"


def _keygen(args: argparse.Namespace) -> int:
    from snapshotter.layer.signature import generate

    directory: Path = args.directory
    private_path, public_path = directory / PRIVATE, directory / PUBLIC
    for path in (private_path, public_path):
        if path.exists():
            raise CommandError(f"{path} exists; refusing to replace a key (remove it first)")
    pair = generate()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # O_EXCL: never follow or reuse a file someone put there meanwhile.
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pair.private_pem)
        public_path.write_bytes(pair.public_pem)
    except OSError as exc:
        raise CommandError(f"cannot write the key pair to {directory}: {exc.strerror}") from None
    print(f"key {pair.key_id}")
    print(f"  private {private_path}  (for `bootseer index`: [trust] signing_key; keep it secret)")
    print(f"  public  {public_path}  (for every node: [trust] keys)")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "trust",
        help="keys that sign layer indexes",
        description=(
            "Nodes serve a layer lazily only from an index signed by a key in their [trust] keys. "
            "`keygen` makes a key pair: the private key for wherever `bootseer index` runs "
            "([trust] signing_key), the public key for every node."
        ),
    )
    commands = parser.add_subparsers(dest="trust_command", required=True, metavar="COMMAND")
    keygen = commands.add_parser("keygen", help="write a new Ed25519 key pair into DIRECTORY")
    keygen.add_argument("directory", type=Path, help=f"where to write {PRIVATE} and {PUBLIC}")
    keygen.set_defaults(func=_keygen)
