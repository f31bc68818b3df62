"""Tile geometry, argument validation and the skip rule shared by every implementation.

Skip rule (identical in serving and counting mode, identical in every implementation)
-------------------------------------------------------------------------------------
Work is cut into tiles.  A *query tile* is ``TILE_Q`` consecutive query rows of one
sequence, aligned to the sequence's first query row; it is taken per query head.  A *KV
tile* is ``TILE_K`` consecutive KV positions of one sequence, aligned to KV position 0
(independent of the cache page size).

For query row ``i`` of a sequence with ``q_len`` queries and ``kv_len`` keys, the absolute
position is ``kv_len - q_len + i``; with ``causal=True`` it sees KV positions ``<=`` that,
otherwise all ``kv_len`` positions.  Rows past ``q_len`` in the last query tile are padding.

A (query head, query tile) *visits* KV tiles ``0 .. last`` where ``last`` is the KV tile
holding the last position its last valid row sees; tiles entirely above the causal
diagonal are neither visited nor counted.

KV *splits*: the KV axis is also cut into splits of ``split_k`` consecutive positions
(default :data:`SPLIT_K`, a multiple of ``TILE_K``), aligned to KV position 0, so split
``j`` holds KV tiles ``t0(j) = j * split_k / TILE_K ..`` up to the next split.  ``split_k``
is a constant of the rule, independent of batch size, phase and GPU: split-KV decode
(flash-decoding) processes each split in its own program and merges the partial
softmaxes by log-sum-exp, and every other path (prefill, the torch implementation,
counting mode) applies the same split boundaries to the skip test even when it does not
launch splits.  For visited KV tile ``t`` of split ``j`` and valid row ``r``:

    tile_max[r, t] = max over visible columns c of tile t of  scale * q_r . k_c    (-inf if none)
    m_before[r, t] = max(tile_max[r, 0], ..., tile_max[r, t-1])                     if j = 0
                     max(tile_max[r, 0], tile_max[r, t0(j)], ..., tile_max[r, t-1])  if j > 0
                     (dense running max; at every split boundary after the first it
                     RESTARTS from KV tile 0's maxima, the SEED, instead of carrying the
                     tiles of earlier splits)
    ratio[t]       = max over valid rows r of exp(tile_max[r, t] - m_before[r, t])

and the tile is *skippable under lambda* iff ``t != 0`` (KV tile 0, the attention-sink
tile, is never skippable; the first tile of a later split is tested against the seed
like any other) and ``ratio[t] < lambda``.  Tile 0 holds position 0, which every row
sees, so ``tile_max[r, 0]`` is finite and every ``m_before`` of a tile ``t > 0`` is.
Seeding keeps each split independent of the other splits (a split program needs only
its own tiles plus tile 0) while every tile is still compared with the attention-sink
tokens at the start of the sequence, which often hold a query's largest scores; a full
restart at -inf compared a later split's tiles with a local maximum only and, measured,
needed 3-400x larger lambdas for the same sparsity with 2-5x the mean error, where the
seed matches the no-split rule on decodes (benchmarks/RESULTS-kernels.md).  Cost: a
split-KV decode program of a split ``j > 0`` reads K tile 0 and computes its Q.K^T once
more (one extra K tile per split program, ``TILE_K / split_k`` of the K reads).

Serving mode with threshold ``lambda`` leaves skippable tiles out of the softmax (no
exp, no V read, no P.V), so the output is the softmax over all visited positions
restricted to the non-skipped tiles (splits are an evaluation order only: the
log-sum-exp merge makes the result the same single softmax).  The running max is the
dense one in both modes: a skipped tile's scores are still known (its Q.K^T is needed
for the test), so ``m_before`` never depends on earlier decisions, and calibration
counts taken in counting mode are exactly the serving-mode skip counts, for any
``split_k`` as long as both modes use the same one.  ``lambda = 0`` never skips
(``exp(.) >= 0``).

The skip decision is per query head: a kernel that packs the query heads of a KV group
into one program (reading each K/V tile once) still tests each head's rows on their own,
and reads a V tile when any head of the program keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

#: Query rows per query tile (per query head).
TILE_Q = 64
#: KV positions per KV tile.
TILE_K = 64
#: KV positions per split of the skip rule (each split's dense running max restarts from
#: KV tile 0's maxima; split-KV decode launches one program per split).  Why 1024 (16
#: tiles), with the seeded rule: a batch-1 32k-token decode with 8 KV heads is
#: 8 * 32768 / 1024 = 256 programs on a 132-SM GPU (H100/H200), ~2 per SM, so every SM
#: has work and a second program to hide memory latency; 2048 would be 128 programs and
#: leave 4 SMs idle with nothing to overlap.  The seed costs every split program after the
#: first one extra K tile (tile 0) and its Q.K^T: 1/16 of the K reads at 1024, 1/8 at 512
#: (which would only add programs beyond the ~2 per SM that already fill the GPU, and
#: double the fp32 split partials [S, splits, Hq, D] a captured graph keeps).  With the
#: seed, the split length barely trades accuracy any more (benchmarks/RESULTS-kernels.md,
#: CPU): decodes need the no-split rule's lambdas and have its error at equal sparsity;
#: a 16k-KV prefill chunk needs a 1.6x larger lambda for 75 % with 1.2x the mean error,
#: and 512 is no better there.  So the choice is parallelism against the extra tile.
SPLIT_K = 1024

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class BatchMeta:
    """Host-side copy of the batch description, produced by :func:`validate`.

    ``seq_lens`` / ``q_starts`` / ``q_lens`` are Python ints per sequence (tokens);
    ``num_kv_heads`` / ``group`` give the GQA mapping ``kv_head = q_head // group``.
    """

    seq_lens: list[int]
    q_starts: list[int]
    q_lens: list[int]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def check_split(split_k) -> int:
    """``split_k`` (``None`` -> :data:`SPLIT_K`) as an int after checking it is a positive
    multiple of ``TILE_K``."""
    if split_k is None:
        return SPLIT_K
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < TILE_K or split_k % TILE_K:
        _fail("split_k (KV positions per split of the skip rule)", repr(split_k),
              f"a positive multiple of TILE_K={TILE_K} (default SPLIT_K={SPLIT_K})")
    return split_k


def _fail(what: str, seen, expected) -> None:
    raise ValueError(f"paged_attention: {what}: got {seen}, expected {expected}")


def check_threshold(value, name: str = "threshold") -> float:
    """Return ``value`` (``None`` -> 0.0) as a float after checking it is finite and >= 0."""
    if value is None:
        return 0.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            _fail(f"{name} must be a scalar", tuple(value.shape), "a Python float or 0-d tensor")
        value = value.item()
    try:
        lam = float(value)
    except (TypeError, ValueError):
        _fail(f"{name} is not a number", repr(value), "a float >= 0")
    if math.isnan(lam) or math.isinf(lam) or lam < 0:
        _fail(f"{name} (lambda) out of range", lam, "a finite float >= 0")
    return lam


def _as_float_list(values, name: str) -> list[float]:
    """Each element of a 1-D list/tuple/tensor checked by :func:`check_threshold`."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.dtype in _INDEX_DTYPES:
            vals = values.detach().double().cpu()
            if bool(torch.isfinite(vals).all()) and bool((vals >= 0).all()):
                return vals.tolist()
        values = values.tolist()
    return [check_threshold(v, f"{name}[{i}]") for i, v in enumerate(values)]


def _shape_of(values) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        return tuple(values.shape)
    if isinstance(values, (list, tuple)):
        if values and all(isinstance(v, (list, tuple, torch.Tensor)) for v in values):
            inner = {len(v) if not isinstance(v, torch.Tensor) else tuple(v.shape) for v in values}
            return (len(values), next(iter(inner))) if len(inner) == 1 and isinstance(next(iter(inner)), int) \
                else (len(values), -1)
        return (len(values),)
    return ()


def check_seq_threshold(value, num_seqs: int, name: str = "threshold") -> float | torch.Tensor:
    """Serving lambda: ``None`` / a number / a 0-d tensor -> one float for every sequence,
    or a 1-D list/tensor of ``num_seqs`` lambdas (one per sequence) -> float32 ``[S]`` CPU tensor.

    Every lambda must be finite and >= 0; a per-sequence 0 means dense for that sequence.
    """
    if value is None or isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        return check_threshold(value, name)
    shape = _shape_of(value)
    if len(shape) != 1:
        _fail(f"{name} must be a number or 1-D (one lambda per sequence)", shape,
              f"a float or shape [num_seqs] = [{num_seqs}]")
    if shape[0] != num_seqs:
        _fail(f"{name} has one lambda per sequence but the wrong length", shape[0],
              f"num_seqs = {num_seqs}")
    return torch.tensor(_as_float_list(value, name), dtype=torch.float32)


def check_thresholds(values: Sequence[float] | torch.Tensor, num_seqs: int | None = None) -> torch.Tensor:
    """Candidate lambdas for counting mode, as a float32 ``[n, S]`` CPU tensor.

    ``values`` is 1-D (``n`` candidates, the same for every sequence) or 2-D ``[n, S]``
    (candidate ``j``'s lambda for sequence ``s``).  With ``num_seqs=None`` only 1-D input
    is accepted and the result is ``[n, 1]``.
    """
    shape = _shape_of(values)
    if len(shape) == 1:
        lams = torch.tensor(_as_float_list(values, "thresholds"), dtype=torch.float32)
        return lams[:, None].expand(-1, num_seqs if num_seqs is not None else 1)
    expected = "shape [num_thresholds]" + (f" or [num_thresholds, num_seqs={num_seqs}]" if num_seqs is not None else "")
    if len(shape) != 2 or num_seqs is None:
        _fail("thresholds must be 1-D or 2-D", shape, expected)
    if shape[1] != num_seqs:
        _fail("thresholds is 2-D but its second dimension is not the number of sequences", shape, expected)
    if isinstance(values, torch.Tensor):
        vals = values.detach().double().cpu()
        if bool(torch.isfinite(vals).all()) and bool((vals >= 0).all()):
            return vals.float()
        values = values.tolist()
    flat = [check_threshold(v, f"thresholds[{j}][{s}]") for j, row in enumerate(values)
            for s, v in enumerate(row.tolist() if isinstance(row, torch.Tensor) else row)]
    return torch.tensor(flat, dtype=torch.float32).view(shape)


def validate(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> BatchMeta:
    """Check every argument before any work and return the batch on the host.

    Raises ``ValueError`` naming what was seen and what was expected.  Costs one
    device->host copy of ``seq_lens`` / ``query_start_loc`` and a reduction over the
    block table.
    """
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} is not a tensor", type(t).__name__, "torch.Tensor")
    if query.dim() != 3:
        _fail("query rank", tuple(query.shape), "[num_tokens, num_q_heads, head_dim]")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4:
            _fail(f"{name} rank", tuple(c.shape), "[num_blocks, page_size, num_kv_heads, head_dim]")
    if key_cache.shape != value_cache.shape:
        _fail("key_cache/value_cache shapes differ", (tuple(key_cache.shape), tuple(value_cache.shape)),
              "identical logical shapes")
    num_tokens, hq, d = query.shape
    num_blocks, page_size, hkv, dk = key_cache.shape
    if page_size < 1:
        _fail("page_size (key_cache.shape[1])", page_size, ">= 1")
    if dk != d:
        _fail("head size mismatch between query and KV cache", f"query D={d}, cache D={dk}", "equal head sizes")
    if hkv == 0 or hq % hkv != 0:
        _fail("num_q_heads is not a multiple of num_kv_heads", f"Hq={hq}, Hkv={hkv}", "Hq % Hkv == 0")
    if query.dtype not in _FLOAT_DTYPES:
        _fail("query dtype", query.dtype, "float32, bfloat16 or float16")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dtype != query.dtype:
            _fail(f"{name} dtype differs from query dtype", c.dtype, query.dtype)
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype not in _INDEX_DTYPES:
            _fail(f"{name} dtype", t.dtype, "torch.int32 or torch.int64")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != query.device:
            _fail(f"{name} device differs from query device", t.device, query.device)
    if seq_lens.dim() != 1:
        _fail("seq_lens rank", tuple(seq_lens.shape), "[num_seqs]")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        _fail("query_start_loc shape", tuple(query_start_loc.shape), f"[num_seqs + 1] = [{num_seqs + 1}]")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        _fail("block_table shape", tuple(block_table.shape), f"[num_seqs={num_seqs}, max_blocks]")
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        _fail("scale is not a number", repr(scale), "a finite float")
    if not math.isfinite(scale):
        _fail("scale", scale, "a finite float")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != query.shape or out.dtype != query.dtype \
                or out.device != query.device:
            seen = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
            _fail("out", seen, (tuple(query.shape), query.dtype, query.device))

    lens = seq_lens.tolist()
    qsl = query_start_loc.tolist()
    if any(n < 0 for n in lens):
        _fail("negative seq_lens", lens, "lengths >= 0")
    if qsl and qsl[0] != 0:
        _fail("query_start_loc[0]", qsl[0], 0)
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    if any(n < 0 for n in q_lens):
        _fail("query_start_loc is not non-decreasing (negative query length)", qsl, "non-decreasing offsets")
    if qsl[-1] != num_tokens:
        _fail("query_start_loc[-1] differs from the number of query tokens", qsl[-1], num_tokens)
    bad = [s for s in range(num_seqs) if q_lens[s] > lens[s]]
    if bad:
        s = bad[0]
        _fail(f"query length exceeds KV length for sequence {s}", f"q_len={q_lens[s]}, kv_len={lens[s]}",
              "q_len <= kv_len (queries are the last q_len KV positions)")
    if num_seqs:
        need = [(n + page_size - 1) // page_size for n in lens]
        if max(need) > block_table.shape[1]:
            s = max(range(num_seqs), key=lambda i: need[i])
            _fail(f"block_table too narrow for sequence {s}", f"{block_table.shape[1]} columns",
                  f">= {need[s]} blocks for kv_len={lens[s]} at page_size={page_size}")
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] \
            < torch.tensor(need, device=block_table.device)[:, None]
        out_of_range = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(out_of_range.any()):
            s, j = (int(x) for x in out_of_range.nonzero()[0])
            _fail(f"block_table[{s}, {j}] out of range", int(block_table[s, j]), f"a block id in [0, {num_blocks})")
    return BatchMeta(lens, qsl[:-1], q_lens, hq, hkv, d, page_size)
