"""CPU (pure torch) implementation of skip-softmax paged attention.

Sequences are processed in groups: a sequence with more than ``TILE_Q`` queries is a
group of its own (its query tiles share every K/V tile), shorter ones are batched by
``next_pow2(q_len)`` (decode is the ``q_len = 1`` group).  Each sequence walks its
visited KV tiles from the first tile its first query tile visits (tile 0 without a sliding
window, the first tile of the window with one), so a windowed decode reads its window
only.  The rule's anchor is tile 0 without a window, whose maxima seed the running max as
the walk reads it; with one it is each query tile's diagonal tile, whose maxima are
computed before the walk (:meth:`_Group._diagonal_seed`: one more K tile per query tile).
Inside a group the loop runs over *chunks* of consecutive walked tiles, vectorised over
all (sequence, query tile, head) (:meth:`_Group.chunk`):

1. gather the chunk's K through the block table, ``S = Q K^T`` for every visited pair
   (needed anyway: the skip test reads the tile maxima), soft-cap, mask; K is gathered
   and multiplied in cache-sized runs of sequences, so it is read from memory once;
2. per-tile row maxima, the rule's dense running max, skip test (not evaluated at all
   when every lambda is 0 and no counts are asked for);
3. exp and P.V only for the tiles that are not skipped (:mod:`.torch_pv`); chunks with no
   skipped tile take a dense path (one exp over S, batched matmuls with the V chunk).

Rows are laid out as ``(query tile, head-in-group, row)`` so the query tiles visiting a
KV tile are a contiguous slice, and a sequence's K/V are never duplicated across its
query tiles or across the query heads sharing a KV head.
"""

from __future__ import annotations

import torch

from ._common import SPLIT_K, TILE_K, TILE_Q, next_pow2
from .batch import BatchMeta, LayerSpec, PagedBatch
from .torch_pv import sparse_pv_tiles, sparse_pv_units
from .torch_tiles import TileReader, sub_batches

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
# Initial exp reference: finite, so a row that has seen nothing yet (a windowed query
# tile before its window) computes exp(-inf - ref) = 0, never exp(-inf + inf) = NaN; any
# finite logit raises it (it exceeds it by far more than the slack).
_NO_REF = -1e30
_NEG_INF = float("-inf")


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
    if not meta.seq_lens_exact:                  # host tensors: exact lengths cost no sync
        meta = BatchMeta.from_host(batch.seq_lens, batch.query_start_loc)

    multi, buckets = [], {}
    for s, q_len in enumerate(meta.q_lens):
        if q_len == 0:
            continue
        if q_len > TILE_Q:
            multi.append([s])
        else:
            buckets.setdefault(next_pow2(q_len), []).append(s)
    groups = [(seqs, TILE_Q) for seqs in multi] + [(seqs, r) for r, seqs in sorted(buckets.items())]
    block_table = batch.block_table.long()
    for seqs, rows in groups:
        group = _Group(batch, spec, meta, block_table, seqs, rows, threshold,
                       count_thresholds if n_thr else None, split_k // TILE_K)
        visited += group.run(skipped, out)
    if not counting:
        return out, None, None
    return out, skipped, visited.expand(hq).clone()


def _group_lambdas(threshold: torch.Tensor, seqs: list[int]):
    """The group's serving lambda: a float when all its sequences share it, else float32 ``[B]``."""
    lam = threshold[seqs]
    if bool((lam == lam[0]).all()):
        return float(lam[0])
    return lam


class _Group:
    """One group of sequences, all with ``nq`` query tiles of ``rows`` rows each
    (``rows <= TILE_Q``; ``nq > 1`` only for a single-sequence group).

    Per-row state is ``[Hkv, B, M]`` with ``M = nq * g * rows`` rows in (query tile,
    head-in-group, row) order, so one KV head's rows of a sequence are one contiguous
    matrix.  Sequences are ordered by walked tiles, longest first, so the sequences still
    walking at a chunk are a prefix; tile indices in a chunk are relative to each
    sequence's ``base`` (the first tile its first query tile visits).
    """

    def __init__(self, batch, spec, meta, block_table, seqs, rows, threshold, lams, tiles_per_split):
        self.hkv, self.g, self.d = batch.num_kv_heads, batch.group, batch.head_dim
        self.rows, self.tiles_per_split = rows, tiles_per_split
        self.window, self.cap = spec.window, spec.soft_cap
        self.sink_logits, self.v_scale = spec.sink_logits, spec.v_scale
        w = self.window
        walk = {}
        for s in seqs:                  # host ints: the first query tile's first tile .. the last tile
            kv, q_len = meta.seq_lens[s], meta.q_lens[s]
            base = max(0, kv - q_len - w + 1) // TILE_K if w is not None else 0
            walk[s] = (base, (kv - 1) // TILE_K - base + 1)
        seqs = sorted(seqs, key=lambda s: -walk[s][1])
        self.seqs, self.n_walk = seqs, [walk[s][1] for s in seqs]
        self.threshold = _group_lambdas(threshold, seqs)
        self.lams = None if lams is None else lams[:, seqs]                     # [n, B]
        # Visited tiles count only for a sequence some counted lambda can skip in (_common).
        self.count_visited = None if lams is None else (self.lams > 0).any(0)   # [B]
        # Serving with lambda = 0 for every sequence and no counts: nothing can be skipped,
        # so the skip test (tile maxima, dense running max, ratios) is not evaluated at all.
        self.test = lams is not None or isinstance(self.threshold, torch.Tensor) or self.threshold > 0
        b_all = self.b_all = len(seqs)
        nq = self.nq = -(-max(meta.q_lens[s] for s in seqs) // rows)
        self.units_all = nq * self.g

        kv = torch.tensor([meta.seq_lens[s] for s in seqs])
        q_len = torch.tensor([meta.q_lens[s] for s in seqs])
        q_start = torch.tensor([meta.q_starts[s] for s in seqs])
        self.base = torch.tensor([walk[s][0] for s in seqs])
        bt_rows = block_table[torch.tensor(seqs)] if b_all < block_table.shape[0] or seqs != list(range(b_all)) \
            else block_table
        self.k_reader = TileReader(batch.key_cache, bt_rows, kv, batch.page_size, "k")
        self.v_reader = TileReader(batch.value_cache, bt_rows, kv, batch.page_size, "v")

        r = torch.arange(nq * rows)
        self.row_valid = r[None, :] < q_len[:, None]                             # [B, nq*rows]
        last_row = torch.minimum(r[None, :], q_len[:, None] - 1)                # padding -> the last row
        self.tok = q_start[:, None] + last_row
        pos = kv[:, None] - q_len[:, None] + last_row                           # each row's position
        limit = pos if spec.causal else (kv - 1)[:, None].expand(-1, nq * rows)
        lo = (pos - w + 1).clamp(min=0) if w is not None else torch.zeros_like(limit)
        # Walked tiles per query tile, relative to base: first .. last.
        self.first = lo.view(b_all, nq, rows).amin(-1) // TILE_K - self.base[:, None]     # [B, nq]
        self.last = limit.view(b_all, nq, rows).amax(-1) // TILE_K - self.base[:, None]   # [B, nq]
        # Each query tile's anchor, the one walked tile never skippable (relative to base):
        # its diagonal tile (last) with a window, tile 0 (first) without.
        self.anchor_tile = self.last if w is not None else self.first                     # [B, nq]
        self.limit_min_qt = limit.view(b_all, nq, rows).amin(-1)                # [B, nq] absolute
        self.lo_max_qt = lo.view(b_all, nq, rows).amax(-1)
        per_row = lambda x: x.view(b_all, nq, 1, rows).expand(-1, -1, self.g, -1).reshape(b_all, -1)
        self.lim_rows, self.lo_rows, self.valid_rows = per_row(limit), per_row(lo), per_row(self.row_valid)
        # Each row's query tile's first walked tile, relative to base, per (B, M) row (the
        # anchor without a window).
        self.first_rows = self.first.view(b_all, nq, 1, 1).expand(-1, -1, self.g, rows).reshape(b_all, -1)

        hkv, g, d = self.hkv, self.g, self.d
        q = batch.query[self.tok].float().mul_(float(spec.scale))
        if isinstance(spec.k_scale, torch.Tensor) or spec.k_scale != 1.0:
            q.mul_(spec.k_scale)                            # k_scale folds into the logit scale
        self.q = q.view(b_all, nq, rows, hkv, g, d).permute(3, 0, 1, 4, 2, 5).reshape(hkv, b_all, -1, d)
        shape = self.q.shape[:3]
        # The anchors' maxima: a windowed query tile's anchor is its last tile, so they are
        # computed before the walk (the running max starts from them); tile 0's are set when
        # the walk reads it.
        self.m_seed = self._diagonal_seed() if self.window is not None and self.test \
            else torch.full(shape, _NEG_INF)
        self.m_dense = self.m_seed.clone()
        self.m_ref = torch.full(shape, _NO_REF)
        self.l_sum = torch.zeros(shape)
        self.acc = torch.zeros(self.q.shape)

    def _diagonal_seed(self) -> torch.Tensor:
        """The rule's seed of windowed rows: each row's maxima over its query tile's anchor,
        the tile ``last`` (its diagonal tile), -inf where the row sees nothing of it; fp32
        ``[Hkv, B, M]``.  One Q.K^T of one K tile per (sequence, query tile), in chunks of
        query tiles whose scores stay within the chunk budget."""
        hkv, g, d, rows, b_all, nq = self.hkv, self.g, self.d, self.rows, self.b_all, self.nq
        per_qt = g * rows
        seed = torch.full((hkv, b_all, nq, per_qt), _NEG_INF)
        walked = self.last >= self.first                                        # [B, nq] query tiles with rows
        pairs = walked.nonzero()
        if pairs.numel() == 0:
            return seed.view(hkv, b_all, -1)
        q = self.q.view(hkv, b_all, nq, per_qt, d)
        lim = self.lim_rows.view(b_all, nq, per_qt)
        lo = self.lo_rows.view(b_all, nq, per_qt)
        step = max(1, min(_SCORE_BUDGET // (per_qt * TILE_K), _KV_BUDGET // (TILE_K * d)))   # per KV head
        for i in range(0, pairs.shape[0], step):
            bs, qts = pairs[i:i + step, 0], pairs[i:i + step, 1]
            tile = self.last[bs, qts]                                           # relative to base
            cols = (self.base[bs] + tile)[:, None, None] * TILE_K + torch.arange(TILE_K)   # [n, 1, 64]
            hide = (cols > lim[bs, qts, :, None]) | (cols < lo[bs, qts, :, None])         # [n, per_qt, 64]
            plan = self.k_reader.plan_tiles(bs, self.base[bs] + tile)           # the anchors only
            pick = torch.arange(bs.shape[0])
            for h in range(hkv):
                k = self.k_reader.read_tiles(plan, pick, 0, h)                  # [n, 64, D]
                sc = torch.matmul(q[h, bs, qts], k.transpose(1, 2))             # [n, per_qt, 64]
                if self.cap is not None:
                    sc.div_(self.cap).tanh_().mul_(self.cap)
                seed[h, bs, qts] = sc.masked_fill_(hide, _NEG_INF).amax(-1)
        return seed.view(hkv, b_all, -1)

    def run(self, skipped: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Walk every chunk, then normalise into ``out``; returns the visited-tile count (per head)."""
        visited = torch.zeros((), dtype=torch.int64)
        t0, n_walk = 0, self.n_walk[0]
        while t0 < n_walk:
            t0, vis = self.chunk(t0, skipped)
            visited += vis
        self.finish(out)
        return visited

    def chunk(self, t0: int, skipped: torch.Tensor):
        """One chunk of walked tiles from relative tile ``t0``; returns ``(next t0, visited)``."""
        hkv, g, d, rows = self.hkv, self.g, self.d, self.rows
        b = sum(1 for n in self.n_walk if n > t0)             # the sequences still walking: a prefix
        # One sequence with several query tiles: those whose walk reaches t0 ..
        qt_lo = int((self.last[0] >= t0).to(torch.int8).argmax()) if self.nq > 1 else 0
        units_est = self.units_all - qt_lo * g
        c = min(_SCORE_BUDGET // (b * hkv * units_est * rows * TILE_K), _KV_BUDGET // (b * hkv * TILE_K * d))
        c = max(1, min(c, self.n_walk[0] - t0))
        # .. and whose anchor is at or before the chunk's last tile.
        qt_hi = self.nq - 1 if self.nq == 1 else int((self.first[0] <= t0 + c - 1).sum()) - 1
        nqa = qt_hi - qt_lo + 1
        u_lo, u_hi = qt_lo * g, (qt_hi + 1) * g
        row_lo, row_hi = u_lo * rows, u_hi * rows
        m_rows, n_cols = (u_hi - u_lo) * rows, c * TILE_K
        tiles = torch.arange(t0, t0 + c)

        k_plan = self.k_reader.plan(b, t0, c, self.base)
        v_plan = k_plan if self.v_reader.kind == self.k_reader.kind else self.v_reader.plan(b, t0, c, self.base)
        runs = sub_batches(b, n_cols * hkv * d)
        s = torch.empty(hkv, b, m_rows, n_cols)
        for b0, b1 in runs:
            k = self.k_reader.read(k_plan, b0, b1)                              # [nb, n_cols, Hkv, D]
            for h in range(hkv):
                torch.matmul(self.q[h, b0:b1, row_lo:row_hi], k[:, :, h].transpose(1, 2), out=s[h, b0:b1])
        del k
        if self.cap is not None:
            s.div_(self.cap).tanh_().mul_(self.cap)
        self._mask(s, b, t0, n_cols, qt_lo, qt_hi)

        vis = (tiles >= self.first[:b, qt_lo:qt_hi + 1, None]) & (tiles <= self.last[:b, qt_lo:qt_hi + 1, None])
        skip_any, skip = False, None
        if self.test:
            tile_max = s.view(hkv, b, m_rows, c, TILE_K).amax(-1)               # [Hkv, b, M, c]
            skip = self._skip_test(tile_max, b, t0, c, qt_lo, nqa, vis, skipped)
            skip_any = bool(skip.any())
            chunk_max = tile_max.amax(-1)
        else:
            chunk_max = s.amax(-1)
        self._raise_ref(chunk_max, b, row_lo, row_hi)
        if not skip_any:
            p = s.sub_(self.m_ref[:, :b, row_lo:row_hi].unsqueeze(-1)).exp_()
            self.l_sum[:, :b, row_lo:row_hi].add_(p.sum(-1))
            for b0, b1 in runs:
                v = self.v_reader.read(v_plan, b0, b1)
                for h in range(hkv):
                    self.acc[h, b0:b1, row_lo:row_hi].baddbmm_(p[h, b0:b1], v[:, :, h])
        else:
            active = (vis.view(1, b, nqa, 1, c) & ~skip).view(hkv, b, u_hi - u_lo, c)  # [Hkv, b, U, c]
            if self.nq == 1:
                sparse_pv_tiles(s, active, self.m_ref, self.acc, self.l_sum, self.v_reader, v_plan)
            else:
                sparse_pv_units(s, active, self.m_ref.view(-1, rows), self.acc.view(-1, rows, d),
                                self.l_sum.view(-1, rows), self.v_reader.read(v_plan, 0, 1), u_lo, self.units_all)
        if self.count_visited is None:
            return t0 + c, vis.sum()
        return t0 + c, (vis & self.count_visited[:b, None, None]).sum()

    def _mask(self, s, b, t0, n_cols, qt_lo, qt_hi):
        """-inf where a row does not see a column: past its position (causal) or before its
        window; only the query tiles of the chunk that have such columns are touched."""
        col0 = (self.base[:b] + t0) * TILE_K                                     # [b] absolute
        qts = slice(qt_lo, qt_hi + 1)
        need = (self.limit_min_qt[:b, qts] < (col0 + n_cols - 1)[:, None]).any(0)
        if self.window is not None:
            need |= (self.lo_max_qt[:b, qts] > col0[:, None]).any(0)
        if not bool(need.any()):
            return
        idx = need.nonzero()[:, 0]
        q_a, q_b = int(idx[0]), int(idx[-1]) + 1                                 # query tiles, chunk-relative
        per_qt = self.g * self.rows
        r_a, r_b = (qt_lo + q_a) * per_qt, (qt_lo + q_b) * per_qt
        cols = col0[:, None, None] + torch.arange(n_cols)                        # [b, 1, n_cols]
        hide = cols > self.lim_rows[:b, r_a:r_b, None]
        if self.window is not None:
            hide |= cols < self.lo_rows[:b, r_a:r_b, None]
        off = qt_lo * per_qt
        s[:, :, r_a - off:r_b - off].masked_fill_(hide, _NEG_INF)

    def _skip_test(self, tile_max, b, t0, c, qt_lo, nqa, vis, skipped):
        """The rule on one chunk of query tiles ``qt_lo ..`` (``nqa`` of them): seeds,
        running max, ratios, counts; returns the serving skip mask ``[Hkv, b, nqa, g, c]``."""
        hkv, g, rows = self.hkv, self.g, self.rows
        row_lo, row_hi = qt_lo * g * rows, (qt_lo + nqa) * g * rows
        if self.window is None:   # tile 0 anchors: its maxima are the seed once the walk reads it
            anchor = self.first_rows[:b, row_lo:row_hi] - t0                    # [b, M] chunk-relative
            here = (anchor >= 0) & (anchor < c)
            if bool(here.any()):
                at = tile_max.gather(-1, anchor.clamp(0, c - 1).expand(hkv, -1, -1).unsqueeze(-1)).squeeze(-1)
                seed = self.m_seed[:, :b, row_lo:row_hi]
                seed.copy_(torch.where(here, at, seed))
        phase = (self.base[:b] + t0) % self.tiles_per_split
        phase = int(phase[0]) if bool((phase == phase[0]).all()) else phase
        md = self.m_dense[:, :b, row_lo:row_hi]
        m_before, m_after = _split_cummax(tile_max, md, self.m_seed[:, :b, row_lo:row_hi], phase,
                                          self.tiles_per_split)
        md.copy_(m_after)
        e = torch.exp(tile_max - m_before)
        if self.window is not None:      # a row that sees nothing of a tile does not vote (0, not NaN)
            e = torch.where(tile_max == _NEG_INF, 0.0, e)
        e = torch.where(self.valid_rows[:b, row_lo:row_hi, None], e, 0.0)
        ratio = e.view(hkv, b, nqa, g, rows, c).amax(4)                         # [Hkv, b, nqa, g, c]
        tiles = torch.arange(t0, t0 + c)
        countable = (vis & (tiles != self.anchor_tile[:b, qt_lo:qt_lo + nqa, None])).view(1, b, nqa, 1, c)
        if self.lams is not None:
            r_c = torch.where(countable, ratio, float("inf"))
            hits = r_c.unsqueeze(0) < self.lams[:, :b].reshape(-1, 1, b, 1, 1, 1)
            skipped += hits.sum((2, 3, 5)).view(len(self.lams), -1)
        lam = self.threshold
        if isinstance(lam, torch.Tensor):
            return countable & (ratio < lam[:b].view(1, b, 1, 1, 1))
        return countable & (ratio < lam)

    def _raise_ref(self, chunk_max, b, row_lo, row_hi):
        ref = self.m_ref[:, :b, row_lo:row_hi]
        raise_ref = chunk_max > ref + _RESCALE_SLACK
        if bool(raise_ref.any()):
            new_ref = torch.where(raise_ref, chunk_max, ref)
            alpha = torch.where(raise_ref, torch.exp(ref - new_ref), 1.0)
            self.acc[:, :b, row_lo:row_hi].mul_(alpha.unsqueeze(-1))
            self.l_sum[:, :b, row_lo:row_hi].mul_(alpha)
            ref.copy_(new_ref)

    def finish(self, out: torch.Tensor) -> None:
        """Normalise (sinks in the denominator, v_scale on the output) and store the valid rows."""
        hkv, g, rows, nq, d, b_all = self.hkv, self.g, self.rows, self.nq, self.d, self.b_all
        v_scale = self.v_scale
        if self.sink_logits is not None:
            sink = self.sink_logits.float().view(hkv, 1, 1, g, 1).expand(hkv, b_all, nq, g, rows).reshape(self.m_ref.shape)
            m_fin = torch.maximum(self.m_ref, sink)
            alpha = torch.exp(self.m_ref - m_fin)
            o = self.acc * (alpha / (self.l_sum * alpha + torch.exp(sink - m_fin))).unsqueeze(-1)
        else:
            o = self.acc / self.l_sum.unsqueeze(-1)
            # A row that sees nothing (l = 0) is 0; a NaN l stays NaN (the NaN policy, _common).
            o = torch.where(self.l_sum.unsqueeze(-1) == 0, 0.0, o)
        if isinstance(v_scale, torch.Tensor) or v_scale != 1.0:
            o = o * v_scale
        o = o.view(hkv, b_all, nq, g, rows, d).permute(1, 2, 4, 0, 3, 5).reshape(b_all, nq * rows, -1, d)
        out[self.tok[self.row_valid].to(out.device)] = o[self.row_valid].to(out.dtype)


def _split_cummax(tile_max, md, seed, phase, tiles_per_split):
    """Dense running max of the rule over one chunk: within a split, restarted from the
    seed (the anchors' maxima) at every split boundary.

    ``tile_max`` [Hkv, b, M, c] holds a chunk of ``c`` walked tiles; ``md`` [Hkv, b, M] is
    the running max carried in from the walked tiles before the chunk (before the first
    chunk: the seed of windowed rows, -inf while tile 0 is not read yet); ``seed`` [Hkv, b, M] the
    anchors' maxima; ``phase`` the position of the chunk's first tile in its split (an int,
    or long [b] when sequences differ).  Returns ``(m_before [Hkv, b, M, c], m_after
    [Hkv, b, M])``.  A boundary at or before a row's first visited tile restarts from the
    seed too: harmless, the row sees nothing of earlier tiles (-inf), so its running max is
    the seed there anyway (with the tile-0 anchor: the anchor is never skippable and its
    own maxima are the seed).
    """
    c, tps = tile_max.shape[-1], tiles_per_split
    if isinstance(phase, int) and phase + c <= tps:      # one split: no boundary except maybe at the start
        init = md if phase else seed
        cm = torch.cat([init.unsqueeze(-1), tile_max], -1).cummax(-1).values
        return cm[..., :-1], cm[..., -1]
    hkv, b, m = md.shape
    first = torch.as_tensor(phase).expand(b)                                    # [b]
    n_seg = -(-(int(first.max()) + c) // tps)
    # Tile i of sequence b sits at position first[b] + i of a grid of n_seg whole splits.
    idx = (first[:, None] + torch.arange(c)).view(1, b, 1, c).expand(hkv, b, m, c)
    padded = tile_max.new_full((hkv, b, m, n_seg * tps), _NEG_INF).scatter_(-1, idx, tile_max)
    init = seed.unsqueeze(-1).expand(hkv, b, m, n_seg).clone()
    init[..., 0] = torch.where((first > 0).view(1, b, 1), md, seed)             # a chunk starting mid-split
    cm = torch.cat([init.unsqueeze(-1), padded.view(hkv, b, m, n_seg, tps)], -1).cummax(-1).values
    m_before = cm[..., :-1].reshape(hkv, b, m, n_seg * tps).gather(-1, idx)
    end = first + c - 1
    at_end = ((end // tps) * (tps + 1) + end % tps + 1).view(1, b, 1, 1).expand(hkv, b, m, 1)
    return m_before, cm.reshape(hkv, b, m, -1).gather(-1, at_end).squeeze(-1)
