"""Which attention layers a skip-softmax group covers: ``targets`` / ``ignore`` patterns.

Validation of the pattern lists (:func:`pattern_list`, which vets ``re:``
patterns through :mod:`.regex_guard`) and matching (:func:`group_matches`);
the matching rules are in the package docstring.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass
from typing import Any, Iterable

from .errors import SparseAttentionConfigError
from .regex_guard import MAX_SPLITS, NAME_LENGTH, check_regex, regex_cost

__all__ = ["MAX_GLOB_LENGTH", "MAX_LIST_SPLITS", "MAX_PATTERNS", "group_matches", "pattern_list"]


#: Most patterns in one ``targets`` or ``ignore`` list. Every worker matches every layer
#: against each list at start-up; a model's own lists hold a few class names or module
#: patterns (one per layer at most, and no served model has 256 attention layers).
MAX_PATTERNS = 256
#: Longest fnmatch pattern accepted (a module name is ~30-100 characters).
MAX_GLOB_LENGTH = 512
#: Most backtracking work all ``re:`` patterns of one list may add per name (four patterns at
#: ``regex_guard.MAX_SPLITS`` each).
MAX_LIST_SPLITS = 4 * MAX_SPLITS
_WILDCARDS = frozenset("*?[")


def _dotted_parts(name: str) -> list[str]:
    parts = name.split(".")
    n = len(parts)
    return [".".join(parts[i:j]) for i in range(n) for j in range(i + 1, n + 1)]


@dataclass(frozen=True)
class _CompiledList:
    """One pattern list, compiled once: literal names (set lookups), fnmatch patterns with
    wildcards and ``re:`` patterns (compiled regexes), and ModelOpt's ``"Attention"`` fallback."""

    literals: frozenset[str]
    #: every fnmatch pattern with a wildcard, as one alternation of their translations
    #: (one C-level match per name instead of one Python call per pattern: ~20x faster at 256)
    globs: re.Pattern[str] | None
    regexes: tuple[re.Pattern[str], ...]
    attention_suffix: bool

    def hit(self, layer_name: str, classes: tuple[str, ...], parts: frozenset[str]) -> bool:
        if any(rx.match(layer_name) or any(rx.match(c) for c in classes) for rx in self.regexes):
            return True
        if self.attention_suffix and any(c.endswith("Attention") for c in classes):
            return True
        if not self.literals.isdisjoint(classes) or not self.literals.isdisjoint(parts):
            return True
        return self.globs is not None and any(self.globs.match(c) for c in (*classes, *parts))


@functools.lru_cache(maxsize=64)
def _compile(patterns: tuple[str, ...], is_target: bool) -> _CompiledList:
    literals, globs, regexes = set(), [], []
    for pattern in patterns:
        if pattern.startswith("re:"):
            regexes.append(re.compile(pattern[3:]))  # vetted by pattern_list when parsed from a file
        elif _WILDCARDS.isdisjoint(pattern):
            literals.add(pattern)
        else:
            globs.append(f"(?:{fnmatch.translate(pattern)})")  # what fnmatch.fnmatchcase compiles
    return _CompiledList(frozenset(literals), re.compile("|".join(globs)) if globs else None, tuple(regexes),
                         attention_suffix=is_target and "Attention" in literals)


def group_matches(targets: tuple[str, ...], ignore: tuple[str, ...], layer_name: str,
                  class_name: str | Iterable[str] | None) -> bool:
    """Whether a layer is covered by ``targets`` and not by ``ignore`` (no targets: every layer).

    A pattern matches a class name, the layer name, or a contiguous dotted part of the
    layer name (package docstring); each list is compiled once, so a layer costs one set
    lookup per name plus one regex match per wildcard pattern and name part.
    """
    if class_name is None:
        classes: tuple[str, ...] = ()
    elif isinstance(class_name, str):
        classes = (class_name,)
    else:
        classes = tuple(class_name)
    parts = frozenset(_dotted_parts(layer_name)) if layer_name else frozenset()
    if ignore and _compile(tuple(ignore), False).hit(layer_name, classes, parts):
        return False
    if not targets:
        return True
    return _compile(tuple(targets), True).hit(layer_name, classes, parts)


def pattern_list(value: Any, path: str, source: str | None) -> tuple[str, ...]:
    """``targets`` / ``ignore`` as a tuple of vetted patterns (a string is a one-pattern list).

    Bounded before anything is compiled: at most ``MAX_PATTERNS`` patterns, each fnmatch
    pattern at most ``MAX_GLOB_LENGTH`` characters, each ``re:`` pattern accepted by
    :func:`regex_guard.check_regex`, and their estimated work at most ``MAX_LIST_SPLITS``.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise SparseAttentionConfigError(
            path, value, "a list of non-empty pattern strings", 'write e.g. ["LlamaAttention"] or ["model.layers.0.*"]', source=source
        )
    if len(value) > MAX_PATTERNS:
        raise SparseAttentionConfigError(
            path, f"a list of {len(value)} patterns", f"at most {MAX_PATTERNS} patterns (every worker matches every layer "
            f"against each one at start-up)", "cover the layers with fewer patterns: a wildcard such as "
            "'model.layers.*.self_attn', a class name, or a re: pattern", source=source,
        )
    work = 0
    for v in value:
        if not v.startswith("re:"):
            if len(v) > MAX_GLOB_LENGTH:
                raise SparseAttentionConfigError(
                    path, v, f"a pattern of at most {MAX_GLOB_LENGTH} characters (this one has {len(v)})",
                    "write the module or class name, or a shorter wildcard pattern", source=source,
                )
            continue
        if v == "re:":
            # re.match("") succeeds on every name: an empty re: targets (or ignores) every layer.
            raise SparseAttentionConfigError(
                path, v, "a regular expression after 're:' (an empty one matches every layer)",
                "write the pattern after 're:', or use '*' to mean every layer on purpose", source=source,
            )
        problem = check_regex(v[3:])
        if problem:
            raise SparseAttentionConfigError(path, v, problem[0], problem[1], source=source)
        work += regex_cost(v[3:])
        if work > MAX_LIST_SPLITS:
            raise SparseAttentionConfigError(
                path, v, f"re: patterns whose repeats together split a {NAME_LENGTH}-character name in at most "
                f"{MAX_LIST_SPLITS} ways (this list reaches ~{work:.2g} at this pattern)",
                "use fewer or simpler re: patterns, or fnmatch patterns", source=source,
            )
    return tuple(value)
