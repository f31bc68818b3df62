"""``benchmarks/quest_bound.py``'s bound logic (torch only, float64): the Quest bound of a page is
the hand-computed value, the rule's decisions equal the independent float64 reference's counts
(``tests/sparse_attn/kernel_reference.py``: anchors, windows, split restarts), and the bound never
rules out a tile the rule keeps, while it does rule out a tile it can see is below the threshold."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from sparse_attn.kernels import TILE_K, TILE_Q, LayerSpec
from .kernel_reference import add_sink_token, gather_seq, make_batch, reference

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("quest_bound", ROOT / "benchmarks" / "quest_bound.py")
qb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qb)


def test_page_bound_is_the_hand_computed_value():
    # q = (1, -2); the page's keys span [-1, 3] x [0.5, 2]: ub = 1 * 3 + (-2) * 0.5 = 2,
    # attained by no single key (the largest q.k of the page is 3 - 2 * 1 = 1).
    q = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    k = torch.tensor([[-1.0, 2.0], [3.0, 1.0], [0.0, 0.5], [2.0, 2.0]], dtype=torch.float64)
    ub = qb.page_bounds(q, k, 4)
    assert ub.shape == (1, 1)
    assert ub.item() == pytest.approx(2.0, abs=1e-9) and ub.item() >= 2.0
    assert (q @ k.T).max().item() == 1.0
    # Pages of 2 keys: [-1, 3] x [1, 2] -> 3 - 2 = 1; [0, 2] x [0.5, 2] -> 2 - 1 = 1.
    assert qb.page_bounds(q, k, 2).flatten().tolist() == pytest.approx([1.0, 1.0], abs=1e-9)


def test_a_tile_far_below_the_anchor_is_ruled_out_without_its_keys():
    # One decode row at position 2 * TILE_K - 1 (tiles 0 and 1), D = 2, scale 1: tile 0 (the anchor)
    # holds a key with q.k = 10; tile 1's keys lie in [0, 1] x [0, 1], so ub = 1 * 1 + 0 = 1 and the
    # bound's ratio is exp(1 - 10) = e^-9, the rule's at most that.
    q = torch.tensor([[[1.0, -1.0]]], dtype=torch.float64)                  # [G=1, R=1, D=2]
    k = torch.zeros(2 * TILE_K, 2, dtype=torch.float64)
    k[0] = torch.tensor([10.0, 0.0])
    k[TILE_K:, 0] = torch.linspace(0, 1, TILE_K, dtype=torch.float64)
    k[TILE_K:, 1] = torch.linspace(1, 0, TILE_K, dtype=torch.float64)
    res = qb.query_tile(q, k, torch.tensor([2 * TILE_K - 1]), 1.0, pages=(TILE_K, 16))
    assert res["tiles"].tolist() == [0, 1] and res["anchor"] == 0
    assert res["ratio"][0, 0] == math.inf and res["bound"][TILE_K][0, 0] == math.inf
    assert res["bound"][TILE_K][0, 1].item() == pytest.approx(math.exp(-9), rel=1e-9)
    assert res["ratio"][0, 1].item() == pytest.approx(math.exp(1 - 10))      # key (1, 0) gives q.k = 1
    # 16-key pages: the first page holds x in [0, 15/63], y in [48/63, 1]: ub = 15/63 - 48/63.
    assert res["page"][16][0, 1, 0].item() == pytest.approx(math.exp(-33 / 63 - 10), rel=1e-9)
    lam = 1e-3
    assert res["bound"][TILE_K][0, 1] < lam and res["ratio"][0, 1] < lam


def _rule_counts(batch, spec, thresholds, split_k, pages):
    """Skipped tiles per threshold per query head by query_tile's rule, and the bound's."""
    q, k, bt = batch.query.double(), batch.key_cache, batch.block_table
    hq, hkv = q.shape[1], k.shape[2]
    g = hq // hkv
    rule = torch.zeros(len(thresholds), hq, dtype=torch.int64)
    qsl = batch.query_start_loc.tolist()
    for s, n in enumerate(batch.seq_lens.tolist()):
        keys = gather_seq(k, bt, s, n)
        a, b = qsl[s], qsl[s + 1]
        for h in range(hkv):
            qg = q[a:b, h * g:(h + 1) * g].transpose(0, 1)
            for r0 in range(0, b - a, TILE_Q):
                pos = torch.arange(n - (b - a) + r0, n - (b - a) + min(b - a, r0 + TILE_Q))
                res = qb.query_tile(qg[:, r0:r0 + TILE_Q], keys[:, h], pos, spec.scale, spec.window,
                                    split_k=split_k, pages=pages)
                for p in pages:
                    assert bool((res["bound"][p] >= res["ratio"]).all())
                    for lam in thresholds:     # every tile the bound rules out, the rule skips
                        assert not bool(((res["bound"][p] < lam) & ~(res["ratio"] < lam)).any())
                for j, lam in enumerate(thresholds):
                    rule[j, h * g:(h + 1) * g] += (res["ratio"] < lam).sum(1)
    return rule


@pytest.mark.parametrize("window,split_k", [(None, 1024), (None, 128), (96, 128)], ids=["global", "splits", "window"])
def test_rule_equals_the_float64_reference_and_the_bound_stays_inside_it(window, split_k):
    torch.manual_seed(0)
    batch = make_batch([300, 70, 1], [80, 1, 1], hq=4, hkv=2, d=8, page=16, dtype=torch.float64, seed=3)
    batch = add_sink_token(batch, strength=4.0, every=32 if window else None)
    spec = LayerSpec(0.35, window=window)
    thresholds = (1e-3, 0.05, 0.3, 0.9)
    _, _, _, per_thr = reference(batch, spec, thresholds=thresholds, split_k=split_k)
    mine = _rule_counts(batch, spec, thresholds, split_k, pages=(TILE_K, 16))
    assert mine.tolist() == per_thr.tolist()
    assert int(per_thr.sum()) > 0


def test_pages_no_row_sees_count_as_no_k_read():
    # A windowed decode row at 191 with a 100-token window sees 92 .. 191: tiles 1 and 2, anchored
    # on tile 2 (its diagonal); tile 1's first 16-page (64 .. 79) is wholly before the window.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 8, generator=g, dtype=torch.float64)
    k = torch.randn(3 * TILE_K, 8, generator=g, dtype=torch.float64)
    res = qb.query_tile(q, k, torch.tensor([191]), 0.3, 100, pages=(TILE_K, 16))
    assert res["tiles"].tolist() == [1, 2] and res["anchor"] == 1
    page = res["page"][16][0, 0]
    assert torch.isnan(page[0]) and not bool(torch.isnan(page[1:]).any())
