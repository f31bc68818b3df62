"""The one error of the config package: a malformed ``sparse_attention_config``, with its key path."""

from __future__ import annotations

from typing import Any

__all__ = ["MISSING", "SparseAttentionConfigError", "short_repr", "short_text"]


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
        where = f" in {short_text(source, 300)}" if source else ""
        shown = short_repr(value)
        super().__init__(f"{short_text(path, 300)}{where}: got {shown}; expected {expected}. Fix: {fix}")

    @classmethod
    def unreadable(cls, path: str, file: str, what: str, fix: str) -> "SparseAttentionConfigError":
        """A file that cannot be read as JSON at all: ``"<file>: <what>. Fix: <fix>"``."""
        error = cls(path, file, what, fix)
        error.args = (f"{short_text(file, 300)}: {what}. Fix: {fix}",)
        return error



def short_repr(value: Any, limit: int = 120) -> str:
    if value is MISSING:
        return "nothing (key is missing)"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_text(text: Any, limit: int = 120) -> str:
    """``str(text)`` cut to ``limit`` characters, naming the full length when cut."""
    text = str(text)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


class _Missing:
    def __repr__(self) -> str:  # pragma: no cover - only shown in messages
        return "<missing>"


MISSING = _Missing()
