"""Which tile should anchor the skip rule on sliding-window rows?  Measured on a real model.

On a windowed row tile 0 is out of the window, so the rule needs another tile that is
never skipped and seeds later splits.  This compares two choices on the windowed layers
of a trained model (Gemma 3: 512-token windows), on its own queries and keys (after
norm and RoPE, recorded from a transformers forward):

- ``first``: the first tile the query tile visits (the window start; TensorRT-LLM's "the
  first tile a program visits is never skipped"): the kernels' rule before issue 17 item 1;
- ``diagonal``: the last tile the query tile visits (its own position, the most recent
  tokens), whose maxima then seed the running max of every tile before it: the rule the
  kernels implement on windowed rows now (``sparse_attn/kernels/_common.py``).

For each anchor, each lambda of a grid and each windowed layer, it computes the rule's
skip decisions per (head, query tile, KV tile) with one split spanning the window (a
512-token window spans at most two 1024-token splits, so splits barely matter here), the
tile sparsity, and the attention output's error against dense attention (relative L2 per
row, averaged), for prefill query tiles of 64 rows and for single-row decodes at the last
positions.  It prints the error each anchor has at equal tile sparsity, and the sparsity
each lambda reaches, for the windowed layers and, beside them, the full-attention layers
(there ``first`` is tile 0, the kernels' anchor of a full row; ``diagonal`` is not what the
kernels do on those layers).

    python benchmarks/window_anchor.py CKPT_DIR --tokens 4096 --decodes 256

Needs ``transformers`` and a Gemma 3 checkpoint directory; CPU, float32.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparse_attn.kernels import TILE_K, TILE_Q, LayerSpec, PagedBatch, paged_attention_counts  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LAMBDAS = torch.logspace(-6, 0, 49).tolist()


def record_attention(ckpt: str, n_tokens: int):
    """Run the model once on ``n_tokens`` tokens of this repository's own documentation;
    return ``{layer: (q [H, T, D], k [Hkv, T, D], v [Hkv, T, D], scaling, window or None)}``."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def record(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kw):
        seen[module.layer_idx] = (query[0].detach().clone(), key[0].detach().clone(), value[0].detach().clone(),
                                  float(scaling), int(sliding_window) if sliding_window else None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kw)

    AttentionInterface.register("record_qkv", record)
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = "\n\n".join(open(os.path.join(ROOT, name)).read() for name in ("README.md", "CONTRIBUTING.md"))
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise SystemExit(f"only {ids.shape[1]} tokens of text; pass --tokens <= {ids.shape[1]}")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="record_qkv")
    with torch.no_grad():
        model(ids)
    return seen


def tile_stats(q, k, v, scale, window, rows_of, anchor):
    """Per (query tile, head): tile ratios of the rule (anchor forced to inf), and per-tile
    softmax partials.  ``rows_of``: list of (first row, last row) query tiles (positions)."""
    g = q.shape[0] // k.shape[0]
    out = []
    for r0, r1 in rows_of:
        pos = torch.arange(r0, r1 + 1)
        lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
        first, last = int(lo[0]) // TILE_K, r1 // TILE_K
        cols = torch.arange(first * TILE_K, (last + 1) * TILE_K)
        n_t = last - first + 1
        kk = k[:, first * TILE_K:(last + 1) * TILE_K].repeat_interleave(g, 0)      # [H, C, D]
        vv = v[:, first * TILE_K:(last + 1) * TILE_K].repeat_interleave(g, 0)
        if kk.shape[1] < cols.numel():                                              # past the end
            pad = cols.numel() - kk.shape[1]
            kk = torch.cat([kk, kk.new_zeros(kk.shape[0], pad, kk.shape[2])], 1)
            vv = torch.cat([vv, vv.new_zeros(vv.shape[0], pad, vv.shape[2])], 1)
        s = torch.einsum("hrd,hcd->hrc", q[:, r0:r1 + 1], kk) * scale
        seen = (cols[None, :] <= pos[:, None]) & (cols[None, :] >= lo[:, None])
        s = s.masked_fill(~seen, float("-inf"))
        tmax = s.view(s.shape[0], s.shape[1], n_t, TILE_K).amax(-1)                 # [H, R, n_t]
        a = 0 if anchor == "first" else n_t - 1
        seed = tmax[..., a]
        m = torch.cat([torch.full_like(tmax[..., :1], float("-inf")), tmax[..., :-1]], -1).cummax(-1).values
        m = torch.maximum(m, seed[..., None]) if anchor == "diagonal" else m
        e = torch.exp(tmax - m.where(m > float("-inf"), torch.zeros_like(m)))
        e = torch.where(tmax == float("-inf"), 0.0, torch.where(m == float("-inf"), float("inf"), e))
        ratio = e.amax(1)                                                           # [H, n_t]
        ratio[:, a] = float("inf")
        ref = s.amax(-1, keepdim=True)
        p = torch.exp(s - ref).view(s.shape[0], s.shape[1], n_t, TILE_K)
        num = torch.einsum("hrtc,htcd->hrtd", p, vv.view(vv.shape[0], n_t, TILE_K, -1))
        den = p.sum(-1)
        # Tiles leave in order of ratio as lambda grows: the output keeping the k best tiles
        # of each head, for every k at once (cumulative sums in that order).
        order = ratio.argsort(1, descending=True)                                   # [H, n_t]
        idx = order[:, None, :].expand(-1, num.shape[1], -1)
        cnum = num.gather(2, idx[..., None].expand(-1, -1, -1, num.shape[-1])).cumsum(2)
        cden = den.gather(2, idx).cumsum(2)
        o = cnum / cden[..., None]                                                  # [H, R, k, D], k = 1..n_t
        dense = o[:, :, -1]                                                         # every tile kept
        err = ((o - dense[:, :, None]).norm(dim=-1) / dense.norm(dim=-1)[..., None]).sum(1)   # [H, n_t]
        out.append((ratio, err, s.shape[1]))
    return out


def curve(stats):
    """(sparsity, mean relative error per row) per lambda of :data:`LAMBDAS`."""
    res = []
    for lam in LAMBDAS:
        skipped = visited = rows = 0
        err = 0.0
        for ratio, err_k, n_rows in stats:
            kept = (ratio >= lam).sum(1)                                            # [H], >= 1 (the anchor)
            skipped += int((ratio.shape[1] - kept).sum())
            visited += ratio.numel()
            err += float(err_k.gather(1, (kept - 1)[:, None]).sum())
            rows += n_rows * ratio.shape[0]
        res.append((skipped / visited, err / rows))
    return res


def at_sparsity(points, target):
    """Error (and lambda) where the curve crosses ``target`` sparsity (log-linear in lambda)."""
    for i in range(1, len(points)):
        (s0, e0), (s1, e1) = points[i - 1], points[i]
        if s0 <= target <= s1 and s1 > s0:
            f = (target - s0) / (s1 - s0)
            lam = math.exp(math.log(LAMBDAS[i - 1]) * (1 - f) + math.log(LAMBDAS[i]) * f)
            return e0 + f * (e1 - e0), lam
    return float("nan"), float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--decodes", type=int, default=256, help="single-row decodes at the last positions")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    recorded = record_attention(a.checkpoint, a.tokens)
    kinds = {"windowed": {i: x for i, x in recorded.items() if x[4]},
             "full": {i: x for i, x in recorded.items() if not x[4]}}
    layers = kinds["windowed"]
    print(f"recorded {len(layers)} windowed and {len(kinds['full'])} full-attention layers of {a.checkpoint} at "
          f"{a.tokens} tokens [{time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}]")
    t = a.tokens
    phases = {"prefill": [(r0, min(t, r0 + TILE_Q) - 1) for r0 in range(0, t, TILE_Q)],
              "decode": [(r, r) for r in range(t - a.decodes, t)]}
    curves = {}
    for kind, group in kinds.items():
        for phase, rows_of in phases.items():
            for anchor in ("first", "diagonal"):
                stats = []
                for q, k, v, scale, window in group.values():
                    stats += tile_stats(q, k, v, scale, window, rows_of, anchor)
                curves[kind, phase, anchor] = curve(stats)
    # Sanity: the "diagonal" anchor is the kernels' rule on windowed rows (one split spanning the window).
    q, k, v, scale, window = next(iter(layers.values()))
    cache = lambda x: x.transpose(0, 1).contiguous().view(t // 16, 16, x.shape[0], x.shape[2])   # noqa: E731
    batch = PagedBatch(q.transpose(0, 1).contiguous(), cache(k), cache(v), torch.arange(t // 16)[None].int(),
                       torch.tensor([t], dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32))
    _, sk, vis = paged_attention_counts(batch, LayerSpec(scale, window=window), LAMBDAS, impl="torch",
                                        split_k=1 << 20)
    mine = tile_stats(q, k, v, scale, window, phases["prefill"], "diagonal")
    mine_sk = [sum(int((r < lam).sum()) for r, _, _ in mine) for lam in LAMBDAS]
    print(f"kernel counts == this script's 'diagonal' anchor on layer {next(iter(layers))}: "
          f"{mine_sk == sk.sum(1).tolist()} (visited {int(vis[0])} per head)")
    print("\n| layers | phase | anchor | sparsity at lambda 1e-3 / 1e-2 / 0.1 / 0.5 | error at 30% | 50% | 70% | "
          "90% tile sparsity | lambda at 50% |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (kind, phase, anchor), pts in curves.items():
        cells = [at_sparsity(pts, s) for s in (0.3, 0.5, 0.7, 0.9)]
        at = [pts[min(range(len(LAMBDAS)), key=lambda i: abs(math.log(LAMBDAS[i] / lam)))][0]
              for lam in (1e-3, 1e-2, 0.1, 0.5)]
        print(f"| {kind} | {phase} | {anchor} | " + " / ".join(f"{x:.0%}" for x in at) + " | "
              + " | ".join(f"{e:.2e}" for e, _ in cells) + f" | {cells[1][1]:.2e} |")
    print(f"\n[{time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}]")


if __name__ == "__main__":
    main()
