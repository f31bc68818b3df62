"""Issue 32 item 4, measured before anything is built: how many of the tiles the skip rule skips
could a per-page key summary rule out WITHOUT reading their keys, exactly?

The rule (``sparse_attn/kernels/_common.py``) skips visited KV tile ``t`` of a (query head, query
tile) when every row's ``exp(tile_max - m_before) < lambda``, ``m_before`` the dense running max
(seeded by the anchor tile, restarted from the seed at every ``SPLIT_K`` boundary) over the tiles
visited before ``t``; it needs ``Q.K^T`` of the tile, so the tile's K is always read.  A Quest-style
summary (per-channel ``kmin``/``kmax`` of a page's keys) gives, for each row, an upper bound of
``q.k`` over the page without its keys::

    ub = sum_d max(q_d * kmin_d, q_d * kmax_d)            (= q+ . kmax + q- . kmin)

``m_before`` is known before tile ``t``'s keys are read (it comes from earlier tiles and the
anchor), so when every voting row has ``exp(scale * ub - m_before) < lambda`` the tile would be
skipped by the rule anyway and its K need not be read: outputs stay exactly the rule's.  Nor does
the running max need the unread tile: its max is below ``m_before + ln(lambda) < m_before``.  This
script measures, on real queries and keys, what fraction of the rule-skipped tiles the bound also
rules out ("K reads saved"), with summaries per ``TILE_K`` tile and per 16-token page (vLLM's block
size; a tile's bound is then the largest of its pages' bounds, and "page-granular" counts the
16-token K pages of rule-skipped tiles that a kernel reading K page by page could leave unread:
if the tile's other pages test below the threshold too, the tile is skipped without them).

Everything is computed in float64 (the reference's precision) with the rule of ``_common.py``
(anchor tile 0, or the diagonal tile on a windowed layer; ``SPLIT_K`` restarts; rows that see
nothing of a tile do not vote); the bound gets a 1e-12 relative safety margin against rounding, and
every tile the bound rules out is asserted to be rule-skipped (and every tile's bound to be >= its
max logit).  ``--check`` first compares the rule's counts here with the kernels' own
``paged_attention_counts`` (torch, fp32) on one layer, prefill and decode.

Prompts: the eval tasks of ``sparse_attn.workloads.tasks`` (held-out stream, chat template where the
model has one).  Phases: prefill = the whole prompt as one chunk, query tiles of ``TILE_Q`` rows
voting together; decode = each of the prompt's last ``--decode-rows`` positions alone at
``kv_len = p + 1``.  For each (length, phase, layer kind) the scale of ``lambda = scale / N``
(``N = kv_len``, ``min(kv_len, w)`` on windowed layers: ``kernels.effective_lambda``; a curve per
layer kind, as calibration writes them) is solved so the pooled tiles (all layers, heads, prompts)
reach each target sparsity; the table reports at it:

* ``s_v``: tiles the rule skips (per query head, visited tiles incl. the anchor as denominator);
* the fraction of those the bound rules out (summaries per tile, per 16-token page, page-granular);
* the same per KV group (a kernel packing the group's query heads reads a V tile when any head keeps
  it, and could leave a K tile unread only when the bound rules it out for every head);
* speedup bounds of a memory-bound decode (K and V traffic equal): today ``2 / (2 - s_v)``; with the
  bound ``2 / (2 - s_v - s_k)`` (``s_k`` = tiles ruled out, per-tile summaries), and that bound
  charged with reading the summaries of every tile (``2 / P`` of a K tile each):
  ``2 / (2 - s_v - s_k + 2/P)``.

Summary memory: ``2 x head_dim`` values per KV head per page = ``2 / P`` of the K cache in the cache
dtype (P = 64: 3.1 %; P = 16: 12.5 %).

    python benchmarks/quest_bound.py CKPT [CKPT2 ...] [--lengths 2048,4096,8192] [--per-length 3]
        [--decode-rows 16] [--targets 0.5,0.7] [--out RESULTS.md] [--check]

Needs torch and transformers 4 (the ``models`` tox env: ``tools/tox -e models --notest``); the
bound logic itself (:func:`query_tile`) needs torch only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparse_attn.kernels import (SPLIT_K, TILE_K, TILE_Q, LayerSpec, PagedBatch,  # noqa: E402
                                 effective_lambda, paged_attention_counts)

TASKS = ("niah_single", "variable_tracking", "qa", "niah_multikey", "common_words")
PAGES = (TILE_K, 16)
_NEG_INF = float("-inf")
#: Relative safety margin of the bound (float64 rounding of q+.kmax + q-.kmin against q.k).
MARGIN = 1e-12


def page_bounds(q: torch.Tensor, k: torch.Tensor, page: int) -> torch.Tensor:
    """Quest upper bound of ``q . k`` over each page of ``page`` consecutive keys.

    ``q`` [..., R, D], ``k`` [C, D] (pages aligned to key 0 of ``k``; the last one may be short)
    -> [..., R, ceil(C / page)]: ``sum_d max(q_d kmin_d, q_d kmax_d)`` plus a relative margin that
    covers rounding, so the value is >= every ``q . k`` of the page."""
    c, d = k.shape
    n = -(-c // page)
    padded = torch.cat([k, k[-1:].expand(n * page - c, d)]) if n * page > c else k   # repeats: same min/max
    kp = padded.view(n, page, d)
    kmin, kmax = kp.amin(1), kp.amax(1)
    ub = q.clamp(min=0) @ kmax.T + q.clamp(max=0) @ kmin.T
    return ub + MARGIN * (q.abs() @ torch.maximum(kmin.abs(), kmax.abs()).T)


def query_tile(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, scaling: float, window: int | None = None,
               *, soft_cap: float | None = None, split_k: int = SPLIT_K, pages=PAGES) -> dict:
    """The rule and the bound on one query tile of one KV group.

    ``q`` [G, R, D] (the group's query heads; rows at positions ``pos`` [R], consecutive, R <=
    TILE_Q), ``k`` [kv_len, D] (the keys in the cache: a row at ``p`` sees ``<= p`` and, with
    ``window``, ``> p - window``); float64 for a reference-grade answer.  Returns, over the visited
    KV tiles ``first .. last`` in KV order (index 0 = tile ``first``):

    * ``tiles`` [n] absolute KV tile indices; ``anchor`` the anchor's index;
    * ``ratio`` [G, n]: the rule's ``max_r exp(tile_max - m_before)`` (inf at the anchor): skipped
      under lambda iff ``< lambda``;
    * ``bound[P]`` [G, n]: the same with ``scale * ub`` (largest over the tile's P-pages) for the tile
      max and the same ``m_before``: ruled out without reading K iff ``< lambda``;
    * ``page[P]`` [G, n, TILE_K // P] (P < TILE_K): per page of the tile, NaN where the page is past
      ``kv_len`` or no row sees any of it (a window's start: no K read to save there).

    Asserts ``scale * ub >= tile_max`` for every row and tile (so ``bound >= ratio``)."""
    g, r, d = q.shape
    kv_len = k.shape[0]
    lo = (pos - window + 1).clamp(min=0) if window is not None else torch.zeros_like(pos)
    first, last = int(lo.min()) // TILE_K, int(pos.max()) // TILE_K
    c0, c1 = first * TILE_K, min(kv_len, (last + 1) * TILE_K)
    n = last - first + 1
    tiles = torch.arange(first, last + 1)
    cols = torch.arange(c0, c1)
    hide = (cols[None, :] > pos[:, None]) | (cols[None, :] < lo[:, None])                 # [R, C]
    s = (q @ k[c0:c1].T) * scaling                                                          # [G, R, C]
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    s = s.masked_fill(hide, _NEG_INF)
    s = torch.nn.functional.pad(s, (0, n * TILE_K - (c1 - c0)), value=_NEG_INF)
    tmax = s.view(g, r, n, TILE_K).amax(-1)                                                 # [G, R, n]
    anchor = n - 1 if window is not None else 0
    seed = tmax[:, :, anchor]
    # The walk of _common: within each split the running max of the tiles before, from the seed
    # (a split restarts from the seed; the first split starts at tile ``first``).
    m_before = torch.empty_like(tmax)
    tps = split_k // TILE_K
    a = 0
    while a < n:
        b = min(n, ((first + a) // tps + 1) * tps - first)
        seg = torch.cat([seed.unsqueeze(-1), tmax[:, :, a:b - 1]], -1).cummax(-1).values
        m_before[:, :, a:b] = seg
        a = b

    def ratio_of(top):                    # rows that see nothing of a tile (-inf) do not vote
        e = torch.where(torch.isneginf(top), 0.0, torch.exp(top - m_before.unsqueeze(-1) if top.dim() == 4
                                                            else top - m_before))
        return e.amax(1)

    ratio = ratio_of(tmax)
    ratio[:, anchor] = math.inf
    out = {"tiles": tiles, "anchor": anchor, "ratio": ratio, "bound": {}, "page": {}}
    for p in pages:
        assert TILE_K % p == 0 and c0 % p == 0
        ub = page_bounds(q, k[c0:c1], p) * scaling                                          # [G, R, npg]
        if soft_cap is not None:
            ub = soft_cap * torch.tanh(ub / soft_cap)
        starts = c0 + torch.arange(ub.shape[-1]) * p
        unseen = (starts[None, :] > pos[:, None]) | ((starts + p - 1)[None, :] < lo[:, None])   # row sees none of it
        ub = ub.masked_fill(unseen, _NEG_INF)
        per = TILE_K // p
        ub = torch.nn.functional.pad(ub, (0, n * per - ub.shape[-1]), value=_NEG_INF).view(g, r, n, per)
        tub = ub.amax(-1)                                                                   # [G, R, n]
        bad = torch.isfinite(tmax) & ~(tub >= tmax)
        assert not bool(bad.any()), f"bound below a tile max: {(tmax - tub)[bad].max().item()}"
        b = ratio_of(tub)
        b[:, anchor] = math.inf
        out["bound"][p] = b
        if per > 1:
            pr = ratio_of(ub)                                                               # [G, n, per]
            pr[:, anchor] = math.inf
            # Pages past kv_len, or that no row sees (before a window), are no K read to save.
            exists = (c0 + torch.arange(n * per) * p < kv_len).view(n, per)
            exists = exists & ~torch.nn.functional.pad(unseen.all(0), (0, n * per - unseen.shape[1]),
                                                       value=True).view(n, per)
            out["page"][p] = torch.where(exists, pr, math.nan)
    return out


class Cell:
    """The pooled tiles of one (length, phase, layer kind): per KV group, ratios [G, n] and N [n]."""

    def __init__(self):
        self.ratio, self.bound, self.page, self.norm = [], {p: [] for p in PAGES}, {p: [] for p in PAGES[1:]}, []

    def add(self, res: dict, norm: float) -> None:
        self.ratio.append(res["ratio"])
        for p in PAGES:
            self.bound[p].append(res["bound"][p])
        for p in PAGES[1:]:
            self.page[p].append(res["page"][p])
        self.norm.append(torch.full((res["ratio"].shape[1],), float(norm), dtype=torch.float64))

    def freeze(self):
        cat = lambda xs: torch.cat(xs, -1 if xs[0].dim() == 2 else 1)        # noqa: E731
        self.R, self.N = cat(self.ratio), torch.cat(self.norm)
        self.B = {p: cat(v) for p, v in self.bound.items()}
        self.P = {p: cat(v) for p, v in self.page.items()}
        return self


def solve_scale(cell: Cell, target: float) -> float | None:
    """The smallest scale at which ``ratio < scale / N`` (with ``scale < N``: ``effective_lambda``'s
    ``lambda < 1``) holds for at least ``target`` of the cell's tiles; None if unreachable."""
    x = (cell.R * cell.N).flatten()
    n = x.numel()
    k = math.ceil(target * n)
    v = torch.sort(x).values[k - 1]
    if not bool(torch.isfinite(v)):
        return None
    scale = math.nextafter(float(v), math.inf)
    return scale if bool((cell.N > scale).all()) else None


def measure(cell: Cell, scale: float) -> dict:
    lam = torch.where(cell.N < scale, torch.tensor(0.0, dtype=torch.float64), scale / cell.N)   # [n]
    skip = cell.R < lam
    row = {"lambda": float(lam.median()), "s_v": float(skip.double().mean())}
    for p in PAGES:
        out = cell.B[p] < lam
        bad = out & ~skip
        assert not bool(bad.any()), f"the bound ruled out {int(bad.sum())} tiles the rule keeps (P={p})"
        row[f"k{p}"] = float(out.double().mean())
    for p in PAGES[1:]:
        pg = cell.P[p]
        exists = ~torch.isnan(pg)
        saved = (pg < lam[None, :, None]) & skip[..., None] & exists
        row[f"pages{p}"] = float(saved.sum()) / max(1, int((exists & skip[..., None]).sum()))
        row[f"pages{p}_all"] = float(saved.sum()) / max(1, int(exists.sum()))
    gskip = skip.all(0)                          # a packed kernel skips V when every head of the group does
    gout = (cell.B[TILE_K] < lam).all(0)
    row["g_s_v"], row["g_k"] = float(gskip.double().mean()), float(gout.double().mean())
    row["tiles"] = skip.numel()
    return row


def capture(model, ids):
    """layer -> (q [Hq, L, D], k [Hkv, L, D], scaling, window or None, soft-cap or None) of one
    forward of the body (post-RoPE, as the attention receives them)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def keep(module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **kw):
        seen[module.layer_idx] = (query[0].detach(), key[0].detach(), float(scaling),
                                  int(sliding_window) if sliding_window else None, softcap)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kw)

    AttentionInterface.register("sparse_attn_quest_capture", keep)
    model.config._attn_implementation = "sparse_attn_quest_capture"
    with torch.no_grad():
        model.model(torch.tensor([ids]))      # the body only: no vocabulary-sized logits
    return seen


def analyse_layer(cells, length, q, k, scaling, window, cap, decode_rows):
    """Adds one layer of one prompt to ``cells[(length, phase, kind)]``."""
    kind = "windowed" if window else "global"
    hq, L, _ = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    q, k = q.double(), k.double()
    for h in range(hkv):
        qg = q[h * g:(h + 1) * g]
        for r0 in range(0, L, TILE_Q):                                    # prefill: the whole prompt, one chunk
            pos = torch.arange(r0, min(L, r0 + TILE_Q))
            res = query_tile(qg[:, r0:r0 + TILE_Q], k[h], pos, scaling, window, soft_cap=cap)
            cells.setdefault((length, "prefill", kind), Cell()).add(res, min(L, window or L))
        for p in range(L - decode_rows, L):                               # decode: row p alone, kv_len p + 1
            res = query_tile(qg[:, p:p + 1], k[h][:p + 1], torch.tensor([p]), scaling, window, soft_cap=cap)
            cells.setdefault((length, "decode", kind), Cell()).add(res, min(p + 1, window or p + 1))


def check_against_kernel(q, k, scaling, window, cap, decode_rows) -> str:
    """The rule's counts here against ``paged_attention_counts`` (torch kernel, fp32) on one layer."""
    hq, L, d = q.shape
    hkv, g = k.shape[0], q.shape[0] // k.shape[0]
    lams = [1e-4, 1e-3, 1e-2, 0.1]
    page = 16
    n_pg = -(-L // page)
    cache = torch.zeros(n_pg * page, hkv, d)
    cache[:L] = k.transpose(0, 1)
    cache = cache.view(n_pg, page, hkv, d)
    spec = LayerSpec(scaling, window=window, soft_cap=cap)
    rows = list(range(L - decode_rows, L))
    qs = q.transpose(0, 1).contiguous()
    cases = {"prefill": (qs, [L], [0, L]), "decode": (qs[rows], [p + 1 for p in rows], list(range(len(rows) + 1)))}
    said = []
    for phase, (qq, kv, qsl) in cases.items():
        batch = PagedBatch(qq, cache, cache.clone(), torch.arange(n_pg)[None].int().expand(len(kv), -1).contiguous(),
                           torch.tensor(kv, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32))
        _, sk, _ = paged_attention_counts(batch, spec, lams, impl="torch")
        cell: dict = {}
        qd, kd = q.double(), k.double()
        for h in range(hkv):
            qg = qd[h * g:(h + 1) * g]
            if phase == "prefill":
                parts = [query_tile(qg[:, r0:r0 + TILE_Q], kd[h], torch.arange(r0, min(L, r0 + TILE_Q)), scaling,
                                    window, soft_cap=cap, pages=(TILE_K,)) for r0 in range(0, L, TILE_Q)]
            else:
                parts = [query_tile(qg[:, p:p + 1], kd[h][:p + 1], torch.tensor([p]), scaling, window,
                                    soft_cap=cap, pages=(TILE_K,)) for p in rows]
            cell[h] = torch.cat([x["ratio"] for x in parts], 1)
        mine = [sum(int((cell[h] < lam).sum()) for h in range(hkv)) for lam in lams]
        kern = sk.sum(1).tolist()
        said.append(f"{phase}: kernel {kern}, here {mine} ({'equal' if kern == mine else 'DIFFERENT'})")
    return "; ".join(said)


def machine_line() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        have = [x for x in ("avx512f", "avx2", "fma") if f" {x}" in info]
        model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = f"{model}, {'/'.join(have) or 'no AVX'}"
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} ({flags}), {os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}"


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def table(model_rows) -> list[str]:
    head = ("| model | length | phase | layers | target | lambda | rule-skipped s_v | ruled out by the bound, % of "
            "s_v: per tile (64) | per 16-page | 16-pages page-granular | per KV group: s_v / ruled out % | "
            "2/(2-s_v) | 2/(2-s_v-s_k) | with summary reads (+2/64) |")
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, (length, phase, kind), target, r in model_rows:
        sv, sk = r["s_v"], r["k64"]
        rel = lambda x: pct(x / sv) if sv else "-"            # noqa: E731
        lam = f"never (max {pct(sv)} at lambda -> 1)" if r.get("unreachable") else f"{r['lambda']:.3g}"
        grp = f"{pct(r['g_s_v'])} / {pct(r['g_k'] / r['g_s_v']) if r['g_s_v'] else '-'}"
        out.append(f"| {name} | {length} | {phase} | {kind} | {target:.0%} | {lam} | {pct(sv)} | "
                   f"{rel(sk)} | {rel(r['k16'])} | {pct(r['pages16'])} | {grp} | {2 / (2 - sv):.3f} | "
                   f"{2 / (2 - sv - sk):.3f} | {2 / (2 - sv - sk + 2 / TILE_K):.3f} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 epilog="Example: python benchmarks/quest_bound.py CKPT --lengths 2048,4096,8192 "
                                        "--per-length 3 --out RESULTS.md --check",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpts", nargs="+", metavar="CKPT", help="Hugging Face checkpoint directories "
                    "(`sparse-attn model get smollm2-135m-instruct DIR`, `... gemma-3-270m DIR`)")
    ap.add_argument("--lengths", default="2048,4096,8192", help="prompt length bins in tokens (default %(default)s)")
    ap.add_argument("--per-length", type=int, default=3, choices=range(1, len(TASKS) + 1), metavar="N",
                    help=f"prompts per length (1-{len(TASKS)}), one task each, the first N of "
                    f"{', '.join(TASKS)} (default %(default)s)")
    ap.add_argument("--decode-rows", type=int, default=16, help="last prompt positions taken as decode rows "
                    "(default %(default)s)")
    ap.add_argument("--targets", default="0.5,0.7", help="tile sparsities to solve lambda for (default %(default)s)")
    ap.add_argument("--layers", default="all", help="'all' or 'every:N' (every Nth layer, from 0) to save time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="eval stream seed (default %(default)s)")
    ap.add_argument("--check", action="store_true", help="first compare the rule's counts here with the kernels' "
                    "paged_attention_counts on one layer of the first prompt")
    ap.add_argument("--out", help="also write the markdown table (with the command line) to this file")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparse_attn.workloads.tasks import build_samples

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    targets = [float(x) for x in args.targets.split(",")]
    t_all = time.time()
    rows, notes = [], []
    for ckpt in args.ckpts:
        name = os.path.basename(os.path.normpath(ckpt))
        tok = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        n_layers = model.config.num_hidden_layers
        every = int(args.layers.split(":")[1]) if args.layers.startswith("every:") else 1
        layers = set(range(0, n_layers, every))
        try:
            with open(os.path.join(ckpt, "sparse_attn_model.json")) as f:
                name = json.load(f)["name"]
        except (OSError, KeyError, ValueError):
            pass
        cells: dict = {}
        checked = not args.check
        n_prompts = {}
        for length in lengths:
            samples = build_samples(tok, tasks=TASKS[:args.per_length], lengths=[length], per_cell=1,
                                    seed=args.seed, stream="eval")
            n_prompts[length] = len(samples)
            for smp in samples:
                t0 = time.time()
                ids = list(smp.prompt_token_ids)
                rec = capture(model, ids)
                if not checked:
                    layer = max(i for i in rec if rec[i][3] is None)
                    q, k, sc, w, cap = rec[layer]
                    notes.append(f"check ({name}, layer {layer}, {len(ids)} tokens, lambdas 1e-4/1e-3/1e-2/0.1, "
                                 f"skipped tiles summed over heads): "
                                 + check_against_kernel(q, k, sc, w, cap, args.decode_rows))
                    print(notes[-1], flush=True)
                    checked = True
                for layer, (q, k, sc, w, cap) in sorted(rec.items()):
                    if layer in layers:
                        analyse_layer(cells, length, q, k, sc, w, cap, args.decode_rows)
                del rec
                print(f"  {name} {smp.task} {length} ({len(ids)} tokens): {time.time() - t0:.0f} s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
        for key in sorted(cells, key=lambda x: (x[0], x[1] != "decode", x[2])):
            cell = cells[key].freeze()
            for target in targets:
                scale = solve_scale(cell, target)
                if scale is None:         # lambda < 1 never gets there: what the largest lambda < 1 skips
                    r = measure(cell, float(cell.N.min()) * (1 - 1e-9))
                    r["unreachable"] = True
                else:
                    r = measure(cell, scale)
                rows.append((name, key, target, r))
        notes.append(f"{name}: {n_layers} layers ({'all' if every == 1 else f'every {every}th'} analysed), "
                     f"prompts per length {n_prompts}, tasks {', '.join(TASKS[:args.per_length])}")
        del model
    lines = table(rows)
    ck = "CKPT" if len(args.ckpts) == 1 else " ".join(f"CKPT{i + 1}" for i in range(len(args.ckpts)))
    cmd = (f"python benchmarks/quest_bound.py {ck} --lengths {args.lengths} --per-length {args.per_length} "
           f"--decode-rows {args.decode_rows} --targets {args.targets} --layers {args.layers} "
           f"--threads {args.threads}" + (" --check" if args.check else "") + (" --out OUT.md" if args.out else ""))
    foot = [f"`{cmd}`", "", *[f"* {n}" for n in notes],
            f"* machine: {machine_line()}; {time.time() - t_all:.0f} s, load {os.getloadavg()[0]:.1f}"]
    text = "\n".join(lines + [""] + foot)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
