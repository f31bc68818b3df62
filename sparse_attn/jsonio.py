"""Reading the JSON a user hands us (``config.json``, ``--engine_kwargs``, prompt files)
without a traceback, a hang or an unbounded read.

Python's ``json`` raises more than ``JSONDecodeError`` on hostile input: a
``RecursionError`` past ~1000 nesting levels and a ``ValueError`` for an
integer of more than 4300 digits (CPython's int-conversion limit). ``open``
blocks forever on a FIFO and reads a device or ``/proc`` file without end.
Every reader here opens non-blocking, accepts regular files only, bounds the
size, decodes strict UTF-8 (naming UTF-16/32 when a byte-order mark says so)
and turns each failure into a :class:`JsonInputError` that names the input,
what was wrong and the fix. A leaf module: stdlib only.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

__all__ = ["JsonInputError", "MAX_DEPTH", "depth_exceeded", "loads", "read_json_file", "read_text_file", "shorten"]

#: Nesting depth accepted in any JSON we read. Hugging Face configs nest a few levels;
#: Python's own parser gives up (``RecursionError``) near 1000, and ``copy.deepcopy``
#: of a value nested ~500 deep exhausts the stack too.
MAX_DEPTH = 64
#: The longest excerpt of a user's input an error message quotes.
SHOWN_CHARS = 200

_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"),
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
    (b"\xff\xfe", "UTF-16 (little-endian)"),
    (b"\xfe\xff", "UTF-16 (big-endian)"),
)


class JsonInputError(ValueError):
    """A JSON input cannot be used; ``str()`` is ``"<where>: <what>. Fix: <fix>"``."""

    def __init__(self, where: str, what: str, fix: str):
        self.where, self.what, self.fix = where, what, fix
        super().__init__(f"{shorten(where, 300)}: {what}. Fix: {fix}")


def shorten(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length named."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 3]}... ({len(text)} characters)"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_text_file(path: str | os.PathLike, *, what: str, max_bytes: int, fix: str) -> str:
    """The UTF-8 text of the regular file ``path`` (symlinks followed), at most ``max_bytes``.

    Never blocks: the file is opened with ``O_NONBLOCK`` and refused unless
    ``fstat`` says it is a regular file (a FIFO, device, socket or directory
    is named as such). ``what`` names the input in the message; ``fix`` is
    the generic fix for an unreadable one.
    """
    where = f"{what} {os.fspath(path)}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise JsonInputError(where, "does not exist", fix) from None
    except OSError as exc:
        raise JsonInputError(where, f"cannot be opened ({exc.strerror or exc})", fix) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise JsonInputError(where, f"is {_kind(info.st_mode)}, expected a regular file", fix)
        if info.st_size > max_bytes:
            raise JsonInputError(where, f"has {info.st_size} bytes, more than the {max_bytes} accepted", fix)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:  # grew while being read
                raise JsonInputError(where, f"has more than the {max_bytes} bytes accepted", fix)
            chunks.append(chunk)
    except OSError as exc:
        raise JsonInputError(where, f"cannot be read ({exc.strerror or exc})", fix) from None
    finally:
        os.close(fd)
    return _decode(b"".join(chunks), where)


def _decode(data: bytes, where: str) -> str:
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise JsonInputError(where, f"is {name} text, expected UTF-8", "save it as UTF-8 (without a byte-order mark)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonInputError(
            where, f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}: {exc.reason})",
            "save it as UTF-8",
        ) from None


def depth_exceeded(value: Any, max_depth: int) -> str | None:
    """The key path of the first place ``value`` nests deeper than ``max_depth``, or None (iterative)."""
    # A first pass visits containers only and builds no key paths: a 20 MB config.json
    # holds ~10^6 values, and a path string per value made this walk seconds long
    # (issue 19: bounded time). Paths are built only once a value is known to be too deep.
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        if depth > max_depth and isinstance(node, (dict, list)):
            break
        depth += 1
        stack.extend([(child, depth) for child in children if isinstance(child, (dict, list))])
    else:
        return None
    paths: list[tuple[Any, str, int]] = [(value, "", 1)]
    while paths:
        node, path, depth = paths.pop()
        if depth > max_depth:
            return path or "the top level"
        if isinstance(node, dict):
            paths.extend((v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in node.items()
                         if isinstance(v, (dict, list)))
        else:
            paths.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node) if isinstance(v, (dict, list)))
    return None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


def loads(text: str, *, where: str, fix: str, allow_nan: bool = True, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)`` with every failure a :class:`JsonInputError` naming ``where``.

    ``allow_nan=False`` refuses ``NaN`` / ``Infinity`` (Python's parser accepts
    them; they are not JSON). Values nested deeper than ``max_depth`` are refused
    with the key path where it happens.
    """
    try:
        value = json.loads(text, parse_constant=None if allow_nan else _refuse_constant)
    except json.JSONDecodeError as exc:
        raise JsonInputError(where, f"is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})", fix) from None
    except RecursionError:
        raise JsonInputError(where, f"nests deeper than JSON's parser can follow (more than {max_depth} levels "
                                    f"are refused)", fix) from None
    except ValueError as exc:  # int digit limit, or a refused NaN
        text_of = str(exc)
        if "non-finite" in text_of:
            raise JsonInputError(where, f"holds a {text_of.split(' ', 2)[-1]} (NaN and Infinity are not JSON numbers)",
                                 "write a finite number") from None
        raise JsonInputError(where, "holds an integer with more digits than Python converts (4300)",
                             "write a number of ordinary size") from None
    deep = depth_exceeded(value, max_depth)
    if deep is not None:
        raise JsonInputError(where, f"nests deeper than {max_depth} levels (at {shorten(deep, 120)})", fix)
    return value


def read_json_file(path: str | os.PathLike, *, what: str, max_bytes: int, fix: str) -> Any:
    """:func:`read_text_file` then :func:`loads`."""
    text = read_text_file(path, what=what, max_bytes=max_bytes, fix=fix)
    return loads(text, where=f"{what} {os.fspath(path)}", fix=fix)

