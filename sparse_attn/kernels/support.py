"""What the skip-softmax kernels serve: the one answer to "can these kernels run this layer".

``features`` is any object with the attributes of ``compat.model.LayerFeatures`` (read by
name, so this package never imports compat): ``sliding_window``, ``logits_soft_cap``,
``has_sinks``, ``kv_cache_dtype``, ``alibi``, ``kv_sharing``, ``attn_type``, ``mla``.
The plugin asks this once per layer and joins it with compat's own refusals; a feature
the kernels learn is switched on here and nowhere else.
"""

from __future__ import annotations

from typing import Any

#: KV-cache dtypes stored unquantised (the query's dtype or a plain float type).
UNQUANTISED_KV_DTYPES = frozenset({"auto", "bfloat16", "float16", "float32", "half", "float"})


def unsupported(features: Any) -> tuple[str, ...]:
    """The features of a layer that the kernels do not serve, one phrase each; empty = servable."""
    reasons = []
    if features.sliding_window is not None:
        reasons.append(f"sliding window {features.sliding_window}")
    if features.logits_soft_cap is not None:
        reasons.append(f"logits soft-cap {features.logits_soft_cap}")
    if features.has_sinks:
        reasons.append("attention sinks")
    if features.kv_cache_dtype not in UNQUANTISED_KV_DTYPES:
        reasons.append(f"quantised KV cache ({features.kv_cache_dtype})")
    if features.alibi:
        reasons.append("ALiBi")
    if features.kv_sharing:
        reasons.append("KV sharing")
    if features.attn_type != "decoder":
        reasons.append(f"attention type {features.attn_type}")
    if features.mla:
        reasons.append("MLA")
    return tuple(reasons)
