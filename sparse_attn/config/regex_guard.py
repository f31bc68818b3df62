"""Vetting ``re:`` patterns before any layer name is matched against them.

Python's ``re`` backtracks and cannot be interrupted (matching holds the GIL in
C), and every vLLM worker matches every attention layer at start-up, so a
pattern that could take long is refused when the config is parsed, in this
order (each step bounded before the next runs):

1. length: at most ``MAX_PATTERN_LENGTH`` characters, checked before anything
   parses or compiles the text (compiling 20 million characters takes minutes);
2. parse, with every way CPython's parser fails on hostile input turned into a
   reason (``re.error``, ``OverflowError`` for ``a{4294967295}``,
   ``RecursionError`` for deeply nested groups);
3. structure: no nested quantifiers, no alternation inside a repeat, no
   back-references (each backtracks exponentially), at most
   ``MAX_UNBOUNDED_REPEATS`` unbounded repeats;
4. work: :func:`regex_cost` counts the ways the repeats can split a name of
   ``NAME_LENGTH`` characters, bounded repeats included (``.{0,99}`` ten times
   in a row is as bad as ten ``.*``), at most ``MAX_SPLITS``.

Steps 3-4 read the parse tree of CPython's private ``re._parser`` (``sre_parse``
before 3.11). That module is not a public API, so :func:`parser_verified`
checks, once per process, that it still answers a set of probe patterns as the
guard expects; where it does not (a Python this guard was not verified on),
every ``re:`` pattern is refused with the advice to use fnmatch patterns,
rather than trusting a parse tree we cannot read. ``VERIFIED_PYTHONS`` lists
the versions the probes were run on; tests/sparse_attn/test_config_hostile.py
pins it per version.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any

__all__ = ["MAX_PATTERN_LENGTH", "MAX_SPLITS", "MAX_UNBOUNDED_REPEATS", "NAME_LENGTH", "VERIFIED_PYTHONS",
           "check_regex", "parser_verified", "regex_cost", "regex_hazard"]

#: Longest ``re:`` pattern accepted (layer names are ~30-100 characters).
MAX_PATTERN_LENGTH = 256
#: Unbounded repeats (``*``, ``+``, ``{n,}``) allowed in one ``re:`` pattern. Each one in
#: sequence multiplies the backtracking work by the name length: four ``.*`` take ~15 ms on a
#: 100-character name, five ~0.2 s, six seconds (measured, CPython 3.11).
MAX_UNBOUNDED_REPEATS = 3
#: Name length the matching work is estimated at: vLLM layer names are ~25-60 characters
#: (``model.layers.12.self_attn.attn``), HF class names shorter.
NAME_LENGTH = 64
#: Most ways the repeats of one pattern may split a name (:func:`regex_cost`): three
#: unbounded repeats' worth. Measured (CPython 3.11, this machine): 10**6 splits cost
#: ~18 ms per failed match, 10**7 ~0.36 s; this bound (~2.7e5) keeps one match under ~5 ms.
MAX_SPLITS = (NAME_LENGTH + 1) ** MAX_UNBOUNDED_REPEATS
#: Python versions whose private regex parser the probes in :func:`parser_verified` were run on.
VERIFIED_PYTHONS: tuple[tuple[int, int], ...] = ((3, 10), (3, 11), (3, 12), (3, 13))

try:  # the regex parser CPython's re uses: re._parser from 3.11, sre_parse before
    from re import _constants as _sre_c
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

_REPEAT_OPS = tuple(
    getattr(_sre_c, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_sre_c, name)
)
_BACKREF_OPS = tuple(getattr(_sre_c, name) for name in ("GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE",
                                                         "GROUPREF_LOC_IGNORE", "GROUPREF_UNI_IGNORE")
                     if hasattr(_sre_c, name))
#: Everything CPython's regex parser or compiler raises on hostile text: ``re.error`` for
#: syntax, ``OverflowError`` for a repeat count >= 2**32 - 1, ``RecursionError`` for groups
#: nested a few hundred deep, ``MemoryError`` / ``ValueError`` for the rest.
_PARSE_FAILURES = (re.error, OverflowError, RecursionError, MemoryError, ValueError, TypeError)


_INVALID = "a valid regular expression"
_BOUNDED_FIX = ("write the pattern without nesting, e.g. 're:[a-z._0-9]*X' instead of 're:([a-z._0-9]+)*X', "
                "list several patterns instead of one alternation, or use an fnmatch pattern such as "
                "'model.layers.*.self_attn'")


def check_regex(regex: str) -> tuple[str, str] | None:
    """``(expected, fix)`` for a refused ``re:`` pattern body, None when it is accepted."""
    why = regex_hazard(regex)
    if why is None:
        return None
    if why.startswith(_INVALID):
        return f"{why} after 're:'", "fix the regex, or use an fnmatch pattern such as 'model.layers.*.self_attn'"
    return f"a regular expression that matches in bounded time: {why}", _BOUNDED_FIX


def _walk(tree: Any) -> tuple[str | None, int, int]:
    """(hazard or None, unbounded repeats, estimated splits) of a parsed pattern."""
    unbounded = 0
    splits = 1

    def walk(sub: Any, in_repeat: bool) -> str | None:
        nonlocal unbounded, splits
        for op, av in sub:
            if op in _REPEAT_OPS:
                lo, hi, body = av
                if hi > 1:
                    if in_repeat:
                        return "no nested quantifiers (a repeat inside a repeated group backtracks exponentially)"
                    if hi == _sre_c.MAXREPEAT:
                        unbounded += 1
                if hi != lo:  # a fixed count (a{5}) has one way to match; a range has hi - lo + 1
                    splits *= min(hi, NAME_LENGTH) - min(lo, NAME_LENGTH) + 1
                found = walk(body, in_repeat or hi > 1)
            elif op == _sre_c.BRANCH:
                if in_repeat and len(av[1]) > 1:
                    return "no alternation inside a repeated group (it backtracks exponentially); use a character class"
                found = next((why for branch in av[1] if (why := walk(branch, in_repeat))), None)
            elif op == _sre_c.SUBPATTERN:
                found = walk(av[3], in_repeat)
            elif op in (_sre_c.ASSERT, _sre_c.ASSERT_NOT):
                found = walk(av[1], in_repeat)
            elif op == getattr(_sre_c, "ATOMIC_GROUP", object()):
                found = walk(av, in_repeat)
            elif op in _BACKREF_OPS:
                return "no back-references (matching them can take exponential time)"
            else:
                found = None
            if found:
                return found
        return None

    return walk(tree, False), unbounded, splits


#: Probe pattern -> (hazard word expected or None, unbounded repeats, splits), as this guard reads them.
_PROBES: dict[str, tuple[str | None, int, int]] = {
    "(a+)+b": ("nested", 1, NAME_LENGTH),
    "(?:ab|cd)*z": ("alternation", 1, NAME_LENGTH + 1),
    r"(m)\.\1": ("back-references", 0, 1),
    "(?:model\\.)?layers\\.[0-9]{1,3}\\..*": (None, 1, 2 * 3 * (NAME_LENGTH + 1)),
    "a{5}b*?": (None, 1, NAME_LENGTH + 1),
    "(?=ab)(?!c)x{2,4}": (None, 0, 3),
}


@functools.lru_cache(maxsize=1)
def parser_verified() -> bool:
    """Whether this Python's private regex parser reads the probe patterns as the guard expects."""
    try:
        for pattern, (word, unbounded, splits) in _PROBES.items():
            why, got_unbounded, got_splits = _walk(_sre_parse.parse(pattern))
            if (why is None) != (word is None) or (word and word not in why):
                return False
            if (got_unbounded, got_splits) != (unbounded, splits):
                return False
    except Exception:  # any change of shape (attribute, tuple layout) means "not verified"
        return False
    return True


def regex_cost(regex: str) -> int:
    """Ways the repeats of ``regex`` can split a ``NAME_LENGTH``-character name (an upper
    bound on the backtracking work of one failed match). The regex must be vetted."""
    return _walk(_sre_parse.parse(regex))[2]


def regex_hazard(regex: str) -> str | None:
    """Why matching ``regex`` could take long, or be refused, or None when it is safe.

    Python's ``re`` backtracks: a repeat around something that can itself match
    in several ways (another repeat, an alternation) tries exponentially many
    splits on a near-miss (``([a-z._0-9]+)*X`` takes ~18 s on a 29-character
    name), back-references make matching NP-hard, and each variable repeat in
    sequence multiplies the work by its range. Matching cannot be interrupted
    (it holds the GIL in C), so the pattern is vetted up front.
    """
    if len(regex) > MAX_PATTERN_LENGTH:
        return f"a pattern of at most {MAX_PATTERN_LENGTH} characters (this one has {len(regex)})"
    if not parser_verified():
        version = ".".join(map(str, sys.version_info[:3]))
        return (f"no re: patterns on Python {version}: its private regex parser is not one this guard was verified on "
                f"({', '.join('.'.join(map(str, v)) for v in VERIFIED_PYTHONS)}), so the matching time cannot be bounded")
    try:
        tree = _sre_parse.parse(regex)
        re.compile(regex)
    except _PARSE_FAILURES as exc:
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, RecursionError):
            detail = "groups nested too deeply"
        return f"{_INVALID} ({detail[:120]})"
    why, unbounded, splits = _walk(tree)
    if why is None and unbounded > MAX_UNBOUNDED_REPEATS:
        why = (f"at most {MAX_UNBOUNDED_REPEATS} unbounded repeats (*, +, {{n,}}); this one has {unbounded}, "
               f"and each multiplies the matching time by the layer-name length")
    if why is None and splits > MAX_SPLITS:
        why = (f"repeats that split a {NAME_LENGTH}-character name in at most {MAX_SPLITS} ways "
               f"(bounded repeats such as .{{0,99}} count by their range); this one allows ~{splits:.2g}")
    return why
