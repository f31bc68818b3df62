"""Kernel level, on CPU: vLLM's own CPU attention vs our compiled kernel on the same paged cache.

Needs an importable vLLM CPU build (e.g. ``.tox/engine0320/bin/python``).  A cpu-packed
cache ``[blocks, Hkv, page, 2 * D]`` (page 128: what CPU_ATTN allocates), written with
vLLM's own ``cpu_attn_reshape_and_cache``; vLLM reads it through its own views and scheduler
metadata (``cpu_attn_get_scheduler_metadata``) with the ISA it picks for the dtype (``vec`` for
fp32; ``amx`` for bf16 on a CPU with AMX tiles, on a cache it writes for ``amx``), we ours (its
``vec`` pages) through ``compat``'s views.
Both outputs are compared (max abs difference), then timed interleaved, best of ``--repeats``,
at ``--threads`` (vLLM's kernel uses OpenMP's thread count, ours ``torch.get_num_threads()``,
the same runtime).  Ours runs dense (lambda 0) and at ~50 / ~75 % tile sparsity.

    .tox/engine0320/bin/python benchmarks/bench_cpu_native.py --threads 1 --repeats 5
    .tox/engine0320/bin/python benchmarks/bench_cpu_native.py --cold-mib 768 --only smol-decode-1x8k

Warm (the default), a call reads the K/V the previous call left in L2/L3; in serving, a layer's
attention runs after the model's weights streamed through the caches, so it reads from DRAM:
``--cold-mib`` (more than lscpu's L3) evicts them before every timed call.  Decode is 2-4x slower
cold, and skipped tiles gain less than warm timings suggest (fp32 1 x 2k at 75 %: 2.3x warm, 1.4x cold).

Cases: SmolLM2-135M's attention (9 query / 3 KV heads, head 64): prefill 2k, an 8k prefill's
last 2k chunk, decode 4 x 2k, 16 x 2k, 4 x 8k, 1 x 2k and 1 x 8k; the kernel benchmark's 8/2/128
prefill 16k chunk; Gemma-3-270M's (4 query / 1 KV head, head 256): decode 1 x 8k and 1 x 32k of a global layer,
decode 1 x 8k and an 8k prefill's last 2k of a 512-token windowed layer.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = [  # name, sequences, KV length, query length, Hq, Hkv, D, window (tokens; None: a global layer)
    ("smol-prefill-2k", 1, 2048, 2048, 9, 3, 64, None),
    ("smol-prefill-8k-last-2k", 1, 8192, 2048, 9, 3, 64, None),
    ("smol-decode-4x2k", 4, 2048, 1, 9, 3, 64, None),
    ("smol-decode-16x2k", 16, 2048, 1, 9, 3, 64, None),  # the serving table's 2048 x 16 decode
    ("smol-decode-4x8k", 4, 8192, 1, 9, 3, 64, None),
    ("smol-decode-1x2k", 1, 2048, 1, 9, 3, 64, None),  # the serving table's 2048 x 1 decode
    ("smol-decode-1x8k", 1, 8192, 1, 9, 3, 64, None),  # 3 KV heads: fewer items than threads without KV parts
    ("prefill-16k-chunk-1k", 1, 16384, 1024, 8, 2, 128, None),
    # Gemma-3-270M (4 query heads on 1 KV head, head 256): its 3 global layers and its 15 windowed (512) ones
    ("gemma-decode-1x8k", 1, 8192, 1, 4, 1, 256, None),
    ("gemma-local-decode-1x8k", 1, 8192, 1, 4, 1, 256, 512),
    ("gemma-decode-1x32k", 1, 32768, 1, 4, 1, 256, None),
    ("gemma-local-prefill-8k-last-2k", 1, 8192, 2048, 4, 1, 256, 512),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="model dtype: bf16 times vLLM with the ISA it picks for bf16 on this CPU (amx where the CPU "
                        "has it, vec otherwise) on a cache it writes for that ISA, and ours on its vec pages")
    p.add_argument("--only", default="", help="comma-separated case names: " + ",".join(c[0] for c in CASES))
    p.add_argument("--cold-mib", type=int, default=0,
                   help="before every timed call, write this many MiB of another buffer (more than the last-level "
                        "cache: lscpu's L3), so the call reads its K/V from DRAM as a served layer does after the "
                        "model's weights streamed through the caches; 0 (default): warm, every call after the first "
                        "reads a cache the previous call left in L2/L3")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import compat
    from bench_kernels import calibrate, make_inputs
    from compat import layouts

    ops = compat.cpu_ops()  # loads vLLM's CPU kernels: vllm._custom_ops up to 0.33, vllm._cpu_ops from 0.34
    from sparse_attn.kernels import LayerSpec, PagedBatch, cpu_impl, layer_launch, step_args

    # vLLM's own choice for the dtype on this CPU (its _get_attn_isa: amx for bf16 where the CPU has AMX tiles).
    native_isa = "amx" if a.dtype == "bf16" and torch.cpu._is_amx_tile_supported() else "vec"
    if native_isa == "amx":
        torch.cpu._init_amx()  # the kernel's tile permission (in an engine, oneDNN's bf16 linears ask for it first)
    flush = torch.empty(a.cold_mib << 18, dtype=torch.float32) if a.cold_mib else None
    print(f"dtype={a.dtype} vLLM isa={native_isa} threads={a.threads} repeats={a.repeats} "
          f"caches={'cold (' + str(a.cold_mib) + ' MiB written before each call)' if flush is not None else 'warm'} "
          f"kernel={cpu_impl.status().describe()} "
          f"load={'/'.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| case | vLLM ms | ours dense ms | dense vs vLLM | ours ~50 % ms (sparsity) | ours ~75 % ms (sparsity) "
          "| ~75 % vs vLLM | max abs diff dense vs vLLM |")
    print("|---|---|---|---|---|---|---|---|")
    keep = set(a.only.split(",")) if a.only else None
    for name, n, kv_len, q_len, hq, hkv, d, window in CASES:
        if keep and name not in keep:
            continue
        page = 128
        dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        src = make_inputs(n, kv_len, q_len, hq, hkv, d, page, dtype, "cpu")  # contiguous K/V to copy from
        n_blocks = src.key_cache.shape[0]
        slots = (src.block_table.long()[:, :, None] * page + torch.arange(page)).view(n, -1)[:, :kv_len].reshape(-1)
        tok_k = src.key_cache.view(-1, hkv, d)[slots]
        tok_v = src.value_cache.view(-1, hkv, d)[slots]

        def cache(isa):  # a [blocks, Hkv, page, 2 D] cache written by vLLM for isa, and the halves its op takes
            kv = torch.zeros(n_blocks, hkv, page, 2 * d, dtype=dtype)
            key_cache, value_cache = kv.view(n_blocks, hkv, 2 * page, d).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(tok_k, tok_v, key_cache, value_cache, slots, isa)
            return kv, key_cache, value_cache

        kv, _, _ = cache("vec")  # ours reads vec pages (compat makes vLLM pack sparse layers' pages so)
        k_view, v_view = layouts.views("cpu-packed", kv, d, isa="vec")
        _, key_cache, value_cache = cache(native_isa)
        batch = PagedBatch(src.query, k_view, v_view, src.block_table, src.seq_lens, src.query_start_loc)
        scale = 1 / math.sqrt(d)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=n, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=src.seq_lens, dtype=dtype,
            query_start_loc=src.query_start_loc, causal=True, sliding_window_size=window or -1, isa=native_isa,
            enable_kv_split=True)
        out_native = torch.empty_like(src.query)

        def native():
            ops.cpu_attention_with_kv_cache(
                query=src.query, key_cache=key_cache, value_cache=value_cache, output=out_native,
                query_start_loc=src.query_start_loc, seq_lens=src.seq_lens, scale=scale, causal=True, alibi_slopes=None,
                sliding_window=window or -1, block_table=src.block_table, softcap=0.0, scheduler_metadata=meta, s_aux=None)

        spec = LayerSpec(scale, window=window)
        (pick50, pick75), grid, frac = calibrate(batch, spec, (0.5, 0.75), "compiled")
        # Ours as a served layer runs it: a launch prepared once for the layer's cache (layer_launch) and the
        # step's arguments once per step (step_args), then one library call per layer; vLLM's op likewise
        # gets its scheduler metadata prepared once.  (paged_attention, the general path, builds and checks
        # every argument per call: ~0.1-0.2 ms of Python that a served layer does not pay.)
        launch = layer_launch(spec, batch, impl="compiled")
        counters = torch.zeros(8, dtype=torch.int64)
        out_ours = torch.empty_like(src.query)

        def served(lam):
            step = step_args(batch.block_table, batch.seq_lens, batch.query_start_loc, torch.full((n,), float(lam)))
            return lambda: launch.run(step, batch.query, out_ours, counters)

        ours = [served(lam) for lam in (0.0, grid[pick50], grid[pick75])]
        native()
        ours[0]()
        diff = (out_ours.float() - out_native.float()).abs().max().item()
        best = [math.inf] * 4
        for _ in range(a.repeats):
            for i, fn in enumerate([native] + ours):
                if flush is not None:
                    flush.fill_(float(i))
                t = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t)
        ms = [x * 1e3 for x in best]
        print(f"| {name} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[0] / ms[1]:.2f}x | {ms[2]:.2f} ({frac[pick50]:.1%}) | "
              f"{ms[3]:.2f} ({frac[pick75]:.1%}) | {ms[0] / ms[3]:.2f}x | {diff:.1e} |", flush=True)
    print(f"\nload after: {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
