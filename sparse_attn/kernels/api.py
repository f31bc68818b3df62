"""Public entry points: validation, backend choice, output allocation.

Backend contract (every implementation module, torch, Triton and the C++ CPU kernel,
has this one function)::

    forward(batch: PagedBatch, spec: LayerSpec, meta: BatchMeta | None, *,
            threshold: Tensor,               # float32 [S] on the query's device, 0 = dense
            count_thresholds: Tensor | None, # float32 [n, S] candidates, or None
            out: Tensor,                     # [T, Hq, D], the query's dtype, filled in place
            split_k: int,                    # KV positions per split of the rule
            ) -> (out, skipped int64 [n, Hq] | None, visited int64 [Hq] | None)

``meta`` is the host copy of the batch (``None`` only on the Triton capture path); the
counts are ``None`` when ``count_thresholds`` is. A backend with ``COUNTS_IN_KERNEL`` (Triton, the compiled
CPU kernel) also takes ``counters`` (the stats' int64 counter, :data:`COUNTER_SLOTS`) and adds a serving
launch's counts into it itself (tiles skipped and visited, V tiles tested and left unread, one launch), with
no host read.  Arguments arrive validated (or ``check=False``: the caller vouches for them); ``T > 0``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import cpu_impl, torch_impl
from .batch import COUNTER_SLOTS, BatchMeta, LayerSpec, PagedBatch
from .checks import CHECKS, check_split, effective_lambda, fail, lambdas, validate
from .rule import LambdaRule

_IMPLS = ("auto", "torch", "compiled", "triton")


def _backend(impl: str, batch: PagedBatch):
    if impl not in _IMPLS:
        fail("impl (the implementation)", repr(impl), f"one of {_IMPLS}")
    device = batch.query.device if isinstance(batch, PagedBatch) and isinstance(batch.query, torch.Tensor) else None
    if impl == "auto":  # CPU tensors: the one rule of cpu_impl.cpu_kernel (env, availability, shapes)
        impl = "triton" if device is not None and device.type == "cuda" else cpu_impl.cpu_kernel(batch)
    if impl in ("torch", "compiled"):
        if device is not None and device.type != "cpu":
            fail(f"impl={impl!r} needs CPU tensors", f"device {device}", "impl='triton' (or 'auto') on a GPU")
        if impl == "compiled":
            cpu_impl.require(batch)
            return cpu_impl
        return torch_impl
    from . import triton_impl  # lazily: triton is optional, and tests set TRITON_INTERPRET first

    return triton_impl


def _run(batch: PagedBatch, spec: LayerSpec, threshold, candidates, count: bool, out, impl, split_k, check,
         counters=None):
    """Serving (``candidates is None``: ``threshold`` applied, counted under it when
    ``count``, or added into ``counters``) or counting mode (the caller's candidate lambdas,
    nothing skipped)."""
    split_k = check_split(split_k)
    backend = _backend(impl, batch)
    if counters is not None and (count or candidates is not None):
        fail("counters", "together with return_counts or candidates", "one way of counting per call")
    if isinstance(threshold, LambdaRule):
        if check:
            effective_lambda(threshold.scale_factor, 1, threshold.window)       # the rule's own argument checks
            lambdas(threshold.scale_factor, 1)                                  # finite, >= 0
        if getattr(backend, "COMPUTES_LAMBDAS", False):
            return _accumulated(batch, spec, threshold, counters, out, backend, split_k, check)
        meta = validate(batch, spec, out, check) if check else batch.host
        # CPU tensors: the rule's host form from the host lengths (no torch op but the tensor)
        if meta is not None and meta.seq_lens_exact:
            threshold = torch.tensor(threshold.host_lambdas(meta.seq_lens), dtype=torch.float32)
        else:
            threshold = threshold.lambdas(batch.seq_lens)
        check = False
    if counters is not None:
        return _accumulated(batch, spec, threshold, counters, out, backend, split_k, check)
    if check not in CHECKS:
        fail("check", repr(check), "True, False or 'full'")
    if check:
        meta = validate(batch, spec, out, check)
    else:
        meta = batch.host
        if meta is None and backend is torch_impl:   # host tensors: reading them is no sync (cpu_impl reads them itself)
            meta = BatchMeta.from_host(batch.seq_lens, batch.query_start_loc)
    reads_device = check == "full" or (bool(check) and batch.host is None)
    num_seqs, dev = batch.num_seqs, batch.query.device
    if candidates is None:
        lam = lambdas(threshold, num_seqs, reads_device=reads_device, device=dev)
        count_thresholds = lam[None, :] if count else None
    else:
        count_thresholds = lambdas(candidates, num_seqs, candidates=True, reads_device=reads_device, device=dev)
        lam = torch.zeros(num_seqs, dtype=torch.float32, device=dev)
    if out is None:
        out = torch.empty_like(batch.query, memory_format=torch.contiguous_format)
    if batch.query.shape[0] == 0:
        n = count_thresholds.shape[0] if count_thresholds is not None else 0
        hq = batch.num_q_heads
        return out, torch.zeros(n, hq, dtype=torch.int64, device=dev), torch.zeros(hq, dtype=torch.int64, device=dev)
    return backend.forward(batch, spec, meta, threshold=lam, count_thresholds=count_thresholds, out=out,
                           split_k=split_k)


def _accumulated(batch, spec, threshold, counters, out, backend, split_k, check):
    """A serving launch whose counts go into ``counters`` (int64, :data:`COUNTER_SLOTS`), or
    nowhere when it is ``None``.  Triton (atomics) and the compiled CPU kernel add them themselves (no
    torch op); the torch kernel returns them and they are added here on the host (CPU tensors: no sync)."""
    if counters is not None and (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int64
                                 or counters.dim() != 1 or counters.shape[0] <= max(COUNTER_SLOTS.values())
                                 or counters.device != batch.query.device):
        seen = (tuple(counters.shape), counters.dtype, counters.device) if isinstance(counters, torch.Tensor) \
            else type(counters).__name__
        fail("counters", seen, f"an int64 [>{max(COUNTER_SLOTS.values())}] tensor on {batch.query.device}")
    meta = validate(batch, spec, out, check) if check else batch.host
    if out is None:
        out = torch.empty_like(batch.query, memory_format=torch.contiguous_format)
    if batch.query.shape[0] == 0:
        return out, None, None
    if isinstance(threshold, LambdaRule):
        lam = threshold
    elif not check and isinstance(threshold, torch.Tensor) and threshold.dtype == torch.float32 \
            and threshold.shape == (batch.num_seqs,):
        lam = threshold                     # the caller vouches for it (check=False): no per-launch scan
    else:
        lam = lambdas(threshold, batch.num_seqs, reads_device=bool(check) and batch.host is None or
                      batch.query.device.type == "cpu", device=batch.query.device)
    if getattr(backend, "COUNTS_IN_KERNEL", False):
        return backend.forward(batch, spec, meta, threshold=lam, count_thresholds=None, out=out, split_k=split_k,
                               counters=counters)
    if meta is None:
        meta = BatchMeta.from_host(batch.seq_lens, batch.query_start_loc)
    counting = counters is not None
    out, skipped, visited = backend.forward(batch, spec, meta, threshold=lam, count_thresholds=lam[None, :] if counting
                                            else None, out=out, split_k=split_k)
    if counting:
        # the rule of COUNTER_SLOTS, on host ints: tiles of sequences with lambda > 0, one launch
        sparse = any(l > 0 and q > 0 for l, q in zip(lam.tolist(), meta.q_lens))
        row = [0] * counters.shape[0]
        if sparse:                          # host tensors: read without an op per sum
            row[COUNTER_SLOTS["skipped"]], row[COUNTER_SLOTS["visited"]] = sum(skipped.view(-1).tolist()), \
                sum(visited.tolist())
        row[COUNTER_SLOTS["launches" if sparse else "dense_launches"]] = 1
        counters.add_(torch.tensor(row, dtype=torch.int64))
    return out, None, None


def paged_attention(
    batch: PagedBatch,
    spec: LayerSpec,
    *,
    threshold: float | Sequence[float] | torch.Tensor | LambdaRule | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    return_counts: bool = False,
    split_k: int | None = None,
    check: bool | str = True,
    counters: torch.Tensor | None = None,
):
    """Varlen paged attention with skip-softmax (BLASST) tile skipping.

    Args:
        batch: the queries and the paged KV cache (:class:`PagedBatch`: shapes there).
        spec: the layer (:class:`LayerSpec`: softmax scale, causal mask, sliding window,
            logit soft-cap, learned sinks, fp8 cache scales); build it once per layer
            (:func:`spec_for` maps a serving engine's layer features to it).
        threshold: lambda, a runtime value: ``None`` or a float (the same lambda for every
            sequence) or ``S`` floats (a list or a 1-D tensor: one lambda per sequence,
            e.g. :func:`effective_lambda`), or a :class:`LambdaRule` (the kernel computes each
            sequence's lambda from its KV length).  Each lambda must be finite and >= 0; ``None``
            or 0 means dense (for that sequence).  A KV tile is skipped when
            ``exp(tile_max - running_max) < lambda`` for every valid row of the query tile
            (exact rule in :mod:`sparse_attn.kernels._common`).  Lambdas are compared in
            fp32; new values never recompile the Triton kernel.
        out: optional ``[T, Hq, D]`` output buffer of the query's dtype.
        impl: ``"auto"`` (Triton for CUDA tensors; for CPU tensors the kernel
            :func:`cpu_impl.cpu_kernel` picks), ``"torch"``, ``"compiled"`` (the C++ CPU
            kernel), ``"triton"``.
        return_counts: also return per-head tile counts.
        split_k: KV positions per split of the skip rule (``None`` = ``SPLIT_K``; a
            multiple of ``TILE_K``).  The dense running max restarts from KV tile 0's
            maxima at every split after the first, so counts depend on it: calibrate
            with the value you serve with.
        check: ``True`` validates every argument; with ``batch.host`` that reads no device
            data, without it ``seq_lens`` / ``query_start_loc`` are copied to the host once
            and every used block id is checked (a device reduction).  ``"full"`` adds the
            block-id check (and reads a device ``threshold``) even with ``batch.host``;
            CPU tensors always get it (nothing to wait for), and the compiled CPU kernel
            refuses an out-of-range id itself even with ``check=False``.
            ``False`` is the capture-safe path for CUDA graphs: nothing is validated and no
            device data is read on the host; ``threshold`` must be a float or a float32
            ``[S]`` device tensor (finite, >= 0: not checked), the grid is sized from
            shapes and host ints (``batch.host`` if given, else ``batch.max_query_len``
            and the block table's width), and the counts stay device tensors.

        counters: an int64 ``[len(PHASE_COUNTERS)]`` tensor on the query's device (the serving
            stats' persistent counter) that the launch adds its counts into, in place and
            without a host read on a GPU (:data:`COUNTER_SLOTS`: tiles skipped and visited by
            sequences with lambda > 0, and one sparse or dense launch); not with
            ``return_counts``.

    Returns:
        ``out`` ``[T, Hq, D]`` in the query dtype (fp32 accumulation), or with
        ``return_counts`` ``(out, skipped, visited)``, both int64 ``[Hq]`` tile counts
        (``visited``: the tiles of sequences whose lambda is > 0, ``_common`` "Counts").
    """
    out, skipped, visited = _run(batch, spec, threshold, None, return_counts, out, impl, split_k, check, counters)
    if return_counts:
        return out, skipped[0], visited
    return out


def paged_attention_counts(
    batch: PagedBatch,
    spec: LayerSpec,
    thresholds: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    split_k: int | None = None,
    check: bool | str = True,
):
    """Calibration pass: dense attention plus skip counts for many candidate lambdas.

    Arguments as :func:`paged_attention` (``split_k`` must be the value served with);
    ``thresholds`` is either ``n`` candidate lambdas (a list or 1-D tensor, the same for
    every sequence) or ``[n, S]`` (candidate ``j``'s lambda for sequence ``s``); each
    finite, >= 0.  Nothing is skipped.  ``skipped[j, h]`` counts the visited KV tiles of
    query head ``h`` (over all query tiles and sequences) that are skippable under
    candidate ``j``; with the dense running max this is exactly the number of tiles
    ``paged_attention(..., threshold=thresholds[j])`` skips.

    Returns:
        ``(out, skipped, visited)``: ``out`` ``[T, Hq, D]`` dense output in the query
        dtype, ``skipped`` int64 ``[n, Hq]``, ``visited`` int64 ``[Hq]`` (the tiles of the
        sequences with some candidate > 0, whatever the values: ``_common`` "Counts").
    """
    return _run(batch, spec, None, thresholds, True, out, impl, split_k, check)


def layer_launch(spec: LayerSpec, batch: PagedBatch, *, impl: str = "auto", split_k: int | None = None):
    """A launcher prepared once for ``spec``'s serving launches on ``batch``'s cache views, where the backend that
    serves ``batch`` has one (the compiled CPU kernel: :class:`cpu_impl.LayerLaunch`, FlashInfer's plan / run
    split), else ``None`` (launch with :func:`paged_attention`).  Its ``run(step, query, out, counters)`` takes
    the step's :class:`cpu_impl.StepArgs` (:func:`step_args`), validates nothing and adds the counts into
    ``counters``; the library itself refuses a block id outside the cache."""
    if _backend(impl, batch) is not cpu_impl:
        return None
    return cpu_impl.LayerLaunch(spec, batch.key_cache, batch.value_cache, batch.num_q_heads, batch.query.dtype,
                                check_split(split_k))


def step_args(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
              lam: torch.Tensor) -> cpu_impl.StepArgs:
    """The batch part of a step's :func:`layer_launch` launches, built once per step for every layer: CPU
    block table, KV lengths and query offsets, and the float32 ``[S]`` lambdas (0 = dense)."""
    return cpu_impl.StepArgs(block_table, seq_lens, query_start_loc, lam)

