"""Public entry points: validation, backend choice, output allocation."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from . import cpu_impl, torch_impl
from ._common import BatchMeta, check_seq_threshold, check_split, check_thresholds, validate

logger = logging.getLogger("sparse_attn")

_IMPLS = ("auto", "torch", "compiled", "triton")
#: ``count_thresholds`` marker of ``paged_attention(return_counts=True)``: count under the serving lambda.
_SERVING = object()
_warned: set[str] = set()


def cpu_kernel(query: torch.Tensor | None = None, key_cache: torch.Tensor | None = None) -> str:
    """The one rule that picks the kernel for CPU tensors (``impl="auto"``): ``"compiled"`` or ``"torch"``.

    ``SPARSE_ATTN_CPU_KERNEL=torch`` -> torch; ``=compiled`` -> compiled (raises
    ``CpuKernelUnavailable`` when it cannot be built here); ``=auto`` (default) -> compiled when
    it builds or loads here (:func:`cpu_impl.status`, once per process) and takes the shapes
    (:func:`cpu_impl.supports`: head size a multiple of 8, fp32/bf16/fp16), else torch, with one
    warning line per process when the build is what failed.  Without tensors, the answer for
    shapes the compiled kernel takes.
    """
    from compat import envs

    choice = envs.get("SPARSE_ATTN_CPU_KERNEL")
    if choice == "torch":
        return "torch"
    shapes_ok = query is None or cpu_impl.supports(query, key_cache)
    if choice == "compiled":
        _require_compiled(query, key_cache)
        return "compiled"
    st = cpu_impl.status()
    if not st.available:
        if "unavailable" not in _warned:
            _warned.add("unavailable")
            logger.warning("sparse-attn: compiled CPU kernel unavailable (%s); the torch kernel serves. Fix: install a "
                           "C++ compiler (g++ or clang++) or point CXX at one; SPARSE_ATTN_CPU_KERNEL=torch silences "
                           "this", st.reason)
        return "torch"
    return "compiled" if shapes_ok else "torch"


def describe_cpu_kernel() -> str:
    """Which kernel serves CPU tensors in this process and why, for the plugin's install line
    (builds or loads the compiled kernel, once; raises like :func:`cpu_kernel` when
    ``SPARSE_ATTN_CPU_KERNEL=compiled`` cannot be honoured)."""
    from compat import envs

    choice = envs.get("SPARSE_ATTN_CPU_KERNEL")
    if cpu_kernel() == "torch":
        return "torch (SPARSE_ATTN_CPU_KERNEL=torch)" if choice == "torch" else cpu_impl.status().describe()
    return cpu_impl.status().describe() + (" (SPARSE_ATTN_CPU_KERNEL=compiled)" if choice == "compiled" else "")


def _require_compiled(query, key_cache) -> None:
    st = cpu_impl.status()
    if not st.available:
        raise cpu_impl.cpu_build.CpuKernelUnavailable(
            f"paged_attention: the compiled CPU kernel was asked for (impl='compiled' or SPARSE_ATTN_CPU_KERNEL="
            f"compiled) but is unavailable: {st.reason}. Fix: install a C++ compiler or set CXX, or use "
            f"SPARSE_ATTN_CPU_KERNEL=auto / torch")
    if query is not None and not cpu_impl.supports(query, key_cache):
        raise ValueError(f"paged_attention: the compiled CPU kernel takes CPU fp32/bf16/fp16 tensors with a head size "
                         f"that is a multiple of 8, got {query.dtype} on {query.device}, head size {query.shape[-1]}; "
                         f"use impl='torch' (or SPARSE_ATTN_CPU_KERNEL=auto)")


def _backend(impl: str, query: torch.Tensor, key_cache: torch.Tensor) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"paged_attention: impl: got {impl!r}, expected one of {_IMPLS}")
    if impl == "auto":
        return "triton" if query.device.type == "cuda" else cpu_kernel(query, key_cache)
    if impl in ("torch", "compiled") and query.device.type != "cpu":
        raise ValueError(f"paged_attention: impl={impl!r} needs CPU tensors, got device {query.device}")
    if impl == "compiled":
        _require_compiled(query, key_cache)
    return impl


#: The CPU implementations; both take the same arguments and return the same outputs.
_CPU_FORWARD = {"torch": torch_impl.forward, "compiled": cpu_impl.forward}


def _unchecked_lambda(threshold, num_seqs: int, device) -> float | torch.Tensor:
    """Serving lambda without reading device data: a float, or a float32 ``[S]`` tensor on
    ``device`` (a 0-d tensor is expanded).  Values are the caller's responsibility."""
    if isinstance(threshold, torch.Tensor):
        if threshold.dim() == 0:
            threshold = threshold.expand(num_seqs)
        if tuple(threshold.shape) != (num_seqs,):
            raise ValueError(f"paged_attention: threshold shape: got {tuple(threshold.shape)}, expected "
                             f"[num_seqs] = [{num_seqs}] (check=False takes a float or a float32 [S] tensor)")
        return threshold.to(device, torch.float32)
    return check_seq_threshold(threshold, num_seqs)


def _host_meta(query, key_cache, seq_lens, query_start_loc) -> BatchMeta:
    """The batch on the host without validation (CPU tensors only: reading them is no sync)."""
    qsl = query_start_loc.tolist()
    return BatchMeta(seq_lens.tolist(), qsl[:-1], [b - a for a, b in zip(qsl[:-1], qsl[1:])],
                     query.shape[1], key_cache.shape[2], query.shape[2], key_cache.shape[1])


def _run(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, causal, out, impl,
         threshold, count_thresholds, split_k=None, check=True, max_query_len=None):
    """``threshold``: serving lambda as given by the caller; ``count_thresholds``: ``None``,
    ``_SERVING`` (count under the serving lambda) or the caller's candidate lambdas.
    ``check=False``: no validation and no host read of device data (capture-safe)."""
    split_k = check_split(split_k)
    backend = _backend(impl, query, key_cache)
    if not check:
        num_seqs = seq_lens.shape[0]
        lam = _unchecked_lambda(threshold, num_seqs, query.device)
        if count_thresholds is _SERVING:
            count_thresholds = lam[None, :] if isinstance(lam, torch.Tensor) \
                else torch.full((1, num_seqs), lam, dtype=torch.float32, device=query.device)
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if query.shape[0] == 0:
            n = count_thresholds.shape[0] if count_thresholds is not None else 0
            return out, torch.zeros(n, query.shape[1], dtype=torch.int64, device=query.device), \
                torch.zeros(query.shape[1], dtype=torch.int64, device=query.device)
        if backend in _CPU_FORWARD:
            meta = _host_meta(query, key_cache, seq_lens, query_start_loc)
            return _CPU_FORWARD[backend](query, key_cache, value_cache, block_table, meta, scale=float(scale),
                                         causal=causal, threshold=lam, count_thresholds=count_thresholds, out=out,
                                         split_k=split_k)
        from . import triton_impl

        return triton_impl.forward(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, None,
                                   scale=float(scale), causal=causal, threshold=lam,
                                   count_thresholds=count_thresholds, out=out, split_k=split_k,
                                   max_query_len=max_query_len)
    meta = validate(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, out)
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
    if backend in _CPU_FORWARD:
        return _CPU_FORWARD[backend](query, key_cache, value_cache, block_table, meta, scale=float(scale),
                                     causal=causal, threshold=threshold, count_thresholds=count_thresholds, out=out,
                                     split_k=split_k)
    from . import triton_impl  # imported lazily: triton is optional, and tests set TRITON_INTERPRET first

    return triton_impl.forward(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, meta,
                               scale=float(scale), causal=causal, threshold=threshold,
                               count_thresholds=count_thresholds, out=out, split_k=split_k)


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
    split_k: int | None = None,
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
        impl: ``"auto"`` (Triton for CUDA tensors; for CPU tensors the kernel :func:`cpu_kernel`
            picks), ``"torch"``, ``"compiled"`` (the C++ CPU kernel), ``"triton"``.
        return_counts: also return per-head tile counts.
        split_k: KV positions per split of the skip rule (``None`` = ``SPLIT_K``; a
            multiple of ``TILE_K``).  The dense running max restarts from KV tile 0's
            maxima at every split after the first, so counts depend on it: calibrate
            with the value you serve with.
        max_query_len: host int, an upper bound on every sequence's query length; only
            read with ``check=False`` (default: the number of query tokens).  1 selects
            the split-KV decode launch.
        check: ``True`` validates every argument (one device->host copy of
            ``seq_lens`` / ``query_start_loc`` and a block-table reduction).  ``False`` is
            the capture-safe path for CUDA graphs: no validation and no host read of
            device data; ``threshold`` must be a float or a float32 ``[S]`` tensor (finite,
            >= 0: not checked), the grid is sized from shapes and host ints (KV bound
            ``block_table.shape[1] * page_size``, query bound ``max_query_len``), the
            arguments must satisfy everything ``check=True`` verifies, and the counts
            stay device tensors.

    Returns:
        ``out`` ``[T, Hq, D]`` in the query dtype (fp32 accumulation), or with
        ``return_counts`` ``(out, skipped, visited)``, both int64 ``[Hq]`` tile counts.
    """
    out, skipped, visited = _run(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                                 causal, out, impl, threshold, _SERVING if return_counts else None,
                                 split_k=split_k, check=check, max_query_len=max_query_len)
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
    split_k: int | None = None,
):
    """Calibration pass: dense attention plus skip counts for many candidate lambdas.

    Arguments as :func:`paged_attention` (``split_k`` must be the value served with);
    ``thresholds`` is either a list or 1-D tensor of
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
                0.0, thresholds, split_k=split_k)
