"""The one exception hierarchy of ``compat``.

Every message answers four questions: what was observed, what was expected,
which vLLM release is installed, and the exact fix (a pin or an environment
variable). Subclasses are also the builtin exception a caller would naturally
catch (``ValueError`` for bad input), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class CompatError(Exception):
    """Base class of every error raised by ``compat``."""


class UnsupportedLayoutError(CompatError, ValueError):
    """A KV-cache tensor does not match the layout selected for its backend,
    or the backend's layout is not one ``compat`` knows how to view."""


class InvalidOverrideError(CompatError, ValueError):
    """An environment override (see ``compat.envs``) has a value outside its choices."""


class UnknownBackendError(CompatError, ValueError):
    """A backend name that ``compat`` does not serve (not FLASHINFER, FLASH_ATTN, CPU_ATTN)."""


class KVWriteError(CompatError, ValueError):
    """New K/V tokens cannot be stored: shape, dtype or slot out of range."""


class BatchDescriptionError(CompatError, ValueError):
    """vLLM's attention metadata lacks a field the sparse path needs."""


def describe_version(version: str | None) -> str:
    """Human text for the installed vLLM release, for error messages."""
    return f"vLLM {version}" if version else "no vLLM installed"
