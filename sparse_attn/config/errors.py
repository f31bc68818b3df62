"""The one error of the config package: a malformed ``sparse_attention_config``, with its key path."""

from __future__ import annotations

from typing import Any

__all__ = ["MISSING", "SparseAttentionConfigError", "short_repr"]


class SparseAttentionConfigError(ValueError):
    """The ``sparse_attention_config`` section is malformed.

    The message names the key path, the bad value, what was expected and how
    to fix it. ``path`` holds the key path on its own.
    """

    def __init__(self, path: str, value: Any, expected: str, fix: str, *, source: str | None = None):
        self.path = path
        self.value = value
        self.expected = expected
        self.fix = fix
        self.source = source
        where = f" in {source}" if source else ""
        shown = short_repr(value)
        super().__init__(f"{path}{where}: got {shown}; expected {expected}. Fix: {fix}")



def short_repr(value: Any, limit: int = 120) -> str:
    if value is MISSING:
        return "nothing (key is missing)"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Missing:
    def __repr__(self) -> str:  # pragma: no cover - only shown in messages
        return "<missing>"


MISSING = _Missing()
