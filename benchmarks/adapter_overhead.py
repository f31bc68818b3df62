"""What the adapter costs around the compiled CPU kernel on one decode layer, without vLLM.

One serving decode layer (``SparseAttentionMixin.forward`` on CPU_ATTN-shaped metadata: the cache write where the
forward owns it, the step's plan, the layer's prepared launch and the counts) against the library call alone on the
same batch (the prepared launch, ``kernels.layer_launch``, run directly) and the general entry point
(``paged_attention(check=False)``), for a SmolLM2-135M-shaped layer (9 / 3 heads, head 64, vLLM's CPU page of 128).
The difference is the per-layer price of Python and torch ops that every decode step pays once per layer (30
layers on SmolLM2): what separated our dense decode from vLLM's native one at short contexts, where the kernel
itself is short. Best of interleaved repeats, one thread.

    python benchmarks/adapter_overhead.py [--kv 2048] [--seqs 1] [--repeats 300]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


class _NativeImpl:
    """The impl the plugin wraps; never called on this path (the sparse decode serves every step)."""

    def forward(self, *args, **kwargs):
        raise AssertionError("the sparse decode path handed the step to the native impl")


def build(seqs: int, kv: int, hq: int, hkv: int, d: int, page: int, scale_factor: float, owns_write: bool = False):
    import compat
    from compat import model as cmodel
    from sparse_attn.adapter import Policy, make_sparse
    from sparse_attn.stats import WorkerStats

    os.environ.setdefault("SPARSE_ATTN_KV_LAYOUT", "CPU_ATTN=cpu-packed")
    os.environ.setdefault("SPARSE_ATTN_CACHE_WRITER", "adapter")
    compat.reset_for_tests()
    g = torch.Generator().manual_seed(0)
    per_seq = -(-(kv + 1) // page)
    kv_cache = torch.randn(seqs * per_seq, hkv, page, 2 * d, generator=g)
    block_table = torch.arange(seqs * per_seq, dtype=torch.int32).view(seqs, per_seq)
    slots = torch.tensor([int(block_table[s, kv // page]) * page + kv % page for s in range(seqs)], dtype=torch.int64)
    # The fields of vLLM's CPU_ATTN metadata that compat.model.describe_batch reads.
    md = types.SimpleNamespace(query_start_loc=torch.arange(seqs + 1, dtype=torch.int32),
                               seq_lens=torch.full((seqs,), kv + 1, dtype=torch.int32), block_table=block_table,
                               slot_mapping=slots, num_actual_tokens=seqs, max_query_len=1, max_seq_len=kv + 1,
                               causal=True)
    query = torch.randn(seqs, hq, d, generator=g)
    key, value = torch.randn(seqs, hkv, d, generator=g), torch.randn(seqs, hkv, d, generator=g)
    info = cmodel.LayerInfo(name="model.layers.0.self_attn.attn", owner_class="LlamaAttention", backend="CPU_ATTN",
                            num_heads=hq, num_kv_heads=hkv, head_size=d, scale=1 / math.sqrt(d), cpu_isa="vec",
                            features=cmodel.LayerFeatures())
    layer = types.SimpleNamespace(impl=_NativeImpl(), isa="vec")
    policy = Policy(scale_factors={"prefill": scale_factor, "decode": scale_factor}, calibration_scales=None,
                    stats_interval_s=1e9)
    impl = make_sparse(layer, info, policy, WorkerStats())
    if not owns_write:
        impl._sa_writer = None  # vLLM >= 0.29 writes the cache itself (its own op, outside the impl's forward)
    return impl, layer, (query, key, value, kv_cache, md), info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv", type=int, default=2048, help="KV length before this step's token (default 2048)")
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--adapter-writes", action="store_true",
                   help="the forward also writes the step's K/V into the cache (vLLM < 0.29; default: vLLM writes it)")
    p.add_argument("--scale-factor", type=float, default=1e-6,
                   help="lambda = scale / kv_len: tiny skips nothing yet runs the sparse path (bench_serving's "
                        "plugin-dense; default 1e-6)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    import compat
    from compat import model as cmodel
    from sparse_attn.kernels import LambdaRule, LayerSpec, PagedBatch, layer_launch, paged_attention, step_args

    impl, layer, (query, key, value, kv_cache, md), info = build(a.seqs, a.kv, 9, 3, 64, 128, a.scale_factor,
                                                                  a.adapter_writes)
    output = torch.empty_like(query)
    batch = cmodel.describe_batch(md)
    k_view, v_view = compat.kv_cache_views(kv_cache, head_size=64, backend="CPU_ATTN", isa="vec")
    q3, out3 = query, output
    lam = LambdaRule(a.scale_factor).lambdas(md.seq_lens)
    spec = LayerSpec(1 / math.sqrt(64))

    def layer_forward():
        impl.forward(layer, query, key, value, kv_cache, md, output)

    def kernel_alone():
        paged_attention(PagedBatch(q3, k_view, v_view, md.block_table, md.seq_lens, md.query_start_loc,
                                   max_query_len=1, host=None), spec, threshold=lam, out=out3, check=False)

    batch3 = PagedBatch(q3, k_view, v_view, md.block_table, md.seq_lens, md.query_start_loc)
    launch = layer_launch(spec, batch3)
    step = step_args(md.block_table, md.seq_lens, md.query_start_loc, lam)
    counters = torch.zeros(8, dtype=torch.int64)

    def launch_alone():
        launch.run(step, q3, out3, counters)

    fns = {"layer forward (adapter + kernel)": layer_forward, "kernel call alone": kernel_alone}
    if launch is not None:
        fns["prepared launch alone"] = launch_alone
    best = dict.fromkeys(fns, math.inf)
    for fn in fns.values():
        fn()
    for _ in range(a.repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    print(f"decode layer, {a.seqs} x {a.kv} KV, 9/3/64, page 128, 1 thread, best of {a.repeats} interleaved "
          f"(load {os.getloadavg()[0]:.1f}); _ = batch {batch.num_tokens} tokens")
    for name, t in best.items():
        print(f"  {name}: {t * 1e6:.1f} us")
    alone = best.get("prepared launch alone", best["kernel call alone"])
    print(f"  adapter around the kernel: {(best['layer forward (adapter + kernel)'] - alone) * 1e6:.1f} us "
          "per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
