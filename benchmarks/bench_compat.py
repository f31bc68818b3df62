"""Benchmark of compat's hot-path cost (a script, not a timed test).

Measures, for each layout:
* the per-call cost of ``compat.kv_cache_views`` as a ratio to the bare torch
  view expression it wraps (median of many calls; target <= 1.5x);
* bytes copied by the views (target 0: the views' storage is the cache's);
and, when vLLM is installed, the cost of ``compat.probe()`` after vLLM's backend
modules are already imported (target <= 50 ms).

    python benchmarks/bench_compat.py [--calls 20000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import importlib
import statistics
import time

import torch

import compat
from compat import envs
from compat.probe import run_probe

B, N, H, D = 256, 16, 8, 128

def median_ns_per_call(fn, calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(samples)

def cases():
    """(layout, cache, the bare torch expression compat wraps for it)."""
    yield "blocks-first", torch.zeros(B, 2, N, H, D), lambda kv: (kv[:, 0], kv[:, 1])
    yield "kv-first", torch.zeros(2, B, N, H, D), lambda kv: (kv[0], kv[1])

    def packed_bare(kv):
        t = kv.transpose(1, 2)
        return t[..., :D], t[..., D:]

    yield "packed", torch.zeros(B, H, N, 2 * D), packed_bare

    def cpu_bare(kv):
        sb, sh = kv.stride(0), kv.stride(1)
        o = kv.storage_offset()
        return kv.as_strided((B, N, H, D), (sb, 1, sh, N), o), kv.as_strided((B, N, H, D), (sb, D, sh, 1), o + N * D)

    yield "cpu-packed", torch.zeros(B, H, N, 2 * D), cpu_bare

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="calls per timing sample")
    parser.add_argument("--repeats", type=int, default=15, help="timing samples; the median is reported")
    args = parser.parse_args()

    print(f"torch {torch.__version__}; vLLM {compat.probe().vllm_version or 'not installed'}")
    print("| layout | bare torch (ns/call) | compat.kv_cache_views (ns/call) | ratio | bytes copied |")
    print("|---|---|---|---|---|")
    for layout, cache, bare in cases():
        backend = {"cpu-packed": "CPU_ATTN"}.get(layout, "FLASHINFER")

        os.environ["SPARSE_ATTN_KV_LAYOUT"] = f"{backend}={layout}"
        compat.reset_for_tests()
        isa = "vec" if layout == "cpu-packed" else None
        key, value = compat.kv_cache_views(cache, head_size=D, backend=backend, isa=isa)
        copied = sum(t.numel() * t.element_size() for t in (key, value) if t.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr())
        bare_ns = median_ns_per_call(lambda: bare(cache), args.calls, args.repeats)
        ours_ns = median_ns_per_call(lambda: compat.kv_cache_views(cache, head_size=D, backend=backend, isa=isa), args.calls, args.repeats)
        print(f"| {layout} | {bare_ns:.0f} | {ours_ns:.0f} | {ours_ns / bare_ns:.2f}x | {copied} |")
    os.environ.pop("SPARSE_ATTN_KV_LAYOUT", None)

    if importlib.util.find_spec("vllm") is None:
        print("\nprobe cost: vLLM not installed (run inside a tox matrix env, e.g. tools/tox -e vllm0310 -- benchmarks)")
        return
    compat.reset_for_tests()
    compat.probe()  # imports vLLM's backend modules
    times = []
    for _ in range(20):
        envs.reset_for_tests()
        start = time.perf_counter()
        run_probe()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"\nprobe cost after vLLM's backend modules are imported: median {statistics.median(times):.2f} ms, max {max(times):.2f} ms (20 runs)")

if __name__ == "__main__":
    main()
