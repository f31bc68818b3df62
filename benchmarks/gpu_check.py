"""One GPU check for issues 12, 13, 17 and 18: compiled kernel tests, CUDA-graph capture and
its memory, benchmark.

Runs on one GPU with torch and triton installed and nothing else (no vLLM, no pytest),
in at most ~8 minutes on an H200:

1. **kernels**: the compiled Triton kernel (no interpreter) in fp32, bf16 and fp16 on GQA
   groups 1/4/8, head sizes 64/128/256, decodes crossing several KV splits (one with a
   split per KV tile, so every split program computes its anchor seed), mixed
   prefill/decode batches and the default ``SPLIT_K``, and the layers of real models:
   Gemma 3 (head 256, a 512-token window), gpt-oss (head 64, learned sinks, a 128-token
   window, an fp8 e4m3 cache with device scales), a soft-capped layer on an fp8 e5m2
   cache, against the float64 brute-force reference of
   ``tests/sparse_attn/kernel_reference.py`` (dense output at lambda 0; outputs and skip
   counts under lambda), and calibration counts == serving skips.
2. **graph**: the capture-safe decode call (``check=False``) on FlashInfer-shaped
   metadata (one packed ``[blocks, Hkv, page, 2D]`` cache viewed as K / V, int32 block
   table, seq_lens, query_start_loc, per-sequence lambdas) captured in a
   ``torch.cuda.CUDAGraph``, plain and with a window, sinks and an fp8 cache with device
   scales; seq_lens, block tables, lambdas, queries and scales are then changed IN PLACE
   and each replay must equal an eager call on the new data.
3. **capture memory**: the bytes a captured decode allocates (its graph pool, and the
   kernel's own scratch) per captured batch size with a 128k-token block table.
4. **forward**: the adapter's whole decode forward on fake vLLM metadata, CUDA-graph captured,
   microseconds per layer-step dense and at 50 / 70 / 90 % tile sparsity against a native
   stand-in (fused SDPA on pre-gathered K/V), 4k / 32k / 128k context, batch 1 and 16.
5. **bench**: the issue-13 benchmark of ``benchmarks/bench_kernels.py`` (skip with
   ``--skip-bench``).

Writes ``<out>.json`` (every number, device name, versions) and ``<out>.md`` (summary).
``--dry-run`` runs everything on CPU under ``TRITON_INTERPRET=1`` with tiny sizes and
skips the graph capture (saying so), so CI keeps the script alive.

    python benchmarks/gpu_check.py --out $OUT/gpu-check          # on the GPU machine
    python benchmarks/gpu_check.py --dry-run --out DIR             # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import traceback

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported

import torch  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sparse_attn.kernels import SPLIT_K, TILE_K, LayerSpec, PagedBatch, paged_attention, paged_attention_counts  # noqa: E402
from tests.sparse_attn.kernel_reference import add_recency, add_sink_token, make_batch, reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 2e-5, "bf16": 3e-2, "fp16": 5e-3}

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: name: (kv_lens, q_lens, Hq, Hkv, D, page, layout, split_k or None = SPLIT_K, layer features)
#: Features: LayerSpec fields, plus "kv" (an fp8 cache dtype) and "scales" ("float" / "tensor").
KERNEL_CASES = {
    "gqa1-decode-splits": ([2000, 300, 65], [1, 1, 1], 4, 4, 64, 16, "contiguous", 256, {}),
    "gqa4-mixed-batch": ([900, 200, 640, 0], [1, 200, 1, 0], 8, 2, 128, 16, "dim_major_k", 256, {}),
    "gqa8-decode-page7-packed": ([1500, 129], [1, 1], 16, 2, 128, 7, "packed_kv", 192, {}),
    "gqa4-default-split-decode": ([SPLIT_K * 3 + 300, 700], [1, 1], 8, 2, 128, 16, "packed_kv", None, {}),
    "gqa4-prefill-chunked": ([1300], [300], 8, 2, 128, 16, "contiguous", None, {}),
    # Every tile opens a split: each split program reads the anchor's K tile for its seed.
    "gqa4-decode-split-per-tile": ([1100, 300], [1, 1], 8, 2, 128, 16, "contiguous", 64, {}),
    "gemma3-window512-d256": ([3000, 700, 1200], [1, 1, 500], 4, 1, 256, 16, "packed_kv", None,
                              dict(window=512)),
    "gptoss-sinks-window128-fp8": ([2500, 300, 900], [1, 1, 200], 16, 2, 64, 16, "packed_kv", 256,
                                   dict(window=128, sink_logits=True, kv=E4M3, scales="tensor")),
    "softcap50-fp8e5m2-d128": ([1800, 600], [1, 300], 8, 2, 128, 16, "dim_major_k", 512,
                               dict(soft_cap=50.0, kv=E5M2, scales="float")),
}
DRY_KERNEL_CASES = {
    "gqa1-decode-splits": ([300, 65], [1, 1], 2, 2, 16, 16, "contiguous", 128, {}),
    "gqa4-mixed-batch": ([200, 30, 0], [1, 30, 0], 8, 2, 16, 16, "dim_major_k", 128, {}),
    "window-sinks-fp8": ([260, 90], [1, 70], 4, 1, 16, 16, "packed_kv", 128,
                         dict(window=100, sink_logits=True, kv=E4M3, scales="tensor", soft_cap=8.0)),
}
LAMS = [0.0, 1e-3, 0.05, 0.4]
DRY_LAMS = [0.0, 0.4]


def _to(batch, device):
    return dataclasses.replace(batch, **{f: getattr(batch, f).to(device) for f in (
        "query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")})


def _case(kv_lens, q_lens, hq, hkv, d, page, layout, features, dtype, seed=41):
    """The batch (on the host) and the layer (on the host, and its copy on the device) of a case."""
    f = dict(features)
    kv_dtype, scales = f.pop("kv", None), f.pop("scales", None)
    k_scale, v_scale = (0.5, 2.0) if kv_dtype is not None else (1.0, 1.0)
    batch = make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, dtype=dtype, seed=seed, kv_dtype=kv_dtype,
                       k_scale=k_scale, v_scale=v_scale)
    batch = add_sink_token(batch, strength=3.0 / k_scale ** 0.5, every=192 if f.get("window") else None)
    if f.get("window"):     # recent keys score higher, so the diagonal anchor has old tiles to skip
        batch = add_recency(batch, k_scale=k_scale, scale=2.0 * d ** -0.5)
    if f.pop("sink_logits", False):
        f["sink_logits"] = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2
    if scales == "tensor":
        k_scale, v_scale = torch.tensor([k_scale]), torch.tensor([v_scale])
    return batch, LayerSpec(2.0 * d ** -0.5, k_scale=k_scale, v_scale=v_scale, **f)


def _spec_to(spec, device):
    moved = {n: getattr(spec, n).to(device) for n in ("sink_logits", "k_scale", "v_scale")
             if isinstance(getattr(spec, n), torch.Tensor)}
    return dataclasses.replace(spec, **moved)


def check_kernels(device, cases, log, lams=LAMS):
    """Compiled kernel vs float64 reference; counts == serving skips.  Returns result dicts."""
    results = []
    for name, (kv_lens, q_lens, hq, hkv, d, page, layout, split_k, features) in cases.items():
        for dname, dt in DTYPES.items():
            t0 = time.perf_counter()
            batch, spec_host = _case(kv_lens, q_lens, hq, hkv, d, page, layout, features, dt)
            rule = {} if split_k is None else {"split_k": split_k}
            ref0, _, ref_vis, ref_thr = reference(batch, spec_host, thresholds=lams, **rule)
            args = _to(batch, device)
            r = dict(case=name, dtype=dname, split_k=split_k or SPLIT_K, checks={},
                     features={k: str(v) for k, v in features.items()}, head_dim=d)
            spec = _spec_to(spec_host, device)
            out0 = paged_attention(args, spec, impl="triton", **rule).cpu().double()
            r["dense_max_err"] = (out0 - ref0).abs().max().item()
            r["checks"]["dense_equals_float64_reference"] = r["dense_max_err"] <= TOL[dname] * (1 + ref0.abs().max().item())
            out_c, skipped, vis = paged_attention_counts(args, spec, lams, impl="triton", **rule)
            skipped, vis = skipped.cpu(), vis.cpu()
            r["checks"]["visited_equals_reference"] = vis.tolist() == ref_vis.tolist()
            r["skipped_per_lambda"] = skipped.sum(1).tolist()
            r["reference_skipped_per_lambda"] = ref_thr.sum(1).tolist()
            r["count_tiles_differing_from_reference"] = int((skipped - ref_thr).abs().sum())
            serve_ok, sparse_err = True, 0.0
            for j, lam in enumerate(lams):
                o, sk, _ = paged_attention(args, spec, threshold=lam, impl="triton", return_counts=True, **rule)
                serve_ok &= sk.cpu().tolist() == skipped[j].tolist()
                if j == len(lams) - 1:
                    ref_l = reference(batch, spec_host, lam=lam, **rule)[0]
                    sparse_err = (o.cpu().double() - ref_l).abs().max().item()
            r["checks"]["counts_equal_serving_skips"] = serve_ok
            r["sparse_max_err"] = sparse_err
            # 16-bit: the kernel's scores are rounded differently from the float64 reference,
            # so a ratio at a lambda's edge may flip; fp32 must match the rule exactly.
            if dname == "fp32":
                r["checks"]["counts_equal_float64_rule"] = r["count_tiles_differing_from_reference"] == 0
                r["checks"]["sparse_equals_float64_reference"] = sparse_err <= 1e-4
            r["ok"] = all(r["checks"].values())
            r["seconds"] = time.perf_counter() - t0
            log(f"  kernels {name} {dname}: {'ok' if r['ok'] else 'FAIL ' + str(r['checks'])} "
                f"(dense err {r['dense_max_err']:.1e}, skipped {r['skipped_per_lambda']}) [{r['seconds']:.1f} s]")
            results.append(r)
    return results


def _flashinfer_decode_batch(num_seqs, max_blocks, hq, hkv, d, page, dtype, device, seed, kv_dtype=None):
    """A decode batch laid out as vLLM's FlashInfer backend holds it: one packed
    ``[blocks, Hkv, page, 2D]`` cache (FlashInfer HND; ``kv_dtype`` an fp8 dtype for an fp8
    cache) viewed as logical ``[blocks, page, Hkv, D]`` K and V, an int32 block table of
    ``max_blocks`` columns, int32 seq_lens and query_start_loc."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = num_seqs * max_blocks + 4
    kv = torch.randn(n_blocks, hkv, page, 2 * d, generator=g).to(kv_dtype or dtype).to(device)
    view = kv.transpose(1, 2)
    key_cache, value_cache = view[..., :d], view[..., d:]
    query = torch.randn(num_seqs, hq, d, generator=g).to(dtype).to(device)
    return kv, key_cache, value_cache, query


#: The graph variants: a plain layer, and gpt-oss-like features (window, sinks, an fp8 e4m3
#: cache with device scales that change between replays).
GRAPH_VARIANTS = {"plain": {}, "window-sinks-fp8": dict(window=1000, sink_logits=True, kv=E4M3)}


def check_graph(device, dry_run, log, sizes=(32, 8, 128, 16, 256, 8), variant="plain"):
    """Capture the capture-safe decode call; replay after in-place metadata changes.

    ``sizes``: (Hq, Hkv, D, page, block-table columns, sequences); KV bound 4096 tokens."""
    if dry_run:
        log(f"  graph {variant}: SKIPPED in --dry-run (no CUDA on this machine: torch.cuda.CUDAGraph needs a GPU)")
        return dict(skipped=True, reason="--dry-run: CUDA graphs need a GPU", ok=True)
    features = GRAPH_VARIANTS[variant]
    hq, hkv, d, page, max_blocks, num_seqs = sizes
    dtype = torch.bfloat16
    kv, kc, vc, query = _flashinfer_decode_batch(num_seqs, max_blocks, hq, hkv, d, page, dtype, device, 7,
                                                 kv_dtype=features.get("kv"))
    n_blocks = kv.shape[0]
    g = torch.Generator().manual_seed(3)

    def new_meta():
        lens = torch.randint(1, max_blocks * page + 1, (num_seqs,), generator=g)
        lens[0] = max_blocks * page                                            # one at the bound
        perm = torch.randperm(n_blocks, generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
        # Random K/V: a tile's max sits ~1 nat below the running max, so these lambdas skip.
        lam = 0.2 + torch.rand(num_seqs, generator=g) * 0.7
        lam[1] = 0.0                                                           # dense for that sequence
        layer = dict(sinks=torch.randn(hq, generator=g), k_scale=0.5 + torch.rand(1, generator=g),
                     v_scale=0.5 + torch.rand(1, generator=g))
        return lens.int(), perm.int(), lam, layer
    lens, perm, lam, layer = new_meta()
    seq_lens, block_table, lam_d = lens.to(device), perm.to(device), lam.to(device)
    layer_d = {k: v.to(device) for k, v in layer.items()}
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    q_static = query.clone()
    out_static = torch.empty_like(query)
    spec = LayerSpec(d ** -0.5)
    if features:
        spec = LayerSpec(d ** -0.5, window=features["window"], sink_logits=layer_d["sinks"],
                         k_scale=layer_d["k_scale"], v_scale=layer_d["v_scale"])
    batch = PagedBatch(q_static, kc, vc, block_table, seq_lens, qsl, max_query_len=1)

    def call():
        return paged_attention(batch, spec, threshold=lam_d, return_counts=True, check=False, out=out_static)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, sk_static, vis_static = call()
    replays = []
    for step in range(4):
        if step:
            lens, perm, lam, layer = new_meta()
            seq_lens.copy_(lens)
            block_table.copy_(perm)
            lam_d.copy_(lam)
            for k, v in layer.items():
                layer_d[k].copy_(v)
            q_static.copy_(torch.randn(q_static.shape, generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        eager_u = paged_attention(batch, spec, threshold=lam_d, return_counts=True, check=False)
        eager_c = paged_attention(batch, spec, threshold=lam.tolist(), return_counts=True)
        rec = dict(step=step, kv_lens=lens.tolist(),
                   equal_to_eager_unchecked=bool(torch.equal(out_static, eager_u[0])
                                                 and torch.equal(sk_static, eager_u[1])
                                                 and torch.equal(vis_static, eager_u[2])),
                   max_diff_vs_eager_checked=(out_static.float() - eager_c[0].float()).abs().max().item(),
                   counts_equal_eager_checked=bool(torch.equal(sk_static, eager_c[1])
                                                   and torch.equal(vis_static, eager_c[2])),
                   skipped=int(sk_static.sum()), visited=int(vis_static.sum()))
        rec["ok"] = rec["equal_to_eager_unchecked"] and rec["counts_equal_eager_checked"] \
            and rec["max_diff_vs_eager_checked"] <= 1e-2
        log(f"  graph {variant} replay {step}: {'ok' if rec['ok'] else 'FAIL'} {rec}")
        replays.append(rec)
    return dict(skipped=False, ok=all(r["ok"] for r in replays) and any(r["skipped"] for r in replays),
                replays=replays, variant=variant,
                shape=dict(num_seqs=num_seqs, hq=hq, hkv=hkv, d=d, page=page, max_blocks=max_blocks,
                           dtype="bfloat16", cache="packed [blocks, Hkv, page, 2D] (FlashInfer HND)",
                           features={k: str(v) for k, v in features.items()}))


#: The adapter step: (batch, KV length) of each case, and the target tile sparsities.
FORWARD_CASES = [(b, kv) for kv in (4096, 32768, 131072) for b in (1, 16)]
FORWARD_SPARSITY = (0.5, 0.7, 0.9)


class _Metadata:
    """The fields FLASH_ATTN-style metadata carries (``compat.model.describe_batch`` reads them)."""

    def __init__(self, batch, q_len):
        s = batch.num_seqs
        self.query_start_loc, self.seq_lens, self.block_table = batch.query_start_loc, batch.seq_lens, batch.block_table
        self.slot_mapping = torch.zeros(s * q_len, dtype=torch.int64, device=batch.query.device)
        self.num_actual_tokens, self.max_query_len = s * q_len, q_len
        self.max_seq_len, self.causal = int(batch.seq_lens.max()), True


class _SdpaImpl:
    """The "native impl" of this script (vLLM is not installed here): fused SDPA
    (``bench_kernels._sdpa_call``: flash / cuDNN / efficient) on K/V gathered beforehand into
    contiguous ``[S, Hkv, L, D]`` tensors, one launch per layer."""

    def __init__(self, sdpa, hq, d):
        self.sdpa, self.num_heads, self.num_kv_heads, self.head_size = sdpa, hq, None, d

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = self.sdpa()                                        # [S, Hq, 1, D]
        output.view(out.shape[0], self.num_heads, self.head_size).copy_(out[:, :, 0])
        return output


def check_forward(device, dry_run, log, cases=FORWARD_CASES, dims=(32, 8, 128), repeats=20, budget_s=150.0):
    """Issue 30: the adapter's whole decode forward (``SparseAttentionMixin.forward`` on fake
    FLASH_ATTN metadata: compat's batch description and cache views, the step plan, the kernel
    computing its lambdas and counts) captured in a CUDA graph, microseconds per layer-step,
    against the native stand-in (:class:`_SdpaImpl`) captured the same way: dense (lambda 0: the
    policy's scale puts lambda >= 1) and at each target tile sparsity (the scale factor whose
    ``scale / kv_len`` is the lambda that reaches it, calibrated on the same data)."""
    import types

    import bench_kernels as bk

    os.environ["SPARSE_ATTN_KV_LAYOUT"] = "FLASH_ATTN=packed"
    os.environ["SPARSE_ATTN_CACHE_WRITER"] = "vllm"          # vLLM stores the tokens before forward
    import compat
    from compat import model as cmodel
    from sparse_attn.adapter import Policy, make_sparse
    from sparse_attn.stats import WorkerStats

    compat.reset_for_tests()
    hq, hkv, d = dims
    rows, not_run, t0 = [], [], time.perf_counter()
    for n_seqs, kv_len in cases:
        if time.perf_counter() - t0 > budget_s:
            not_run.append(f"b{n_seqs}-{kv_len}")
            log(f"  forward b{n_seqs} kv {kv_len}: not run, past the {budget_s:.0f} s budget")
            continue
        page = 16
        batch = bk.make_inputs(n_seqs, kv_len, 1, hq, hkv, d, page, torch.bfloat16, device)
        scale = d ** -0.5
        picks, grid, frac = bk.calibrate(batch, scale, FORWARD_SPARSITY, "auto")
        q4, k4, v4 = bk.gathered(batch, 1)
        sdpa, backend = bk._sdpa_call(q4, k4, v4, scale, 1, kv_len)
        kv = torch.empty(batch.key_cache.shape[0], hkv, page, 2 * d, dtype=torch.bfloat16, device=device)
        kc, vc = compat.kv_cache_views(kv, head_size=d, backend="FLASH_ATTN", isa=None, kv_cache_dtype="auto")
        kc.copy_(batch.key_cache)
        vc.copy_(batch.value_cache)
        md = _Metadata(batch, 1)
        query = batch.query.reshape(n_seqs, hq * d).contiguous()
        key = torch.zeros(n_seqs, hkv, d, dtype=torch.bfloat16, device=device)
        info = cmodel.LayerInfo(name="layers.0.attn", owner_class="LlamaAttention", backend="FLASH_ATTN",
                                num_heads=hq, num_kv_heads=hkv, head_size=d, scale=scale, cpu_isa=None,
                                features=cmodel.LayerFeatures())
        # scale factor -> lambda = scale / kv_len: dense (>= 1), then each target's lambda
        factors = [2.0 * kv_len] + [grid[i] * kv_len for i in picks]
        fns, outs = [], []
        for factor in factors:
            layer = types.SimpleNamespace(impl=_SdpaImpl(sdpa, hq, d))
            impl = make_sparse(layer, info, Policy(scale_factors={"decode": factor}, stats_interval_s=0),
                               WorkerStats())
            out = torch.empty(n_seqs, hq * d, dtype=torch.bfloat16, device=device)
            outs.append(out)
            fns.append(lambda impl=impl, layer=layer, out=out: impl.forward(layer, query, key, key, kv, md, out))
        native_out = torch.empty(n_seqs, hq * d, dtype=torch.bfloat16, device=device)
        native = _SdpaImpl(sdpa, hq, d)
        fns.append(lambda: native.forward(None, query, key, key, kv, md, native_out))
        mode = "eager"
        if device == "cuda":
            fns, mode = [bk._graphed(f) for f in fns], "cuda-graph"
        ms = bk._time_ms(fns, 1 if dry_run else repeats, device)
        for fn in fns:
            fn()
        err = max((o.float() - native_out.float()).abs().max().item() for o in outs[:1])
        for j, factor in enumerate(factors):
            rows.append(dict(batch=n_seqs, kv=kv_len, heads=f"{hq}/{hkv}/{d}", target=0.0 if j == 0 else
                             FORWARD_SPARSITY[j - 1], sparsity=0.0 if j == 0 else frac[picks[j - 1]],
                             scale_factor=factor, us=ms[j] * 1e3, us_native=ms[-1] * 1e3,
                             vs_native=ms[-1] / ms[j], native=backend, timing=mode, dense_max_abs_err=err))
        log(f"  forward b{n_seqs} kv {kv_len}: native {ms[-1] * 1e3:.1f} us ({backend}), dense {ms[0] * 1e3:.1f} us, "
            + ", ".join(f"{r['sparsity']:.0%}: {r['us']:.1f} us" for r in rows[-len(FORWARD_SPARSITY):])
            + f" [{mode}]")
        del batch, kv, kc, vc, q4, k4, v4
    ok = bool(rows) and all(r["dense_max_abs_err"] <= 3e-2 for r in rows)
    return dict(rows=rows, not_run=not_run, ok=ok, dims=dict(hq=hq, hkv=hkv, d=d),
                note="per layer and decode step; native = fused SDPA on pre-gathered contiguous K/V (vLLM absent)")


CAPTURE_BATCHES = (1, 8, 64, 256, 512)


def check_capture_memory(device, dry_run, log, max_tokens=131072, dims=(32, 8, 128), page=16):
    """Bytes a captured decode step allocates per batch size, with a ``max_tokens`` block
    table (issue 18 item 2): the kernel's scratch (partials, counts, per-program arrays,
    from :func:`triton_impl.prepare`) and, on a GPU, what the captured graph's pool holds
    after capture.  ``unbounded_partials_bytes`` is what the partials took before the
    grid was bounded (one program per split of the table's width)."""
    from sparse_attn.kernels import triton_impl

    hq, hkv, d = dims
    rows = []
    for num_seqs in CAPTURE_BATCHES:
        dev = "meta" if dry_run else device
        n_blocks = 64
        kv = torch.zeros(n_blocks, hkv, page, 2 * d, dtype=torch.bfloat16, device=dev).transpose(1, 2)
        query = torch.zeros(num_seqs, hq, d, dtype=torch.bfloat16, device=dev)
        block_table = torch.zeros(num_seqs, max_tokens // page, dtype=torch.int32, device=dev)
        seq_lens = torch.full((num_seqs,), 1000, dtype=torch.int32, device=dev)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=dev)
        lam = torch.full((num_seqs,), 0.1, dtype=torch.float32, device=dev)
        batch = PagedBatch(query, kv[..., :d], kv[..., d:], block_table, seq_lens, qsl, max_query_len=1)
        spec = LayerSpec(d ** -0.5)
        out = torch.empty_like(query)
        plan = triton_impl.prepare(batch, spec, None, threshold=lam, count_thresholds=lam[None], out=out)
        row = dict(batch=num_seqs, max_tokens=max_tokens, kv_programs=plan.grid.kv_progs,
                   scratch_bytes=plan.scratch_bytes,
                   unbounded_partials_bytes=num_seqs * -(-max_tokens // SPLIT_K) * hq * (d + 2) * 4)
        if not dry_run:
            def call():
                return paged_attention(batch, spec, threshold=lam, return_counts=True, check=False, out=out)
            call()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            torch.cuda.synchronize()
            row["graph_pool_bytes"] = torch.cuda.memory_allocated() - before
            graph.replay()
            torch.cuda.synchronize()
            del graph
        log(f"  capture memory batch {num_seqs}: {row}")
        rows.append(row)
    # Bounded: never more than MAX_KV_PROGRAMS programs' partials per sequence.
    per_seq = triton_impl.MAX_KV_PROGRAMS * hq * ((d + 2) * 4 + 3 * 4) + 64
    return dict(rows=rows, ok=all(r["scratch_bytes"] <= r["batch"] * per_seq for r in rows))


def _markdown(res) -> str:
    env = res["environment"]
    lines = ["# GPU check results", "", f"- device: {env['device']}", f"- torch {env['torch']}, triton "
             f"{env['triton']}, CUDA {env['cuda']}, python {env['python']}", f"- dry run: {res['dry_run']}",
             f"- SPLIT_K={env['SPLIT_K']}, TILE_K={env['TILE_K']}", f"- total {res['seconds']:.0f} s", "",
             "## Kernel tests (compiled Triton vs float64 reference)", "",
             "| case | D | features | dtype | ok | dense max err | sparse max err | skipped per lambda | reference "
             "| seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("kernels", []):
        feats = ", ".join(f"{k}={v}" for k, v in r.get("features", {}).items()) or "-"
        lines.append(f"| {r['case']} | {r.get('head_dim')} | {feats} | {r['dtype']} | {'ok' if r['ok'] else 'FAIL'} | "
                     f"{r['dense_max_err']:.1e} | "
                     f"{r['sparse_max_err']:.1e} | {r['skipped_per_lambda']} | {r['reference_skipped_per_lambda']} "
                     f"| {r['seconds']:.1f} |")
    lines += ["", "## CUDA graph capture of the capture-safe decode", ""]
    for g in res.get("graph", {}).values():
        if g.get("skipped"):
            lines.append(f"Skipped: {g['reason']}.")
            continue
        lines.append(f"{'ok' if g['ok'] else 'FAIL'}: {g.get('variant')} {g.get('shape')}")
        for rep in g.get("replays", []):
            lines.append(f"- replay {rep['step']}: equal to eager check=False: {rep['equal_to_eager_unchecked']}, "
                         f"counts equal eager check=True: {rep['counts_equal_eager_checked']}, max diff vs "
                         f"check=True {rep['max_diff_vs_eager_checked']:.1e}, skipped {rep['skipped']} / "
                         f"{rep['visited']}")
    mem = res.get("capture_memory", {})
    if mem:
        lines += ["", "## Captured decode memory per batch size (128k-token block table, 32/8 heads, D 128)", "",
                  "| batch | KV programs | kernel scratch | graph pool | before the bound (partials) |",
                  "|---|---|---|---|---|"]
        for r in mem.get("rows", []):
            pool = f"{r['graph_pool_bytes'] / 2**20:.2f} MiB" if "graph_pool_bytes" in r else "not measured (dry run)"
            lines.append(f"| {r['batch']} | {r['kv_programs']} | {r['scratch_bytes'] / 2**20:.2f} MiB | {pool} | "
                         f"{r['unbounded_partials_bytes'] / 2**20:.1f} MiB |")
    if "forward" in res and res["forward"].get("rows"):
        lines += ["", "## Adapter decode forward per layer-step (issue 30)", "",
                  "| batch | kv | target | tile sparsity | us | native us | native / ours | timing |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {r['batch']} | {r['kv']} | {r['target']:.0%} | {r['sparsity']:.1%} | {r['us']:.1f} | "
                  f"{r['us_native']:.1f} | {r['vs_native']:.2f} | {r['timing']} |" for r in res["forward"]["rows"]]
        lines += ["", res["forward"]["note"]]
    if "bench" in res:
        from bench_kernels import gpu_markdown

        lines += ["", "## Issue-13 benchmark", "", gpu_markdown(res["bench"])]
        if res.get("bench_not_run"):
            lines += ["", f"Not run (time budget): {', '.join(res['bench_not_run'])}"]
    for k, v in res.get("errors", {}).items():
        lines += ["", f"## ERROR in {k}", "", "```", v, "```"]
    lines += ["", f"Overall: {'PASS' if res['ok'] else 'FAIL'}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, Triton interpreter, tiny sizes, no graph capture (CI smoke run)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "RESULTS-gpu-check"),
                   help="results path without extension: writes OUT.json and OUT.md")
    p.add_argument("--skip-bench", action="store_true", help="kernel tests and graph capture only")
    p.add_argument("--bench-only", default="", help="comma-separated benchmark case names (default: all)")
    p.add_argument("--repeats", type=int, default=20, help="benchmark repeats (median)")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds after which no new benchmark case starts (the check must fit 8 minutes)")
    a = p.parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); "
              "expected a GPU. Fix: run on the GPU machine, or pass --dry-run for the CPU smoke run.",
              file=sys.stderr)
        return 2
    device = "cpu" if a.dry_run else "cuda"
    import triton

    t_start = time.perf_counter()
    res = dict(dry_run=a.dry_run, environment=dict(
        device=torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or 'unknown'}), "
        "Triton interpreter", torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        python=platform.python_version(), SPLIT_K=SPLIT_K, TILE_K=TILE_K), errors={})

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    log(f"gpu_check on {res['environment']['device']}")
    steps = [("kernels", lambda: check_kernels(device, DRY_KERNEL_CASES, log, DRY_LAMS) if a.dry_run
              else check_kernels(device, KERNEL_CASES, log)),
             ("graph", lambda: {v: check_graph(device, a.dry_run, log, variant=v) for v in GRAPH_VARIANTS}),
             ("capture_memory", lambda: check_capture_memory(device, a.dry_run, log)),
             ("forward", lambda: check_forward(device, a.dry_run, log, cases=[(2, 192)], dims=(4, 2, 32))
              if a.dry_run else check_forward(device, a.dry_run, log, repeats=a.repeats))]
    if not a.skip_bench:
        def bench():
            import bench_kernels as bk

            if a.dry_run:
                cases = [("prefill-tiny", 1, 192, 192), ("decode-tiny-b2", 2, 320, 1)]
                return bk.gpu_suite("cpu", torch.bfloat16, cases, dims=(4, 2, 32), repeats=1, log=log)
            cases = bk.GPU_CASES if not a.bench_only else [c for c in bk.GPU_CASES if c[0] in a.bench_only.split(",")]
            rows = res["bench"] = []
            for case in cases:                   # one case at a time: partial results are written
                if time.perf_counter() - t_start > a.budget:
                    res.setdefault("bench_not_run", []).append(case[0])
                    log(f"  bench {case[0]}: not run, past the {a.budget:.0f} s budget")
                    continue
                rows += bk.gpu_suite("cuda", torch.bfloat16, [case], repeats=a.repeats, log=log)
                _write(a.out, res, t_start)
            return rows
        steps.append(("bench", bench))
    for name, fn in steps:
        log(f"{name} ...")
        try:
            res[name] = fn()
        except Exception:                       # keep going: one results file with every part
            res["errors"][name] = traceback.format_exc()
            log(f"{name} raised:\n{res['errors'][name]}")
        _write(a.out, res, t_start)             # partial results survive a timeout
    res["ok"] = bool(not res["errors"] and all(r["ok"] for r in res.get("kernels", []))
                     and res.get("graph") and all(g["ok"] for g in res["graph"].values())
                     and res.get("capture_memory", {}).get("ok") and res.get("forward", {}).get("ok"))
    _write(a.out, res, t_start)
    log(f"{'PASS' if res['ok'] else 'FAIL'}: wrote {a.out}.json and {a.out}.md")
    return 0 if res["ok"] else 1


def _write(out, res, t_start):
    res["seconds"] = time.perf_counter() - t_start
    res.setdefault("ok", False)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for ext, text in ((".json", json.dumps(res, indent=1, default=str)), (".md", _markdown(res))):
        tmp = out + ext + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, out + ext)              # never a half-written results file


if __name__ == "__main__":
    sys.exit(main())
