"""Issue 17 item 3: on a windowed model, does one threshold curve serve windowed and global layers?

Runs a Gemma 3 checkpoint in transformers (fp32, CPU) on long prompts, keeps each layer's
post-RoPE queries and keys, and counts with the skip-softmax rule (float32, TILE_Q = TILE_K = 64;
a KV tile is skipped when every row of the query tile has exp(tile_max - running_max) < lambda;
the first tile a query tile visits is never skipped; no KV splits) which tiles each layer kind
skips, for prefill and for decode rows, under two normalisations of the threshold:

* ``kv``:     lambda = scale / kv_len           (TensorRT-LLM's choice, also on windowed layers)
* ``window``: lambda = scale / min(kv_len, w)   (the number of keys a windowed row can see)

and prints, per normalisation, the scale that gives the target sparsity on the global layers and
what the windowed layers achieve at that same scale, for each prompt length.

    python benchmarks/measure_window_lambda.py CKPT [--lengths 1024,2048,4096] [--target 0.5]

Needs torch and transformers (the engine0320 env has both). Nothing is written but stdout.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time

import torch

TILE = 64


def prompts(tokenizer, length: int, count: int, seed: int = 0) -> list[list[int]]:
    from sparse_attn.calibration.synthetic import _essay

    out = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer(" ".join(_essay(rng, 200)), add_special_tokens=False)["input_ids"]
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        out.append((bos + ids)[:length])
    return out


def capture(model, ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, float, int | None]]:
    """layer -> (q [Hq, L, D], k [Hkv, L, D], scaling, window) of one forward."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def keep(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
        seen[module.layer_idx] = (query[0].detach(), key[0].detach(), float(scaling), sliding_window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)

    AttentionInterface.register("sparse_attn_capture", keep)
    model.config._attn_implementation = "sparse_attn_capture"
    with torch.no_grad():
        model(torch.tensor([ids]))
    return seen


def tile_stats(q, k, scaling, window, rows: slice):
    """For query rows ``rows`` of one head: per query tile, the skip margin of each KV tile it visits.

    Returns (margin [num_visits], anchor [num_visits] bool): margin = max over the tile's rows of
    exp(tile_max - running max before the tile) (a tile is skipped at lambda iff margin < lambda and it
    is not the anchor); rows see keys [p - w + 1, p] (all of [0, p] when ``window`` is None)."""
    length = k.shape[0]
    positions = torch.arange(length)[rows]
    s = (q[rows] @ k.T) * scaling                                        # [R, L]
    key = torch.arange(length)[None, :]
    visible = key <= positions[:, None]
    if window:
        visible &= key > positions[:, None] - window
    s = s.masked_fill(~visible, -math.inf)
    num_tiles = (length + TILE - 1) // TILE
    pad = num_tiles * TILE - length
    s = torch.nn.functional.pad(s, (0, pad), value=-math.inf).view(s.shape[0], num_tiles, TILE)
    tile_max = s.max(dim=2).values                                      # [R, T]
    before = torch.cummax(tile_max, dim=1).values
    before = torch.cat([torch.full_like(before[:, :1], -math.inf), before[:, :-1]], dim=1)
    ratio = torch.exp(tile_max - before)                                # inf where nothing came before
    ratio = torch.where(torch.isinf(tile_max) & (tile_max < 0), torch.zeros_like(ratio), ratio)
    margins, anchors = [], []
    for start in range(0, s.shape[0], TILE):                            # query tiles of 64 rows
        block_visible = torch.isfinite(tile_max[start:start + TILE]).any(dim=0)
        idx = block_visible.nonzero().flatten()
        if idx.numel() == 0:
            continue
        margin = ratio[start:start + TILE, idx].max(dim=0).values
        anchor = torch.zeros_like(margin, dtype=torch.bool)
        anchor[0] = True
        margins.append(margin)
        anchors.append(anchor)
    return torch.cat(margins), torch.cat(anchors)


def sparsity(margin, anchor, lam: float) -> tuple[int, int]:
    if not 0 < lam < 1:  # serving runs such a sequence dense (kernels.effective_lambda)
        return 0, int(margin.numel())
    return int(((margin < lam) & ~anchor).sum()), int(margin.numel())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--decode-rows", type=int, default=64, help="last rows of each prompt taken as decode steps")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(args.ckpt)
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, torch_dtype=torch.float32).eval()
    scales = [math.exp(x / 4) for x in range(-8, 49)]                  # 0.14 ... 160000
    print(f"# {args.ckpt}: target {args.target}, scales {scales[0]:.3g}..{scales[-1]:.3g}, torch {torch.__version__}")
    for length in (int(x) for x in args.lengths.split(",")):
        t0 = time.time()
        # counts[(phase, kind, norm)] -> [skipped per scale], visited
        counts: dict[tuple[str, str, str], list] = {}
        for ids in prompts(tok, length, args.prompts):
            for layer, (q, k, scaling, window) in capture(model, ids).items():
                kind = "windowed" if window else "global"
                group = q.shape[0] // k.shape[0]
                for phase, rows in (("prefill", slice(0, length)), ("decode", None)):
                    for h in range(q.shape[0]):
                        if phase == "prefill":
                            margin, anchor = tile_stats(q[h], k[h // group], scaling, window, rows)
                            kv = [length]
                        else:  # each of the last rows alone, as a decode step at kv_len = p + 1
                            parts = [tile_stats(q[h], k[h // group][: p + 1], scaling, window, slice(p, p + 1))
                                     for p in range(length - args.decode_rows, length)]
                            margin, anchor = torch.cat([m for m, _ in parts]), torch.cat([a for _, a in parts])
                            kv = [length]  # within 64 positions of length: one normalisation per prompt
                        for norm in ("kv", "window"):
                            n = kv[0] if norm == "kv" or not window else min(kv[0], window)
                            entry = counts.setdefault((phase, kind, norm), [[0] * len(scales), 0])
                            for i, scale in enumerate(scales):
                                skipped, visited = sparsity(margin, anchor, scale / n)
                                entry[0][i] += skipped
                            entry[1] += margin.numel()
        print(f"\n## length {length} ({args.prompts} prompts, {time.time() - t0:.0f} s)")
        for phase in ("prefill", "decode"):
            for norm in ("kv", "window"):
                glob = counts[(phase, "global", norm)]
                win = counts[(phase, "windowed", norm)]
                g = [s / glob[1] for s in glob[0]]
                w = [s / win[1] for s in win[0]]
                i = next((j for j, v in enumerate(g) if v >= args.target), None)
                if i is None:
                    print(f"{phase:7} {norm:6}: global layers never reach {args.target:.0%} (max {max(g):.1%})")
                    continue
                lo = max(i - 1, 0)
                frac = 0.0 if i == lo or g[i] == g[lo] else (args.target - g[lo]) / (g[i] - g[lo])
                log_s = math.log(scales[lo]) + frac * (math.log(scales[i]) - math.log(scales[lo]))
                w_at = w[lo] + frac * (w[i] - w[lo])
                j = next((j for j, v in enumerate(w) if v >= args.target), None)
                print(f"{phase:7} {norm:6}: global hits {args.target:.0%} at scale {math.exp(log_s):9.3g}; windowed there "
                      f"{w_at:6.1%}; windowed hits it at scale {scales[j] if j is not None else float('nan'):9.3g} "
                      f"(tiles: global {glob[1]}, windowed {win[1]})")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
