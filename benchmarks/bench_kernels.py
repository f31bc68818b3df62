"""Benchmark skip-softmax paged attention: skipping vs the same kernel dense, and vs SDPA.

CPU (default): the torch implementation at 4k and 16k KV, prefill and decode, timed with
the lambda that gives ~50% and ~75% tile sparsity and with lambda = 0 (same code, no
skipping), plus ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V
gathered into contiguous tensors beforehand (the gather is not timed for SDPA).

``--device cuda``: the issue-13 suite (:func:`gpu_suite`): the Triton kernel through the
capture-safe path, timed as CUDA-graph replays, dense (lambda 0) vs 50/70/90 % tile
sparsity, against torch SDPA (flash / cuDNN / efficient backend) on the same K/V;
bf16, 32 query / 8 KV heads, head size 128, prefill 8k and 32k, decode batch 1, 8, 64
at KV 8k and 32k.  ``benchmarks/gpu_check.py`` runs it as part of the GPU check.

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
import dataclasses
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparse_attn.kernels import (SPLIT_K, TILE_K, TILE_Q, LayerSpec, PagedBatch, paged_attention,  # noqa: E402
                                 paged_attention_counts)

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
    w = 2 * math.pi / torch.tensor(periods, dtype=torch.float64, device=pos.device)
    ang = pos.double()[:, None] * w[None, :]
    return (torch.cat([ang.cos(), ang.sin()], -1) * rho).float()


def make_inputs(n_seqs, kv_len, q_len, hq, hkv, d, page, dtype, device, seed=0, layout="contiguous"):
    """Paged K/V cache (shuffled blocks) and queries with sink/window/topic/noise structure.

    ``layout``: ``contiguous`` (K and V each ``[blocks, page, Hkv, D]``) or ``cpu-packed``
    (vLLM's CPU cache ``[blocks, Hkv, page, 2D]``, K dim-major in each page, viewed through
    ``compat.layouts``, as the serving adapter reads it).

    Returns a :class:`PagedBatch` (query ``[T, Hq, D]``, K/V ``[blocks, page, Hkv, D]``,
    int32 block table ``[S, blocks/seq]``, seq_lens ``[S]``, query_start_loc ``[S+1]``).
    """
    # Generated on ``device`` (a CUDA generator on GPU: the 64 x 32k decode cache is 8 GiB).
    g = torch.Generator(device=device).manual_seed(seed)
    # Small head sizes (the serving-overhead cases) get fewer topics and periods.
    n_topics = min(_N_TOPICS, d // 2)
    periods = _PERIODS[:min(len(_PERIODS), max(1, d // 8))]
    n_pos = 2 * len(periods)
    n_noise = d - n_topics - n_pos
    assert n_noise > 0, "head_dim too small for the synthetic feature layout"
    blocks_per_seq = -(-kv_len // page)
    n_blocks = n_seqs * blocks_per_seq
    dev = dict(device=device)
    kc = torch.empty(n_blocks, page, hkv, d, **dev)
    vc = torch.randn(n_blocks, page, hkv, d, generator=g, **dev)
    perm = torch.randperm(n_blocks, generator=g, **dev)
    block_table = perm.view(n_seqs, blocks_per_seq).int()
    queries = []
    kpos = torch.arange(kv_len, **dev)
    for s in range(n_seqs):
        keys = torch.empty(kv_len, hkv, d, **dev)
        keys[..., :n_noise] = torch.randn(kv_len, hkv, n_noise, generator=g, **dev)
        topic = torch.randint(1, n_topics, (kv_len // _SEGMENT + 1, hkv), generator=g, **dev)
        tok_topic = topic[kpos // _SEGMENT]
        tok_topic[:_N_SINK] = 0
        keys[..., n_noise:n_noise + n_topics] = torch.nn.functional.one_hot(tok_topic, n_topics) * KAP
        keys[..., n_noise + n_topics:] = _features(kpos, RHO, periods)[:, None, :]
        qpos = torch.arange(kv_len - q_len, kv_len, **dev)
        q = torch.empty(q_len, hq, d, **dev)
        q[..., :n_noise] = torch.randn(q_len, hq, n_noise, generator=g, **dev) * QN
        # Heads of one KV group share most of their topic affinities.
        base = torch.randn(hkv, n_topics, generator=g, **dev).repeat_interleave(hq // hkv, 0)
        aff = base * 0.9 + 0.35 * torch.randn(hq, n_topics, generator=g, **dev)
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
    kc, vc = kc.to(dtype=dtype, **to), vc.to(dtype=dtype, **to)
    if layout == "cpu-packed":
        from compat import layouts

        kv = torch.empty(n_blocks, hkv, page, 2 * d, dtype=dtype, **to)
        kc_view, vc_view = layouts.views("cpu-packed", kv, d, isa="vec")
        kc_view.copy_(kc)
        vc_view.copy_(vc)
        kc, vc = kc_view, vc_view
    return PagedBatch(query.to(dtype=dtype, **to), kc, vc, block_table.to(**to), seq_lens.to(**to), qsl.to(**to))


def calibrate(batch, scale, targets, impl):
    """Lambdas reaching each target tile sparsity, from one counting pass over a lambda grid; ``scale`` is the
    softmax scale or a whole :class:`LayerSpec` (a windowed layer's)."""
    grid = torch.logspace(-7, 0, 141).tolist()
    spec = scale if isinstance(scale, LayerSpec) else LayerSpec(scale)
    _, skipped, visited = paged_attention_counts(batch, spec, grid, impl=impl)
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


def gathered(batch, q_len):
    """K/V of every sequence as contiguous ``[S, Hkv, kv_len, D]`` and queries ``[S, Hq, q, D]``."""
    query, kc, vc, bt, seq_lens = batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens
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


def run(cfg, a):
    name, n_seqs, kv_len, q_len, hq, hkv, head_dim = cfg
    device = a.device
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    impl = a.impl if device == "cpu" else "triton"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    args = make_inputs(n_seqs, kv_len, q_len, hq, hkv, head_dim, a.page_size, dtype, device, layout=a.layout)
    scale = 1 / math.sqrt(head_dim)
    picks, grid, frac = calibrate(args, scale, a.sparsities, impl)
    q, k, v = gathered(args, q_len)
    spec = LayerSpec(scale)
    fns = [lambda: paged_attention(args, spec, threshold=0.0, impl=impl),
           sdpa_fn(q, k, v, scale, q_len, kv_len)]
    fns += [(lambda lam: lambda: paged_attention(args, spec, threshold=lam, impl=impl))(grid[i])
            for i in picks]
    times = timeit(fns, a.repeats, sync)
    t_dense, t_sdpa = times[0], times[1]
    ref = paged_attention(args, spec, impl=impl).float()
    rows = []
    for j, i in enumerate(picks):
        lam = grid[i]
        err = (paged_attention(args, spec, threshold=lam, impl=impl).float() - ref).abs().max().item()
        rows.append((name, n_seqs, kv_len, q_len, f"{hq}/{hkv}/{head_dim}", f"{lam:.2e}", f"{frac[i]:.1%}", t_dense,
                     times[2 + j], t_sdpa, err))
    return rows


# --------------------------------------------------------------------------- GPU suite (issue 13)

#: (name, sequences, KV length, query length per sequence)
GPU_CASES = [("prefill-8k", 1, 8192, 8192), ("prefill-32k", 1, 32768, 32768)] + [
    (f"decode-b{b}-{kv // 1024}k", b, kv, 1) for kv in (8192, 32768) for b in (1, 8, 64)]
GPU_DIMS = (32, 8, 128)               # query heads, KV heads, head size
GPU_SPARSITY = (0.5, 0.7, 0.9)        # target tile sparsities (0 % = our dense, lambda 0)


def _sdpa_call(q, k, v, scale, q_len, kv_len):
    """SDPA on the gathered K/V with the fastest fused backend that accepts it, and its name.

    Tries flash, then cuDNN, then memory-efficient attention with ``enable_gqa``, then the
    same with K/V expanded to the query heads; on CPU torch picks the backend."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    causal = q_len == kv_len
    if q_len not in (1, kv_len):
        raise ValueError("GPU suite cases are full prefills or decodes")
    if q.device.type != "cuda":
        return (lambda: sdpa(q, k, v, scale=scale, is_causal=causal, enable_gqa=True)), "cpu-default"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    expanded = []      # K/V expanded to the query heads, made only if no backend takes GQA

    def variants():
        yield k, v, True, "gqa"
        if not expanded:
            expanded.append((k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
        yield (*expanded[0], False, "expanded-kv")

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for kk, vv, gqa, tag in variants():
            def fn(kk=kk, vv=vv, gqa=gqa, backend=backend):
                with sdpa_kernel([backend]):
                    return sdpa(q, kk, vv, scale=scale, is_causal=causal, enable_gqa=gqa)
            try:
                fn()
                torch.cuda.synchronize()
            except RuntimeError:
                continue
            return fn, f"{backend.name.lower()}/{tag}"
    raise RuntimeError("no fused SDPA backend accepted the inputs")


def _time_ms(fns, repeats, device):
    """Median milliseconds of each callable, interleaved; CUDA events on GPU."""
    for fn in fns:
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times[i].append((time.perf_counter() - t) * 1e3)
    return [sorted(t)[len(t) // 2] for t in times]


def _graphed(fn):
    """``fn`` captured in a CUDA graph (as vLLM serves decode): returns the replay callable."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def gpu_suite(device="cuda", dtype=torch.bfloat16, cases=GPU_CASES, dims=GPU_DIMS, page=16, repeats=20,
              sparsity=GPU_SPARSITY, log=print):
    """The issue-13 benchmark: our Triton kernel dense vs skipping vs SDPA on the same data.

    Our calls go through the capture-safe path (``check=False``) and, on CUDA, are timed as
    CUDA-graph replays (launch overhead excluded, as in vLLM's captured decode); SDPA is one
    eager launch on K/V gathered beforehand.  Returns one dict per (case, sparsity) with
    milliseconds, achieved tile sparsity, speedup over our dense and ratio to SDPA.
    """
    hq, hkv, d = dims
    rows = []
    for name, n_seqs, kv_len, q_len in cases:
        t0 = time.perf_counter()
        args = make_inputs(n_seqs, kv_len, q_len, hq, hkv, d, page, dtype, device)
        scale = 1 / math.sqrt(d)
        picks, grid, frac = calibrate(args, scale, sparsity, "triton")
        q, k, v = gathered(args, q_len)
        sdpa, backend = _sdpa_call(q, k, v, scale, q_len, kv_len)
        lams = [0.0] + [grid[i] for i in picks]
        outs = [torch.empty_like(args.query) for _ in lams]
        lam_t = [torch.full((n_seqs,), lam, dtype=torch.float32, device=device) for lam in lams]
        bounded, spec = dataclasses.replace(args, max_query_len=q_len), LayerSpec(scale)

        def ours(j):
            return lambda: paged_attention(bounded, spec, threshold=lam_t[j], out=outs[j], impl="triton",
                                           check=False)
        fns = [ours(j) for j in range(len(lams))]
        mode = "eager"
        if device == "cuda":
            fns, mode = [_graphed(f) for f in fns], "cuda-graph"
        ms = _time_ms(fns + [sdpa], repeats, device)
        ms_sdpa = ms[-1]
        for j, lam in enumerate(lams):
            fns[j]()
        if device == "cuda":
            torch.cuda.synchronize()
        for j, lam in enumerate(lams):
            rows.append(dict(case=name, seqs=n_seqs, kv=kv_len, q=q_len, heads=f"{hq}/{hkv}/{d}",
                             dtype=str(dtype).replace("torch.", ""), target=0.0 if j == 0 else sparsity[j - 1],
                             lam=lam, sparsity=0.0 if j == 0 else frac[picks[j - 1]], ms=ms[j], ms_dense=ms[0],
                             speedup=ms[0] / ms[j], ms_sdpa=ms_sdpa, vs_sdpa=ms_sdpa / ms[j], sdpa_backend=backend,
                             timing=mode, max_abs_err=(outs[j].float() - outs[0].float()).abs().max().item()))
        log(f"{name}: dense {ms[0]:.3f} ms, SDPA {ms_sdpa:.3f} ms ({backend}), "
            + ", ".join(f"{r['sparsity']:.0%}: {r['ms']:.3f} ms" for r in rows[-len(sparsity):])
            + f"  [{time.perf_counter() - t0:.0f} s]")
        del args, q, k, v, outs
    return rows


def gpu_markdown(rows) -> str:
    head = ["case", "seqs", "kv", "q", "Hq/Hkv/D", "target", "lambda", "tile sparsity", "ms", "speedup vs our dense",
            "SDPA ms", "SDPA/ours", "SDPA backend", "timing", "max abs err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in (
            r["case"], r["seqs"], r["kv"], r["q"], r["heads"], f"{r['target']:.0%}", f"{r['lam']:.2e}",
            f"{r['sparsity']:.1%}", f"{r['ms']:.3f}", f"{r['speedup']:.2f}x", f"{r['ms_sdpa']:.3f}",
            f"{r['vs_sdpa']:.2f}x", r["sdpa_backend"], r["timing"], f"{r['max_abs_err']:.1e}")) + " |")
    return "\n".join(lines)



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: torch implementation, CPU cases; cuda: the issue-13 suite on the Triton kernel "
                        "(bf16, 32/8 heads, D 128, prefill 8k/32k, decode batch 1/8/64 at 8k/32k, "
                        "sparsity 0/50/70/90%%, vs torch SDPA)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--impl", choices=("auto", "torch", "compiled"), default="auto",
                   help="cpu: which CPU kernel (default auto: sparse_attn.kernels.api.cpu_kernel's rule)")
    p.add_argument("--layout", choices=("contiguous", "cpu-packed"), default="contiguous",
                   help="cpu cases: cache layout (cpu-packed = vLLM's CPU cache, K dim-major; use --page-size 128)")
    p.add_argument("--hq", type=int, default=8, help="query heads (cpu cases)")
    p.add_argument("--hkv", type=int, default=2, help="KV heads (cpu cases)")
    p.add_argument("--head-dim", type=int, default=128, help="head size (cpu cases)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--decode-batch", type=int, default=8, help="sequences in the decode batches (cpu cases)")
    p.add_argument("--prefill-16k-q", type=int, default=1024,
                   help="query length of the 16k prefill (a chunked-prefill suffix; 16384 = full prefill)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per entry (cpu: best of, default 3; cuda: median of, default 20)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--sparsities", type=lambda s: tuple(float(x) for x in s.split(",")), default=(0.5, 0.75),
                   help="cpu cases: comma-separated target tile sparsities, each timed against our dense "
                        "(lambda 0) in the same interleaved loop (default 0.5,0.75)")
    p.add_argument("--only", default="",
                   help="comma-separated subset of case names (cpu: prefill-4k,prefill-16k,decode-4k,decode-16k,"
                        "small-decode,small-prefill; cuda: " + ",".join(c[0] for c in GPU_CASES) + ")")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.dtype is None:
        a.dtype = "bf16" if a.device == "cuda" else "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    keep = set(a.only.split(",")) if a.only else None
    if a.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); "
                    "run on a GPU machine, or use --device cpu")
        cases = [c for c in GPU_CASES if keep is None or c[0] in keep]
        print(f"device={torch.cuda.get_device_name()} dtype={a.dtype} page={a.page_size} TILE_Q={TILE_Q} "
              f"TILE_K={TILE_K} SPLIT_K={SPLIT_K}\n")
        rows = gpu_suite("cuda", dtype, cases, page=a.page_size, repeats=a.repeats or 20)
        print(gpu_markdown(rows))
        return
    a.repeats = a.repeats or 3
    dims = (a.hq, a.hkv, a.head_dim)
    cfgs = [("prefill-4k", 1, 4096, 4096, *dims), ("prefill-16k", 1, 16384, a.prefill_16k_q, *dims),
            ("decode-4k", a.decode_batch, 4096, 1, *dims), ("decode-16k", a.decode_batch, 16384, 1, *dims),
            # Per-call overhead at the sizes the CPU serving adapter sees (tiny model, per layer per step).
            ("small-decode", 16, 512, 1, 4, 2, 32), ("small-prefill", 1, 2048, 2048, 4, 2, 32),
            # SmolLM2-135M's decode layer (9 / 3 heads, head 64) at the serving benchmark's short contexts,
            # where "never slower than skipping off" is hardest (the kernel is short, the skip test the same).
            ("smol-decode-2k", 1, 2048, 1, 9, 3, 64), ("smol-decode-4k", 1, 4096, 1, 9, 3, 64),
            ("smol-decode-4x2k", 4, 2048, 1, 9, 3, 64)]
    if keep:
        cfgs = [c for c in cfgs if c[0] in keep]
    print(f"device={a.device} impl={a.impl} layout={a.layout} dtype={a.dtype} page={a.page_size} TILE_Q={TILE_Q} TILE_K={TILE_K} "
          f"SPLIT_K={SPLIT_K} threads={torch.get_num_threads()} load={os.getloadavg()[0]:.1f}\n")
    head = ["case", "seqs", "kv", "q", "Hq/Hkv/D", "lambda", "tile sparsity", "dense ms", "skip ms", "speedup",
            "SDPA ms", "dense/SDPA", "max abs err"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for cfg in cfgs:
        for (name, n, kv, q, dims_s, lam, sp, td, ts, tsd, err) in run(cfg, a):
            ms = (lambda t: f"{t * 1e3:.2f}") if td < 0.02 else (lambda t: f"{t * 1e3:.1f}")
            cells = [name, n, kv, q, dims_s, lam, sp, ms(td), ms(ts), f"{td / ts:.2f}x",
                     ms(tsd), f"{td / tsd:.2f}x", f"{err:.1e}"]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
