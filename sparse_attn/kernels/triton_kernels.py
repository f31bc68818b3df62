"""The Triton kernels of skip-softmax paged attention (launched by :mod:`.triton_impl`).

One program per (query tile, KV head, head chunk, KV program).  A program holds
``HEADS`` query heads of one KV group as one packed block of ``HEADS * BLOCK_M`` rows
(row ``i`` is head ``i // BLOCK_M`` of the program, query row ``row0 + i % BLOCK_M``), so
each K and V tile it needs is read once for all of them; the skip decision stays per
query head (the rule of :mod:`sparse_attn.kernels._common`) and a V tile is read when any
head of the program keeps it (heads that skip it get ``P = 0`` and no rescale).

``SPLIT`` (decode, every query length <= 1): the program walks a contiguous run of whole
rule splits of its sequence (``num_programs(2)`` programs share them) and writes an
unnormalised partial (accumulator, exp reference, row sum) that
:func:`merge_splits_kernel` combines by log-sum-exp; otherwise the program walks all of
its query tile's tiles and writes the output.  Two running maxima per row: the dense one
of the rule (every visited tile; starting from the anchor's maxima, the seed, and
restarted from them at split boundaries; a windowed query tile's anchor is its diagonal
tile, so its programs compute the seed before walking)
and the exp reference (kept tiles only).  Lambdas are read from per-sequence fp32 arrays
(``LAM[seq]`` serving, ``THRESH[seq, :]`` counting), so changing them never recompiles.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_nan(a, b):
    """Maximum that is NaN when either operand is (``tl.max`` / ``tl.maximum`` drop NaN):
    the NaN policy of :mod:`sparse_attn.kernels._common`."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _logits(q, k, qk_scale, soft_cap, SOFT_CAP: tl.constexpr, FP32_DOT: tl.constexpr):
    """``[rows, BLOCK_N]`` logits of a K tile ``k`` [BLOCK_D, BLOCK_N] (any cache dtype)."""
    if FP32_DOT:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, k.to(q.dtype)) * qk_scale
    if SOFT_CAP:
        # cap * tanh(s / cap), tanh from exp (libdevice's has no interpreter form):
        # tanh(x) = sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|}), no overflow for any x.
        x = s / soft_cap
        z = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - z) / (1.0 + z)
        s = soft_cap * tl.where(x < 0, -t, t)
    return s


@triton.jit
def _rule_lambda(kv_len, lam_hi, lam_mid, lam_lo, lam_window):
    """``kernels.checks.effective_lambda`` of KV lengths ``kv_len`` (a scalar or a block), in
    float64 exactly as its device form: the scale factor arrives as three fp32 parts whose
    fp64 sum is the host double (:func:`triton_impl.f64_parts`), ``scale * (1 / norm)`` as
    torch's ``scalar / tensor`` computes it, dense (0) where lambda is not in (0, 1)."""
    norm = tl.cast(kv_len, tl.float64)
    norm = tl.where(lam_window > 0, tl.minimum(norm, tl.cast(lam_window, tl.float64)), norm)
    factor = (tl.cast(lam_hi, tl.float64) + tl.cast(lam_mid, tl.float64)) + tl.cast(lam_lo, tl.float64)
    lam = factor * (1.0 / norm)
    return tl.where((lam > 0) & (lam < 1), lam, 0.0).to(tl.float32)


@triton.jit
def _count_launch(COUNTERS, SEQ_LENS, QSL, LAM, num_seqs, lam_hi, lam_mid, lam_lo, lam_window,
                  LAM_RULE: tl.constexpr, SLOT_LAUNCHES: tl.constexpr, SLOT_DENSE: tl.constexpr):
    """One program of the launch adds it as sparse (some sequence with query rows has
    lambda > 0) or dense to ``COUNTERS``."""
    offs = tl.arange(0, 128)
    sparse = tl.zeros([128], tl.int32)
    for s0 in range(0, num_seqs, 128):
        s = s0 + offs
        ok = s < num_seqs
        q_len = tl.load(QSL + s + 1, mask=ok, other=0) - tl.load(QSL + s, mask=ok, other=0)
        if LAM_RULE:
            lam = _rule_lambda(tl.load(SEQ_LENS + s, mask=ok, other=0), lam_hi, lam_mid, lam_lo, lam_window)
        else:
            lam = tl.load(LAM + s, mask=ok, other=0.0)
        sparse = tl.maximum(sparse, ((lam > 0) & (q_len > 0) & ok).to(tl.int32))
    any_sparse = tl.max(sparse, 0).to(tl.int64)
    tl.atomic_add(COUNTERS + SLOT_LAUNCHES, any_sparse)
    tl.atomic_add(COUNTERS + SLOT_DENSE, 1 - any_sparse)


#: Arguments Triton must not specialise on (== 1, divisible by 16, a pointer's alignment): the
#: ints that change with the batch, and those the install warm-up cannot know before vLLM
#: allocates the cache (page size, block and table strides; the block table and length arrays,
#: which are views at any offset). So a new batch never compiles a variant on live traffic; the
#: head counts and the head/dim strides stay specialised (fixed per model, they vectorise loads).
PAGED_DO_NOT_SPECIALIZE = ("BT", "SEQ_LENS", "QSL", "num_thresh", "num_seqs", "page_size", "stride_kb", "stride_vb",
                           "stride_bts")
MERGE_DO_NOT_SPECIALIZE = ("QSL", "num_progs")


@triton.jit(do_not_specialize=list(PAGED_DO_NOT_SPECIALIZE))
def paged_attn_kernel(
    Q, K, V, O, BT, SEQ_LENS, QSL, TILE_SEQ, TILE_ROW0,
    LAM, THRESH, SKIP_CNT, VIS_CNT, O_PART, M_PART, L_PART, SINKS, K_SCALE, V_SCALE, COUNTERS,
    scale, v_scale, soft_cap, window, num_thresh, page_size, tiles_per_split, num_seqs, num_q_heads,
    lam_hi, lam_mid, lam_lo, lam_window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    SCALE_PTRS: tl.constexpr, COUNT: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
    TILE_MAP: tl.constexpr, LAM_RULE: tl.constexpr, ACCUMULATE: tl.constexpr,
    SLOT_SKIPPED: tl.constexpr, SLOT_VISITED: tl.constexpr, SLOT_LAUNCHES: tl.constexpr, SLOT_DENSE: tl.constexpr,
    SLOT_V_TESTED: tl.constexpr, SLOT_V_SKIPPED: tl.constexpr,
):
    N_HCHUNKS: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    ROWS: tl.constexpr = HEADS * BLOCK_M
    pid = tl.program_id(0)
    kv_head = tl.program_id(1) // N_HCHUNKS
    h_lo = (tl.program_id(1) % N_HCHUNKS) * HEADS          # first head-in-group of this program
    sp = tl.program_id(2)
    n_progs = tl.num_programs(2)

    if TILE_MAP:
        seq_raw = tl.load(TILE_SEQ + pid)
        row0 = tl.load(TILE_ROW0 + pid)
    else:                                                  # decode: program pid is sequence pid, row 0
        seq_raw = pid
        row0 = 0
    live = seq_raw < num_seqs                              # surplus programs (upper-bound grid) do nothing
    seq = tl.minimum(seq_raw, num_seqs - 1).to(tl.int64)
    q_start = tl.load(QSL + seq)
    q_len = tl.where(live, tl.load(QSL + seq + 1) - q_start, 0)
    kv_len = tl.load(SEQ_LENS + seq)

    offs_r = tl.arange(0, ROWS)
    row_head = offs_r // BLOCK_M                           # head-in-program of each packed row
    rows = row0 + offs_r % BLOCK_M
    prog_heads = tl.arange(0, HEADS)
    prog_head_ok = h_lo + prog_heads < GROUP
    head_ok = h_lo + row_head < GROUP
    heads = kv_head * GROUP + h_lo + row_head
    row_ok = (rows < q_len) & head_ok
    last_row = tl.minimum(row0 + BLOCK_M, q_len) - 1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # Each row's visible range [lo, limit]; padding rows take the last valid row's.
    pos = kv_len - q_len + tl.minimum(rows, last_row)
    if CAUSAL:
        limit = pos
        last = (kv_len - q_len + last_row) // BLOCK_N
    else:
        limit = tl.zeros([ROWS], dtype=tl.int32) + kv_len - 1
        last = (kv_len - 1) // BLOCK_N
    if WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
        first = tl.maximum(kv_len - q_len + row0 - window + 1, 0) // BLOCK_N
    else:
        lo = tl.zeros([ROWS], dtype=tl.int32)
        first = 0
    last = tl.where(row0 < q_len, last, first - 1)                             # nothing to walk
    # The anchor (never skipped, its maxima seed the running max): the diagonal tile of a
    # windowed query tile, tile 0 otherwise.
    if WINDOW:
        anchor = last
    else:
        anchor = first
    if SPLIT:
        # Whole rule splits, a contiguous run per program: splits first // tps .. last // tps.
        j_first = first // tiles_per_split
        per_prog = tl.cdiv(last // tiles_per_split - j_first + 1, n_progs)
        j_lo = j_first + sp * per_prog
        t_lo = tl.maximum(first, j_lo * tiles_per_split)
        t_hi = tl.minimum(last + 1, (j_lo + per_prog) * tiles_per_split)
    else:
        t_lo = first
        t_hi = last + 1

    q_ptrs = Q + (q_start + rows)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # same_head[h, i]: packed row i belongs to head-in-program h (per-head reductions).
    same_head = row_head[None, :] == prog_heads[:, None]
    qk_scale = scale
    if SCALE_PTRS:
        qk_scale = scale * tl.load(K_SCALE).to(tl.float32)

    m_ref = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    if LAM_RULE:
        lam_s = _rule_lambda(kv_len, lam_hi, lam_mid, lam_lo, lam_window)
    else:
        lam_s = tl.load(LAM + seq)
    if COUNT:
        thresh = tl.load(THRESH + seq * BLOCK_T + offs_t, mask=offs_t < num_thresh, other=-1.0)
    skip_cnt = tl.zeros([HEADS, BLOCK_T], tl.int32)
    skip_h = tl.zeros([HEADS], tl.int32)                   # ACCUMULATE: tiles each head skipped
    v_skip = 0                                             # ACCUMULATE: tiles no head of the program kept (V unread)

    # The anchor's maxima seed the dense running max, and every later split restarts from
    # them (the rule).  A program that does not start at the anchor (a windowed one, or a
    # split program after the first) computes them first: one extra K tile and Q.K^T.
    m_seed = tl.full([ROWS], float("-inf"), tl.float32)
    if t_lo != anchor:
        if t_lo < t_hi:
            cols0 = anchor * BLOCK_N + tl.arange(0, BLOCK_N)
            col0_ok = cols0 < kv_len
            blk0 = tl.load(BT + seq * stride_bts + (cols0 // page_size) * stride_btb, mask=col0_ok,
                           other=0).to(tl.int64)
            k0 = tl.load(K + (blk0 * stride_kb + (cols0 % page_size) * stride_kp)[None, :] + kv_head * stride_kh
                         + offs_d[:, None] * stride_kd, mask=col0_ok[None, :] & d_ok[:, None], other=0.0)
            s0 = _logits(q, k0, qk_scale, soft_cap, SOFT_CAP, FP32_DOT)
            seen0 = col0_ok[None, :] & (cols0[None, :] <= limit[:, None]) & (cols0[None, :] >= lo[:, None])
            m_seed = tl.reduce(tl.where(seen0, s0, float("-inf")), 1, _max_nan)
    m_dense = m_seed

    for t in range(t_lo, t_hi):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        blk = tl.load(BT + seq * stride_bts + (cols // page_size) * stride_btb, mask=col_ok, other=0).to(tl.int64)
        tok = blk * stride_kb + (cols % page_size) * stride_kp
        k = tl.load(K + tok[None, :] + kv_head * stride_kh + offs_d[:, None] * stride_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        s = _logits(q, k, qk_scale, soft_cap, SOFT_CAP, FP32_DOT)
        seen = col_ok[None, :] & (cols[None, :] <= limit[:, None]) & (cols[None, :] >= lo[:, None])
        s = tl.where(seen, s, float("-inf"))
        tile_max = tl.reduce(s, 1, _max_nan)                 # NaN policy: a NaN logit reaches the ratio
        m_seed = tl.where(t == anchor, tile_max, m_seed)
        # The rule's dense running max restarts from the anchor's maxima at every split
        # boundary after the anchor; the anchor itself is never skippable (+inf).
        m_dense = tl.where(((t % tiles_per_split) == 0) & (t != anchor), m_seed, m_dense)
        # A row that sees nothing of the tile does not vote (0), one whose running max is
        # still empty keeps it (inf); no -inf - -inf is ever computed.
        no_max = m_dense == float("-inf")
        e = tl.exp(tile_max - tl.where(no_max, 0.0, m_dense))
        e = tl.where(tile_max == float("-inf"), 0.0, tl.where(no_max, float("inf"), e))
        ratio = tl.where(row_ok, e, 0.0)
        ratio_h = tl.reduce(tl.where(same_head, ratio[None, :], 0.0), 1, _max_nan)  # [HEADS]
        ratio_h = tl.where(t == anchor, float("inf"), ratio_h)
        m_dense = _max_nan(m_dense, tile_max)
        if COUNT:
            skip_cnt += ((ratio_h[:, None] < thresh[None, :]) & prog_head_ok[:, None]).to(tl.int32)
        if ACCUMULATE:
            skip_h += ((ratio_h < lam_s) & prog_head_ok).to(tl.int32)
        keep_h = ~(ratio_h < lam_s) & prog_head_ok                                # a NaN ratio keeps the tile
        any_keep = tl.max(keep_h.to(tl.int32), 0) > 0
        if ACCUMULATE:
            v_skip += 1 - any_keep.to(tl.int32)
        if any_keep:
            keep = tl.max(tl.where(same_head & keep_h[:, None], 1, 0), 0) > 0          # [ROWS]
            m_new = tl.where(keep, tl.maximum(m_ref, tile_max), m_ref)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_ref - m_safe)
            p = tl.where(keep[:, None], tl.exp(s - m_safe[:, None]), 0.0)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            vtok = blk * stride_vb + (cols % page_size) * stride_vp
            v = tl.load(V + vtok[:, None] + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_ref = m_new

    if SPLIT:
        # Decode: one valid row per head (r = 0); partials are [slot, program, Hq, D].
        part = (pid * n_progs + sp) * num_q_heads + heads
        tl.store(O_PART + part[:, None].to(tl.int64) * BLOCK_D + offs_d[None, :], acc,
                 mask=row_ok[:, None] & (rows == 0)[:, None])
        tl.store(M_PART + part, m_ref, mask=row_ok & (rows == 0))
        tl.store(L_PART + part, l_sum, mask=row_ok & (rows == 0))
    else:
        if HAS_SINKS:       # the sink joins the denominator once, here or in the merge
            sink = tl.load(SINKS + heads, mask=head_ok, other=0.0).to(tl.float32)
            m_fin = tl.maximum(m_ref, sink)
            alpha = tl.exp(m_ref - m_fin)
            norm = alpha / (l_sum * alpha + tl.exp(sink - m_fin))
        else:
            norm = 1.0 / tl.where(l_sum > 0, l_sum, 1.0)
        if SCALE_PTRS:
            norm = norm * tl.load(V_SCALE).to(tl.float32)
        else:
            norm = norm * v_scale
        o = acc * norm[:, None]
        o_ptrs = O + (q_start + rows)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh \
            + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if COUNT:
        cnt_heads = ((pid * n_progs + sp) * num_q_heads + kv_head * GROUP + h_lo + prog_heads).to(tl.int64)
        tl.store(SKIP_CNT + cnt_heads[:, None] * BLOCK_T + offs_t[None, :], skip_cnt, mask=prog_head_ok[:, None])
        # Visited tiles count only for a sequence some counted lambda can skip in (_common).
        n_vis = tl.where(tl.max(thresh, 0) > 0, tl.maximum(t_hi - t_lo, 0), 0)
        tl.store(VIS_CNT + cnt_heads, tl.zeros([HEADS], tl.int32) + n_vis, mask=prog_head_ok)
    if ACCUMULATE:
        # Straight into the stats' persistent counter: tiles of sequences with lambda > 0 only.
        if lam_s > 0:
            n_heads = tl.sum(prog_head_ok.to(tl.int32), 0)
            tl.atomic_add(COUNTERS + SLOT_SKIPPED, tl.sum(skip_h, 0).to(tl.int64))
            tl.atomic_add(COUNTERS + SLOT_VISITED, (n_heads * tl.maximum(t_hi - t_lo, 0)).to(tl.int64))
            # the V tiles this program did not read (its heads: a KV group's, or a chunk of one)
            tl.atomic_add(COUNTERS + SLOT_V_TESTED, tl.maximum(t_hi - t_lo, 0).to(tl.int64))
            tl.atomic_add(COUNTERS + SLOT_V_SKIPPED, v_skip.to(tl.int64))
        if (pid == 0) & (tl.program_id(1) == 0) & (sp == 0):
            _count_launch(COUNTERS, SEQ_LENS, QSL, LAM, num_seqs, lam_hi, lam_mid, lam_lo, lam_window,
                          LAM_RULE, SLOT_LAUNCHES, SLOT_DENSE)


@triton.jit(do_not_specialize=list(MERGE_DO_NOT_SPECIALIZE))
def merge_splits_kernel(
    O_PART, M_PART, L_PART, O, QSL, SINKS, V_SCALE, v_scale, num_progs, num_q_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr, SCALE_PTRS: tl.constexpr,
):
    """Log-sum-exp merge of one (sequence, query head)'s program partials into ``O``, with
    the head's sink logit in the denominator exactly once."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < tl.where(q_len > 0, num_progs, 0)   # (vector & scalar masks trip the interpreter)
    part = (seq * num_progs + offs_s) * num_q_heads + head
    m = tl.load(M_PART + part, mask=s_ok, other=float("-inf"))
    l_part = tl.load(L_PART + part, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + head).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_all)                                # programs with nothing kept weigh 0
    l_all = tl.sum(l_part * w, 0)
    if HAS_SINKS:
        l_all += tl.exp(sink - m_all)
    acc = tl.load(O_PART + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_all > 0, l_all, 1.0)
    if SCALE_PTRS:
        o = o * tl.load(V_SCALE).to(tl.float32)
    else:
        o = o * v_scale
    tl.store(O + q_start * stride_ot + head * stride_oh + offs_d * stride_od, o.to(O.dtype.element_ty),
             mask=offs_d < tl.where(q_len > 0, HEAD_DIM, 0))
