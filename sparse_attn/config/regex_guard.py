"""Vetting ``re:`` patterns before any layer name is matched against them.

Python's ``re`` backtracks and cannot be interrupted (matching holds the GIL in
C), and every vLLM worker matches every attention layer at start-up, so a
pattern that could take long is refused when the config is parsed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_PATTERN_LENGTH", "MAX_UNBOUNDED_REPEATS", "regex_hazard"]

#: Longest ``re:`` pattern accepted (layer names are ~30-100 characters).
MAX_PATTERN_LENGTH = 256
#: Unbounded repeats (``*``, ``+``, ``{n,}``) allowed in one ``re:`` pattern. Each one in
#: sequence multiplies the backtracking work by the name length: four ``.*`` take ~15 ms on a
#: 100-character name, five ~0.2 s, six seconds (measured, CPython 3.11).
MAX_UNBOUNDED_REPEATS = 3

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


def regex_hazard(regex: str) -> str | None:
    """Why matching ``regex`` could backtrack for a long time, or None when it cannot.

    Python's ``re`` backtracks: a repeat around something that can itself match
    in several ways (another repeat, an alternation) tries exponentially many
    splits on a near-miss (``([a-z._0-9]+)*X`` takes ~18 s on a 29-character
    name), back-references make matching NP-hard, and each unbounded repeat in
    sequence multiplies the work by the name length. Matching cannot be
    interrupted (it holds the GIL in C), so the pattern is vetted up front.
    """
    if len(regex) > MAX_PATTERN_LENGTH:
        return f"a pattern of at most {MAX_PATTERN_LENGTH} characters (this one has {len(regex)})"
    unbounded = 0

    def walk(sub: Any, in_repeat: bool) -> str | None:
        nonlocal unbounded
        for op, av in sub:
            if op in _REPEAT_OPS:
                lo, hi, body = av
                if hi > 1:
                    if in_repeat:
                        return "no nested quantifiers (a repeat inside a repeated group backtracks exponentially)"
                    if hi == _sre_c.MAXREPEAT:
                        unbounded += 1
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

    why = walk(_sre_parse.parse(regex), False)
    if why is None and unbounded > MAX_UNBOUNDED_REPEATS:
        why = (f"at most {MAX_UNBOUNDED_REPEATS} unbounded repeats (*, +, {{n,}}); this one has {unbounded}, "
               f"and each multiplies the matching time by the layer-name length")
    return why

