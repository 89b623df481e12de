"""The protocol line parser (``afd_patches.connectors.handshake.parse_line``) judges the text ``json`` parses.

Finding 9 of issue 51: the nesting-depth scan read bytes while ``json.loads(bytes)`` also decodes UTF-16 and
UTF-32, so a character whose UTF-16/32 code unit holds a quote byte (``Ģ``: ``22 01``) made the byte scan think
it was inside a string, and a line nested far deeper than ``MAX_DEPTH`` reached ``json``.
"""

from __future__ import annotations

import json

import pytest

from afd_patches.connectors import handshake

DEEP = 200  # far past MAX_DEPTH, well inside json's recursion limit: only the scan can refuse it
NESTED = {"x": "\u0122", "y": json.loads("[" * DEEP + "]" * DEEP)}  # U+0122 encodes with a 0x22 (quote) byte


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be", "utf-16", "utf-32"])
def test_a_deeply_nested_utf16_or_utf32_line_is_refused(encoding: str) -> None:
    """``utf-16``/``utf-32`` (no suffix) write a byte order mark first."""
    line = json.dumps(NESTED, ensure_ascii=False).encode(encoding)
    assert len(line) <= handshake.MAX_LINE
    assert json.loads(line) == NESTED  # what json alone would accept
    with pytest.raises(ValueError, match="not JSON"):
        handshake.parse_line(line)


@pytest.mark.parametrize("bom", [b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff"])
def test_a_line_with_a_byte_order_mark_is_refused(bom: bytes) -> None:
    line = bom + json.dumps({"afd": handshake.PROTOCOL, "nonce": "00"}).encode()
    with pytest.raises(ValueError, match="not JSON"):
        handshake.parse_line(line)


def test_the_same_line_in_utf8_is_refused_for_its_depth_and_a_shallow_one_parses() -> None:
    with pytest.raises(ValueError, match=f"nested deeper than {handshake.MAX_DEPTH}"):
        handshake.parse_line(json.dumps(NESTED, ensure_ascii=False).encode())
    shallow = {"x": "\u0122", "y": [[["\u00e9"]]]}
    assert handshake.parse_line(json.dumps(shallow, ensure_ascii=False).encode()) == shallow
    assert handshake.nesting_depth(json.dumps(shallow)) == handshake.MAX_DEPTH  # too few brackets to scan
