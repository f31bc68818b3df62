"""Argument checks of a kernel call: the batch, the layer, the lambdas, the split length.

Everything is checked before any work starts and raises ``ValueError`` naming what was
seen and what was expected.  GPU data is read on the host only where the caller allows
it (``reads_device``): a checked call without a host copy of the batch, or
``check="full"``; CPU tensors are read whenever the call is checked (no stream to wait for).
"""

from __future__ import annotations

import math

import torch

from ._common import SPLIT_K, TILE_K
from .batch import BatchMeta, LayerSpec, PagedBatch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: fp8 caches as vLLM stores them (a uint8 cache viewed as one of these).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_INDEX_DTYPES = (torch.int32, torch.int64)
CHECKS = (True, False, "full")


def fail(what: str, seen, expected) -> None:
    raise ValueError(f"paged_attention: {what}: got {seen}, expected {expected}")


def check_split(split_k) -> int:
    """``split_k`` (``None`` -> :data:`SPLIT_K`) as an int after checking it is a positive
    multiple of ``TILE_K``."""
    if split_k is None:
        return SPLIT_K
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < TILE_K or split_k % TILE_K:
        fail("split_k (KV positions per split of the skip rule)", repr(split_k),
             f"a positive multiple of TILE_K={TILE_K} (default SPLIT_K={SPLIT_K})")
    return split_k


def effective_lambda(scale_factor, kv_len, window=None):
    """The serving threshold of one sequence: ``lambda = scale_factor / kv_len`` (the
    TensorRT-LLM / ModelOpt rule), or ``scale_factor / min(kv_len, window)`` for a layer
    served by a sliding-window curve (``window`` tokens: the most keys a row sees), and the
    one home of "this sequence runs dense".

    A sequence runs dense (lambda 0, which skips nothing) when ``scale_factor`` is
    ``None`` or ``kv_len <= 0``, or when lambda is not finite, ``<= 0`` or ``>= 1``:
    ``lambda >= 1`` would skip every tile whose maximum is below the running maximum,
    which no calibrated config asks for.

    Host form: ``kv_len`` an int (tokens) -> a Python float.  Device form: ``kv_len`` a
    tensor of KV lengths (any shape, dtype and device) -> float32 tensor of that shape,
    computed in float64 like the host form; no host read (capture-safe: ``window`` is a
    host int, applied with ``clamp``).
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"effective_lambda: window must be a positive number of tokens or None, got {window!r}")
    if isinstance(kv_len, torch.Tensor):
        if scale_factor is None:
            return torch.zeros(kv_len.shape, dtype=torch.float32, device=kv_len.device)
        norm = kv_len.to(torch.float64)
        if window is not None:
            norm = norm.clamp(max=float(window))
        lam = float(scale_factor) / norm
        dense = ~((lam > 0) & (lam < 1))          # also nan, inf (kv_len 0) and negative lengths
        return torch.where(dense, torch.zeros_like(lam), lam).to(torch.float32)
    if scale_factor is None or kv_len <= 0:
        return 0.0
    lam = float(scale_factor) / (min(kv_len, window) if window is not None else kv_len)
    return lam if 0 < lam < 1 else 0.0


def never_skips(scale_factor, longest_normaliser) -> bool:
    """Whether a phase served with ``scale_factor`` runs dense at every length: its
    :func:`effective_lambda` is 0 at ``longest_normaliser`` (tokens: the longest KV length
    served, or a window curve's ``w``, the most ``min(kv_len, w)`` can be).  Lambda falls
    as the normaliser grows, so "dense there" is "dense everywhere"; the rule itself
    (``lambda >= 1`` runs dense) lives in :func:`effective_lambda` alone."""
    return effective_lambda(scale_factor, longest_normaliser) == 0.0


def _lambda_values(value, name: str, reads_device: bool) -> torch.Tensor:
    """``value`` (a number, nested lists of numbers, or a tensor) as a float32 tensor,
    every element checked finite and >= 0 unless it is device data that may not be read."""
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point() or value.dtype in _INDEX_DTYPES):
            fail(f"{name} dtype", value.dtype, "a floating-point or integer tensor")
        if value.device.type != "cpu" and not reads_device:
            return value.to(torch.float32)       # the caller's responsibility (capture / host-meta path)
        vals = value.detach().to("cpu", torch.float64)
        bad = ~torch.isfinite(vals) | (vals < 0)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            fail(f"{name}{list(idx)} (lambda) out of range", float(vals[idx]), "a finite float >= 0")
        return value.to(torch.float32)
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            vals = torch.tensor(value, dtype=torch.float64)     # one tensor, not one per element
            bad = ~torch.isfinite(vals) | (vals < 0)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                fail(f"{name}[{i}] (lambda) out of range", value[i], "a finite float >= 0")
            return vals.to(torch.float32)
        rows = [_lambda_values(v, f"{name}[{i}]", reads_device) for i, v in enumerate(value)]
        if len({tuple(r.shape) for r in rows}) > 1:
            fail(f"{name} is ragged", [tuple(r.shape) for r in rows], "rows of one length")
        return torch.stack(rows) if rows else torch.zeros(0)
    if isinstance(value, bool):
        fail(f"{name} is not a number", repr(value), "a float >= 0")
    try:
        lam = float(value)
    except (TypeError, ValueError):
        fail(f"{name} is not a number", repr(value), "a float >= 0")
    if not math.isfinite(lam) or lam < 0:
        fail(f"{name} (lambda) out of range", lam, "a finite float >= 0")
    return torch.tensor(lam, dtype=torch.float32)


def lambdas(value, num_seqs: int, *, candidates: bool = False, reads_device: bool = True,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """The one normaliser of skip thresholds, as a float32 tensor on ``device``.

    Serving (``candidates=False``): ``None`` (dense), a number or a 0-d tensor (every
    sequence), or ``S`` values (one per sequence) -> ``[S]``.  Counting candidates
    (``candidates=True``): ``n`` values (the same for every sequence) -> ``[n, S]``, or
    ``[n, S]`` (candidate ``j``'s lambda for sequence ``s``).  Every lambda must be finite
    and >= 0 (0 = dense); a tensor on another device than the CPU is checked for shape
    and dtype only when ``reads_device`` is false (its values are then the caller's
    responsibility: nothing is read on the host).
    """
    name = "thresholds" if candidates else "threshold"
    if value is None and not candidates:
        return torch.zeros(num_seqs, dtype=torch.float32, device=device)
    lam = _lambda_values(value, name, reads_device)
    if candidates:
        if lam.dim() == 1:
            lam = lam[:, None].expand(-1, num_seqs)
        elif lam.dim() != 2 or lam.shape[1] != num_seqs:
            fail(f"{name} must be [num_thresholds] or [num_thresholds, num_seqs={num_seqs}]", tuple(lam.shape),
                 "one candidate list for every sequence, or one lambda per (candidate, sequence)")
    elif lam.dim() == 0:
        if lam.device.type == "cpu":
            # A fill on the device, not a copy: safe under graph capture (the value is baked in).
            return torch.full((num_seqs,), float(lam), dtype=torch.float32, device=device)
        lam = lam.expand(num_seqs)
    elif lam.shape != (num_seqs,):
        fail(f"{name} must be a number or one lambda per sequence", tuple(lam.shape),
             f"a float or shape [num_seqs] = [{num_seqs}]")
    return _to(lam, device).contiguous()     # kernels index lambdas as dense arrays


def _to(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for a GPU goes through pinned memory
    (an asynchronous copy that does not wait for the stream)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.contiguous().pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_tensors(batch: PagedBatch) -> None:
    """Ranks, shapes, dtypes and devices: no data read."""
    fields = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")
    for name in fields:
        if not isinstance(getattr(batch, name), torch.Tensor):
            fail(f"{name} is not a tensor", type(getattr(batch, name)).__name__, "torch.Tensor")
    query, key_cache, value_cache = batch.query, batch.key_cache, batch.value_cache
    if query.dim() != 3:
        fail("query rank", tuple(query.shape), "[num_tokens, num_q_heads, head_dim]")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4:
            fail(f"{name} rank", tuple(c.shape), "[num_blocks, page_size, num_kv_heads, head_dim]")
    if key_cache.shape != value_cache.shape:
        fail("key_cache/value_cache shapes differ", (tuple(key_cache.shape), tuple(value_cache.shape)),
             "identical logical shapes")
    _, hq, d = query.shape
    _, page_size, hkv, dk = key_cache.shape
    if page_size < 1:
        fail("page_size (key_cache.shape[1])", page_size, ">= 1")
    if dk != d:
        fail("head size mismatch between query and KV cache", f"query D={d}, cache D={dk}", "equal head sizes")
    if hkv == 0 or hq % hkv != 0:
        fail("num_q_heads is not a multiple of num_kv_heads", f"Hq={hq}, Hkv={hkv}", "Hq % Hkv == 0")
    if query.dtype not in _FLOAT_DTYPES:
        fail("query dtype", query.dtype, "float32, bfloat16 or float16")
    if key_cache.dtype != value_cache.dtype:
        fail("key_cache/value_cache dtypes differ", (key_cache.dtype, value_cache.dtype), "one cache dtype")
    if key_cache.dtype != query.dtype and key_cache.dtype not in FP8_DTYPES:
        fail("KV cache dtype", key_cache.dtype, f"the query's dtype ({query.dtype}) or an fp8 view "
             "(torch.float8_e4m3fn / torch.float8_e5m2)")
    for name in ("block_table", "seq_lens", "query_start_loc"):
        if getattr(batch, name).dtype not in _INDEX_DTYPES:
            fail(f"{name} dtype", getattr(batch, name).dtype, "torch.int32 or torch.int64")
    for name in fields[1:]:
        if getattr(batch, name).device != query.device:
            fail(f"{name} device differs from query device", getattr(batch, name).device, query.device)
    if batch.seq_lens.dim() != 1:
        fail("seq_lens rank", tuple(batch.seq_lens.shape), "[num_seqs]")
    num_seqs = batch.num_seqs
    if batch.query_start_loc.shape != (num_seqs + 1,):
        fail("query_start_loc shape", tuple(batch.query_start_loc.shape), f"[num_seqs + 1] = [{num_seqs + 1}]")
    if batch.block_table.dim() != 2 or batch.block_table.shape[0] != num_seqs:
        fail("block_table shape", tuple(batch.block_table.shape), f"[num_seqs={num_seqs}, max_blocks]")


def _check_scale_value(value, name: str, device) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point() or value.device != device:
            fail(name, (tuple(value.shape), value.dtype, value.device),
                 f"a float or a 1-element float tensor on {device}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        fail(name, repr(value), "a finite float > 0 or a 1-element float tensor")


def check_spec(spec: LayerSpec, batch: PagedBatch) -> None:
    """The layer's fields against each other and the batch (no data read)."""
    if not isinstance(spec, LayerSpec):
        fail("spec", type(spec).__name__, "a sparse_attn.kernels.LayerSpec")
    try:
        scale = float(spec.scale)
    except (TypeError, ValueError):
        fail("scale is not a number", repr(spec.scale), "a finite float")
    if not math.isfinite(scale):
        fail("scale", scale, "a finite float")
    w = spec.window
    if w is not None:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            fail("window (tokens a query sees, itself included)", repr(w), "an int >= 1 or None")
        if not spec.causal:
            fail("window without causal", "causal=False", "causal=True (a window [p - w + 1, p])")
    cap = spec.soft_cap
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap)
                            or cap <= 0):
        fail("soft_cap", repr(cap), "a finite float > 0 or None")
    if spec.sink_logits is not None:
        sinks = spec.sink_logits
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (batch.num_q_heads,) \
                or not sinks.is_floating_point() or sinks.device != batch.query.device:
            seen = (tuple(sinks.shape), sinks.dtype, sinks.device) if isinstance(sinks, torch.Tensor) \
                else type(sinks).__name__
            fail("sink_logits (one per query head)", seen, f"a float tensor [{batch.num_q_heads}] on {batch.query.device}")
    _check_scale_value(spec.k_scale, "k_scale", batch.query.device)
    _check_scale_value(spec.v_scale, "v_scale", batch.query.device)


def _check_host(batch: PagedBatch, meta: BatchMeta) -> None:
    """The host lengths against each other and the tensor shapes."""
    num_seqs, num_tokens = batch.num_seqs, batch.query.shape[0]
    if not isinstance(meta, BatchMeta):
        fail("host (the batch's host copy)", type(meta).__name__, "a BatchMeta or None")
    if len(meta.seq_lens) != num_seqs or len(meta.q_lens) != num_seqs:
        fail("host has another number of sequences than seq_lens", len(meta.seq_lens), num_seqs)
    lens, q_lens = meta.seq_lens, meta.q_lens
    if any(n < 0 for n in lens):
        fail("negative seq_lens", list(lens), "lengths >= 0")
    if num_seqs and meta.q_starts[0] != 0:
        fail("query_start_loc[0]", meta.q_starts[0], 0)
    if any(n < 0 for n in q_lens):
        fail("query_start_loc is not non-decreasing (negative query length)",
             list(meta.q_starts) + [meta.num_tokens], "non-decreasing offsets")
    if meta.num_tokens != num_tokens:
        fail("query_start_loc[-1] differs from the number of query tokens", meta.num_tokens, num_tokens)
    bad = [s for s in range(num_seqs) if q_lens[s] > lens[s]]     # an upper bound on lens keeps this sound
    if bad:
        s = bad[0]
        fail(f"query length exceeds KV length for sequence {s}", f"q_len={q_lens[s]}, kv_len={lens[s]}",
             "q_len <= kv_len (queries are the last q_len KV positions)")
    page = batch.page_size
    need = [(n + page - 1) // page for n in lens]
    if num_seqs and meta.seq_lens_exact and max(need) > batch.block_table.shape[1]:
        s = max(range(num_seqs), key=lambda i: need[i])
        fail(f"block_table too narrow for sequence {s}", f"{batch.block_table.shape[1]} columns",
             f">= {need[s]} blocks for kv_len={lens[s]} at page_size={page}")


def _check_block_ids(batch: PagedBatch) -> None:
    """Every block id a sequence uses (by the device ``seq_lens``) is in range: a device
    reduction and one host read (nothing to wait for on CPU tensors)."""
    bt, page = batch.block_table, batch.page_size
    if not batch.num_seqs:
        return
    num_blocks = batch.key_cache.shape[0]
    need = (batch.seq_lens.long() + page - 1) // page
    used = torch.arange(bt.shape[1], device=bt.device)[None, :] < need[:, None]
    out_of_range = used & ((bt < 0) | (bt >= num_blocks))
    if bool(out_of_range.any()):
        s, j = (int(x) for x in out_of_range.nonzero()[0])
        fail(f"block_table[{s}, {j}] out of range", int(bt[s, j]),
             f"a block id in [0, {num_blocks}) (the key cache has {num_blocks} blocks of {page} tokens). Fix: pass "
             "the block table built for this KV cache (the ids vLLM's scheduler assigned in it)")


def block_table_error(batch: PagedBatch) -> None:
    """Raise the ``ValueError`` that says which block id or length the compiled kernel refused
    (``sa_forward`` returns a code only; it reads nothing it refuses)."""
    seq_lens = batch.seq_lens.cpu().long()
    need = (seq_lens + batch.page_size - 1) // batch.page_size
    if bool((seq_lens < 0).any()):
        s = int((seq_lens < 0).nonzero()[0])
        fail(f"seq_lens[{s}] negative", int(seq_lens[s]), "a KV length >= 0")
    if batch.num_seqs and int(need.max()) > batch.block_table.shape[1]:
        s = int(need.argmax())
        fail(f"block_table too narrow for sequence {s}", f"{batch.block_table.shape[1]} columns",
             f">= {int(need[s])} blocks for kv_len={int(seq_lens[s])} at page_size={batch.page_size}")
    _check_block_ids(batch)
    fail("the compiled CPU kernel refused the block table", "a block id or length it cannot read",
         "ids in [0, num_blocks) for every block a sequence uses")


def validate(batch: PagedBatch, spec: LayerSpec, out: torch.Tensor | None, check) -> BatchMeta:
    """Check every argument before any work; return the batch's host lengths.

    With ``batch.host`` nothing on a GPU is read unless ``check == "full"`` (which adds
    the block-id range check); without it ``seq_lens`` / ``query_start_loc`` are copied to
    the host once and the block ids are checked.  CPU tensors always have their block ids
    checked: reading them waits for nothing.
    """
    if check not in CHECKS:
        fail("check", repr(check), "True, False or 'full'")
    if not isinstance(batch, PagedBatch):
        fail("batch", type(batch).__name__, "a sparse_attn.kernels.PagedBatch")
    _check_tensors(batch)
    check_spec(spec, batch)
    query = batch.query
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != query.shape or out.dtype != query.dtype \
                or out.device != query.device:
            seen = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
            fail("out", seen, (tuple(query.shape), query.dtype, query.device))
    meta = batch.host
    if meta is None:
        meta = BatchMeta.from_host(batch.seq_lens.cpu(), batch.query_start_loc.cpu())
    _check_host(batch, meta)
    if batch.host is None or check == "full" or batch.block_table.device.type == "cpu":
        _check_block_ids(batch)
    return meta
