"""One GPU check for issues 12 and 13: compiled kernel tests, CUDA-graph capture, benchmark.

Runs on one GPU with torch and triton installed and nothing else (no vLLM, no pytest),
in at most ~8 minutes on an H200:

1. **kernels**: the compiled Triton kernel (no interpreter) in fp32, bf16 and fp16 on GQA
   groups 1/4/8, decodes crossing several KV splits (one with a split per KV tile, so
   every split program computes its tile-0 seed), mixed prefill/decode batches and
   the default ``SPLIT_K``, against the float64 brute-force reference of
   ``tests/sparse_attn/kernel_reference.py`` (dense output at lambda 0; outputs and skip
   counts under lambda), and calibration counts == serving skips.
2. **graph**: the capture-safe decode call (``check=False``) on FlashInfer-shaped
   metadata (one packed ``[blocks, Hkv, page, 2D]`` cache viewed as K / V, int32 block
   table, seq_lens, query_start_loc, per-sequence lambdas) captured in a
   ``torch.cuda.CUDAGraph``; seq_lens, block tables, lambdas and queries are then changed
   IN PLACE and each replay must equal an eager call on the new data.
3. **bench**: the issue-13 benchmark of ``benchmarks/bench_kernels.py`` (skip with
   ``--skip-bench``).

Writes ``<out>.json`` (every number, device name, versions) and ``<out>.md`` (summary).
``--dry-run`` runs everything on CPU under ``TRITON_INTERPRET=1`` with tiny sizes and
skips the graph capture (saying so), so CI keeps the script alive.

    python benchmarks/gpu_check.py --out $OUT/gpu-check          # on the GPU machine
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-check  # CPU smoke run
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
from tests.sparse_attn.kernel_reference import add_sink, make_batch, reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 2e-5, "bf16": 3e-2, "fp16": 5e-3}

#: name: (kv_lens, q_lens, Hq, Hkv, D, page, layout, split_k or None = SPLIT_K)
KERNEL_CASES = {
    "gqa1-decode-splits": ([2000, 300, 65], [1, 1, 1], 4, 4, 64, 16, "contiguous", 256),
    "gqa4-mixed-batch": ([900, 200, 640, 0], [1, 200, 1, 0], 8, 2, 128, 16, "dim_major_k", 256),
    "gqa8-decode-page7-packed": ([1500, 129], [1, 1], 16, 2, 128, 7, "packed_kv", 192),
    "gqa4-default-split-decode": ([SPLIT_K * 3 + 300, 700], [1, 1], 8, 2, 128, 16, "packed_kv", None),
    "gqa4-prefill-chunked": ([1300], [300], 8, 2, 128, 16, "contiguous", None),
    # Every tile opens a split: each split program reads K tile 0 for its seed.
    "gqa4-decode-split-per-tile": ([1100, 300], [1, 1], 8, 2, 128, 16, "contiguous", 64),
}
DRY_KERNEL_CASES = {
    "gqa1-decode-splits": ([300, 65], [1, 1], 2, 2, 16, 16, "contiguous", 128),
    "gqa4-mixed-batch": ([200, 30, 0], [1, 30, 0], 8, 2, 16, 16, "dim_major_k", 128),
}
LAMS = [0.0, 1e-3, 0.05, 0.4]
DRY_LAMS = [0.0, 0.4]


def _to(batch, device):
    return dataclasses.replace(batch, **{f: getattr(batch, f).to(device) for f in (
        "query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")})


def check_kernels(device, cases, log, lams=LAMS):
    """Compiled kernel vs float64 reference; counts == serving skips.  Returns result dicts."""
    results = []
    for name, (kv_lens, q_lens, hq, hkv, d, page, layout, split_k) in cases.items():
        for dname, dt in DTYPES.items():
            t0 = time.perf_counter()
            batch = add_sink(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, dtype=dt, seed=41))
            rule = {} if split_k is None else {"split_k": split_k}
            scale = 2.0 * d ** -0.5
            ref0, _, ref_vis, ref_thr = reference(batch, scale, thresholds=lams, **rule)
            args = _to(batch, device)
            r = dict(case=name, dtype=dname, split_k=split_k or SPLIT_K, checks={})
            spec = LayerSpec(scale)
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
                    ref_l = reference(batch, scale, lam=lam, **rule)[0]
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


def _flashinfer_decode_batch(num_seqs, max_blocks, hq, hkv, d, page, dtype, device, seed):
    """A decode batch laid out as vLLM's FlashInfer backend holds it: one packed
    ``[blocks, Hkv, page, 2D]`` cache (FlashInfer HND) viewed as logical ``[blocks, page,
    Hkv, D]`` K and V, an int32 block table of ``max_blocks`` columns, int32 seq_lens and
    query_start_loc."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = num_seqs * max_blocks + 4
    kv = torch.randn(n_blocks, hkv, page, 2 * d, generator=g).to(dtype).to(device)
    view = kv.transpose(1, 2)
    key_cache, value_cache = view[..., :d], view[..., d:]
    query = torch.randn(num_seqs, hq, d, generator=g).to(dtype).to(device)
    return kv, key_cache, value_cache, query


def check_graph(device, dry_run, log, sizes=(32, 8, 128, 16, 256, 8)):
    """Capture the capture-safe decode call; replay after in-place metadata changes.

    ``sizes``: (Hq, Hkv, D, page, block-table columns, sequences); KV bound 4096 tokens."""
    if dry_run:
        log("  graph: SKIPPED in --dry-run (no CUDA on this machine: torch.cuda.CUDAGraph needs a GPU)")
        return dict(skipped=True, reason="--dry-run: CUDA graphs need a GPU", ok=True)
    hq, hkv, d, page, max_blocks, num_seqs = sizes
    dtype = torch.bfloat16
    kv, kc, vc, query = _flashinfer_decode_batch(num_seqs, max_blocks, hq, hkv, d, page, dtype, device, 7)
    n_blocks = kv.shape[0]
    g = torch.Generator().manual_seed(3)

    def new_meta():
        lens = torch.randint(1, max_blocks * page + 1, (num_seqs,), generator=g)
        lens[0] = max_blocks * page                                            # one at the bound
        perm = torch.randperm(n_blocks, generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
        # Random K/V: a tile's max sits ~1 nat below the running max, so these lambdas skip.
        lam = 0.2 + torch.rand(num_seqs, generator=g) * 0.7
        lam[1] = 0.0                                                           # dense for that sequence
        return lens.int(), perm.int(), lam
    lens, perm, lam = new_meta()
    seq_lens, block_table, lam_d = lens.to(device), perm.to(device), lam.to(device)
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    q_static = query.clone()
    out_static = torch.empty_like(query)
    spec = LayerSpec(d ** -0.5)
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
            lens, perm, lam = new_meta()
            seq_lens.copy_(lens)
            block_table.copy_(perm)
            lam_d.copy_(lam)
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
        log(f"  graph replay {step}: {'ok' if rec['ok'] else 'FAIL'} {rec}")
        replays.append(rec)
    return dict(skipped=False, ok=all(r["ok"] for r in replays) and any(r["skipped"] for r in replays),
                replays=replays,
                shape=dict(num_seqs=num_seqs, hq=hq, hkv=hkv, d=d, page=page, max_blocks=max_blocks,
                           dtype="bfloat16", cache="packed [blocks, Hkv, page, 2D] (FlashInfer HND)"))


def _markdown(res) -> str:
    env = res["environment"]
    lines = ["# GPU check results", "", f"- device: {env['device']}", f"- torch {env['torch']}, triton "
             f"{env['triton']}, CUDA {env['cuda']}, python {env['python']}", f"- dry run: {res['dry_run']}",
             f"- SPLIT_K={env['SPLIT_K']}, TILE_K={env['TILE_K']}", f"- total {res['seconds']:.0f} s", "",
             "## Kernel tests (compiled Triton vs float64 reference)", "",
             "| case | dtype | ok | dense max err | sparse max err | skipped per lambda | reference | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res.get("kernels", []):
        lines.append(f"| {r['case']} | {r['dtype']} | {'ok' if r['ok'] else 'FAIL'} | {r['dense_max_err']:.1e} | "
                     f"{r['sparse_max_err']:.1e} | {r['skipped_per_lambda']} | {r['reference_skipped_per_lambda']} "
                     f"| {r['seconds']:.1f} |")
    g = res.get("graph", {})
    lines += ["", "## CUDA graph capture of the capture-safe decode", ""]
    if g.get("skipped"):
        lines.append(f"Skipped: {g['reason']}.")
    elif g:
        lines.append(f"{'ok' if g['ok'] else 'FAIL'}: {g.get('shape')}")
        for rep in g.get("replays", []):
            lines.append(f"- replay {rep['step']}: equal to eager check=False: {rep['equal_to_eager_unchecked']}, "
                         f"counts equal eager check=True: {rep['counts_equal_eager_checked']}, max diff vs "
                         f"check=True {rep['max_diff_vs_eager_checked']:.1e}, skipped {rep['skipped']} / "
                         f"{rep['visited']}")
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
             ("graph", lambda: check_graph(device, a.dry_run, log))]
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
    res["ok"] = not res["errors"] and all(r["ok"] for r in res.get("kernels", [])) and res.get("graph", {}).get("ok")
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
