"""CPU (pure torch) implementation of skip-softmax paged attention.

Sequences are processed in groups: a sequence with more than ``TILE_Q`` queries is a
group of its own (its query tiles share every K/V tile), shorter ones are batched by
``next_pow2(q_len)`` (decode is the ``q_len = 1`` group).  Inside a group the loop runs
over *chunks* of consecutive KV tiles, vectorised over all (sequence, query tile, head):

1. gather the chunk's K through the block table, ``S = Q K^T`` for every visited pair
   (needed anyway: the skip test reads the tile maxima);
2. per-tile row maxima, exclusive cumulative max = dense running max, skip test;
3. exp and P.V only for the tiles that are not skipped: active (query tile, head) units
   are grouped by KV tile, the tile's V is read from the cache once and multiplied with
   the stacked P rows of exactly the active units of that tile.  Chunks with no skipped
   tile take a dense path (one exp over S, one batched matmul with the whole V chunk).

Rows are laid out as ``(query tile, head-in-group, row)`` so the query tiles still
visiting a KV tile (a suffix, causal) are a contiguous slice, and a sequence's K/V are
never duplicated across its query tiles or across the query heads sharing a KV head.
"""

from __future__ import annotations

import math

import torch

from ._common import TILE_K, TILE_Q, BatchMeta

# Chunk sizing, in elements per chunk.  Scores are a fresh tensor per chunk: 2**22 fp32
# (16 MiB) stays below glibc's largest mmap threshold, so malloc recycles it instead of
# mapping and page-faulting it afresh every chunk.  Gathered K/V live in buffers reused
# across chunks, so they may be larger: fewer chunks means less per-chunk Python work.
_SCORE_BUDGET = 1 << 22
_KV_BUDGET = 1 << 23
# The exp reference per row is only raised when a chunk's max exceeds it by this many
# nats: exp(s - m_ref) <= e**8 cannot overflow fp32, and most chunks then skip the
# full rescale of the accumulator (exact: the reference cancels in the final division).
_RESCALE_SLACK = 8.0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def forward(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    meta: BatchMeta,
    *,
    scale: float,
    causal: bool,
    threshold: float,
    count_thresholds: list[float] | None,
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fill ``out`` [T, Hq, D] and return ``(out, skipped, visited)``.

    ``threshold`` is the lambda applied (0 = dense).  With ``count_thresholds`` (a list of
    ``n`` lambdas), ``skipped`` is int64 ``[n, Hq]``: visited non-first tiles with
    ``ratio < lambda_j``; ``visited`` is int64 ``[Hq]``.  Both are ``None`` otherwise.
    """
    hq = meta.num_q_heads
    counting = count_thresholds is not None
    lams = torch.tensor(count_thresholds if counting else [], dtype=torch.float32)
    skipped = torch.zeros(len(lams), hq, dtype=torch.int64)
    visited = torch.zeros((), dtype=torch.int64)

    multi, buckets = [], {}
    for s, q_len in enumerate(meta.q_lens):
        if q_len == 0:
            continue
        if q_len > TILE_Q:
            multi.append([s])
        else:
            buckets.setdefault(_next_pow2(q_len), []).append(s)
    groups = [(seqs, TILE_Q) for seqs in multi] + [(seqs, r) for r, seqs in sorted(buckets.items())]
    bt = block_table.long()
    for seqs, rows in groups:
        visited += _run_group(query, key_cache, value_cache, bt, meta, seqs, rows, scale, causal,
                              threshold, lams if counting else None, skipped, out)
    if not counting:
        return out, None, None
    return out, skipped, visited.expand(hq).clone()


class _TileReader:
    """Reads whole KV tiles of one cache view through a group's block-table rows.

    ``bt_rows`` [B, max_blocks] long and ``kv`` [B] long describe the group's sequences.
    When a KV tile is a whole number of cache "units" (pages, or TILE_K slices of larger
    pages) the read is one ``index_select`` of units (memcpy speed for any layout whose
    token rows are contiguous, still correct for any strides); other page sizes fall
    back to per-token advanced indexing.  Positions past a sequence's end read as 0:
    their scores are masked to -inf, and 0 * garbage could be NaN.

    The result of :meth:`read` lives in a buffer reused by the next call: ``index_select``
    into a preallocated ``out`` is several times faster on CPU than letting it allocate.
    """

    def __init__(self, cache, bt_rows, kv, page_size):
        self.cache, self.bt_rows, self.kv, self.page = cache, bt_rows, kv, page_size
        self.units = None
        self.buf = torch.empty(0, dtype=cache.dtype)
        if TILE_K % page_size == 0:
            self.unit, self.units, self.per_block = page_size, cache, 1
        elif page_size % TILE_K == 0:
            split = cache.unflatten(1, (page_size // TILE_K, TILE_K))
            if split.stride(0) == split.shape[1] * split.stride(1):
                self.unit, self.per_block = TILE_K, page_size // TILE_K
                self.units = split.flatten(0, 1)

    def read(self, seq: torch.Tensor, tiles: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """KV tiles ``tiles`` [n, c] of sequences ``seq`` [n] as fp32.

        Returns ``[n, c * TILE_K, Hkv, D]``, or ``[n, c * TILE_K, D]`` for one KV ``head``.
        """
        n, c = tiles.shape
        kv = self.kv[seq][:, None]
        pos = (tiles[:, :, None] * TILE_K + torch.arange(TILE_K)).view(n, -1)
        if self.units is None:
            pos = torch.minimum(pos, kv - 1)
            blk = self.bt_rows[seq[:, None], pos // self.page]
            off = pos % self.page
            return (self.cache[blk, off] if head is None else self.cache[blk, off, head]).float()
        start = pos[:, ::self.unit]
        start = torch.minimum(start, (kv - 1) // self.unit * self.unit)
        blk = self.bt_rows[seq[:, None], start // self.page]
        ids = blk * self.per_block + (start % self.page) // self.unit
        units = self.units if head is None else self.units[:, :, head]
        shape = (n * c * TILE_K // self.unit,) + units.shape[1:]
        numel = math.prod(shape)
        if self.buf.numel() < numel:
            self.buf = torch.empty(numel, dtype=self.cache.dtype)
        x = self.buf[:numel].view(shape)
        torch.index_select(units, 0, ids.view(-1), out=x)
        x = x.view((n, c * TILE_K) + units.shape[2:]).float()
        if bool((pos[:, -1:] >= kv).any()):
            x[pos >= kv] = 0.0
        return x


def _run_group(query, key_cache, value_cache, bt, meta, seqs, rows, scale, causal, threshold, lams,
               skipped, out):
    """Attention for one group of sequences; returns the group's visited-tile count (per head).

    All sequences of the group have ``nq`` query tiles of ``rows`` rows each
    (``rows <= TILE_Q``; ``nq > 1`` only for a single-sequence group).  Per-row state is
    ``[Hkv, B, M]`` with ``M = nq * g * rows`` rows in (query tile, head-in-group, row)
    order, so one KV head's rows of a sequence are one contiguous matrix.
    """
    hkv, g, d, page = meta.num_kv_heads, meta.group, meta.head_dim, meta.page_size
    seqs = sorted(seqs, key=lambda s: -meta.seq_lens[s])  # active sequences form a prefix
    b_all = len(seqs)
    nq = -(-max(meta.q_lens[s] for s in seqs) // rows)
    units_all = nq * g

    kv = torch.tensor([meta.seq_lens[s] for s in seqs])
    q_len = torch.tensor([meta.q_lens[s] for s in seqs])
    q_start = torch.tensor([meta.q_starts[s] for s in seqs])
    bt_rows = bt[torch.tensor(seqs)].cpu()
    k_reader = _TileReader(key_cache, bt_rows, kv, page)
    v_reader = _TileReader(value_cache, bt_rows, kv, page)

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
    m_ref = torch.full(q.shape[:3], float("-inf"))
    l_sum = torch.zeros(q.shape[:3])
    acc = torch.zeros(q.shape)
    n_tiles = int(last_tile.max()) + 1
    seq_ids = torch.arange(b_all)
    visited = torch.zeros((), dtype=torch.int64)

    t0 = 0
    while t0 < n_tiles:
        b = int((kv > t0 * TILE_K).sum())
        still = (last_tile[:b] >= t0).any(0)
        qt_lo = int(still.to(torch.int8).argmax())
        nqa = nq - qt_lo
        u_lo = qt_lo * g
        row_lo = u_lo * rows
        units = units_all - u_lo
        m_rows = units * rows
        c = min(_SCORE_BUDGET // (b * hkv * m_rows * TILE_K), _KV_BUDGET // (b * hkv * TILE_K * d))
        c = max(1, min(c, n_tiles - t0))
        n_cols = c * TILE_K
        tiles = torch.arange(t0, t0 + c)

        chunk = tiles.expand(b, -1)
        k = k_reader.read(seq_ids[:b], chunk)                                    # [b, n_cols, Hkv, D]
        s = torch.empty(hkv, b, m_rows, n_cols)
        for h in range(hkv):
            torch.matmul(q[h, :b, row_lo:], k[:, :, h].transpose(1, 2), out=s[h])
        del k
        # Mask only the leading query tiles whose visible range ends inside this chunk.
        need = (limit_min_qt[:b, qt_lo:] < t0 * TILE_K + n_cols - 1).any(0)
        if bool(need.any()):
            n_mask = (int(need.nonzero()[-1]) + 1) * g * rows
            cols = t0 * TILE_K + torch.arange(n_cols)
            lim = lim_rows[:b, row_lo:row_lo + n_mask]
            s[:, :, :n_mask].masked_fill_(cols > lim[:, :, None], float("-inf"))

        tile_max = s.view(hkv, b, m_rows, c, TILE_K).amax(-1)                   # [Hkv, b, M, c]
        md = m_dense[:, :b, row_lo:]
        m_before = torch.cat([md.unsqueeze(-1), tile_max[..., :-1]], -1).cummax(-1).values
        chunk_max = tile_max.amax(-1)
        md.copy_(torch.maximum(md, chunk_max))
        ratio = torch.exp(tile_max - m_before)
        ratio = torch.where(valid_rows[:b, row_lo:, None], ratio, 0.0)
        ratio = ratio.view(hkv, b, nqa, g, rows, c).amax(4)                      # [Hkv, b, nqa, g, c]
        vis = tiles <= last_tile[:b, qt_lo:, None]                               # [b, nqa, c]
        countable = (vis & (tiles > 0)).view(1, b, nqa, 1, c)
        visited += vis.sum()
        if lams is not None and len(lams):
            r_c = torch.where(countable, ratio, float("inf"))
            hits = r_c.unsqueeze(0) < lams.view(-1, 1, 1, 1, 1, 1)
            skipped += hits.sum((2, 3, 5)).view(len(lams), -1)
        skip = countable & (ratio < threshold)

        mr = m_ref[:, :b, row_lo:]
        raise_ref = chunk_max > mr + _RESCALE_SLACK
        if bool(raise_ref.any()):
            new_ref = torch.where(raise_ref, chunk_max, mr)
            alpha = torch.where(raise_ref, torch.exp(mr - new_ref), 1.0)
            acc[:, :b, row_lo:].mul_(alpha.unsqueeze(-1))
            l_sum[:, :b, row_lo:].mul_(alpha)
            mr.copy_(new_ref)

        if not bool(skip.any()):
            p = s.sub_(mr.unsqueeze(-1)).exp_()
            l_sum[:, :b, row_lo:].add_(p.sum(-1))
            v = v_reader.read(seq_ids[:b], chunk)
            for h in range(hkv):
                acc[h, :b, row_lo:].baddbmm_(p[h], v[:, :, h])
        else:
            active = vis.view(1, b, nqa, 1, c) & ~skip                           # [Hkv, b, nqa, g, c]
            _sparse_pv(s.view(hkv, b, units, rows, c, TILE_K), mr.reshape(hkv, b, units, rows), active,
                       acc.view(-1, rows, d), l_sum.view(-1, rows), v_reader, t0, u_lo, units_all, b_all)
        del s
        t0 += c

    o = acc / l_sum.unsqueeze(-1)
    o = torch.where(l_sum.unsqueeze(-1) > 0, o, 0.0)
    o = o.view(hkv, b_all, nq, g, rows, d).permute(1, 2, 4, 0, 3, 5).reshape(b_all, nq * rows, -1, d)
    out[tok[row_valid].to(out.device)] = o[row_valid].to(out.dtype)
    return visited


def _sparse_pv(s6, m_ref, active, acc_flat, l_flat, v_reader, t0, u_lo, units_all, b_all):
    """exp and P.V for the active (unit, KV tile) pairs of one chunk.

    ``s6`` scores [Hkv, b, U, R, c, TILE_K], ``m_ref`` [Hkv, b, U, R], ``active`` bool
    [Hkv, b, nqa, g, c] with ``U = nqa * g`` units (query tile, head-in-group) starting
    at unit ``u_lo``; ``acc_flat`` [Hkv*B*units_all, R, D] and ``l_flat`` [Hkv*B*units_all, R]
    are the group's accumulators.  (KV head, KV tile) pairs are bucketed by KV head and
    by how many units are active on them, so each bucket is one batched matmul
    ``[n, k*R, TILE_K] @ [n, TILE_K, D]`` with no padding, and a tile no unit needs is
    never read.
    """
    hkv, b, units, rows, c, _ = s6.shape
    act = active.permute(0, 1, 4, 2, 3).reshape(hkv, b, c, units)
    per_tile = act.sum(-1)
    nz = act.nonzero()                                                           # sorted by (h, b, c, u)
    key = per_tile[nz[:, 0], nz[:, 1], nz[:, 2]] * hkv + nz[:, 0]
    order = torch.argsort(key, stable=True)
    nz, key = nz[order], key[order]
    keys, lens = torch.unique_consecutive(key, return_counts=True)
    start = 0
    for kh, n_e in zip(keys.tolist(), lens.tolist()):
        k, h = divmod(kh, hkv)
        eh, eb, ec, eu = nz[start:start + n_e].unbind(1)
        start += n_e
        p = s6[h, eb, eu, :, ec, :]                                             # [n_e, R, TILE_K]
        p = p.sub_(m_ref[h, eb, eu].unsqueeze(-1)).exp_()
        flat = (h * b_all + eb) * units_all + u_lo + eu
        l_flat.index_add_(0, flat, p.sum(-1))
        v = v_reader.read(eb[::k], (t0 + ec[::k])[:, None], h)               # [n_e/k, TILE_K, D]
        o = torch.bmm(p.view(-1, k * rows, p.shape[-1]), v)
        acc_flat.index_add_(0, flat, o.view(n_e, rows, -1))
