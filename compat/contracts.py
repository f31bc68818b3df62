"""The vLLM call signatures compat relies on, stated as data in one place.

compat calls or wraps a few vLLM methods by position. Each entry names the
leading parameters it depends on, in order; anything after them is passed
through untouched (``*args, **kwargs``), so a release may add trailing
parameters freely. ``tests/matrix/test_contract.py`` asserts every entry
against each real release in the tox matrix (``inspect.signature`` of the live
class), and ``tests/matrix/tools/probe_release.py`` records the full signatures
(``contracts`` in ``tests/matrix/expected/vllm-<ver>.json``).

This module imports nothing from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Contract:
    """``owner``: ``"impl"`` (``backend.get_impl_cls()``) or ``"builder"``
    (``backend.get_builder_cls()``). ``leading``: the positional parameters
    compat passes or receives, in order, starting with ``self``. ``user``: the
    compat code that depends on it. ``optional``: a backend may lack the method
    (then compat must not need it for that backend)."""

    owner: str
    method: str
    leading: tuple[str, ...]
    user: str
    optional: bool = False


#: vLLM's worker stores the step's new tokens through this before ``forward``
#: (from 0.23, where ``forward_includes_kv_cache_update`` is False); compat's
#: views must be exactly the tensors it hands its native op (tests/matrix).
DO_KV_CACHE_UPDATE = Contract(
    "impl", "do_kv_cache_update", ("self", "layer", "key", "value", "kv_cache", "slot_mapping"),
    "compat.cache_writer / the adapter's forward-owns-the-write path", optional=True,
)

#: ``compat.runtime.capture_batches`` wraps the builder's ``build`` and reads its
#: first two arguments by position to keep the backend-independent metadata.
BUILDER_BUILD = Contract(
    "builder", "build", ("self", "common_prefix_len", "common_attn_metadata"), "compat.runtime.capture_batches",
)

CONTRACTS: tuple[Contract, ...] = (DO_KV_CACHE_UPDATE, BUILDER_BUILD)
