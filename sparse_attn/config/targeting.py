"""Which attention layers a skip-softmax group covers: ``targets`` / ``ignore`` patterns.

Validation of the pattern lists (:func:`pattern_list`, which vets ``re:``
patterns through :mod:`.regex_guard`) and matching (:func:`group_matches`);
the matching rules are in the package docstring.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Iterable

from .errors import SparseAttentionConfigError
from .regex_guard import regex_hazard

__all__ = ["group_matches", "pattern_list"]


def _dotted_parts(name: str) -> list[str]:
    parts = name.split(".")
    n = len(parts)
    return [".".join(parts[i:j]) for i in range(n) for j in range(i + 1, n + 1)]


def pattern_matches(pattern: str, layer_name: str, classes: tuple[str, ...], *, is_target: bool) -> bool:
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])  # re caches compiled patterns; the parser vetted this one
        return bool(rx.match(layer_name)) or any(rx.match(c) for c in classes)
    for cls in classes:
        if fnmatch.fnmatchcase(cls, pattern):
            return True
        if is_target and pattern == "Attention" and cls.endswith("Attention"):
            return True
    if layer_name:
        return any(fnmatch.fnmatchcase(part, pattern) for part in _dotted_parts(layer_name))
    return False


def group_matches(targets: tuple[str, ...], ignore: tuple[str, ...], layer_name: str,
                  class_name: str | Iterable[str] | None) -> bool:
    """Whether a layer is covered by ``targets`` and not by ``ignore`` (no targets: every layer)."""
    if class_name is None:
        classes: tuple[str, ...] = ()
    elif isinstance(class_name, str):
        classes = (class_name,)
    else:
        classes = tuple(class_name)
    if any(pattern_matches(p, layer_name, classes, is_target=False) for p in ignore):
        return False
    if not targets:
        return True
    return any(pattern_matches(p, layer_name, classes, is_target=True) for p in targets)


def pattern_list(value: Any, path: str, source: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise SparseAttentionConfigError(
            path, value, "a list of non-empty pattern strings", 'write e.g. ["LlamaAttention"] or ["model.layers.0.*"]', source=source
        )
    for v in value:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as exc:
                raise SparseAttentionConfigError(path, v, f"a valid regular expression after 're:' ({exc})", "fix the regex", source=source) from None
            hazard = regex_hazard(v[3:])
            if hazard:
                raise SparseAttentionConfigError(
                    path, v, f"a regular expression that matches in bounded time: {hazard}",
                    "write the pattern without nesting, e.g. 're:[a-z._0-9]*X' instead of 're:([a-z._0-9]+)*X', "
                    "list several patterns instead of one alternation, or use an fnmatch pattern such as "
                    "'model.layers.*.self_attn'", source=source,
                )
    return tuple(value)
