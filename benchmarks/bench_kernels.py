"""Benchmark skip-softmax paged attention: skipping vs the same kernel dense, and vs SDPA.

CPU (default): the torch implementation at 4k and 16k KV, prefill and decode, timed with
the lambda that gives ~50% and ~75% tile sparsity and with lambda = 0 (same code, no
skipping), plus ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V
gathered into contiguous tensors beforehand (the gather is not timed for SDPA).

``--device cuda``: the Triton kernel, dense vs skipping, plus flashinfer's paged
prefill/decode wrappers when flashinfer is importable.

Scores are structured, not uniform noise: every sequence has attention-sink tokens, a
local window (rotary-style position features), topical segments the query heads of a KV
group find relevant to different degrees, and noise.  Lambdas are calibrated with
``paged_attention_counts`` on the same inputs, and the measured sparsity is printed.

The ``small-*`` cases use the serving adapter's sizes (Hq 4, Hkv 2, D 32: a tiny model
called per layer per step) and measure per-call time, Python overhead included.

Prints a markdown table (with the 1-minute load average at start: this machine is
shared).  Example: ``python benchmarks/bench_kernels.py --repeats 3``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparse_attn.kernels import TILE_K, TILE_Q, paged_attention, paged_attention_counts  # noqa: E402

_SEGMENT = 256          # tokens per topical segment
_N_TOPICS = 32          # one-hot topic features; topic 0 marks the attention sink
_N_SINK = 4             # sink tokens at the start of every sequence
_PERIODS = (8, 16, 32, 64, 128, 256, 512, 1024)   # rotary-style periods (tokens) of the local window
# Feature strengths, chosen so softmax mass is concentrated (sink, local window, relevant
# segments) the way trained models' attention is, rather than spread like uniform noise.
QN = 0.5      # query noise std (keys have unit noise)
KAP = 20.0    # topic feature strength in keys
RHO = 2.5     # position feature amplitude (local window height)
SINK = 4.0    # every head's affinity for the sink tokens


def _features(pos: torch.Tensor, rho: float, periods=_PERIODS) -> torch.Tensor:
    """Position features ``[n, 2 * len(periods)]``; their dot product peaks at equal positions."""
    w = 2 * math.pi / torch.tensor(periods, dtype=torch.float64)
    ang = pos.double()[:, None] * w[None, :]
    return (torch.cat([ang.cos(), ang.sin()], -1) * rho).float()


def make_inputs(n_seqs, kv_len, q_len, hq, hkv, d, page, dtype, device, seed=0):
    """Paged K/V cache (shuffled blocks) and queries with sink/window/topic/noise structure.

    Returns ``(query [T, Hq, D], key_cache, value_cache [blocks, page, Hkv, D],
    block_table [S, blocks/seq] int32, seq_lens [S] int32, query_start_loc [S+1] int32)``.
    """
    g = torch.Generator().manual_seed(seed)
    # Small head sizes (the serving-overhead cases) get fewer topics and periods.
    n_topics = min(_N_TOPICS, d // 2)
    periods = _PERIODS[:min(len(_PERIODS), max(1, d // 8))]
    n_pos = 2 * len(periods)
    n_noise = d - n_topics - n_pos
    assert n_noise > 0, "head_dim too small for the synthetic feature layout"
    blocks_per_seq = -(-kv_len // page)
    n_blocks = n_seqs * blocks_per_seq
    kc = torch.empty(n_blocks, page, hkv, d)
    vc = torch.randn(n_blocks, page, hkv, d, generator=g)
    perm = torch.randperm(n_blocks, generator=g)
    block_table = perm.view(n_seqs, blocks_per_seq).int()
    queries = []
    kpos = torch.arange(kv_len)
    for s in range(n_seqs):
        keys = torch.empty(kv_len, hkv, d)
        keys[..., :n_noise] = torch.randn(kv_len, hkv, n_noise, generator=g)
        topic = torch.randint(1, n_topics, (kv_len // _SEGMENT + 1, hkv), generator=g)
        tok_topic = topic[kpos // _SEGMENT]
        tok_topic[:_N_SINK] = 0
        keys[..., n_noise:n_noise + n_topics] = torch.nn.functional.one_hot(tok_topic, n_topics) * KAP
        keys[..., n_noise + n_topics:] = _features(kpos, RHO, periods)[:, None, :]
        qpos = torch.arange(kv_len - q_len, kv_len)
        q = torch.empty(q_len, hq, d)
        q[..., :n_noise] = torch.randn(q_len, hq, n_noise, generator=g) * QN
        # Heads of one KV group share most of their topic affinities.
        base = torch.randn(hkv, n_topics, generator=g).repeat_interleave(hq // hkv, 0)
        aff = base * 0.9 + 0.35 * torch.randn(hq, n_topics, generator=g)
        aff[:, 0] = SINK
        q[..., n_noise:n_noise + n_topics] = aff[None]
        q[..., n_noise + n_topics:] = _features(qpos, RHO, periods)[:, None, :]
        queries.append(q)
        flat = block_table[s].long()[kpos // page]
        kc[flat, kpos % page] = keys
    query = torch.cat(queries)
    seq_lens = torch.full((n_seqs,), kv_len, dtype=torch.int32)
    qsl = torch.arange(n_seqs + 1, dtype=torch.int32) * q_len
    to = dict(device=device)
    return (query.to(dtype=dtype, **to), kc.to(dtype=dtype, **to), vc.to(dtype=dtype, **to),
            block_table.to(**to), seq_lens.to(**to), qsl.to(**to))


def calibrate(args, scale, targets, impl):
    """Lambdas reaching each target tile sparsity, from one counting pass over a lambda grid."""
    grid = torch.logspace(-7, 0, 141).tolist()
    _, skipped, visited = paged_attention_counts(*args, grid, scale=scale, impl=impl)
    frac = (skipped.sum(1).double() / visited.sum().double()).tolist()
    return [min(range(len(grid)), key=lambda i: abs(frac[i] - t)) for t in targets], grid, frac


def timeit(fns, repeats, sync):
    """Best wall time (s) of each callable; calls are interleaved so that all of them
    see the same background load (this machine is shared)."""
    for fn in fns:
        fn()
    sync()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def gathered(args, q_len):
    """K/V of every sequence as contiguous ``[S, Hkv, kv_len, D]`` and queries ``[S, Hq, q, D]``."""
    query, kc, vc, bt, seq_lens, _ = args
    n_seqs, kv_len, page = bt.shape[0], int(seq_lens[0]), kc.shape[1]
    pos = torch.arange(kv_len, device=kc.device)
    blk = bt.long()[:, pos // page]
    k = kc[blk, pos % page].transpose(1, 2).contiguous()
    v = vc[blk, pos % page].transpose(1, 2).contiguous()
    q = query.view(n_seqs, q_len, *query.shape[1:]).transpose(1, 2).contiguous()
    return q, k, v


def sdpa_fn(q, k, v, scale, q_len, kv_len):
    if q_len == 1:
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if q_len == kv_len:
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                                        enable_gqa=True)
    mask = torch.arange(kv_len, device=q.device)[None, :] <= torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                    enable_gqa=True)


def flashinfer_fn(args, q_len, scale):
    """A flashinfer paged-attention call on the same cache, or None when unavailable."""
    try:
        import flashinfer
    except ImportError:
        return None
    query, kc, vc, bt, seq_lens, qsl = args
    n_seqs, page = bt.shape[0], kc.shape[1]
    hq, hkv, d = query.shape[1], kc.shape[2], kc.shape[3]
    indptr = torch.arange(n_seqs + 1, device=kc.device, dtype=torch.int32) * bt.shape[1]
    last = (seq_lens - 1) % page + 1
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=kc.device)
    if q_len == 1:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, bt.reshape(-1), last, hq, hkv, d, page, sm_scale=scale, q_data_type=query.dtype)
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qsl, indptr, bt.reshape(-1), last, hq, hkv, d, page, causal=True, sm_scale=scale,
               q_data_type=query.dtype)
    return lambda: w.run(query, (kc, vc))


def run(cfg, a):
    name, n_seqs, kv_len, q_len, hq, hkv, head_dim = cfg
    device = a.device
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    impl = "torch" if device == "cpu" else "triton"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    args = make_inputs(n_seqs, kv_len, q_len, hq, hkv, head_dim, a.page_size, dtype, device)
    scale = 1 / math.sqrt(head_dim)
    picks, grid, frac = calibrate(args, scale, (0.5, 0.75), impl)
    q, k, v = gathered(args, q_len)
    fns = [lambda: paged_attention(*args, scale=scale, threshold=0.0, impl=impl),
           sdpa_fn(q, k, v, scale, q_len, kv_len)]
    fns += [(lambda lam: lambda: paged_attention(*args, scale=scale, threshold=lam, impl=impl))(grid[i])
            for i in picks]
    fi = flashinfer_fn(args, q_len, scale) if device == "cuda" else None
    if fi:
        fns.append(fi)
    times = timeit(fns, a.repeats, sync)
    t_dense, t_sdpa, t_fi = times[0], times[1], (times[-1] if fi else None)
    ref = paged_attention(*args, scale=scale, impl=impl).float()
    rows = []
    for j, i in enumerate(picks):
        lam = grid[i]
        err = (paged_attention(*args, scale=scale, threshold=lam, impl=impl).float() - ref).abs().max().item()
        rows.append((name, n_seqs, kv_len, q_len, f"{hq}/{hkv}/{head_dim}", f"{lam:.2e}", f"{frac[i]:.1%}", t_dense, times[2 + j], t_sdpa,
                     t_fi, err))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: torch implementation; cuda: Triton kernel (+ flashinfer if importable)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--hq", type=int, default=8, help="query heads")
    p.add_argument("--hkv", type=int, default=2, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--decode-batch", type=int, default=8, help="sequences in the decode batches")
    p.add_argument("--prefill-16k-q", type=int, default=1024,
                   help="query length of the 16k prefill (a chunked-prefill suffix; 16384 = full prefill)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per entry (best is reported)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--only", default="",
                   help="comma-separated subset of: prefill-4k,prefill-16k,decode-4k,decode-16k,"
                        "small-decode,small-prefill")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dims = (a.hq, a.hkv, a.head_dim)
    cfgs = [("prefill-4k", 1, 4096, 4096, *dims), ("prefill-16k", 1, 16384, a.prefill_16k_q, *dims),
            ("decode-4k", a.decode_batch, 4096, 1, *dims), ("decode-16k", a.decode_batch, 16384, 1, *dims),
            # Per-call overhead at the sizes the CPU serving adapter sees (tiny model, per layer per step).
            ("small-decode", 16, 512, 1, 4, 2, 32), ("small-prefill", 1, 2048, 2048, 4, 2, 32)]
    if a.only:
        keep = set(a.only.split(","))
        cfgs = [c for c in cfgs if c[0] in keep]
    other = "flashinfer ms" if a.device == "cuda" else ""
    print(f"device={a.device} dtype={a.dtype} page={a.page_size} TILE_Q={TILE_Q} TILE_K={TILE_K} "
          f"threads={torch.get_num_threads()} load={os.getloadavg()[0]:.1f}\n")
    head = ["case", "seqs", "kv", "q", "Hq/Hkv/D", "lambda", "tile sparsity", "dense ms", "skip ms", "speedup",
            "SDPA ms", "dense/SDPA", "max abs err"] + ([other] if other else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for cfg in cfgs:
        for (name, n, kv, q, dims_s, lam, sp, td, ts, tsd, tfi, err) in run(cfg, a):
            ms = (lambda t: f"{t * 1e3:.2f}") if td < 0.02 else (lambda t: f"{t * 1e3:.1f}")
            cells = [name, n, kv, q, dims_s, lam, sp, ms(td), ms(ts), f"{td / ts:.2f}x",
                     ms(tsd), f"{td / tsd:.2f}x", f"{err:.1e}"]
            if other:
                cells.append(f"{tfi * 1e3:.2f}" if tfi else "n/a")
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
