"""CPU (pure torch) implementation of skip-softmax paged attention.

Sequences are processed in groups: a sequence with more than ``TILE_Q`` queries is a
group of its own (its query tiles share every K/V tile), shorter ones are batched by
``next_pow2(q_len)`` (decode is the ``q_len = 1`` group).  Inside a group the loop runs
over *chunks* of consecutive KV tiles, vectorised over all (sequence, query tile, head):

1. gather the chunk's K through the block table, ``S = Q K^T`` for every visited pair
   (needed anyway: the skip test reads the tile maxima); K is gathered and multiplied
   in cache-sized runs of sequences, so it is read from memory once;
2. per-tile row maxima, exclusive cumulative max = dense running max, skip test (not
   evaluated at all when every lambda is 0 and no counts are asked for);
3. exp and P.V only for the tiles that are not skipped.  Every active (unit, KV tile)
   P block is gathered with one ``index_select`` of ``TILE_K``-float rows.  Groups with
   one query tile per sequence (decode, short prefills) then read, per KV head, the V
   of the tiles any of its units needs and do one batched matmul per cache-sized run
   (inactive units' P is exactly 0); a long prefill buckets (KV head, tile) pairs by
   how many units are active on them (one batched matmul per bucket).  Chunks with no
   skipped tile take a dense path (one exp over S, batched matmuls with the V chunk).

Rows are laid out as ``(query tile, head-in-group, row)`` so the query tiles still
visiting a KV tile (a suffix, causal) are a contiguous slice, and a sequence's K/V are
never duplicated across its query tiles or across the query heads sharing a KV head.
"""

from __future__ import annotations

import math
import threading

import torch

from ._common import SPLIT_K, TILE_K, TILE_Q, next_pow2
from .batch import BatchMeta, LayerSpec, PagedBatch

# Chunk sizing, in elements per chunk.  Scores are a fresh tensor per chunk: 2**22 fp32
# (16 MiB) stays below glibc's largest mmap threshold, so malloc recycles it instead of
# mapping and page-faulting it afresh every chunk.  Gathered K/V live in buffers reused
# across chunks, so they may be larger: fewer chunks means less per-chunk Python work.
_SCORE_BUDGET = 1 << 22
_KV_BUDGET = 1 << 23
# K/V are read and consumed in runs of at most this many elements (2 MiB fp32), so the
# matmul reads them from cache rather than from memory.
_SUB_BUDGET = 1 << 19
# The exp reference per row is only raised when a chunk's max exceeds it by this many
# nats: exp(s - m_ref) <= e**8 cannot overflow fp32, and most chunks then skip the
# full rescale of the accumulator (exact: the reference cancels in the final division).
_RESCALE_SLACK = 8.0


# Gather buffers, kept across calls (per thread): a fresh multi-MiB buffer per call would
# be page-faulted in again every call, which costs as much as the gather itself.
_BUFFERS = threading.local()


def _buffer(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    key = (name, dtype)
    buf = getattr(_BUFFERS, "pool", None)
    if buf is None:
        buf = _BUFFERS.pool = {}
    t = buf.get(key)
    if t is None or t.numel() < numel:
        t = buf[key] = torch.empty(max(numel, 1 << 16), dtype=dtype)
    return t[:numel]


def forward(
    batch: PagedBatch,
    spec: LayerSpec,
    meta: BatchMeta,
    *,
    threshold: torch.Tensor,
    count_thresholds: torch.Tensor | None,
    out: torch.Tensor,
    split_k: int = SPLIT_K,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backend contract of :mod:`sparse_attn.kernels.api` (CPU tensors, ``meta`` given)."""
    hq = batch.num_q_heads
    counting = count_thresholds is not None
    n_thr = count_thresholds.shape[0] if counting else 0
    skipped = torch.zeros(n_thr, hq, dtype=torch.int64)
    visited = torch.zeros((), dtype=torch.int64)

    multi, buckets = [], {}
    for s, q_len in enumerate(meta.q_lens):
        if q_len == 0:
            continue
        if q_len > TILE_Q:
            multi.append([s])
        else:
            buckets.setdefault(next_pow2(q_len), []).append(s)
    groups = [(seqs, TILE_Q) for seqs in multi] + [(seqs, r) for r, seqs in sorted(buckets.items())]
    bt = batch.block_table.long()
    for seqs, rows in groups:
        visited += _run_group(batch, bt, meta, seqs, rows, float(spec.scale), spec.causal,
                              threshold, count_thresholds if n_thr else None, skipped, out, split_k // TILE_K)
    if not counting:
        return out, None, None
    return out, skipped, visited.expand(hq).clone()


class _TileReader:
    """Reads whole KV tiles of one cache view through a group's block-table rows.

    ``bt_rows`` [B, max_blocks] long and ``kv`` [B] long describe the group's sequences.
    When a KV tile is a whole number of cache "units" (pages, or TILE_K slices of larger
    pages) a read is one ``index_select`` of units (memcpy speed for any layout whose
    token rows are contiguous, still correct for any strides); other page sizes fall
    back to per-token advanced indexing.  Positions past a sequence's end read as 0
    (units path) or as the sequence's last token (fallback): their scores are masked to
    -inf, and 0 * garbage could be NaN.

    :meth:`plan` resolves the unit ids of one chunk (the group's first ``b`` sequences,
    tiles ``t0 .. t0+c-1``) once; :meth:`read` (a slice of sequences, all tiles) and
    :meth:`read_tiles` (given (sequence, tile) pairs, one KV head) then only gather.
    Results live in a buffer reused by the next call: ``index_select`` into a
    preallocated ``out`` is several times faster on CPU than letting it allocate, and a
    small reused buffer stays in cache for the matmul that consumes it.
    """

    def __init__(self, cache, bt_rows, kv, page_size, name):
        self.cache, self.bt_rows, self.kv, self.page, self.name = cache, bt_rows, kv, page_size, name
        self.units, self.unit, self.per_block = None, 0, 0
        if TILE_K % page_size == 0:
            self.unit, self.units, self.per_block = page_size, cache, 1
        elif page_size % TILE_K == 0:
            split = cache.unflatten(1, (page_size // TILE_K, TILE_K))
            if split.stride(0) == split.shape[1] * split.stride(1):
                self.unit, self.per_block = TILE_K, page_size // TILE_K
                self.units = split.flatten(0, 1)
        # One KV head's tiles are gathered as rows of D elements when the units view is
        # [N, unit, Hkv, D] contiguous (index_select of a strided per-head view is slow).
        self.rows = None
        if self.units is not None:
            u = self.units
            if u.stride(3) == 1 and u.stride(2) == u.shape[3] and u.stride(1) == u.shape[2] * u.shape[3] \
                    and u.stride(0) == u.shape[1] * u.stride(1):
                self.rows = u.reshape(-1, u.shape[3])
        # Readers of the same kind resolve the same plan (K and V share the block table).
        self.kind = (self.units is None, self.unit, self.per_block)

    def plan(self, b: int, t0: int, c: int):
        """Unit ids ``[b, c, units per tile]`` (or token (block, offset) ids ``[b, c, TILE_K]``)
        and the ``[b, c, TILE_K]`` mask of positions past each sequence's end (None if none)."""
        kv = self.kv[:b, None]
        pos = torch.arange(t0 * TILE_K, (t0 + c) * TILE_K)
        invalid = pos[None, :] >= kv
        invalid = invalid.view(b, c, TILE_K) if bool(invalid[:, -1].any()) else None
        if self.units is None:
            pos = torch.minimum(pos[None, :], kv - 1)
            blk = self.bt_rows[:b].gather(1, pos // self.page)
            return (blk.view(b, c, TILE_K), (pos % self.page).view(b, c, TILE_K)), None
        start = torch.minimum(pos[None, ::self.unit], (kv - 1) // self.unit * self.unit)
        blk = self.bt_rows[:b].gather(1, start // self.page)
        ids = blk * self.per_block + (start % self.page) // self.unit
        return ids.view(b, c, -1), invalid

    def _gather(self, ids, invalid, head):
        if self.units is None:
            blk, off = ids
            x = self.cache[blk, off] if head is None else self.cache[blk, off, head]
            return (x.flatten(1, 2) if blk.dim() == 3 else x).float()
        n = ids.shape[0]
        if head is not None:
            hkv, unit = self.units.shape[2], self.unit
            if self.rows is not None:
                rows = ((ids[:, :, None] * unit + torch.arange(unit)) * hkv + head).view(-1)
                x = _buffer(self.name, rows.numel() * self.rows.shape[1], self.cache.dtype).view(-1, self.rows.shape[1])
                torch.index_select(self.rows, 0, rows, out=x)
                x = x.view(n, -1, self.rows.shape[1]).float()
                if invalid is not None:
                    inv = invalid.reshape(n, -1)
                    if bool(inv.any()):
                        x[inv] = 0.0
                return x
            return self._gather(ids, invalid, None)[:, :, head]
        units = self.units
        shape = (ids.numel(),) + units.shape[1:]
        x = _buffer(self.name, math.prod(shape), self.cache.dtype).view(shape)
        torch.index_select(units, 0, ids.reshape(-1), out=x)
        x = x.view((n, -1) + units.shape[2:]).float()
        if invalid is not None:
            inv = invalid.reshape(n, -1)
            if bool(inv.any()):
                x[inv] = 0.0
        return x

    def read(self, plan, b0: int, b1: int) -> torch.Tensor:
        """The planned tiles of sequences ``b0:b1`` as fp32 ``[b1 - b0, c * TILE_K, Hkv, D]``."""
        ids, invalid = plan
        ids = (ids[0][b0:b1], ids[1][b0:b1]) if self.units is None else ids[b0:b1]
        return self._gather(ids, None if invalid is None else invalid[b0:b1], None)

    def read_tiles(self, plan, seq: torch.Tensor, tile: torch.Tensor, head: int) -> torch.Tensor:
        """Planned tiles ``tile`` [n] (0-based in the chunk) of sequences ``seq`` [n], one
        KV ``head``, as fp32 ``[n, TILE_K, D]``."""
        ids, invalid = plan
        ids = (ids[0][seq, tile], ids[1][seq, tile]) if self.units is None else ids[seq, tile]
        return self._gather(ids, None if invalid is None else invalid[seq, tile], head)


def _sub_batches(b: int, per_seq: int):
    """Split ``b`` sequences into runs whose gathered K/V (``per_seq`` elements each) stay
    within ``_SUB_BUDGET`` elements, so each run is consumed from cache right after its read."""
    step = max(1, _SUB_BUDGET // max(per_seq, 1))
    return [(b0, min(b, b0 + step)) for b0 in range(0, b, step)]


def _run_group(batch, bt, meta, seqs, rows, scale, causal, threshold, lams, skipped, out, tps):
    """Attention for one group of sequences; returns the group's visited-tile count (per head).

    All sequences of the group have ``nq`` query tiles of ``rows`` rows each
    (``rows <= TILE_Q``; ``nq > 1`` only for a single-sequence group).  Per-row state is
    ``[Hkv, B, M]`` with ``M = nq * g * rows`` rows in (query tile, head-in-group, row)
    order, so one KV head's rows of a sequence are one contiguous matrix.  ``tps``: KV
    tiles per split of the skip rule (the dense running max restarts from KV tile 0's
    maxima at each later split).
    """
    hkv, g, d, page = batch.num_kv_heads, batch.group, batch.head_dim, batch.page_size
    query, key_cache, value_cache = batch.query, batch.key_cache, batch.value_cache
    seqs = sorted(seqs, key=lambda s: -meta.seq_lens[s])  # active sequences form a prefix
    threshold = _group_lambdas(threshold, seqs)
    if lams is not None:
        lams = lams[:, seqs]                                                     # [n, B]
    # Serving with lambda = 0 for every sequence and no counts: nothing can be skipped,
    # so the skip test (tile maxima, dense running max, ratios) is not evaluated at all.
    test = lams is not None or isinstance(threshold, torch.Tensor) or threshold > 0
    b_all = len(seqs)
    nq = -(-max(meta.q_lens[s] for s in seqs) // rows)
    units_all = nq * g

    kv = torch.tensor([meta.seq_lens[s] for s in seqs])
    q_len = torch.tensor([meta.q_lens[s] for s in seqs])
    q_start = torch.tensor([meta.q_starts[s] for s in seqs])
    bt_rows = bt[torch.tensor(seqs)].cpu() if b_all < bt.shape[0] or seqs != list(range(b_all)) else bt
    k_reader = _TileReader(key_cache, bt_rows, kv, page, "k")
    v_reader = _TileReader(value_cache, bt_rows, kv, page, "v")

    r = torch.arange(nq * rows)
    row_valid = r[None, :] < q_len[:, None]                                     # [B, nq*rows]
    tok = q_start[:, None] + torch.minimum(r[None, :], q_len[:, None] - 1)      # padding -> a real row
    if causal:
        # Padding rows get the last row's limit: finite scores, never read back.
        limit = kv[:, None] - q_len[:, None] + torch.minimum(r[None, :], q_len[:, None] - 1)
    else:
        limit = (kv - 1)[:, None].expand(-1, nq * rows)
    # Last visited KV tile per query tile: the tile of its last valid row's limit.
    last_tile = limit.view(b_all, nq, rows).amax(-1) // TILE_K                     # [B, nq]
    limit_min_qt = limit.view(b_all, nq, rows).amin(-1)                          # [B, nq]
    lim_rows = limit.view(b_all, nq, 1, rows).expand(-1, -1, g, -1).reshape(b_all, -1)
    valid_rows = row_valid.view(b_all, nq, 1, rows).expand(-1, -1, g, -1).reshape(b_all, -1)

    q = query[tok].float().mul_(scale)                                           # [B, nq*rows, Hq, D]
    q = q.view(b_all, nq, rows, hkv, g, d).permute(3, 0, 1, 4, 2, 5).reshape(hkv, b_all, -1, d)
    m_dense = torch.full(q.shape[:3], float("-inf"))
    m_seed = None                      # KV tile 0's maxima [Hkv, B, M], set by the first chunk
    m_ref = torch.full(q.shape[:3], float("-inf"))
    l_sum = torch.zeros(q.shape[:3])
    acc = torch.zeros(q.shape)
    kv_host = [meta.seq_lens[s] for s in seqs]
    n_tiles = int(last_tile.max()) + 1
    visited = torch.zeros((), dtype=torch.int64)

    t0 = 0
    while t0 < n_tiles:
        b = sum(1 for n in kv_host if n > t0 * TILE_K)
        still = (last_tile[:b] >= t0).any(0)
        qt_lo = int(still.to(torch.int8).argmax()) if nq > 1 else 0
        nqa = nq - qt_lo
        u_lo = qt_lo * g
        row_lo = u_lo * rows
        units = units_all - u_lo
        m_rows = units * rows
        c = min(_SCORE_BUDGET // (b * hkv * m_rows * TILE_K), _KV_BUDGET // (b * hkv * TILE_K * d))
        c = max(1, min(c, n_tiles - t0))
        n_cols = c * TILE_K
        tiles = torch.arange(t0, t0 + c)

        k_plan = k_reader.plan(b, t0, c)
        v_plan = k_plan if v_reader.kind == k_reader.kind else v_reader.plan(b, t0, c)
        runs = _sub_batches(b, n_cols * hkv * d)
        s = torch.empty(hkv, b, m_rows, n_cols)
        for b0, b1 in runs:
            k = k_reader.read(k_plan, b0, b1)                                   # [nb, n_cols, Hkv, D]
            for h in range(hkv):
                torch.matmul(q[h, b0:b1, row_lo:], k[:, :, h].transpose(1, 2), out=s[h, b0:b1])
        del k
        # Mask only the leading query tiles whose visible range ends inside this chunk.
        need = (limit_min_qt[:b, qt_lo:] < t0 * TILE_K + n_cols - 1).any(0)
        if bool(need.any()):
            n_mask = (int(need.nonzero()[-1]) + 1) * g * rows
            cols = t0 * TILE_K + torch.arange(n_cols)
            lim = lim_rows[:b, row_lo:row_lo + n_mask]
            s[:, :, :n_mask].masked_fill_(cols > lim[:, :, None], float("-inf"))

        skip_any = False
        if test:
            tile_max = s.view(hkv, b, m_rows, c, TILE_K).amax(-1)               # [Hkv, b, M, c]
            if m_seed is None:
                # The first chunk starts at tile 0 and holds every row of every sequence
                # (all of them visit tile 0), so its first tile maxima are the full seed.
                m_seed = tile_max[..., 0].clone()
            md = m_dense[:, :b, row_lo:]
            m_before, m_after = _split_cummax(tile_max, md, m_seed[:, :b, row_lo:], t0, tps)
            chunk_max = tile_max.amax(-1)
            md.copy_(m_after)
            ratio = torch.exp(tile_max - m_before)
            ratio = torch.where(valid_rows[:b, row_lo:, None], ratio, 0.0)
            ratio = ratio.view(hkv, b, nqa, g, rows, c).amax(4)                  # [Hkv, b, nqa, g, c]
            vis = tiles <= last_tile[:b, qt_lo:, None]                           # [b, nqa, c]
            countable = (vis & (tiles != 0)).view(1, b, nqa, 1, c)   # KV tile 0 never skips
            visited += vis.sum()
            if lams is not None:
                r_c = torch.where(countable, ratio, float("inf"))
                hits = r_c.unsqueeze(0) < lams[:, :b].reshape(-1, 1, b, 1, 1, 1)
                skipped += hits.sum((2, 3, 5)).view(len(lams), -1)
            if isinstance(threshold, torch.Tensor):
                skip = countable & (ratio < threshold[:b].view(1, b, 1, 1, 1))
            else:
                skip = countable & (ratio < threshold)
            skip_any = bool(skip.any())
        else:
            chunk_max = s.amax(-1)

        mr = m_ref[:, :b, row_lo:]
        raise_ref = chunk_max > mr + _RESCALE_SLACK
        if bool(raise_ref.any()):
            new_ref = torch.where(raise_ref, chunk_max, mr)
            alpha = torch.where(raise_ref, torch.exp(mr - new_ref), 1.0)
            acc[:, :b, row_lo:].mul_(alpha.unsqueeze(-1))
            l_sum[:, :b, row_lo:].mul_(alpha)
            mr.copy_(new_ref)

        if not skip_any:
            p = s.sub_(mr.unsqueeze(-1)).exp_()
            l_sum[:, :b, row_lo:].add_(p.sum(-1))
            for b0, b1 in runs:
                v = v_reader.read(v_plan, b0, b1)
                for h in range(hkv):
                    acc[h, b0:b1, row_lo:].baddbmm_(p[h, b0:b1], v[:, :, h])
        else:
            active = (vis.view(1, b, nqa, 1, c) & ~skip).view(hkv, b, units, c)  # [Hkv, b, U, c]
            if nq == 1:
                _sparse_pv_tiles(s, active, m_ref, acc, l_sum, v_reader, v_plan)
            else:
                _sparse_pv_units(s, active, m_ref.view(-1, rows), acc.view(-1, rows, d), l_sum.view(-1, rows),
                                 v_reader.read(v_plan, 0, 1), u_lo, units_all)
        del s
        t0 += c

    o = acc / l_sum.unsqueeze(-1)
    o = torch.where(l_sum.unsqueeze(-1) > 0, o, 0.0)
    o = o.view(hkv, b_all, nq, g, rows, d).permute(1, 2, 4, 0, 3, 5).reshape(b_all, nq * rows, -1, d)
    out[tok[row_valid].to(out.device)] = o[row_valid].to(out.dtype)
    return visited


def _split_cummax(tile_max, md, seed, t0, tps):
    """Dense running max of the rule: within a split, seeded with KV tile 0's maxima at
    every split boundary after the first.

    ``tile_max`` [..., c] holds KV tiles ``t0 .. t0+c-1``; ``md`` [...] is the running max
    carried in from the tiles before ``t0`` (of ``t0``'s split, seed included); ``seed``
    [...] is tile 0's maxima.  Returns ``(m_before [..., c], m_after [...])``: each tile's
    exclusive running max and the running max after the chunk's last tile (to carry into
    the next chunk).  ``m_before`` of tile 0 is -inf (tile 0 is never skippable).
    """
    c = tile_max.shape[-1]
    p = t0 % tps
    if p + c <= tps:  # the chunk stays inside one split (no boundary except maybe at t0)
        if p:
            init = md
        elif t0:
            init = seed
        else:
            init = torch.full_like(md, float("-inf"))
        cm = torch.cat([init.unsqueeze(-1), tile_max], -1).cummax(-1).values
        return cm[..., :-1], cm[..., -1]
    n_seg = -(-(p + c) // tps)
    lead = tile_max.shape[:-1]
    padded = tile_max.new_full(lead + (n_seg * tps,), float("-inf"))
    padded[..., p:p + c] = tile_max
    # Segment k opens split (t0 - p) / tps + k: tile 0's split starts at -inf, a later one
    # from the seed; a chunk starting inside a split carries md into its first segment.
    init = seed.unsqueeze(-1).unsqueeze(-1).expand(lead + (n_seg, 1)).clone()
    if p:
        init[..., 0, 0] = md
    elif t0 == 0:
        init[..., 0, 0] = float("-inf")
    cm = torch.cat([init, padded.view(lead + (n_seg, tps))], -1).cummax(-1).values   # [..., n_seg, tps+1]
    m_before = cm[..., :-1].flatten(-2)[..., p:p + c]
    end = p + c - 1
    return m_before, cm[..., end // tps, end % tps + 1]


def _group_lambdas(threshold, seqs):
    """The group's serving lambda: a float when all its sequences share it, else float32 ``[B]``."""
    lam = threshold[seqs]
    if bool((lam == lam[0]).all()):
        return float(lam[0])
    return lam


def _sparse_pv_tiles(s, active, m_ref, acc, l_sum, v_reader, v_plan):
    """exp and P.V of one chunk for a group with one query tile per sequence (decode,
    short prefills), vectorised per KV head over the KV tiles that any of its units need.

    ``s`` scores [Hkv, b, M, c*TILE_K] with ``M = U * R`` rows (``U = g`` units of ``R``
    rows); ``active`` bool [Hkv, b, U, c]; ``m_ref`` / ``l_sum`` [Hkv, B, M] and ``acc``
    [Hkv, B, M, D] are the group's exp references and accumulators.

    Per KV head, the (sequence, KV tile) pairs needed by at least one of its units have
    their V read once (rows of D elements gathered with ``index_select``, in runs that
    stay in cache) and their P blocks gathered with one ``index_select`` of
    ``TILE_K``-float rows; inactive units' P is set to exactly 0 (``exp(-inf)``), so one
    batched matmul per run does the P.V.  Nothing is read or multiplied for a tile no
    unit of the head needs; inactive units of a needed tile cost a few wasted FLOPs but
    no extra memory traffic.
    """
    hkv, b, units, c = active.shape
    m = s.shape[2]
    rows = m // units
    b_all, d = acc.shape[1], acc.shape[-1]
    s_rows = s.view(-1, TILE_K)
    m_rows, l_rows, acc_rows = m_ref.view(-1, m), l_sum.view(-1, m), acc.view(-1, m, d)
    need = active.any(2).view(hkv, -1)                                           # [Hkv, b*c]
    step = max(1, _SUB_BUDGET // (TILE_K * d))
    for h in range(hkv):
        pair = need[h].nonzero().squeeze(1)                                      # (seq, tile) pairs, [n]
        n = pair.numel()
        if n == 0:
            continue
        bb, t = pair // c, pair % c
        src = (((h * b + bb)[:, None] * m + torch.arange(m)) * c + t[:, None]).view(-1)
        p = torch.index_select(s_rows, 0, src).view(n, m, TILE_K)
        hb = h * b_all + bb
        p.sub_(m_rows[hb].unsqueeze(-1))
        act = active[h].permute(0, 2, 1)[bb, t]                                 # [n, U]
        p.view(n, units, rows, TILE_K).masked_fill_(~act[..., None, None], float("-inf"))
        p.exp_()
        l_rows.index_add_(0, hb, p.sum(-1))
        o = torch.empty(n, m, d)
        for i0 in range(0, n, step):
            i1 = min(n, i0 + step)
            v = v_reader.read_tiles(v_plan, bb[i0:i1], t[i0:i1], h)             # [n, TILE_K, D]
            torch.bmm(p[i0:i1], v, out=o[i0:i1])
        acc_rows.index_add_(0, hb, o)


def _sparse_pv_units(s, active, m_flat, acc_flat, l_flat, v_chunk, u_lo, units_all):
    """exp and P.V of one chunk for a single sequence with many query tiles (prefill),
    per active (unit, KV tile) pair.

    ``s`` scores [Hkv, 1, U*R, c*TILE_K] (row-major: unit ``u``'s rows of KV tile ``t``
    are the ``R`` rows ``u*R ..`` at columns ``t*TILE_K ..``); ``active`` bool
    [Hkv, 1, U, c] with ``U`` units (query tile, head-in-group) starting at unit
    ``u_lo``; ``m_flat`` / ``l_flat`` [Hkv*units_all, R] and ``acc_flat``
    [Hkv*units_all, R, D] are the group's exp references and accumulators; ``v_chunk``
    [1, c*TILE_K, Hkv, D] is the chunk's V.

    Every active block's P is gathered with one ``index_select`` of ``TILE_K``-float
    rows, exponentiated and summed in one op each.  (KV head, KV tile) pairs are
    bucketed by KV head and by how many units are active on them, so each bucket is one
    batched matmul ``[n, k*R, TILE_K] @ [n, TILE_K, D]`` with no padding, and the
    results go into the accumulators with one ``index_add_``.
    """
    hkv, b, units, c = active.shape
    assert b == 1, "a group with several query tiles holds one sequence"
    rows = m_flat.shape[1]
    d = acc_flat.shape[-1]
    v_tiles = v_chunk.view(c, -1)
    per_tile = active.sum(2).view(-1)                                            # [Hkv*c], (head, tile)
    pair = per_tile.nonzero().squeeze(1)                                         # active (head, tile) pairs
    key = per_tile[pair] * hkv + pair // c                                       # (units active, head)
    order = torch.argsort(key, stable=True)
    pair, key = pair[order], key[order]
    keys, lens = torch.unique_consecutive(key, return_counts=True)
    act_units = active.permute(0, 1, 3, 2).reshape(-1, units)[pair]             # [n_pairs, U]
    i, u = act_units.nonzero().unbind(1)                                         # blocks, pair-major
    pair_head, pair_tile = pair // c, pair % c
    blk_head, blk_tile = pair_head[i], pair_tile[i]
    row0 = (blk_head * units + u) * rows                                         # first row in s
    src = ((row0[:, None] + torch.arange(rows)) * c + blk_tile[:, None]).view(-1)
    p = torch.index_select(s.view(-1, TILE_K), 0, src).view(-1, rows, TILE_K)
    flat = blk_head * units_all + u_lo + u
    p.sub_(m_flat[flat].unsqueeze(-1)).exp_()
    l_flat.index_add_(0, flat, p.sum(-1))
    o = torch.empty(p.shape[0], rows, d)
    p_start = blk_start = 0
    for kh, n_p in zip(keys.tolist(), lens.tolist()):
        k, h = divmod(kh, hkv)
        v = torch.index_select(v_tiles, 0, pair_tile[p_start:p_start + n_p]).view(n_p, TILE_K, hkv, d)[:, :, h]
        n_b = n_p * k
        torch.bmm(p[blk_start:blk_start + n_b].view(n_p, k * rows, TILE_K), v,
                  out=o[blk_start:blk_start + n_b].view(n_p, k * rows, d))
        p_start += n_p
        blk_start += n_b
    acc_flat.index_add_(0, flat, o)
