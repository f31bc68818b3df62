"""Public entry points: validation, backend choice, output allocation."""

from __future__ import annotations

from typing import Sequence

import torch

from . import torch_impl
from ._common import check_seq_threshold, check_thresholds, validate

_IMPLS = ("auto", "torch", "triton")
#: ``count_thresholds`` marker of ``paged_attention(return_counts=True)``: count under the serving lambda.
_SERVING = object()


def _backend(impl: str, query: torch.Tensor) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"paged_attention: impl: got {impl!r}, expected one of {_IMPLS}")
    if impl == "auto":
        return "triton" if query.device.type == "cuda" else "torch"
    if impl == "torch" and query.device.type != "cpu":
        raise ValueError(f"paged_attention: impl='torch' needs CPU tensors, got device {query.device}")
    return impl


def _run(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, causal, out, impl,
         threshold, count_thresholds):
    """``threshold``: serving lambda as given by the caller; ``count_thresholds``: ``None``,
    ``_SERVING`` (count under the serving lambda) or the caller's candidate lambdas."""
    meta = validate(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, out)
    backend = _backend(impl, query)
    num_seqs = len(meta.seq_lens)
    if count_thresholds is None or count_thresholds is _SERVING:
        lam = check_seq_threshold(threshold, num_seqs)
        if count_thresholds is _SERVING:
            count_thresholds = lam[None, :] if isinstance(lam, torch.Tensor) \
                else torch.full((1, num_seqs), lam, dtype=torch.float32)
        threshold = lam
    else:
        count_thresholds = check_thresholds(count_thresholds, num_seqs)
        threshold = 0.0
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if query.shape[0] == 0:
        hq = query.shape[1]
        n = count_thresholds.shape[0] if count_thresholds is not None else 0
        return out, torch.zeros(n, hq, dtype=torch.int64, device=query.device), \
            torch.zeros(hq, dtype=torch.int64, device=query.device)
    if backend == "torch":
        return torch_impl.forward(query, key_cache, value_cache, block_table, meta, scale=float(scale),
                                  causal=causal, threshold=threshold, count_thresholds=count_thresholds, out=out)
    from . import triton_impl  # imported lazily: triton is optional, and tests set TRITON_INTERPRET first

    return triton_impl.forward(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, meta,
                               scale=float(scale), causal=causal, threshold=threshold,
                               count_thresholds=count_thresholds, out=out)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    threshold: float | None = None,
    causal: bool = True,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    return_counts: bool = False,
    max_query_len: int | None = None,
    check: bool = True,
):
    """Varlen paged attention with skip-softmax (BLASST) tile skipping.

    Args:
        query: ``[T, Hq, D]``, the query tokens of all sequences concatenated.
        key_cache, value_cache: logical ``[num_blocks, page_size, Hkv, D]`` views with any
            strides (read in place through the block table, never made contiguous).
        block_table: ``[S, max_blocks]`` int32/int64, cache block ids per sequence.
        seq_lens: ``[S]`` KV length per sequence in tokens, including this step's tokens
            (already written to the cache).
        query_start_loc: ``[S + 1]`` cumulative query offsets; sequence ``s`` owns query
            rows ``query_start_loc[s]:query_start_loc[s+1]``, which are its LAST
            ``q_len`` KV positions (query row ``i`` is at position ``kv_len - q_len + i``).
        scale: softmax scale applied to ``q . k``.
        threshold: lambda, a runtime value: ``None`` or a float (the same lambda for every
            sequence) or a 1-D list/tensor of ``S`` floats (one lambda per sequence, e.g.
            ``scale / kv_len``).  Each lambda must be finite and >= 0; ``None`` or 0 means
            dense (for that sequence).  A KV tile is skipped when
            ``exp(tile_max - running_max) < lambda`` for every valid row of the query tile
            (exact rule in :mod:`sparse_attn.kernels._common`).  Lambdas are compared in
            fp32; new values never recompile the Triton kernel.
        causal: mask KV positions after each query's position.
        out: optional ``[T, Hq, D]`` output buffer of the query's dtype.
        impl: ``"auto"`` (Triton for CUDA tensors, torch otherwise), ``"torch"``, ``"triton"``.
        return_counts: also return per-head tile counts.
        max_query_len: host upper bound of the query lengths (sizes the launch grid without
            reading ``query_start_loc``); accepted now, used by the capture-safe launch.
        check: ``False`` lets the capture-safe launch skip the data-dependent checks.

    Returns:
        ``out`` ``[T, Hq, D]`` in the query dtype (fp32 accumulation), or with
        ``return_counts`` ``(out, skipped, visited)``, both int64 ``[Hq]`` tile counts.
    """
    out, skipped, visited = _run(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                                 causal, out, impl, threshold, _SERVING if return_counts else None)
    if return_counts:
        return out, skipped[0], visited
    return out


def paged_attention_counts(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    thresholds: Sequence[float] | torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    impl: str = "auto",
):
    """Calibration pass: dense attention plus skip counts for many candidate lambdas.

    Arguments as :func:`paged_attention`; ``thresholds`` is either a list or 1-D tensor of
    ``n`` candidate lambdas (the same for every sequence) or a 2-D ``[n, S]`` list/tensor
    (candidate ``j``'s lambda for sequence ``s``); each finite, >= 0.  Nothing is skipped.
    ``skipped[j, h]`` counts the visited KV tiles of query head ``h`` (over all query tiles
    and sequences) that are skippable under candidate ``j``; with the dense running max
    this is exactly the number of tiles ``paged_attention(..., threshold=thresholds[j])``
    skips.

    Returns:
        ``(out, skipped, visited)``: ``out`` ``[T, Hq, D]`` dense output in the query
        dtype, ``skipped`` int64 ``[n, Hq]``, ``visited`` int64 ``[Hq]`` (independent of
        lambda).
    """
    return _run(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, causal, out, impl,
                0.0, thresholds)
