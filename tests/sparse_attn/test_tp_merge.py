"""Tensor-parallel merge of skip counts, with real ``torch.distributed`` (gloo, CPU).

Under tensor parallelism each rank serves its own slice of the query heads (and the KV
heads they read), so each rank's calibration counts cover only those heads. The project
sums the integer counts of all ranks before taking any ratio
(``sparse_attn.calibration.runner.merge_worker_counts`` on the per-worker
``WorkerStats.snapshot()`` dicts that ``collective_rpc`` returns). Here two real processes
(gloo over 127.0.0.1) each run the counting kernel on their half of one shared random
problem, all-reduce (SUM) the counts, and the test checks:

* the all-reduced counts equal the counts of one process over all heads, exactly;
* ``merge_worker_counts`` on the ranks' snapshots equals the all-reduced counts;
* with ranks that visit different numbers of tiles (an uneven head split), the ratio of
  the merged counts is the right sparsity and the mean of per-rank ratios is not.

No vLLM; runs in the unit env in a few seconds (two spawned interpreters importing torch).
"""

from __future__ import annotations

import json
import os
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparse_attn.calibration.runner import PHASES, merge_worker_counts
from sparse_attn.kernels import paged_attention_counts
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


def counts_for_heads(phase: str, kv_heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting-mode attention of one phase's batch restricted to ``kv_heads`` and their
    query heads (a TP rank's shard). Returns (skipped [n_candidates], visited [n_candidates])
    summed over the shard's query heads, int64."""
    q, k, v, bt, seq_lens, qsl = make_problem(*BATCHES[phase], seed=1 if phase == "prefill" else 2)
    group = HQ // HKV
    q_heads = [h * group + j for h in kv_heads for j in range(group)]
    idx = torch.tensor(kv_heads)
    # Head slices of the shared caches: strided views, as a rank's own cache would be.
    k_shard, v_shard = k[:, :, idx], v[:, :, idx]
    _, skipped, visited = paged_attention_counts(q[:, q_heads], k_shard, v_shard, bt, seq_lens, qsl, CANDIDATES,
                                                 scale=SCALE, impl="torch")
    n = len(CANDIDATES)
    return skipped.sum(dim=1), torch.full((n,), int(visited.sum()), dtype=torch.int64)


def snapshot_for_heads(kv_heads: list[int]) -> dict:
    """This shard's ``WorkerStats.snapshot()``, recorded the way the adapter records
    calibration launches (``add_candidates`` per phase)."""
    stats = WorkerStats()
    for phase in PHASES:
        skipped, visited = counts_for_heads(phase, kv_heads)
        stats.add_candidates(phase, skipped.tolist(), visited.tolist())
    return stats.snapshot()


def _rank_main(rank: int, world: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        result = {}
        for split, shards in SPLITS.items():
            snap = snapshot_for_heads(shards[rank])
            reduced = {}
            for phase in PHASES:
                skipped = torch.tensor(snap["candidate_skipped"][phase], dtype=torch.int64)
                visited = torch.tensor(snap["candidate_visited"][phase], dtype=torch.int64)
                dist.all_reduce(skipped, op=dist.ReduceOp.SUM)
                dist.all_reduce(visited, op=dist.ReduceOp.SUM)
                reduced[phase] = [skipped.tolist(), visited.tolist()]
            gathered: list = [None] * world
            dist.all_gather_object(gathered, snap)
            result[split] = {"snapshot": snap, "reduced": reduced, "gathered": gathered}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    # file:// rendezvous: no port race with other jobs on the machine.
    init_method = f"file://{out / 'rendezvous'}"
    # gloo binds to the interface the hostname resolves to unless told; loopback always exists.
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
    try:
        mp.spawn(_rank_main, args=(2, init_method, str(out)), nprocs=2, join=True)
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def single_process() -> dict:
    """phase -> (skipped, visited) over all heads, one process."""
    return {phase: tuple(t.tolist() for t in counts_for_heads(phase, list(range(HKV)))) for phase in PHASES}


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_all_reduced_counts_equal_single_process(tp_results, single_process, split):
    for rank in (0, 1):
        reduced = tp_results[rank][split]["reduced"]
        for phase in PHASES:
            skipped, visited = single_process[phase]
            assert reduced[phase] == [skipped, visited], (split, rank, phase)
    # The problem is not degenerate: some candidates skip, and not all the same amount.
    for phase in PHASES:
        skipped, visited = single_process[phase]
        assert 0 < max(skipped) < visited[0] and len(set(skipped)) > 2, (phase, skipped, visited)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_merge_worker_counts_equals_all_reduce(tp_results, split):
    snapshots = [tp_results[rank][split]["snapshot"] for rank in (0, 1)]
    # Every rank gathered the same snapshots the ranks produced.
    assert tp_results[0][split]["gathered"] == tp_results[1][split]["gathered"] == snapshots
    merged = merge_worker_counts(snapshots, len(CANDIDATES))
    for phase in PHASES:
        assert [list(merged[phase][0]), list(merged[phase][1])] == tp_results[0][split]["reduced"][phase]


def test_merge_before_ratio_differs_from_mean_of_rank_ratios(tp_results, single_process):
    # Uneven split: rank 0 serves 3 KV heads, rank 1 one, so rank 0 visits 3x the tiles.
    snapshots = [tp_results[rank]["uneven"]["snapshot"] for rank in (0, 1)]
    merged = merge_worker_counts(snapshots, len(CANDIDATES))
    differs = []
    for phase in PHASES:
        v0, v1 = snapshots[0]["candidate_visited"][phase][0], snapshots[1]["candidate_visited"][phase][0]
        assert v0 == 3 * v1 > 0
        skipped, visited = merged[phase]
        truth = single_process[phase]
        for j in range(len(CANDIDATES)):
            merged_ratio = Fraction(skipped[j], visited[j])
            assert merged_ratio == Fraction(truth[0][j], truth[1][j])  # the all-heads sparsity, exactly
            rank_ratios = [Fraction(s["candidate_skipped"][phase][j], s["candidate_visited"][phase][j]) for s in snapshots]
            mean_ratio = sum(rank_ratios) / 2
            # Weighted by visited tiles, the per-rank ratios give back the merged one ...
            assert (rank_ratios[0] * v0 + rank_ratios[1] * v1) / (v0 + v1) == merged_ratio
            if rank_ratios[0] != rank_ratios[1]:
                # ... their plain mean does not (it weighs rank 1's few tiles as much as rank 0's).
                assert mean_ratio != merged_ratio
                differs.append((phase, CANDIDATES[j], float(merged_ratio), float(mean_ratio)))
    assert len(differs) >= 4, differs
    # The even split still gives equal visited counts per rank: there the mean happens to be right.
    even = [tp_results[rank]["even"]["snapshot"] for rank in (0, 1)]
    for phase in PHASES:
        assert even[0]["candidate_visited"][phase] == even[1]["candidate_visited"][phase]
