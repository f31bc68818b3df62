"""The start-up policy: what a checkpoint's ``sparse_attention_config`` means for a server.

One home for the decision that ``sparse-attn serve --validate-only`` previews and
the vLLM plugin applies in every worker (issue 18 item 5): which section is
ours, what is an error (a malformed skip-softmax group; under strict mode also
unserved groups, misspelt keys and ModelOpt metadata of the wrong shape), what
is a warning (groups not served, near-miss keys, curves that cannot skip at the
served length) and what is one line of information (no section, another
model's section). Callers only choose where the lines go and what the model is
called; the caller supplies the served length (``max_kv_len``): the worker's
``max_model_len`` in the plugin, ``compat.launch`` in ``sparse-attn serve``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import SparseAttentionConfigError
from .parse import read_section
from .schema import DISABLE_HINT, SECTION_KEY, SparseAttentionConfig

__all__ = ["Startup", "StartupRefused", "startup_notes"]
_STRICT_FIX = f"Fix: unset SPARSE_ATTN_STRICT to serve the skip_softmax group only, {DISABLE_HINT}"


class StartupRefused(ValueError):
    """The checkpoint's config must fail start-up; ``str()`` is the full message with its fix."""


@dataclass(frozen=True)
class Startup:
    """What to serve, and what to say about it once."""

    #: the skip-softmax config to install; None = native attention
    config: SparseAttentionConfig | None
    #: one-line facts (no section, another model's section), each naming the model
    info: tuple[str, ...] = ()
    #: warnings, each a full sentence with its key path
    warnings: tuple[str, ...] = ()


def startup_notes(section: Any, *, source: str, model: str, max_kv_len: int | None, strict: bool) -> Startup:
    """Decide start-up for ``section`` (the ``sparse_attention_config`` value, None when absent).

    ``source`` names where it came from in messages, ``model`` the model in the info lines; ``max_kv_len`` is the longest KV
    length served (None: unknown, no never-skip check); ``strict`` is
    ``SPARSE_ATTN_STRICT``. Raises :class:`StartupRefused` where start-up must fail.
    """
    try:
        reading = read_section(section, source=source)
    except SparseAttentionConfigError as exc:
        raise StartupRefused(f"{exc}; {DISABLE_HINT}") from None
    if reading.config is None and not reading.ours:
        if not reading.present:
            return Startup(None, info=(f"{model} has no {SECTION_KEY} in config.json; vLLM attention left native",))
        if reading.malformed:
            if strict:
                raise StartupRefused(f"SPARSE_ATTN_STRICT=1 and {source}: {reading.note}; {DISABLE_HINT}")
            return Startup(None, warnings=(reading.note or "",))
        return Startup(None, info=(f"{model}: {reading.note}",))
    if reading.unserved and strict:
        raise StartupRefused(
            f"SPARSE_ATTN_STRICT=1 and {source} has {len(reading.unserved)} group(s) this runtime does not serve: "
            + "; ".join(g.label for g in reading.unserved[:8])
            + f". {_STRICT_FIX}"
        )
    config = reading.config
    if config is None:  # ModelOpt metadata without a skip_softmax group
        return Startup(None, info=(f"{model}: {reading.note}",), warnings=tuple(g.message() for g in reading.unserved))
    if strict and config.suspect_keys:
        raise StartupRefused(f"SPARSE_ATTN_STRICT=1 and {source}: " + " ".join(config.suspect_keys)
                             + f". Fix: rename the key, or unset SPARSE_ATTN_STRICT to serve with the warning, {DISABLE_HINT}")
    return Startup(config, warnings=config.warnings + config.never_skip_warnings(max_kv_len))
