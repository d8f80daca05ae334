"""Requirement files and everything they pull in.

A requirement file can include others (`-r`, `-c` and their long forms);
every file reached that way changes what gets installed, so every one of them
goes into the key. Local projects named by path (`-e ./proj`, `./proj`)
contribute their build metadata files, which decide what an install of them
produces.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

_INCLUDE_OPTIONS = {
    "-r": "requirement",
    "--requirement": "requirement",
    "-c": "constraint",
    "--constraint": "constraint",
}
_PROJECT_METADATA = ("pyproject.toml", "setup.cfg", "setup.py")


class RequirementsError(Exception):
    """A requirement file is missing, unreadable or includes itself."""


@dataclass(frozen=True)
class InputFile:
    """One file that went into the key: how it was reached and its digest."""

    role: str  # "requirement", "constraint" or "project"
    path: Path
    sha256: str


def _logical_lines(text: str) -> list[str]:
    """Lines with comments dropped and backslash continuations joined, as pip reads them."""
    joined = re.sub(r"\\\n", "", text)
    lines = []
    for raw in joined.splitlines():
        # A comment starts at "#" at line start or after whitespace (URLs keep their fragments).
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if line:
            lines.append(line)
    return lines


# "-r x", "-rx", "--requirement x", "--requirement=x" (optparse accepts them all).
_OPTION = re.compile(r"^(--requirement|--constraint|--editable|-r|-c|-e)(?:\s*=\s*|\s+|(?<=-[rce])(?=\S))(.+)$")


def _split_option(line: str) -> tuple[str, str] | None:
    """("-r", "path") for an include or editable line, else None."""
    match = _OPTION.match(line)
    return (match.group(1), match.group(2).strip()) if match else None


def _is_local_path(spec: str) -> bool:
    return spec.startswith((".", "/", "file:")) and not spec.endswith((".whl", ".tar.gz", ".zip"))


def _project_dir(spec: str, base: Path) -> Path:
    spec = spec.removeprefix("file://").removeprefix("file:")
    # "./proj[extra]" and "./proj#egg=..." name the directory before the decoration.
    spec = re.split(r"[\[#]", spec, maxsplit=1)[0]
    return (base / spec).resolve()


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise RequirementsError(f"cannot read {path}: {exc.strerror}") from None


def collect(roots: list[Path], role: str = "requirement") -> list[InputFile]:
    """Every file `roots` reach, depth first in reading order, each once.

    Paths inside a file are relative to that file's directory, as pip and uv
    read them.
    """
    found: list[InputFile] = []
    seen: set[Path] = set()

    def visit(path: Path, file_role: str, stack: tuple[Path, ...]) -> None:
        path = path.resolve()
        if path in stack:
            chain = " -> ".join(str(p) for p in (*stack, path))
            raise RequirementsError(f"requirement files include each other: {chain}")
        if path in seen:
            return
        if not path.is_file():
            where = f" (included from {stack[-1]})" if stack else ""
            raise RequirementsError(f"requirement file not found: {path}{where}")
        seen.add(path)
        found.append(InputFile(file_role, path, _digest(path)))
        text = path.read_text(errors="replace")
        for line in _logical_lines(text):
            option = _split_option(line)
            if option is not None and option[0] in _INCLUDE_OPTIONS:
                target = shlex.split(option[1])[0]
                visit(path.parent / target, _INCLUDE_OPTIONS[option[0]], (*stack, path))
                continue
            spec = option[1] if option is not None else line.split(";", 1)[0].strip()
            if _is_local_path(spec):
                _visit_project(_project_dir(spec, path.parent))

    def _visit_project(directory: Path) -> None:
        if directory in seen:
            return
        seen.add(directory)
        for name in _PROJECT_METADATA:
            meta = directory / name
            if meta.is_file():
                found.append(InputFile("project", meta, _digest(meta)))

    for root in roots:
        visit(root, role, ())
    return found
