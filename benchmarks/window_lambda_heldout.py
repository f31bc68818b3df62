"""Issue 17 item 3, decided on held-out prompts: which normalisation of lambda lets ONE calibrated
curve hit the target on a windowed model's windowed and global layers alike?

Gemma 3 (``sparse-attn model get gemma-3-270m DIR``) runs in transformers (float32, CPU) on the
eval's own prompt kinds (``sparse_attn.workloads.tasks``: the ``calib`` stream to calibrate, the
``eval`` stream held out, as ``sparse-attn calibrate`` / ``eval`` use them).  Each layer's post-RoPE
queries and keys are recorded and every visited (query tile, KV tile) gets its skip margin under the
kernels' rule (64 x 64 tiles; a tile is skippable at lambda when every row of the query tile has
``exp(tile_max - running_max) < lambda``; rows see ``[p - w + 1, p]``; one KV split).  Two anchors
(the tile that is never skipped and seeds the running max):

* ``first``:    the first tile the query tile visits (the window start): the kernels' rule before
  issue 17 item 1, kept here for comparison;
* ``diagonal``: on windowed layers the query tile's own (last) tile, whose maxima seed the running
  max of every tile before it; on global layers tile 0 (= ``first``): what the kernels do now
  (``sparse_attn/kernels/_common.py``).  Until the kernels adopted it, ``diagonal`` here anchored
  global layers on their diagonal too, so the README's global-layer numbers measured then under
  ``diagonal`` used that anchor, not the kernels' tile 0.

Two normalisations of the per-sequence threshold, ``lambda = scale / N``:

* ``kv``:     ``N = kv_len`` on every layer (TensorRT-LLM's; what serving does today);
* ``window``: ``N = min(kv_len, w)`` on windowed layers (the keys a windowed row sees), kv_len elsewhere.

For each (anchor, normalisation, phase) it solves the scale at which the calibration prompts, all
layers pooled by tiles (as ``calibrate`` pools them), reach the target, then prints what the held-out
prompts reach at that one scale per layer kind and length; and, beside it, a curve per layer kind
(each kind's own scale, solved on the calibration prompts).  ``lambda >= 1`` runs a sequence dense
(``kernels.effective_lambda``), so a kind may never reach a target: "max" gives the most it reaches.
Decode rows are the prompt's last ``--decode-rows`` positions, each alone at ``kv_len = p + 1``.

    python benchmarks/window_lambda_heldout.py CKPT [--lengths 1024,2048,4096] [--per-cell 1]

Needs torch and transformers (the engine0320 env has both).  Prints only.
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

assert TILE_Q == TILE_K == 64, "the tiling below assumes 64 x 64 tiles (the kernels' constants)"
TILE = TILE_K
ANCHORS = ("first", "diagonal")
NORMS = ("kv", "window")
TASKS = ("niah_single", "niah_multikey")


def capture(model, ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, float, int | None]]:
    """layer -> (q [Hq, L, D], k [Hkv, L, D], scaling, window or None) of one forward of the body."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def keep(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
        seen[module.layer_idx] = (query[0].detach(), key[0].detach(), float(scaling),
                                  int(sliding_window) if sliding_window else None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)

    AttentionInterface.register("sparse_attn_capture", keep)
    model.config._attn_implementation = "sparse_attn_capture"
    with torch.no_grad():
        model.model(torch.tensor([ids]))   # the body only: the 262k-vocab head would cost GBs of logits
    return seen


def margins(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int | None, rows: range) -> dict[str, torch.Tensor]:
    """One head: the skip margin of every visited (query tile, KV tile) for query rows ``rows``
    (whole 64-row tiles from 0 for prefill, or one row for a decode step), per anchor; the anchor's
    own margin is +inf (never skipped).  q [L, D], k [kv_len, D].  Each query tile's scores are
    computed over the KV tiles it visits only (a windowed tile sees at most 9 of them)."""
    kv_len = k.shape[0]
    out = {a: [] for a in ANCHORS}
    for start in range(0, len(rows), TILE):                               # query tiles of 64 rows
        pos = torch.tensor(list(rows[start:start + TILE]))
        lo = max(0, int(pos[0]) - window + 1) if window else 0
        t0, t1 = lo // TILE, int(pos[-1]) // TILE                         # first and last visited KV tile
        c0, c1 = t0 * TILE, min(kv_len, (t1 + 1) * TILE)
        s = (q[pos] @ k[c0:c1].T) * scaling                                # [R, C]
        key = torch.arange(c0, c1)[None, :]
        visible = key <= pos[:, None]
        if window:
            visible &= key > pos[:, None] - window
        s = s.masked_fill(~visible, -math.inf)
        n_t = t1 - t0 + 1
        s = torch.nn.functional.pad(s, (0, n_t * TILE - (c1 - c0)), value=-math.inf).view(len(pos), n_t, TILE)
        tmax = s.amax(2)                                                   # [R, n_t]
        before = torch.cat([torch.full_like(tmax[:, :1], -math.inf), tmax[:, :-1].cummax(1).values], 1)
        diag = tmax.gather(1, (pos // TILE - t0)[:, None])                # the row's own tile's max
        seen = torch.isfinite(tmax).any(0).nonzero().flatten()
        for anchor in ANCHORS:
            diagonal = anchor == "diagonal" and window is not None     # global layers: tile 0 either way
            m = torch.maximum(before, diag) if diagonal else before
            ratio = torch.exp(tmax - m)                                    # inf where nothing seeds it yet
            ratio = torch.where(torch.isneginf(tmax), torch.zeros_like(ratio), ratio)
            marg = ratio[:, seen].amax(0)
            marg[len(seen) - 1 if diagonal else 0] = math.inf             # visits are in KV order
            out[anchor].append(marg)
    return {a: torch.cat(v) for a, v in out.items()}


class Record:
    """The margins of one (prompt, layer, phase, anchor) over its heads, with each margin's kv_len and the window."""

    def __init__(self, values: torch.Tensor, kv_lens: torch.Tensor, window: int | None):
        self.values, self.kv_lens, self.window = values, kv_lens, window   # kv_len per margin (decode rows differ)

    def normaliser(self, norm: str) -> torch.Tensor:
        n = self.kv_lens.double()
        return n.clamp(max=self.window) if norm == "window" and self.window else n


_FLAT: dict = {}


def sparsity(recs: list[Record], scale: float, norm: str) -> float:
    """Tiles skipped / visited over ``recs`` at ``lambda = scale / N``: a margin is skipped when
    ``0 < lambda < 1`` (else the sequence runs dense) and ``margin < lambda``, i.e. ``N > scale`` and
    ``margin * N < scale``."""
    key = (tuple(map(id, recs)), norm)
    if key not in _FLAT:
        n = torch.cat([r.normaliser(norm) for r in recs]) if recs else torch.zeros(0, dtype=torch.float64)
        x = torch.cat([r.values.double() for r in recs]) * n if recs else n
        _FLAT[key] = (x, n, recs)        # recs kept alive so their ids stay unique
    x, n, _ = _FLAT[key]
    return float(((x < scale) & (n > scale)).sum()) / x.numel() if x.numel() else float("nan")


def solve(recs: list[Record], norm: str, target: float) -> tuple[float | None, float]:
    """The scale at which ``recs`` pooled reach ``target`` (bisection in log scale), or None and the
    most they reach over scales 1e-3 .. 1e6 (16 per decade)."""
    grid = [10 ** (x / 16) for x in range(-48, 97)]
    curve = [sparsity(recs, c, norm) for c in grid]
    best = max(curve)
    hits = [i for i, v in enumerate(curve) if v >= target]
    if not hits:
        return None, best
    i = hits[0]
    if i == 0:
        return grid[0], best
    lo, hi = math.log(grid[i - 1]), math.log(grid[i])
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sparsity(recs, math.exp(mid), norm) < target else (lo, mid)
    return math.exp(hi), best


def collect(model, tok, stream: str, lengths, per_cell: int, decode_rows: int, seed: int, cache: str | None):
    """{(phase, anchor): [(length, kind, Record)]} over the stream's prompts; each prompt's margins are
    kept in ``cache`` (a directory) when given, so a run cut short resumes."""
    from sparse_attn.workloads.tasks import build_samples

    samples = build_samples(tok, tasks=TASKS, lengths=lengths, per_cell=per_cell, seed=seed, stream=stream)
    out: dict[tuple[str, str], list] = {}
    for smp in samples:
        t0 = time.time()
        cached = os.path.join(cache, f"{stream}-{smp.task}-{smp.length}-{smp.index}-{decode_rows}.pt") if cache else None
        if cached and os.path.exists(cached):
            for key, recs in torch.load(cached).items():
                out.setdefault(key, []).extend((smp.length, kind, Record(v, n, w)) for kind, v, n, w in recs)
            continue
        mine: dict[tuple[str, str], list] = {}
        ids = list(smp.prompt_token_ids)
        L = len(ids)
        pre_rows = range(0, L)                                              # every prompt row, as prefill
        for layer, (q, k, scaling, window) in capture(model, ids).items():
            kind = "windowed" if window else "global"
            g = q.shape[0] // k.shape[0]
            acc = {(ph, a): [] for ph in ("prefill", "decode") for a in ANCHORS}
            for h in range(q.shape[0]):
                for a, m in margins(q[h], k[h // g], scaling, window, pre_rows).items():
                    acc["prefill", a].append((m, torch.full_like(m, L, dtype=torch.int64)))
                for p in range(L - decode_rows, L):
                    for a, m in margins(q[h], k[h // g][: p + 1], scaling, window, range(p, p + 1)).items():
                        acc["decode", a].append((m, torch.full_like(m, p + 1, dtype=torch.int64)))
            for key, parts in acc.items():
                v, n = torch.cat([m for m, _ in parts]), torch.cat([n for _, n in parts])
                mine.setdefault(key, []).append((kind, v, n, window))
                out.setdefault(key, []).append((smp.length, kind, Record(v, n, window)))
        if cached:
            torch.save(mine, cached + ".tmp")
            os.replace(cached + ".tmp", cached)
        print(f"  {stream} {smp.task} {smp.length} ({L} tokens) [{time.time() - t0:.0f} s, "
              f"load {os.getloadavg()[0]:.1f}]", flush=True)
    return out


def check_against_kernel(model, tok) -> None:
    """The margins reproduce the kernels' own counts (anchor ``diagonal``, one split) on a 1024-token
    prompt, on a windowed and a global layer."""
    from sparse_attn.workloads.tasks import build_samples

    ids = list(build_samples(tok, tasks=TASKS[:1], lengths=[1024], per_cell=1, seed=99, stream="calib")[0].prompt_token_ids)
    ids = ids[: len(ids) - len(ids) % TILE]
    t = len(ids)
    rec = capture(model, ids)
    lams = [0.05, 0.2, 0.5, 0.9]
    for layer in (max(i for i, x in rec.items() if x[3]), max(i for i, x in rec.items() if not x[3])):  # deep layers skip most
        q, k, scaling, window = rec[layer]
        cache = k.transpose(0, 1).contiguous().view(t // 16, 16, k.shape[0], k.shape[2])
        batch = PagedBatch(q.transpose(0, 1).contiguous(), cache, cache.clone(), torch.arange(t // 16)[None].int(),
                           torch.tensor([t], dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32))
        _, sk, _ = paged_attention_counts(batch, LayerSpec(scaling, window=window), lams, impl="torch", split_k=1 << 20)
        g = q.shape[0] // k.shape[0]
        mine = [sum(int((margins(q[h], k[h // g], scaling, window, range(t))["diagonal"] < lam).sum())
                    for h in range(q.shape[0])) for lam in lams]
        kern = sk.sum(1).tolist()
        print(f"check layer {layer} (window {window}): kernel skips {kern}, this script {mine}: "
              f"{'equal' if kern == mine else 'DIFFERENT'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--per-cell", type=int, default=1, help="prompts per (task, length) in each stream")
    ap.add_argument("--targets", default="0.3,0.5,0.7")
    ap.add_argument("--decode-rows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", help="directory keeping each prompt's margins (a rerun resumes from it)")
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with the kernels' counts")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.ckpt)
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).eval()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"# {args.ckpt}: tasks {','.join(TASKS)}, lengths {lengths}, {args.per_cell} per cell per stream, "
          f"{args.decode_rows} decode rows, torch {torch.__version__}")
    if args.cache:
        os.makedirs(args.cache, exist_ok=True)
    if not args.no_check:
        check_against_kernel(model, tok)
    calib = collect(model, tok, "calib", lengths, args.per_cell, args.decode_rows, seed=0, cache=args.cache)
    held = collect(model, tok, "eval", lengths, args.per_cell, args.decode_rows, seed=0, cache=args.cache)
    kinds = ("global", "windowed")
    for target in (float(x) for x in args.targets.split(",")):
        print(f"\n## target {target:.0%}: held-out sparsity per layer kind (lengths {'/'.join(map(str, lengths))}, "
              f"then pooled over lengths)")
        print("| anchor | normalisation | phase | curve | scale | global | windowed | all layers |")
        print("|---|---|---|---|---|---|---|---|")
        for anchor in ANCHORS:
            for norm in NORMS:
                for phase in ("prefill", "decode"):
                    cal, ho = calib[phase, anchor], held[phase, anchor]

                    def cell(recs, scale):
                        per_len = [sparsity([r for n, _, r in recs if n == L], scale, norm) for L in lengths]
                        return "/".join(f"{x:.0%}" for x in per_len) + f" ({sparsity([r for *_, r in recs], scale, norm):.1%})"

                    scale, best = solve([r for *_, r in cal], norm, target)
                    row = [anchor, norm, phase, "one (pooled)"]
                    if scale is None:
                        row += [f"never (max {best:.0%})", "", "", ""]
                    else:
                        row += [f"{scale:.3g}"] + [cell([x for x in ho if x[1] == kd], scale) for kd in kinds] + [cell(ho, scale)]
                    print("| " + " | ".join(row) + " |")
                    own = []
                    for kd in kinds:
                        s, b = solve([r for _, kk, r in cal if kk == kd], norm, target)
                        own.append(f"{s:.3g}: " + cell([x for x in ho if x[1] == kd], s) if s else f"never (max {b:.0%})")
                    print("| " + " | ".join([anchor, norm, phase, "one per kind", "", *own, ""]) + " |")
        sys.stdout.flush()
    print(f"\n[{time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
