"""exp and P.V of a chunk with skipped tiles (the torch implementation's sparse paths).

Every active (unit, KV tile) P block is gathered with one ``index_select`` of
``TILE_K``-float rows (a *unit* is one query head's rows of one query tile).  Groups with
one query tile per sequence (decode, short prefills) read, per KV head, the V of the
tiles any of its units needs and do one batched matmul per cache-sized run (inactive
units' P is exactly 0); a long prefill buckets (KV head, tile) pairs by how many units
are active on them (one batched matmul per bucket).
"""

from __future__ import annotations

import torch

from ._common import TILE_K
from .torch_tiles import SUB_BUDGET


def sparse_pv_tiles(s, active, m_ref, acc, l_sum, v_reader, v_plan):
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
    step = max(1, SUB_BUDGET // (TILE_K * d))
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


def sparse_pv_units(s, active, m_flat, acc_flat, l_flat, v_chunk, u_lo, units_all):
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
