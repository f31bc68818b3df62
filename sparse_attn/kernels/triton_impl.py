"""Triton implementation of skip-softmax paged attention (GPU; CPU under TRITON_INTERPRET=1).

Programs and phases
-------------------
One program per (query tile, KV head, head chunk, KV split).  A program holds ``HPP``
query heads of one KV group (all of them in decode; in prefill as many as the tile table
allows, see :data:`TILE_CONFIGS`) as one packed block of ``HPP * BLOCK_M`` rows, so each K
and V tile it needs is read once for all of them.  The skip decision stays per query head
(the rule of :mod:`sparse_attn.kernels._common`): each head's rows are tested on their own,
and a V tile is read when any head of the program keeps it (heads that skip it get
``P = 0`` and no rescale).

- *decode* (every query length <= 1): split-KV (flash-decoding).  Each sequence's KV is
  cut into the rule's splits of ``split_k`` positions; one program per split writes an
  unnormalised partial (accumulator, exp reference, row sum) and a second kernel merges
  the splits by log-sum-exp.  The dense running max of a split after the first starts
  from KV tile 0's maxima, exactly as the rule says, so that program reads K tile 0 and
  computes its Q.K^T once before its own tiles (one extra K tile per split program);
  counts are unchanged by the split launch.
- *prefill* (anything else): no split launch; the program walks all its KV tiles, keeps
  tile 0's maxima, and resets the dense running max to them at every later split
  boundary.

Two running maxima per row: the dense one (updated on every visited tile, reset to tile
0's maxima at split boundaries, drives the skip test) and the exp reference (updated on
computed tiles only).  Lambdas are read from per-sequence fp32 arrays (``lam[seq]`` for
serving, ``THRESH[seq, :]`` for counting), so changing them never recompiles.

Capture safety
--------------
:func:`prepare` is pure Python + torch ops on the call's device: it sizes the grid from
tensor shapes and host ints (upper bounds when no host copy of the batch is given),
maps query tiles to sequences on the device (``searchsorted`` over per-sequence tile
counts; surplus programs see an out-of-range sequence and do nothing) and allocates the
partial/count buffers.  :func:`launch` only calls the kernels.  With ``meta=None`` nothing
in :func:`prepare` or :func:`finish` reads device data on the host, so the whole call can
be captured in a CUDA graph; ``tests/sparse_attn/test_kernels_capture.py`` runs
:func:`prepare` under ``FakeTensorMode`` to prove it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ._common import SPLIT_K, TILE_K, TILE_Q, next_pow2
from .batch import BatchMeta, LayerSpec, PagedBatch


@dataclass(frozen=True)
class TileConfig:
    """Launch constants of one (head size, dtype, phase): ``heads_per_program`` caps the
    query heads of a KV group packed into one program (a power of two; the packed block
    is ``heads * BLOCK_M`` rows), ``num_warps`` / ``num_stages`` are Triton's."""

    heads_per_program: int
    num_warps: int
    num_stages: int


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
#: Fixed tile configurations, keyed by (BLOCK_D = head size rounded up to a power of two,
#: dtype, phase).  No runtime autotuning: a CUDA graph captures one launch, and an
#: autotuner's benchmarking launches cannot run while a stream is capturing.
#: Decode packs the whole group (memory-bound: K/V read once per KV head); prefill packs
#: up to 128 rows (2 heads of a 64-row query tile) for 16-bit and 64 rows for fp32 or
#: head size 256, the register budget of one program's fp32 accumulator.
#: Not yet tuned on a GPU (see benchmarks/RESULTS-kernels.md).
TILE_CONFIGS: dict[tuple[int, torch.dtype, str], TileConfig] = {
    (64, _BF16, "decode"): TileConfig(16, 4, 2),
    (64, _F16, "decode"): TileConfig(16, 4, 2),
    (64, _F32, "decode"): TileConfig(16, 4, 2),
    (128, _BF16, "decode"): TileConfig(16, 4, 2),
    (128, _F16, "decode"): TileConfig(16, 4, 2),
    (128, _F32, "decode"): TileConfig(16, 4, 1),
    (256, _BF16, "decode"): TileConfig(8, 8, 2),
    (256, _F16, "decode"): TileConfig(8, 8, 2),
    (256, _F32, "decode"): TileConfig(8, 8, 1),
    (64, _BF16, "prefill"): TileConfig(2, 4, 3),
    (64, _F16, "prefill"): TileConfig(2, 4, 3),
    (64, _F32, "prefill"): TileConfig(1, 4, 2),
    (128, _BF16, "prefill"): TileConfig(2, 8, 3),
    (128, _F16, "prefill"): TileConfig(2, 8, 3),
    (128, _F32, "prefill"): TileConfig(1, 8, 2),
    (256, _BF16, "prefill"): TileConfig(1, 8, 2),
    (256, _F16, "prefill"): TileConfig(1, 8, 2),
    (256, _F32, "prefill"): TileConfig(1, 8, 1),
}


def tile_config(head_dim: int, dtype: torch.dtype, phase: str) -> TileConfig:
    """The :data:`TILE_CONFIGS` entry for ``head_dim`` (head sizes <= 64 use the 64 row)."""
    block_d = max(64, next_pow2(head_dim))
    key = (block_d, dtype, phase)
    if key not in TILE_CONFIGS:
        raise ValueError(f"paged_attention: no Triton tile configuration for head size {head_dim} "
                         f"(BLOCK_D={block_d}), dtype {dtype}, phase {phase}: expected head size <= 256")
    return TILE_CONFIGS[key]


@triton.jit
def _paged_attn_kernel(
    Q, K, V, O, BT, SEQ_LENS, QSL, TILE_SEQ, TILE_ROW0,
    lam, THRESH, SKIP_CNT, VIS_CNT, O_PART, M_PART, L_PART,
    scale, num_thresh, page_size, tiles_per_split, num_seqs, num_q_heads,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    GROUP: tl.constexpr, HPP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    CAUSAL: tl.constexpr, COUNT: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
):
    N_HCHUNKS: tl.constexpr = (GROUP + HPP - 1) // HPP
    R: tl.constexpr = HPP * BLOCK_M
    pid = tl.program_id(0)
    kv_head = tl.program_id(1) // N_HCHUNKS
    h_lo = (tl.program_id(1) % N_HCHUNKS) * HPP           # first head-in-group of this program
    sp = tl.program_id(2)
    n_splits = tl.num_programs(2)

    seq_raw = tl.load(TILE_SEQ + pid)
    live = seq_raw < num_seqs                              # surplus programs (upper-bound grid) do nothing
    seq = tl.minimum(seq_raw, num_seqs - 1).to(tl.int64)
    row0 = tl.load(TILE_ROW0 + pid)
    q_start = tl.load(QSL + seq)
    q_len = tl.where(live, tl.load(QSL + seq + 1) - q_start, 0)
    kv_len = tl.load(SEQ_LENS + seq)

    # Packed rows i = (head-in-program hin, query row r).
    offs_i = tl.arange(0, R)
    hin = offs_i // BLOCK_M
    rows = row0 + offs_i % BLOCK_M
    hh = tl.arange(0, HPP)
    hh_ok = h_lo + hh < GROUP
    head_ok = h_lo + hin < GROUP
    heads = kv_head * GROUP + h_lo + hin
    row_ok = (rows < q_len) & head_ok
    last_row = tl.minimum(row0 + BLOCK_M, q_len) - 1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # Padding rows take the last valid row's limit: finite scores, never stored.
    if CAUSAL:
        limit = kv_len - q_len + tl.minimum(rows, last_row)
        n_tiles = (kv_len - q_len + last_row) // BLOCK_N + 1
    else:
        limit = tl.zeros([R], dtype=tl.int32) + kv_len - 1
        n_tiles = tl.cdiv(kv_len, BLOCK_N)
    n_tiles = tl.where(row0 < q_len, n_tiles, 0)
    if SPLIT:
        t_lo = sp * tiles_per_split
        t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)
    else:
        t_lo = 0
        t_hi = n_tiles

    q_ptrs = Q + (q_start + rows)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # same_head[h, i]: packed row i belongs to head-in-program h (per-head reductions).
    same_head = hin[None, :] == hh[:, None]

    m_dense = tl.full([R], float("-inf"), tl.float32)
    m_ref = tl.full([R], float("-inf"), tl.float32)
    l_sum = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BLOCK_D], tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    lam_s = tl.load(lam + seq)
    if COUNT:
        thresh = tl.load(THRESH + seq * BLOCK_T + offs_t, mask=offs_t < num_thresh, other=-1.0)
    skip_cnt = tl.zeros([HPP, BLOCK_T], tl.int32)

    # Tile 0's maxima seed the dense running max of every later split (the rule).  A split
    # program of split > 0 computes them first: one extra K tile read and Q.K^T.
    m_seed = tl.full([R], float("-inf"), tl.float32)
    if t_lo > 0:
        if t_lo < t_hi:
            cols0 = tl.arange(0, BLOCK_N)
            col0_ok = cols0 < kv_len
            blk0 = tl.load(BT + seq * stride_bts + (cols0 // page_size) * stride_btb, mask=col0_ok,
                           other=0).to(tl.int64)
            k0 = tl.load(K + (blk0 * stride_kb + (cols0 % page_size) * stride_kp)[None, :] + kv_head * stride_kh
                         + offs_d[:, None] * stride_kd, mask=col0_ok[None, :] & d_ok[:, None], other=0.0)
            if FP32_DOT:
                s0 = tl.dot(q.to(tl.float32), k0.to(tl.float32), input_precision="ieee") * scale
            else:
                s0 = tl.dot(q, k0) * scale
            s0 = tl.where(col0_ok[None, :] & (cols0[None, :] <= limit[:, None]), s0, float("-inf"))
            m_seed = tl.max(s0, 1)

    for t in range(t_lo, t_hi):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        blk = tl.load(BT + seq * stride_bts + (cols // page_size) * stride_btb, mask=col_ok, other=0).to(tl.int64)
        tok = blk * stride_kb + (cols % page_size) * stride_kp
        k = tl.load(K + tok[None, :] + kv_head * stride_kh + offs_d[:, None] * stride_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        visible = col_ok[None, :] & (cols[None, :] <= limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        tile_max = tl.max(s, 1)
        m_seed = tl.where(t == 0, tile_max, m_seed)
        # The rule's dense running max restarts from tile 0's maxima at every later split
        # boundary; only tile 0 is never skippable (+inf also hides its -inf - -inf NaN).
        m_dense = tl.where((t % tiles_per_split) == 0, m_seed, m_dense)
        ratio = tl.where(row_ok, tl.exp(tile_max - m_dense), 0.0)
        ratio_h = tl.max(tl.where(same_head, ratio[None, :], 0.0), 1)             # [HPP]
        ratio_h = tl.where(t == 0, float("inf"), ratio_h)
        m_dense = tl.maximum(m_dense, tile_max)
        if COUNT:
            skip_cnt += ((ratio_h[:, None] < thresh[None, :]) & hh_ok[:, None]).to(tl.int32)
        keep_h = (ratio_h >= lam_s) & hh_ok
        if tl.max(keep_h.to(tl.int32), 0) > 0:
            keep = tl.max(tl.where(same_head & keep_h[:, None], 1, 0), 0) > 0          # [R]
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
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_ref = m_new

    if SPLIT:
        # Decode: one valid row per head (r = 0); partials are [slot, split, Hq, D].
        part = (pid * n_splits + sp) * num_q_heads + heads
        tl.store(O_PART + part[:, None].to(tl.int64) * BLOCK_D + offs_d[None, :], acc,
                 mask=row_ok[:, None] & (rows == 0)[:, None])
        tl.store(M_PART + part, m_ref, mask=row_ok & (rows == 0))
        tl.store(L_PART + part, l_sum, mask=row_ok & (rows == 0))
    else:
        o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        o_ptrs = O + (q_start + rows)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh \
            + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if COUNT:
        cnt_heads = ((pid * n_splits + sp) * num_q_heads + kv_head * GROUP + h_lo + hh).to(tl.int64)
        tl.store(SKIP_CNT + cnt_heads[:, None] * BLOCK_T + offs_t[None, :], skip_cnt, mask=hh_ok[:, None])
        tl.store(VIS_CNT + cnt_heads, tl.zeros([HPP], tl.int32) + tl.maximum(t_hi - t_lo, 0), mask=hh_ok)


@triton.jit
def _merge_splits_kernel(
    O_PART, M_PART, L_PART, O, QSL, num_splits, num_q_heads,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Log-sum-exp merge of one (sequence, query head)'s split partials into ``O``."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < tl.where(q_len > 0, num_splits, 0)   # (vector & scalar masks trip the interpreter)
    part = (seq * num_splits + offs_s) * num_q_heads + head
    m = tl.load(M_PART + part, mask=s_ok, other=float("-inf"))
    l_part = tl.load(L_PART + part, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))   # splits with nothing kept weigh 0
    l_all = tl.sum(l_part * w, 0)
    acc = tl.load(O_PART + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_all > 0, l_all, 1.0)
    tl.store(O + q_start * stride_ot + head * stride_oh + offs_d * stride_od, o.to(O.dtype.element_ty),
             mask=offs_d < tl.where(q_len > 0, HEAD_DIM, 0))


def _interpreting() -> bool:
    # Triton's interpreter multiplies bf16 dot operands as raw integers (garbage), so
    # under it 16-bit inputs are upcast; compiled kernels use native 16-bit dots.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass
class KernelCall:
    """One kernel launch: ``kernel[grid](*args, **constexprs)``."""

    kernel: object
    grid: tuple[int, int, int] | tuple[int, int]
    args: tuple
    constexprs: dict


@dataclass
class Launch:
    """What :func:`prepare` decided: the kernel calls and the buffers :func:`finish` reads.

    ``phase`` is ``"decode"`` (split-KV launch + merge) or ``"prefill"``; ``config`` the
    :data:`TILE_CONFIGS` entry; ``skip_cnt`` int32 ``[slots, splits, Hq, BLOCK_T]`` and
    ``vis_cnt`` int32 ``[slots, splits, Hq]`` (``None`` without counts); ``n_thr`` the
    number of counted lambdas.
    """

    phase: str
    config: TileConfig
    calls: list[KernelCall] = field(default_factory=list)
    out: torch.Tensor | None = None
    skip_cnt: torch.Tensor | None = None
    vis_cnt: torch.Tensor | None = None
    n_thr: int = 0


def prepare(
    batch: PagedBatch,
    spec: LayerSpec,
    meta: BatchMeta | None,
    *,
    threshold: torch.Tensor,
    count_thresholds: torch.Tensor | None,
    out: torch.Tensor,
    split_k: int = SPLIT_K,
) -> Launch:
    """Grid, tensor arguments and constexprs of one forward; launches nothing.

    With ``meta`` (the host copy of the batch) the grid is exact.  With ``meta=None`` it
    is sized from shapes and host ints only: ``batch.max_query_len`` (default ``T``, the
    number of query tokens) bounds the query length, ``block_table.shape[1] * page_size``
    the KV length; no device data is read on the host.  ``threshold``: float32 ``[S]`` on
    the device; ``count_thresholds``: float32 ``[n, S]`` or ``None``.
    """
    query, key_cache, value_cache = batch.query, batch.key_cache, batch.value_cache
    block_table, seq_lens, query_start_loc = batch.block_table, batch.seq_lens, batch.query_start_loc
    scale, causal, max_query_len = float(spec.scale), spec.causal, batch.max_query_len
    dev = query.device
    num_tokens, hq, d = query.shape
    hkv, page = key_cache.shape[2], key_cache.shape[1]
    group = hq // hkv
    n_seqs = seq_lens.shape[0]
    if meta is not None:
        max_q = max(meta.q_lens)
        max_kv = max(meta.seq_lens)
    else:
        max_q = num_tokens if max_query_len is None else min(int(max_query_len), num_tokens)
        max_kv = block_table.shape[1] * page
    phase = "decode" if max_q <= 1 else "prefill"
    cfg = tile_config(d, query.dtype, phase)
    hpp = min(cfg.heads_per_program, next_pow2(group))
    n_hchunks = -(-group // hpp)
    # A smaller row block is the same query tile when every sequence fits in it; the
    # packed block needs >= 16 rows for tl.dot.
    block_m = min(TILE_Q, max(next_pow2(max(max_q, 1)), -(-16 // hpp)))
    block_d = max(16, next_pow2(d))
    tps = split_k // TILE_K

    # Query tiles -> sequences, on the device: tiles per sequence, their cumulative sum,
    # and for each program slot the sequence whose tiles cover it (S = surplus slot).
    # Decode: slot s is sequence s (the merge kernel relies on it; q_len 0 does nothing).
    if phase == "decode":
        n_slots = n_seqs
        tile_seq = torch.arange(n_seqs, dtype=torch.int32, device=dev)
        tile_row0 = torch.zeros(n_seqs, dtype=torch.int32, device=dev)
    else:
        if meta is not None:
            n_slots = max(1, sum(-(-n // block_m) for n in meta.q_lens))
        else:
            n_slots = -(-num_tokens // block_m) + n_seqs       # sum ceil(q_s / B) <= T / B + S
        qsl = query_start_loc.long()
        tiles = (qsl[1:] - qsl[:-1] + block_m - 1) // block_m
        cum = tiles.cumsum(0)
        slot = torch.arange(n_slots, device=dev)
        tile_seq = torch.searchsorted(cum, slot, right=True)
        first_tile = (cum - tiles)[tile_seq.clamp(max=n_seqs - 1)]
        tile_row0 = ((slot - first_tile) * block_m).to(torch.int32)
        tile_seq = tile_seq.to(torch.int32)

    n_splits = max(1, -(-max_kv // split_k)) if phase == "decode" else 1
    counting = count_thresholds is not None
    n_thr = count_thresholds.shape[0] if counting else 0
    block_t = max(2, next_pow2(max(n_thr, 1)))
    # Per-sequence lambdas live in device arrays (pointers): new values never recompile.
    thresh = torch.full((n_seqs, block_t), -1.0, dtype=torch.float32, device=dev)
    if n_thr:
        thresh[:, :n_thr] = count_thresholds.T.to(dev, torch.float32)
    lam = threshold
    cnt_slots = n_slots if counting else 1
    skip_cnt = torch.zeros(cnt_slots, n_splits if counting else 1, hq, block_t, dtype=torch.int32, device=dev)
    vis_cnt = torch.zeros(cnt_slots, n_splits if counting else 1, hq, dtype=torch.int32, device=dev)
    if phase == "decode":
        o_part = torch.empty(n_slots, n_splits, hq, block_d, dtype=torch.float32, device=dev)
        m_part = torch.empty(n_slots, n_splits, hq, dtype=torch.float32, device=dev)
        l_part = torch.empty(n_slots, n_splits, hq, dtype=torch.float32, device=dev)
    else:
        o_part = m_part = l_part = torch.empty(1, dtype=torch.float32, device=dev)

    launch = Launch(phase, cfg, out=out, skip_cnt=skip_cnt if counting else None,
                    vis_cnt=vis_cnt if counting else None, n_thr=n_thr)
    launch.calls.append(KernelCall(
        _paged_attn_kernel, (n_slots, hkv * n_hchunks, n_splits),
        (query, key_cache, value_cache, out, block_table, seq_lens, query_start_loc, tile_seq, tile_row0,
         lam, thresh, skip_cnt, vis_cnt, o_part, m_part, l_part,
         float(scale), n_thr, page, tps, n_seqs, hq,
         *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(), *block_table.stride()),
        dict(GROUP=group, HPP=hpp, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=TILE_K, BLOCK_T=block_t,
             CAUSAL=bool(causal), COUNT=counting, SPLIT=phase == "decode",
             FP32_DOT=query.dtype == torch.float32 or _interpreting(),
             num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    if phase == "decode":
        launch.calls.append(KernelCall(
            _merge_splits_kernel, (n_slots, hq),
            (o_part, m_part, l_part, out, query_start_loc, n_splits, hq, *out.stride()),
            dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(2, next_pow2(n_splits)), num_warps=4)))
    return launch


def launch(plan: Launch) -> None:
    """Run the prepared kernels (the only step that touches Triton)."""
    for call in plan.calls:
        call.kernel[call.grid](*call.args, **call.constexprs)


def finish(plan: Launch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(out, skipped int64 [n, Hq], visited int64 [Hq])`` as device tensors (no host read)."""
    if plan.skip_cnt is None:
        return plan.out, None, None
    skipped = plan.skip_cnt[..., :plan.n_thr].sum((0, 1), dtype=torch.int64).T.contiguous()
    return plan.out, skipped, plan.vis_cnt.sum((0, 1), dtype=torch.int64)


def forward(batch: PagedBatch, spec: LayerSpec, meta: BatchMeta | None, **kw):
    """The backend contract of :mod:`sparse_attn.kernels.api`; ``meta=None`` is the
    capture-safe mode of :func:`prepare`."""
    plan = prepare(batch, spec, meta, **kw)
    launch(plan)
    return finish(plan)
