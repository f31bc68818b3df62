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
    from sparse_attn.workloads.text import essay

    out = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer(" ".join(essay(rng, 200)), add_special_tokens=False)["input_ids"]
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
    """(skipped, visited) tiles at ``lam``, one of :data:`LAMBDAS`: all in (0, 1), so no swept
    lambda is one serving runs dense (``kernels.effective_lambda``)."""
    return int(((margin < lam) & ~anchor).sum()), int(margin.numel())


#: thresholds tried (lambda itself: the normalisation only maps a scale to it), and those printed
LAMBDAS = sorted({round(10 ** (x / 8), 10) for x in range(-40, 0)} | {0.5, 0.9, 0.99})
SHOWN = {1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 0.99}


def _crossing(lams, curve, target):
    """The lambda (log-interpolated) where ``curve`` first reaches ``target``, or None."""
    for i, v in enumerate(curve):
        if v >= target:
            if i == 0:
                return lams[0]
            lo, hi = math.log(lams[i - 1]), math.log(lams[i])
            frac = (target - curve[i - 1]) / (v - curve[i - 1]) if v != curve[i - 1] else 0.0
            return math.exp(lo + frac * (hi - lo))
    return None


def _fmt(x):
    return f"{x:9.3g}" if x is not None else "  never (lambda < 1)"


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
    print(f"# {args.ckpt}: target {args.target}, lambdas {LAMBDAS[0]:.2g}..{LAMBDAS[-1]:.2g}, torch {torch.__version__}")
    for length in (int(x) for x in args.lengths.split(",")):
        t0 = time.time()
        lam_counts: dict[tuple[str, str], list] = {}   # (phase, kind) -> [skipped per lambda], visited
        windows = []
        for ids in prompts(tok, length, args.prompts):
            for layer, (q, k, scaling, window) in capture(model, ids).items():
                kind = "windowed" if window else "global"
                if window:
                    windows.append(window)
                group = q.shape[0] // k.shape[0]
                for phase in ("prefill", "decode"):
                    for h in range(q.shape[0]):
                        if phase == "prefill":
                            margin, anchor = tile_stats(q[h], k[h // group], scaling, window, slice(0, length))
                        else:  # each of the last rows alone, as a decode step at kv_len = p + 1
                            parts = [tile_stats(q[h], k[h // group][: p + 1], scaling, window, slice(p, p + 1))
                                     for p in range(length - args.decode_rows, length)]
                            margin, anchor = torch.cat([m for m, _ in parts]), torch.cat([a for _, a in parts])
                        entry = lam_counts.setdefault((phase, kind), [[0] * len(LAMBDAS), 0])
                        for i, lam in enumerate(LAMBDAS):
                            entry[0][i] += sparsity(margin, anchor, lam)[0]
                        entry[1] += margin.numel()
        print(f"\n## length {length} ({args.prompts} prompts, {time.time() - t0:.0f} s)")
        for phase in ("prefill", "decode"):
            at = {}
            for kind in ("global", "windowed"):
                skipped, visited = lam_counts[(phase, kind)]
                curve = [x / visited for x in skipped]
                at[kind] = _crossing(LAMBDAS, curve, args.target)
                shown = ", ".join(f"{lam:g}: {v:5.1%}" for lam, v in zip(LAMBDAS, curve) if lam in SHOWN)
                print(f"{phase:7} {kind:8} ({visited} tiles) sparsity at lambda {shown}")
            for norm, n_win in (("kv", length), ("window", min(length, windows[0]) if windows else length)):
                scale_g = at["global"] * length if at["global"] else None
                scale_w = at["windowed"] * n_win if at["windowed"] else None
                print(f"{phase:7} scale for {args.target:.0%} with lambda = scale / {'kv_len' if norm == 'kv' else 'min(kv_len, w)'}: "
                      f"global {_fmt(scale_g)}, windowed {_fmt(scale_w)}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
