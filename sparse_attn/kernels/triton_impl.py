"""Triton implementation of skip-softmax paged attention (GPU; CPU under TRITON_INTERPRET=1).

One program per (query tile, query head).  It walks the KV tiles its query tile visits,
reading K and V token by token through the block table with the cache views' strides
(any layout, e.g. dim-major K), and applies the skip rule of
:mod:`sparse_attn.kernels._common`: two running maxima per row, the dense one (updated
on every visited tile, drives the skip test) and the exp reference (updated only on
computed tiles).  Lambdas are read from per-sequence fp32 arrays (``lam[seq]`` for
serving, ``THRESH[seq, :]`` for counting), so changing them never recompiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import TILE_K, TILE_Q, BatchMeta


@triton.jit
def _paged_attn_kernel(
    Q, K, V, O, BT, SEQ_LENS, QSL, TILE_SEQ, TILE_ROW0,
    THRESH, SKIP_CNT, VIS_CNT,
    scale, lam, num_thresh, page_size,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    CAUSAL: tl.constexpr, COUNT: tl.constexpr, FP32_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(TILE_SEQ + pid).to(tl.int64)
    row0 = tl.load(TILE_ROW0 + pid)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    kv_len = tl.load(SEQ_LENS + seq)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    last_row = tl.minimum(row0 + BLOCK_M, q_len) - 1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # Padding rows take the last valid row's limit: finite scores, never stored.
    if CAUSAL:
        limit = kv_len - q_len + tl.minimum(rows, last_row)
        n_tiles = (kv_len - q_len + last_row) // BLOCK_N + 1
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len - 1
        n_tiles = tl.cdiv(kv_len, BLOCK_N)

    q_ptrs = Q + (q_start + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_dense = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m_ref = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    lam_s = tl.load(lam + seq)
    if COUNT:
        thresh = tl.load(THRESH + seq * BLOCK_T + offs_t, mask=offs_t < num_thresh, other=-1.0)
    skip_cnt = tl.zeros([BLOCK_T], tl.int32)

    for t in range(0, n_tiles):
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
        ratio = tl.where(row_ok, tl.exp(tile_max - m_dense), 0.0)
        # The first tile is never skippable; +inf also hides the -inf - -inf NaN there.
        tile_ratio = tl.where(t > 0, tl.max(ratio, 0), float("inf"))
        m_dense = tl.maximum(m_dense, tile_max)
        if COUNT:
            skip_cnt += (tile_ratio < thresh).to(tl.int32)
        if tile_ratio >= lam_s:
            m_new = tl.maximum(m_ref, tile_max)
            alpha = tl.exp(m_ref - m_new)
            p = tl.exp(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            vtok = blk * stride_vb + (cols % page_size) * stride_vp
            v = tl.load(V + vtok[:, None] + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_ref = m_new

    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_ptrs = O + (q_start + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if COUNT:
        n_heads = tl.num_programs(1)
        tl.store(SKIP_CNT + (pid * n_heads + head) * BLOCK_T + offs_t, skip_cnt)
        tl.store(VIS_CNT + pid * n_heads + head, n_tiles)


def _interpreting() -> bool:
    # Triton's interpreter multiplies bf16 dot operands as raw integers (garbage), so
    # under it 16-bit inputs are upcast; compiled kernels use native 16-bit dots.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def forward(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    meta: BatchMeta,
    *,
    scale: float,
    causal: bool,
    threshold: float | torch.Tensor,
    count_thresholds: torch.Tensor | None,
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Same contract as :func:`sparse_attn.kernels.torch_impl.forward`."""
    dev = query.device
    hq, d = meta.num_q_heads, meta.head_dim
    tiles_per_seq = [-(-n // TILE_Q) for n in meta.q_lens]
    n_qtiles = sum(tiles_per_seq)
    tile_seq = torch.repeat_interleave(torch.arange(len(tiles_per_seq)), torch.tensor(tiles_per_seq))
    first = torch.tensor([0] + tiles_per_seq).cumsum(0)[:-1]
    tile_row0 = (torch.arange(n_qtiles) - first[tile_seq]) * TILE_Q
    # A smaller row block is the same query tile when every sequence fits in it (decode).
    block_m = min(TILE_Q, max(16, _next_pow2(max(meta.q_lens))))
    n_seqs = len(meta.seq_lens)
    counting = count_thresholds is not None
    n_thr = count_thresholds.shape[0] if counting else 0
    block_t = max(2, _next_pow2(max(n_thr, 1)))
    # Per-sequence lambdas live in device arrays (pointers): new values never recompile.
    thresh = torch.full((n_seqs, block_t), -1.0, dtype=torch.float32)
    if n_thr:
        thresh[:, :n_thr] = count_thresholds.T
    thresh = thresh.to(dev)
    if isinstance(threshold, torch.Tensor):
        lam = threshold.to(dev, torch.float32)
    else:
        lam = torch.full((n_seqs,), threshold, dtype=torch.float32, device=dev)
    skip_cnt = torch.zeros(n_qtiles, hq, block_t, dtype=torch.int32, device=dev)
    vis_cnt = torch.zeros(n_qtiles, hq, dtype=torch.int32, device=dev)

    _paged_attn_kernel[(n_qtiles, hq)](
        query, key_cache, value_cache, out, block_table, seq_lens, query_start_loc,
        tile_seq.to(dev, torch.int32), tile_row0.to(dev, torch.int32),
        thresh, skip_cnt, vis_cnt,
        scale, lam, n_thr, meta.page_size,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(), *block_table.stride(),
        GROUP=meta.group, HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)),
        BLOCK_M=block_m, BLOCK_N=TILE_K, BLOCK_T=block_t,
        CAUSAL=causal, COUNT=counting, FP32_DOT=query.dtype == torch.float32 or _interpreting(),
    )
    if not counting:
        return out, None, None
    skipped = skip_cnt[:, :, :n_thr].sum(0, dtype=torch.int64).T.contiguous()
    return out, skipped, vis_cnt.sum(0, dtype=torch.int64)
