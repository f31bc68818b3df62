"""Where the compiled CPU kernel spends its time: cycles per phase, per case.

Builds the ``-DSA_PROFILE`` variant of ``sparse_attn/kernels/csrc/skip_attn_cpu.cpp`` (its
phases are timed with ``rdtsc``; the normal build has no timers), runs each case dense and at
``--sparsities`` (default ~75 %) tile sparsity, and prints the share of each phase.  One thread (``--threads``), the
cpu-packed cache (vLLM's CPU layout, page 128) unless ``--layout contiguous``.

    python benchmarks/profile_cpu_kernel.py [--only smol-prefill-2k,...] [--repeats 3]

Phases: ``q`` (queries -> scaled fp32 rows), ``k-prep`` (K panel pointers, or the gather
of non-dim-major K), ``qk`` (S = Q K^T), ``mask+max`` (causal/tail mask, row maxima),
``rule`` (skip test, counts, dense running max), ``exp`` (exp, row sums, rescale), ``v-prep``
(V row pointers or gather), ``pv`` (O += P V), ``out`` (O / l to the output dtype).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import calibrate, make_inputs  # noqa: E402

from sparse_attn.kernels import LayerSpec, cpu_build, cpu_impl, paged_attention  # noqa: E402

PHASES = ("q", "k-prep", "qk", "mask+max", "rule", "exp", "v-prep", "pv", "out")
#: (name, sequences, KV length, query length, Hq, Hkv, D): SmolLM2-135M's attention (9/3/64)
#: at the serving benchmark's sizes, and the kernel benchmark's 8/2/128 cases.
CASES = [
    ("smol-prefill-2k", 1, 2048, 2048, 9, 3, 64),
    ("smol-prefill-8k-chunk", 1, 8192, 2048, 9, 3, 64),
    ("smol-decode-4x2k", 4, 2048, 1, 9, 3, 64),
    ("smol-decode-4x8k", 4, 8192, 1, 9, 3, 64),
    ("prefill-16k", 1, 16384, 1024, 8, 2, 128),
    ("decode-16k", 8, 16384, 1, 8, 2, 128),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--only", default="", help="comma-separated case names: " + ",".join(c[0] for c in CASES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="calls per measurement (phase cycles are summed)")
    p.add_argument("--layout", choices=("cpu-packed", "contiguous"), default="cpu-packed")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="queries and cache")
    p.add_argument("--sparsities", type=lambda s: tuple(float(x) for x in s.split(",")), default=(0.75,),
                   help="comma-separated target tile sparsities profiled after dense (default 0.75)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    built = cpu_build.load(profile=True)
    cpu_impl.use_library(built.lib)  # this process serves with the timed variant
    buf = (ctypes.c_uint64 * len(PHASES))()
    keep = set(a.only.split(",")) if a.only else None
    print(f"profile build {built.path.name} ({built.target}); threads={a.threads} layout={a.layout} page={a.page_size} "
          f"load={os.getloadavg()[0]:.1f}\n")
    print("| case | tile sparsity | wall ms | " + " | ".join(PHASES) + " |")
    print("|---|---|---|" + "---|" * len(PHASES))
    for name, n, kv, q, hq, hkv, d in CASES:
        if keep and name not in keep:
            continue
        args = make_inputs(n, kv, q, hq, hkv, d, a.page_size,
                           {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype], "cpu",
                           layout=a.layout)
        spec = LayerSpec(1 / math.sqrt(d))
        picks, grid, frac = calibrate(args, spec.scale, a.sparsities, "compiled")
        for lam, sp in [(0.0, 0.0)] + [(grid[i], frac[i]) for i in picks]:
            paged_attention(args, spec, threshold=lam, impl="compiled")
            built.lib.sa_profile(buf, 1)
            t = time.perf_counter()
            for _ in range(a.repeats):
                paged_attention(args, spec, threshold=lam, impl="compiled")
            wall = (time.perf_counter() - t) / a.repeats
            built.lib.sa_profile(buf, 1)
            total = sum(buf) or 1
            print(f"| {name} | {sp:.1%} | {wall * 1e3:.2f} | " + " | ".join(f"{100 * x / total:.1f}%" for x in buf) + " |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
