"""The one exception hierarchy of ``compat``.

Every error answers four questions, as fields: what was ``observed``, what was
``expected``, which vLLM release is installed (``vllm_version``) and the exact
``fix`` (a flag that exists, a pin, an environment variable). The message is
built from them in ``__str__`` (as ``sparse_attn.config.SparseAttentionConfigError``
does), so callers and tests read the fields instead of parsing text.
Subclasses are also the builtin exception a caller would naturally catch
(``ValueError`` for bad input), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

import sys
from typing import Any

#: ``vllm_version`` when the raiser did not say: read from an already imported
#: ``vllm`` (never imported here: building an error must stay cheap).
_FROM_IMPORTED = object()


def imported_vllm_version() -> str | None:
    """``vllm.__version__`` if this process already imported vLLM, else ``None``."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    return str(version) if version else None


class CompatError(Exception):
    """Base class of every error raised by ``compat``.

    ``what``: the subject in a few words (``"KV-cache layout of FLASHINFER"``);
    ``observed`` / ``expected``: what was seen and what compat needs; ``fix``:
    the exact remedy. A bare message (``CompatError("text")``) is still accepted
    for callers that have not been converted; then ``what`` holds it.
    """

    def __init__(self, what: str, *, observed: Any = None, expected: Any = None, fix: str | None = None,
                 vllm_version: Any = _FROM_IMPORTED):
        self.what = what
        self.observed = observed
        self.expected = expected
        self.fix = fix
        #: True when the raiser said which release is installed (``None`` = none installed)
        self.version_known = vllm_version is not _FROM_IMPORTED
        self.vllm_version = vllm_version if self.version_known else imported_vllm_version()
        super().__init__(what)

    @property
    def structured(self) -> bool:
        """True when the error carries its fields (not only a hand-written message)."""
        return self.observed is not None or self.expected is not None or self.fix is not None

    def __str__(self) -> str:
        if not self.structured:
            return self.what
        parts = [self.what]
        if self.observed is not None:
            parts.append(f"observed {self.observed}")
        if self.expected is not None:
            parts.append(f"expected {self.expected}")
        known = self.vllm_version or self.version_known
        version = describe_version(self.vllm_version) if known else "vLLM not imported in this process"
        if version not in self.what:  # a context string may already name it
            parts.append(version)
        text = "; ".join(parts) + "."
        if self.fix:
            text += f" Fix: {self.fix}"
        return text


class UnsupportedLayoutError(CompatError, ValueError):
    """A KV-cache tensor does not match the layout selected for its backend,
    or the backend's layout is not one ``compat`` knows how to view."""


class InvalidOverrideError(CompatError, ValueError):
    """An environment override (see ``compat.envs``) has a value outside its choices."""


class UnknownBackendError(CompatError, ValueError):
    """A backend name that ``compat`` does not serve (not FLASHINFER, FLASH_ATTN, CPU_ATTN)."""


class KVWriteError(CompatError, ValueError):
    """New K/V tokens cannot be stored: shape, dtype or slot out of range."""


class HookError(CompatError, RuntimeError):
    """A worker hook or RPC cannot be installed (class moved, name taken)."""


class ImplReplacementError(CompatError, TypeError):
    """An attention impl cannot be replaced by a sparse subclass (e.g. slots the copy cannot reach)."""


class OpsNotFoundError(CompatError, ImportError):
    """No module of the installed vLLM holds the native ops asked for (``compat.cpu_ops()``)."""


def describe_version(version: str | None) -> str:
    """Human text for the installed vLLM release, for error messages."""
    return f"vLLM {version}" if version else "no vLLM installed"
