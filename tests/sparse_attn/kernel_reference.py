"""Independent float64 reference for the skip-softmax kernels, and random paged batches.

Shared by the kernel tests and ``benchmarks/gpu_check.py`` (which runs where pytest may
not be installed, hence no pytest import here).  Dense attention is float64 softmax on
K/V gathered token by token; the sparse reference walks every (query head, query tile,
KV tile) in Python loops and applies the documented skip rule: the anchor tile (tile 0,
or the diagonal tile of a windowed query tile) and KV splits (the running max starts from,
and each later split restarts from, the anchor's maxima), sliding windows, logit
soft-cap, learned sink logits, fp8 caches with per-tensor scales.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from sparse_attn.kernels import SPLIT_K, TILE_K, TILE_Q, BatchMeta, LayerSpec, PagedBatch


def _cache_pair(n_blocks, page, hkv, d, layout, dtype, gen):
    """Logical [n_blocks, page, Hkv, D] K and V views in a given physical layout, NaN-filled."""
    if layout == "contiguous":
        k = torch.empty(n_blocks, page, hkv, d, dtype=dtype)
        v = torch.empty(n_blocks, page, hkv, d, dtype=dtype)
    elif layout == "dim_major_k":
        # K stored [blocks, Hkv, D, page] (x-major style), V head-major.
        k = torch.empty(n_blocks, hkv, d, page, dtype=dtype).permute(0, 3, 1, 2)
        v = torch.empty(n_blocks, hkv, page, d, dtype=dtype).permute(0, 2, 1, 3)
    elif layout == "packed_kv":
        # One [B, H, N, 2D] buffer, transposed to [B, N, H, 2D] and split into K | V.
        buf = torch.empty(n_blocks, hkv, page, 2 * d, dtype=dtype).transpose(1, 2)
        k, v = buf[..., :d], buf[..., d:]
    elif layout == "cpu_packed":
        # vLLM's CPU cache [blocks, Hkv, page, 2D]: per (block, head) the page's keys
        # dim-major ([D, page]), then its values token-major, viewed as compat reads it.
        from compat import layouts

        k, v = layouts.views("cpu-packed", torch.empty(n_blocks, hkv, page, 2 * d, dtype=dtype), d, isa="vec")
    elif layout == "kv_interleaved_blocks":
        # [blocks, 2, page, Hkv, D]: block stride is not page * token stride.
        buf = torch.empty(n_blocks, 2, page, hkv, d, dtype=dtype)
        k, v = buf[:, 0], buf[:, 1]
    else:
        raise AssertionError(layout)
    k.fill_(float("nan"))
    v.fill_(float("nan"))
    return k, v


def make_batch(kv_lens, q_lens, hq, hkv, d, page, *, layout="contiguous", dtype=torch.float32, seed=0,
               host=False, kv_dtype=None, k_scale=1.0, v_scale=1.0):
    """Random :class:`PagedBatch`; every cache slot no sequence owns holds NaN, unused table
    entries -1; ``host=True`` attaches the host copy of the lengths.  ``kv_dtype`` (default:
    the query's ``dtype``) may be an fp8 dtype: the cache then holds ``x / scale`` rounded to
    it (the dequantised values are ``cache * scale``, as vLLM's writer stores them)."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    need = [-(-n // page) for n in kv_lens]
    n_blocks = sum(need) + 2
    k, v = _cache_pair(n_blocks, page, hkv, d, layout, kv_dtype, gen)
    perm = torch.randperm(n_blocks, generator=gen)
    bt = torch.full((len(kv_lens), max(need + [1]) + 1), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(kv_lens):
        bt[s, :need[s]] = perm[used:used + need[s]]
        used += need[s]
        pos = torch.arange(n)
        blk = bt[s].long()[pos // page]
        k[blk, pos % page] = (torch.randn(n, hkv, d, generator=gen) / k_scale).to(kv_dtype)
        v[blk, pos % page] = (torch.randn(n, hkv, d, generator=gen) / v_scale).to(kv_dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = BatchMeta.from_host(kv_lens, qsl) if host else None
    return PagedBatch(q, k, v, bt, torch.tensor(kv_lens, dtype=torch.int32), qsl, host=meta)


def add_sink_token(batch, strength=3.0, every=None):
    """Give every query a large score on each sequence's first key (a StreamingLLM
    "sink token"), and with ``every`` on each key at a multiple of ``every`` positions
    too, so that whole 64-row query tiles agree on skipping the unremarkable KV tiles
    (windowed rows do not see position 0: ``every`` gives them peaks inside the window)."""
    q, k, bt, seq_lens = batch.query, batch.key_cache, batch.block_table, batch.seq_lens
    page = k.shape[1]
    u = torch.zeros(q.shape[-1], dtype=q.dtype)
    u[0] = strength
    for s in range(len(seq_lens)):
        n = int(seq_lens[s])
        for pos in range(0, n, every or max(n, 1)):
            k[int(bt[s, pos // page]), pos % page, :, 0] = strength * 2
    return dataclasses.replace(batch, query=q + u)


RAMP_TILES = 16


def add_recency(batch, per_tile=3.0, k_scale=1.0, scale=1.0):
    """Make every query prefer recent keys, as a local (windowed) layer does: key dimension 1
    becomes a ramp that is 0 at each sequence's last position and falls by ``per_tile``
    nats of logit per ``TILE_K`` positions before it (for a layer of logit ``scale`` and
    ``k_scale``), flat from ``RAMP_TILES`` tiles back (an fp8 e4m3 cache stays within its
    range), and the queries get +4 on dimension 1 (so every row sees the ramp with the same
    sign).  A windowed query tile near the end then has its largest scores in its diagonal
    tile, and the rule's diagonal anchor lets its older tiles be skipped."""
    q, k, bt, seq_lens = batch.query, batch.key_cache, batch.block_table, batch.seq_lens
    page, lift = k.shape[1], 4.0
    slope = per_tile / (TILE_K * lift * float(scale) * float(k_scale))        # stored key units per position
    for s in range(len(seq_lens)):
        n = int(seq_lens[s])
        pos = torch.arange(n)
        blk = bt[s].long()[pos // page]
        age = (n - 1 - pos).clamp(max=RAMP_TILES * TILE_K).float()
        k[blk, pos % page, :, 1] = (-age * slope)[:, None].to(k.dtype)
    u = torch.zeros(q.shape[-1], dtype=q.dtype)
    u[1] = lift
    return dataclasses.replace(batch, query=q + u)


def gather_seq(cache, bt, s, n):
    page = cache.shape[1]
    pos = torch.arange(n)
    return cache[bt[s].long()[pos // page], pos % page].double()       # [n, Hkv, D]


def _scale_value(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def reference(batch, spec, lam=0.0, thresholds=(), split_k=SPLIT_K, v_tiles: dict | None = None,
              heads_per_item: int | None = None):
    """Brute-force float64 attention with the documented tile skip rule, written from the
    text of ``sparse_attn/kernels/_common.py`` alone.

    ``spec`` is a :class:`LayerSpec` or a float (the softmax scale of a plain causal
    layer); ``lam`` a float or one per sequence; ``thresholds`` candidate lambdas (the same
    for every sequence).  Returns ``(out [T, Hq, D] float64, skipped [Hq] under lam,
    visited [Hq], skipped_per_threshold [len(thresholds), Hq])``; ``visited`` counts the
    tiles of the sequences whose ``lam`` or some threshold is > 0 (one a tile can be
    skipped under: what serving and calibration both count).

    ``v_tiles``: a dict that receives ``tested`` (the (sequence, query tile, KV head, tile)
    visits of sequences whose ``lam`` is > 0) and ``skipped`` (those every query head of the
    KV head skips under ``lam``: the V tiles a kernel packing the group's heads does not read);
    ``heads_per_item``: a kernel that packs only this many of a group's heads together reads V
    once per such chunk (default: the whole group).
    """
    spec = spec if isinstance(spec, LayerSpec) else LayerSpec(float(spec))
    q, k, v, bt, seq_lens, qsl = (batch.query, batch.key_cache, batch.value_cache, batch.block_table,
                                  batch.seq_lens, batch.query_start_loc)
    t_tokens, hq, d = q.shape
    g = hq // k.shape[2]
    logit_scale = float(spec.scale) * _scale_value(spec.k_scale)
    w, cap = spec.window, spec.soft_cap
    sinks = None if spec.sink_logits is None else spec.sink_logits.detach().double().cpu()
    out = torch.zeros(t_tokens, hq, d, dtype=torch.float64)
    skipped = torch.zeros(hq, dtype=torch.int64)
    visited = torch.zeros(hq, dtype=torch.int64)
    per_thr = torch.zeros(len(thresholds), hq, dtype=torch.int64)
    lams = [float(x) for x in lam] if isinstance(lam, (list, tuple)) else [float(lam)] * len(seq_lens)
    group_skips: dict[tuple, bool] = {}  # (s, qt, kv head, head chunk, t) -> every head so far skipped it
    for s in range(len(seq_lens)):
        n, a, b = int(seq_lens[s]), int(qsl[s]), int(qsl[s + 1])
        q_len = b - a
        if q_len == 0:
            continue
        lam_s = lams[s]
        counted = lam_s > 0 or any(thr > 0 for thr in thresholds)
        keys, vals = gather_seq(k, bt, s, n), gather_seq(v, bt, s, n) * _scale_value(spec.v_scale)
        qpos = torch.arange(n - q_len, n)
        cols = torch.arange(n)
        allowed = cols[None, :] <= qpos[:, None] if spec.causal else torch.ones(q_len, n, dtype=torch.bool)
        if w is not None:
            allowed &= cols[None, :] >= qpos[:, None] - w + 1
        for h in range(hq):
            scores = q[a:b, h].double() @ keys[:, h // g].T * logit_scale
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            scores = scores.masked_fill(~allowed, float("-inf"))
            keep = torch.zeros(q_len, n, dtype=torch.bool)
            for qt in range(-(-q_len // TILE_Q)):
                r0, r1 = qt * TILE_Q, min(q_len, (qt + 1) * TILE_Q)
                seen = allowed[r0:r1].nonzero()[:, 1]
                first, last = int(seen.min()) // TILE_K, int(seen.max()) // TILE_K
                # The anchor: the diagonal tile with a window, tile first (= 0) without; its
                # maxima (-inf for a row that sees nothing of it) seed the running max.
                anchor = last if w is not None else first
                seed = scores[r0:r1, anchor * TILE_K:min(n, (anchor + 1) * TILE_K)].amax(1)
                m = seed.clone()
                for t in range(first, last + 1):
                    c0, c1 = t * TILE_K, min(n, (t + 1) * TILE_K)
                    tmax = scores[r0:r1, c0:c1].amax(1)
                    visited[h] += counted
                    if t > first and c0 % split_k == 0:               # a later split opens: the seed
                        m = seed.clone()
                    if t == anchor:
                        ratio = math.inf                              # the anchor is never skipped
                    else:
                        # A row that sees nothing of the tile does not vote (0); one that sees
                        # it while its running max is still empty keeps it (inf).
                        e = torch.where(tmax == float("-inf"), 0.0, torch.exp(tmax - m))
                        ratio = e.max().item()
                    for j, thr in enumerate(thresholds):
                        per_thr[j, h] += ratio < thr
                    if ratio < lam_s:
                        skipped[h] += 1
                    else:
                        keep[r0:r1, c0:c1] = True
                    if lam_s > 0:
                        key = (s, qt, h // g, (h % g) // (heads_per_item or g), t)
                        group_skips[key] = group_skips.get(key, True) and ratio < lam_s
                    m = torch.maximum(m, tmax)
            logits = scores.masked_fill(~keep, float("-inf"))
            if sinks is not None:    # one more logit per head, in the denominator only
                logits = torch.cat([logits, sinks[h].expand(q_len, 1)], 1)
            p = logits.softmax(-1)[:, :n]
            out[a:b, h] = p @ vals[:, h // g]
    if v_tiles is not None:
        v_tiles.update(tested=len(group_skips), skipped=sum(group_skips.values()))
    return out, skipped, visited, per_thr
