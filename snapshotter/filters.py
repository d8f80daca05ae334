"""containerd's filter syntax, as `List` receives it.

A request carries several filter strings; a snapshot is listed if it matches
any of them. Inside one string, comma-separated selectors must all match:

    name==sha256:abc,labels."containerd.io/snapshot.ref"
    kind==committed,parent!=""
    labels.team~=^ml-

A selector is a dotted field path (parts bare or double-quoted), optionally
followed by an operator (`==`, `!=`, `~=`) and a value (bare, double-quoted,
or /regex/). A selector without an operator asks whether the field is present.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from snapshotter.errors import InvalidArgument

# Returns (value, present) for a field path of the thing being filtered.
FieldGetter = Callable[[Sequence[str]], tuple[str, bool]]

_OPERATORS = ("==", "!=", "~=")
_FIELD_CHARS = re.compile(r"[A-Za-z0-9_\-]+")


@dataclass(frozen=True)
class Selector:
    path: tuple[str, ...]
    operator: str | None = None
    value: str = ""

    def matches(self, field: FieldGetter) -> bool:
        value, present = field(self.path)
        if self.operator is None:
            return present
        if self.operator == "==":
            return present and value == self.value
        if self.operator == "!=":
            return value != self.value
        return present and re.search(self.value, value) is not None


@dataclass(frozen=True)
class Filter:
    """All of its selectors must match (the comma-joined form)."""

    selectors: tuple[Selector, ...]

    def matches(self, field: FieldGetter) -> bool:
        return all(s.matches(field) for s in self.selectors)


def matches_any(filters: Sequence[Filter], field: FieldGetter) -> bool:
    """An empty filter list matches everything, as in containerd."""
    return not filters or any(f.matches(field) for f in filters)


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str) -> InvalidArgument:
        return InvalidArgument(f"invalid filter {self.text!r} at position {self.pos}: {message}")

    def done(self) -> bool:
        return self.pos >= len(self.text)

    def peek(self, token: str) -> bool:
        return self.text.startswith(token, self.pos)

    def skip_spaces(self) -> None:
        while not self.done() and self.text[self.pos].isspace():
            self.pos += 1

    def quoted(self, quote: str) -> str:
        """A quoted string with backslash escapes; the scanner sits on the quote."""
        self.pos += 1
        out: list[str] = []
        while not self.done():
            char = self.text[self.pos]
            if char == "\\" and self.pos + 1 < len(self.text):
                out.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            self.pos += 1
            if char == quote:
                return "".join(out)
            out.append(char)
        raise self.error(f"unterminated {quote}-quoted string")

    def field(self) -> str:
        if self.peek('"'):
            return self.quoted('"')
        match = _FIELD_CHARS.match(self.text, self.pos)
        if not match:
            raise self.error("expected a field name")
        self.pos = match.end()
        return match.group()

    def value(self) -> str:
        self.skip_spaces()
        if self.peek('"'):
            return self.quoted('"')
        if self.peek("/"):
            return self.quoted("/")
        start = self.pos
        while not self.done() and self.text[self.pos] != ",":
            self.pos += 1
        return self.text[start : self.pos].strip()


def parse(text: str) -> Filter:
    """Parse one filter string; raises InvalidArgument saying where it went wrong."""
    scanner = _Scanner(text)
    selectors: list[Selector] = []
    while True:
        scanner.skip_spaces()
        path = [scanner.field()]
        while scanner.peek("."):
            scanner.pos += 1
            path.append(scanner.field())
        scanner.skip_spaces()
        operator = next((op for op in _OPERATORS if scanner.peek(op)), None)
        value = ""
        if operator is not None:
            scanner.pos += len(operator)
            value = scanner.value()
            if operator == "~=":
                try:
                    re.compile(value)
                except re.error as exc:
                    raise scanner.error(f"bad regular expression {value!r}: {exc}") from None
        selectors.append(Selector(tuple(path), operator, value))
        scanner.skip_spaces()
        if scanner.done():
            return Filter(tuple(selectors))
        if not scanner.peek(","):
            raise scanner.error("expected ',' or an operator (==, !=, ~=)")
        scanner.pos += 1


def parse_all(texts: Sequence[str]) -> list[Filter]:
    return [parse(t) for t in texts if t.strip()]
