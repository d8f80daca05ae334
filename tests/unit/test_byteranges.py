"""The multipart/byteranges parser: any split of a well-formed body gives
back each part's bytes at its offsets; a malformed one is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshotter.registry import multirange
from snapshotter.registry.byteranges import ByteRangesParser, MalformedByteRanges, boundary_of
from snapshotter.registry.reference import parse as parse_reference
from snapshotter.registry.resumable import BlobBody

BLOB = bytes(range(256)) * 64
BOUNDARY = b"3d6b6a416f9b5"
REF = parse_reference("registry.example/app:v1")
DIGEST = "sha256:" + "ab" * 32


def _body(ranges: list[tuple[int, int]], leading_crlf: bool, epilogue: bytes = b"\r\n") -> bytes:
    """As Go's net/http (no CRLF before the first delimiter) or nginx (one) writes it."""
    out = b"\r\n" if leading_crlf else b""
    for i, (start, end) in enumerate(ranges):
        out += (b"\r\n" if i else b"") + b"--" + BOUNDARY + b"\r\n"
        content_type = b"Content-Type: application/octet-stream\r\n"
        content_range = f"Content-Range: bytes {start}-{end - 1}/{len(BLOB)}\r\n".encode()
        # Go puts Content-Range first, nginx last.
        out += (content_type + content_range if leading_crlf else content_range + content_type) + b"\r\n"
        out += BLOB[start:end]
    return out + b"\r\n--" + BOUNDARY + b"--" + epilogue


def _parse(body: bytes, cuts: list[int]) -> tuple[dict[int, bytes], bool]:
    parser = ByteRangesParser(BOUNDARY)
    got: dict[int, bytearray] = {}
    expected_at: dict[int, int] = {}
    last = 0
    for cut in [*sorted(cuts), len(body)]:
        for offset, piece in parser.feed(body[last:cut]):
            # Pieces of one part arrive in order: group them by where they continue.
            start = next((s for s, e in expected_at.items() if e == offset), offset)
            got.setdefault(start, bytearray()).extend(piece)
            expected_at[start] = offset + len(piece)
        last = cut
    return {k: bytes(v) for k, v in got.items()}, parser.finished


ranges_strategy = st.lists(
    st.tuples(st.integers(0, len(BLOB) - 1), st.integers(1, 3000)).map(lambda t: (t[0], min(len(BLOB), t[0] + t[1]))),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(ranges=ranges_strategy, leading=st.booleans(), data=st.data())
def test_any_split_gives_every_part_back(ranges: list[tuple[int, int]], leading: bool, data: st.DataObject) -> None:
    ordered = sorted(set(ranges))
    # Ranges apart from each other, so each part can be told apart by its start.
    disjoint = [r for i, r in enumerate(ordered) if i == 0 or r[0] > ordered[i - 1][1]]
    body = _body(disjoint, leading)
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=12))
    got, finished = _parse(body, cuts)
    assert finished
    assert got == {start: BLOB[start:end] for start, end in disjoint}


def test_pieces_of_a_part_pass_through_and_the_epilogue_is_ignored() -> None:
    body = _body([(10, 2010), (5000, 5001)], leading_crlf=False, epilogue=b"\r\nanything at all")
    got, finished = _parse(body, [150, 151, 152, 1000])
    assert finished and got == {10: BLOB[10:2010], 5000: BLOB[5000:5001]}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"--other\r\n", "boundary"),
        (_body([(0, 100)], True).replace(b"Content-Range: bytes 0-99/16384\r\n", b""), "no Content-Range"),
        (_body([(0, 100)], False).replace(b"bytes 0-99/", b"bytes 99-0/"), "empty"),
        # A part longer than its Content-Range says: its last bytes sit where a delimiter must.
        (_body([(0, 100)], False).replace(b"bytes 0-99/", b"bytes 0-89/"), "does not end"),
        (_body([(0, 100)], False).replace(b"--" + BOUNDARY + b"\r\n", b"--" + BOUNDARY + b"xx", 1), "line end"),
        (b"--" + BOUNDARY + b"\r\n" + b"X-Padding: " + b"a" * 9000, "exceed"),
    ],
)
def test_malformed_bodies_are_refused(body: bytes, reason: str) -> None:
    parser = ByteRangesParser(BOUNDARY)
    with pytest.raises(MalformedByteRanges, match=reason):
        for _ in parser.feed(body):
            pass


def test_boundary_of_content_types() -> None:
    assert boundary_of("multipart/byteranges; boundary=3d6b6a416f9b5") == BOUNDARY
    assert boundary_of('Multipart/ByteRanges; boundary="a b"') == b"a b"
    assert boundary_of("application/octet-stream") is None
    assert boundary_of("multipart/byteranges") is None


def test_pieces_go_to_the_ranges_they_continue() -> None:
    """What a server sends for several ranges (parts, or ranges it coalesced
    into one): each range takes the bytes that continue it, once; bytes it
    has, and bytes past a gap, it does not."""
    got: list[list[bytes]] = [[], [], []]
    ranges = [(0, 10), (20, 30), (25, 40)]
    bodies = [BlobBody(REF, DIGEST, out.append, start, end) for out, (start, end) in zip(got, ranges, strict=True)]
    multirange._deliver(bodies, 0, BLOB[0:35])  # coalesced: 0-9, 20-29 and the first of 25-39
    multirange._deliver(bodies, 5, BLOB[5:12])  # again: nothing new for 0-9
    multirange._deliver(bodies, 37, BLOB[37:40])  # past a gap in 25-39: not taken
    assert [b"".join(out) for out in got] == [BLOB[0:10], BLOB[20:30], BLOB[25:35]]
    assert [b.done for b in bodies] == [True, True, False]
