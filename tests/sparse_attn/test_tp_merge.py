"""Tensor-parallel merge of skip counts: per-head counts are additive, so shard sums equal the whole.

Under tensor parallelism each rank serves its own slice of the query heads (and the KV
heads they read), and its calibration counts cover only those heads. The driver sums
the integer counts of all ranks before any ratio is taken
(``sparse_attn.calibration.runner.merge_worker_counts`` on the ``WorkerStats.snapshot()``
dicts that ``collective_rpc`` returns). That is right exactly when the counting kernel's
counts are additive over heads: nothing in one head's count depends on another head.
Here, in one process, the counting kernel runs once over all heads and once per shard
(head slices of the same caches, strided views as a rank's own cache would be), and:

* the shards' counts sum to the all-heads counts exactly, for an even and an uneven split;
* ``merge_worker_counts`` on the shards' snapshots equals those all-heads counts;
* with an uneven split the ratio of the merged counts is the all-heads sparsity and the
  mean of per-shard ratios is not.

(The collective itself is vLLM's ``collective_rpc``; tests/engine/test_tensor_parallel.py
runs it with two real CPU workers.)
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

import pytest
import torch

from sparse_attn.calibration.runner import PHASES, merge_worker_counts
from sparse_attn.kernels import LayerSpec, PagedBatch, paged_attention_counts
from sparse_attn.stats import WorkerStats

HQ, HKV, D, PAGE = 8, 4, 32, 16
SCALE = D ** -0.5
#: candidate lambdas: from "skip nothing" to "skip almost everything but the max tile"
CANDIDATES = [1e-6, 1e-4, 1e-3, 1e-2, 5e-2, 0.2, 0.5, 0.9]
#: phase -> (kv_lens, q_lens): a chunked prefill (q_len > TILE_Q and a short one) and a decode batch
BATCHES = {
    "prefill": ([400, 150], [400, 30]),
    "decode": ([520, 333, 70], [1, 1, 1]),
}
#: how the KV heads are split over two ranks: even (what TP does) and uneven (3 + 1)
SPLITS = {"even": [[0, 1], [2, 3]], "uneven": [[0, 1, 2], [3]]}


def make_problem(kv_lens, q_lens, seed):
    """One random paged batch in the logical ``[blocks, page, Hkv, D]`` layout, with an
    attention sink on each sequence's first key so that the candidates skip different
    numbers of tiles per head (plain random scores are near uniform)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in kv_lens]
    n_blocks = sum(need) + 1
    k = torch.randn(n_blocks, PAGE, HKV, D, generator=gen)
    v = torch.randn(n_blocks, PAGE, HKV, D, generator=gen)
    perm = torch.randperm(n_blocks, generator=gen)
    bt = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(kv_lens):
        bt[s, : need[s]] = perm[used : used + need[s]]
        used += need[s]
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    # Per KV head a different sink strength: head-dependent sparsity.
    for h in range(HKV):
        q[:, h * (HQ // HKV) : (h + 1) * (HQ // HKV), 0] += 1.0 + h
        for s in range(len(kv_lens)):
            k[int(bt[s, 0]), 0, h, 0] = 4.0 * (1 + h)
    qsl = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    return q, k, v, bt, torch.tensor(kv_lens, dtype=torch.int32), qsl


@lru_cache(maxsize=None)  # each shard's kernel run is reused by several tests
def _counts(phase: str, kv_heads: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting-mode attention of one phase's batch restricted to ``kv_heads`` and their
    query heads (a TP rank's shard). Returns (skipped [n_candidates], visited [n_candidates])
    summed over the shard's query heads, int64."""
    q, k, v, bt, seq_lens, qsl = make_problem(*BATCHES[phase], seed=1 if phase == "prefill" else 2)
    group = HQ // HKV
    q_heads = [h * group + j for h in kv_heads for j in range(group)]
    idx = torch.tensor(list(kv_heads))
    # Head slices of the shared caches: strided views, as a rank's own cache would be.
    k_shard, v_shard = k[:, :, idx], v[:, :, idx]
    _, skipped, visited = paged_attention_counts(PagedBatch(q[:, q_heads], k_shard, v_shard, bt, seq_lens, qsl),
                                                 LayerSpec(SCALE), CANDIDATES, impl="torch")
    n = len(CANDIDATES)
    return skipped.sum(dim=1), torch.full((n,), int(visited.sum()), dtype=torch.int64)


def counts_for_heads(phase: str, kv_heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return _counts(phase, tuple(kv_heads))


def snapshot_for_heads(kv_heads: list[int]) -> dict:
    """This shard's ``WorkerStats.snapshot()``, recorded the way the adapter records
    calibration launches (``add_candidates`` per phase)."""
    stats = WorkerStats()
    for phase in PHASES:
        skipped, visited = counts_for_heads(phase, kv_heads)
        stats.add_candidates(phase, skipped.tolist(), visited.tolist())
    return stats.snapshot()


@pytest.fixture(scope="module")
def whole() -> dict:
    """phase -> (skipped, visited) over all heads, one kernel call."""
    return {phase: tuple(t.tolist() for t in counts_for_heads(phase, list(range(HKV)))) for phase in PHASES}


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_shard_counts_sum_to_the_whole(whole, split):
    for phase in PHASES:
        parts = [counts_for_heads(phase, shard) for shard in SPLITS[split]]
        skipped = [sum(int(p[0][j]) for p in parts) for j in range(len(CANDIDATES))]
        visited = [sum(int(p[1][j]) for p in parts) for j in range(len(CANDIDATES))]
        assert (skipped, visited) == whole[phase], (split, phase)
    # The problem is not degenerate: some candidates skip, and not all the same amount.
    for phase in PHASES:
        skipped, visited = whole[phase]
        assert 0 < max(skipped) < visited[0] and len(set(skipped)) > 2, (phase, skipped, visited)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_merge_worker_counts_of_shard_snapshots_equals_the_whole(whole, split):
    snapshots = [snapshot_for_heads(shard) for shard in SPLITS[split]]
    merged = merge_worker_counts(snapshots, len(CANDIDATES))
    for phase in PHASES:
        assert (list(merged["global"][phase][0]), list(merged["global"][phase][1])) == whole[phase], (split, phase)
        assert not any(merged["windowed"][phase][1])  # no windowed layer: its counts stay zero


def test_uneven_merge_gives_the_all_heads_ratio_not_a_mean_of_rank_ratios(whole):
    # Uneven split: rank 0 serves 3 KV heads, rank 1 one, so rank 0 visits 3x the tiles.
    snapshots = [snapshot_for_heads(shard) for shard in SPLITS["uneven"]]
    merged = merge_worker_counts(snapshots, len(CANDIDATES))
    discriminating = []
    for phase in PHASES:
        v0, v1 = (s["candidate_visited"]["global"][phase][0] for s in snapshots)
        assert v0 == 3 * v1 > 0
        skipped, visited = merged["global"][phase]
        truth = whole[phase]
        for j in range(len(CANDIDATES)):
            # the all-heads sparsity (counted over every head at once), exactly
            assert Fraction(skipped[j], visited[j]) == Fraction(truth[0][j], truth[1][j]), (phase, CANDIDATES[j])
            rank_ratios = [Fraction(s["candidate_skipped"]["global"][phase][j], s["candidate_visited"]["global"][phase][j])
                           for s in snapshots]
            if rank_ratios[0] != rank_ratios[1]:
                discriminating.append((phase, CANDIDATES[j]))
    # The check above discriminates: where the ranks' ratios differ, a merge that averaged them (weighing
    # rank 1's few tiles as much as rank 0's) would miss the all-heads ratio. Enough such candidates exist.
    assert len(discriminating) >= 4, discriminating
