from __future__ import annotations

from collections.abc import Sequence

import pytest

from snapshotter import filters
from snapshotter.errors import InvalidArgument

SNAP = {
    ("name",): ("sha256:abc", True),
    ("parent",): ("", False),
    ("kind",): ("committed", True),
    ("labels", "containerd.io/snapshot.ref"): ("sha256:abc", True),
    ("labels", "team"): ("ml-infra", True),
}


def field(path: Sequence[str]) -> tuple[str, bool]:
    return SNAP.get(tuple(path), ("", False))


def matches(*texts: str) -> bool:
    return filters.matches_any(filters.parse_all(texts), field)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("name==sha256:abc", True),
        ("name==sha256:abd", False),
        ("name!=sha256:abd", True),
        ("kind==committed", True),
        ("kind==active", False),
        ('labels."containerd.io/snapshot.ref"==sha256:abc', True),
        ('labels."containerd.io/snapshot.ref"', True),
        ('labels."containerd.io/snapshot.missing"', False),
        ("labels.team~=^ml-", True),
        ("labels.team~=/^ml-i/", True),
        ("labels.team~=^gpu", False),
        ('kind==committed,labels."containerd.io/snapshot.ref"==sha256:abc', True),
        ("kind==committed,name==other", False),
        ('name=="sha256:abc"', True),
        ("parent", False),
        ('parent==""', False),
        ("parent!=x", True),
        ("  kind == committed ", True),
    ],
)
def test_single_filter(text: str, expected: bool) -> None:
    assert matches(text) is expected


def test_filters_are_ored() -> None:
    assert matches("name==nope", "kind==committed")
    assert not matches("name==nope", "kind==view")


def test_no_filters_match_everything() -> None:
    assert matches()
    assert matches("", "  ")


def test_quoted_value_with_comma_and_escape() -> None:
    parsed = filters.parse(r'labels.team=="a,\"b\"",kind==committed')
    assert parsed.selectors[0].value == 'a,"b"'
    assert parsed.selectors[1].path == ("kind",)


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("==x", "expected a field name"),
        ('labels."unterminated', "unterminated"),
        ("name==a,", "expected a field name"),
        ("name==a b c,kind=committed", "expected ','"),
        ("labels.team~=(", "bad regular expression"),
        ("name>=3", "expected ','"),
    ],
)
def test_malformed_filters_are_invalid_argument(text: str, fragment: str) -> None:
    with pytest.raises(InvalidArgument, match="invalid filter") as info:
        filters.parse(text)
    assert fragment in str(info.value)
