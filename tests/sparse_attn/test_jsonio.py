"""sparse_attn.jsonio: the one reader of user JSON never blocks, never reads without
bound, and names what was wrong (issue 19)."""

from __future__ import annotations

import json
import os
import time

import pytest

from sparse_attn import jsonio


def _file(tmp_path, data: bytes):
    p = tmp_path / "in.json"
    p.write_bytes(data)
    return p


def _fifo(tmp_path):
    p = tmp_path / "fifo.json"
    os.mkfifo(p)
    return p


READS = [
    # id, make(tmp_path) -> path, max_bytes, words in the error (None: reads fine)
    ("regular_utf8", lambda t: _file(t, '{"a": "é"}'.encode()), 1 << 20, None),
    ("fifo_never_blocks", _fifo, 1 << 20, "is a FIFO (named pipe), expected a regular file"),
    ("dev_zero_is_a_device", lambda t: "/dev/zero", 1 << 20, "is a character device"),
    ("directory", lambda t: t, 1 << 20, "is a directory"),
    ("missing", lambda t: t / "nope.json", 1 << 20, "does not exist"),
    ("over_the_size_bound", lambda t: _file(t, b" " * 2048 + b"{}"), 1024, "has 2050 bytes, more than the 1024 accepted"),
    ("utf16_le", lambda t: _file(t, b"\xff\xfe" + '{"a": 1}'.encode("utf-16-le")), 1 << 20, "is UTF-16 (little-endian)"),
    ("utf16_be", lambda t: _file(t, b"\xfe\xff" + '{"a": 1}'.encode("utf-16-be")), 1 << 20, "is UTF-16 (big-endian)"),
    ("utf32_le", lambda t: _file(t, '{"a": 1}'.encode("utf-32")), 1 << 20, "is UTF-32 (little-endian)"),
    ("latin1", lambda t: _file(t, b'{"a": "caf\xe9"}'), 1 << 20, "is not UTF-8 text (byte 0xe9 at offset 10"),
]


@pytest.mark.parametrize("make,max_bytes,words", [c[1:] for c in READS], ids=[c[0] for c in READS])
def test_read_text_file(tmp_path, make, max_bytes, words):
    path = make(tmp_path)
    t0 = time.perf_counter()
    if words is None:
        assert json.loads(jsonio.read_text_file(path, what="x", max_bytes=max_bytes, fix="f")) == {"a": "é"}
    else:
        with pytest.raises(jsonio.JsonInputError) as info:
            jsonio.read_text_file(path, what="x", max_bytes=max_bytes, fix="f")
        assert words in str(info.value) and "Fix: " in str(info.value)
    assert time.perf_counter() - t0 < 1.0


LOADS = [
    ("valid", '{"a": [1, 2.5, null]}', True, None),
    ("not_json", "{a: 1}", True, "is not valid JSON (line 1, column 2"),
    ("deep_for_python", "[" * 100_000 + "]" * 100_000, True, "nests deeper than JSON's parser can follow"),
    ("deep_for_us", "[" * 65 + "]" * 65, True, "nests deeper than 64 levels (at [0][0]"),
    ("at_the_depth_bound", "[" * 64 + "]" * 64, True, None),
    ("huge_integer", "7" * 5000, True, "holds an integer with more digits than Python converts"),
    ("nan_allowed", '{"a": NaN}', True, None),
    ("nan_refused", '{"a": NaN}', False, "holds a NaN"),
    ("infinity_refused", '[-Infinity]', False, "holds a -Infinity"),
]


@pytest.mark.parametrize("text,allow_nan,words", [c[1:] for c in LOADS], ids=[c[0] for c in LOADS])
def test_loads(text, allow_nan, words):
    if words is None:
        assert jsonio.loads(text, where="w", fix="f", allow_nan=allow_nan) is not None
        return
    with pytest.raises(jsonio.JsonInputError) as info:
        jsonio.loads(text, where="w", fix="f", allow_nan=allow_nan)
    assert str(info.value).startswith("w: ") and words in str(info.value)


def test_depth_path_names_the_key():
    value = {"a": {"b": [{"c": {"d": 1}}]}}
    assert jsonio.depth_exceeded(value, 3) == "a.b[0]"
    assert jsonio.depth_exceeded(value, 5) is None


@pytest.mark.parametrize("max_depth, expected", [(0, "the top level"), (1, "g"), (2, "g[4999]"), (3, "g[4999].x"),
                                                 (4, None)], ids=lambda v: str(v))
def test_depth_path_among_many_siblings_and_leaves(max_depth, expected):
    # Wide values with leaves everywhere and one deeper branch last: the first pass skips
    # leaves and paths, the second names the place. Reference: the path written by hand.
    value = {"leaf": 1, "g": [{"a": 1, "b": "x"} for _ in range(4999)] + [{"x": [1, 2]}]}
    assert jsonio.depth_exceeded(value, max_depth) == expected


def test_long_inputs_are_cut():
    assert jsonio.shorten("x" * 100_000).endswith("... (100000 characters)")
    assert len(jsonio.shorten("x" * 100_000)) < 250
    error = jsonio.JsonInputError("y" * 100_000, "what", "fix")
    assert len(str(error)) < 400
