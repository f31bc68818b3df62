"""The skip rule and tile geometry shared by every implementation (the exact spec).

Skip rule (identical in serving and counting mode, identical in every implementation)
-------------------------------------------------------------------------------------
Work is cut into tiles.  A *query tile* is ``TILE_Q`` consecutive query rows of one
sequence, aligned to the sequence's first query row; it is taken per query head.  A *KV
tile* is ``TILE_K`` consecutive KV positions of one sequence, aligned to KV position 0
(independent of the cache page size).

For query row ``i`` of a sequence with ``q_len`` queries and ``kv_len`` keys, the absolute
position is ``kv_len - q_len + i``; with ``causal=True`` it sees KV positions ``<=`` that,
otherwise all ``kv_len`` positions.  Rows past ``q_len`` in the last query tile are padding.

A (query head, query tile) *visits* KV tiles ``0 .. last`` where ``last`` is the KV tile
holding the last position its last valid row sees; tiles entirely above the causal
diagonal are neither visited nor counted.

KV *splits*: the KV axis is also cut into splits of ``split_k`` consecutive positions
(default :data:`SPLIT_K`, a multiple of ``TILE_K``), aligned to KV position 0, so split
``j`` holds KV tiles ``t0(j) = j * split_k / TILE_K ..`` up to the next split.  ``split_k``
is a constant of the rule, independent of batch size, phase and GPU: split-KV decode
(flash-decoding) processes each split in its own program and merges the partial
softmaxes by log-sum-exp, and every other path (prefill, the torch implementation,
counting mode) applies the same split boundaries to the skip test even when it does not
launch splits.  For visited KV tile ``t`` of split ``j`` and valid row ``r``:

    tile_max[r, t] = max over visible columns c of tile t of  scale * q_r . k_c    (-inf if none)
    m_before[r, t] = max(tile_max[r, 0], ..., tile_max[r, t-1])                     if j = 0
                     max(tile_max[r, 0], tile_max[r, t0(j)], ..., tile_max[r, t-1])  if j > 0
                     (dense running max; at every split boundary after the first it
                     RESTARTS from KV tile 0's maxima, the SEED, instead of carrying the
                     tiles of earlier splits)
    ratio[t]       = max over valid rows r of exp(tile_max[r, t] - m_before[r, t])

and the tile is *skippable under lambda* iff ``t != 0`` (KV tile 0, which holds the
first tokens of the sequence, is never skippable; the first tile of a later split is
tested against the seed like any other) and ``ratio[t] < lambda``.  Tile 0 holds position 0, which every row
sees, so ``tile_max[r, 0]`` is finite and every ``m_before`` of a tile ``t > 0`` is.
Seeding keeps each split independent of the other splits (a split program needs only
its own tiles plus tile 0) while every tile is still compared with the first tokens of
the sequence (StreamingLLM's "sink tokens", which often hold a query's largest scores;
not to be confused with learned per-head sink logits); a full
restart at -inf compared a later split's tiles with a local maximum only and, measured,
needed 3-400x larger lambdas for the same sparsity with 2-5x the mean error, where the
seed matches the no-split rule on decodes (benchmarks/RESULTS-kernels.md).  Cost: a
split-KV decode program of a split ``j > 0`` reads K tile 0 and computes its Q.K^T once
more (one extra K tile per split program, ``TILE_K / split_k`` of the K reads).

Serving mode with threshold ``lambda`` leaves skippable tiles out of the softmax (no
exp, no V read, no P.V), so the output is the softmax over all visited positions
restricted to the non-skipped tiles (splits are an evaluation order only: the
log-sum-exp merge makes the result the same single softmax).  The running max is the
dense one in both modes: a skipped tile's scores are still known (its Q.K^T is needed
for the test), so ``m_before`` never depends on earlier decisions, and calibration
counts taken in counting mode are exactly the serving-mode skip counts, for any
``split_k`` as long as both modes use the same one.  ``lambda = 0`` never skips
(``exp(.) >= 0``).

The skip decision is per query head: a kernel that packs the query heads of a KV group
into one program (reading each K/V tile once) still tests each head's rows on their own,
and reads a V tile when any head of the program keeps it.
"""

from __future__ import annotations

#: Query rows per query tile (per query head).
TILE_Q = 64
#: KV positions per KV tile.
TILE_K = 64
#: KV positions per split of the skip rule (each split's dense running max restarts from
#: KV tile 0's maxima; split-KV decode launches one program per split).  Why 1024 (16
#: tiles), with the seeded rule: a batch-1 32k-token decode with 8 KV heads is
#: 8 * 32768 / 1024 = 256 programs on a 132-SM GPU (H100/H200), ~2 per SM, so every SM
#: has work and a second program to hide memory latency; 2048 would be 128 programs and
#: leave 4 SMs idle with nothing to overlap.  The seed costs every split program after the
#: first one extra K tile (tile 0) and its Q.K^T: 1/16 of the K reads at 1024, 1/8 at 512
#: (which would only add programs beyond the ~2 per SM that already fill the GPU, and
#: double the fp32 split partials [S, splits, Hq, D] a captured graph keeps).  With the
#: seed, the split length barely trades accuracy any more (benchmarks/RESULTS-kernels.md,
#: CPU): decodes need the no-split rule's lambdas and have its error at equal sparsity;
#: a 16k-KV prefill chunk needs a 1.6x larger lambda for 75 % with 1.2x the mean error,
#: and 512 is no better there.  So the choice is parallelism against the extra tile.
SPLIT_K = 1024


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())
