"""The skip rule and tile geometry shared by every implementation (the exact spec).

Skip rule (identical in serving and counting mode, and the same rule in every implementation)
---------------------------------------------------------------------------------------------
Work is cut into tiles.  A *query tile* is ``TILE_Q`` consecutive query rows of one
sequence, aligned to the sequence's first query row; it is taken per query head.  A *KV
tile* is ``TILE_K`` consecutive KV positions of one sequence, aligned to KV position 0
(independent of the cache page size).

Logits.  For query row ``r`` and key position ``c`` (``LayerSpec`` fields)::

    logit[r, c] = cap * tanh(x / cap)  with  x = scale * k_scale * q_r . k_c    (soft-cap set)
                  x                                                             (otherwise)

where ``k_c`` is the cache as stored (for an fp8 cache the fp8 value; ``k_scale`` folds
its dequantisation into the logit scale).

Visibility.  Query row ``i`` of a sequence with ``q_len`` queries and ``kv_len`` keys sits
at position ``p = kv_len - q_len + i`` and sees KV positions ``<= p`` with ``causal``
(all ``kv_len`` positions otherwise), and with a sliding window of ``w`` tokens only
``[p - w + 1, p]``.  Rows past ``q_len`` in the last query tile are padding.  A (query
head, query tile) *visits* KV tiles ``first .. last``: ``last`` holds the last position
its last valid row sees, ``first`` the first position its first row sees (0 without a
window).  Tiles outside that range (above the causal diagonal, before the window) are
neither visited nor counted; a row sees nothing of a visited tile when the tile lies
wholly outside the row's own range.

The *anchor* is the one visited tile that is never skippable and whose maxima seed the
dense running max (below).  Without a window it is tile ``first`` = tile 0, which holds
position 0 and the sequence's first tokens (StreamingLLM's "sink tokens"; TensorRT-LLM's
rule "the first tile a program visits is never skipped").  With a window it is tile
``last``, the query tile's own diagonal tile (the one holding its last valid row's
position): tile 0 leaves the window on long sequences, and the window's first tile holds
the oldest tokens a row sees, which a local layer attends to least, so a running max that
starts there is below the recent tokens' scores and almost no tile tests small.  Measured
on Gemma-3-270M's 512-token-window layers (``benchmarks/window_lambda_heldout.py``,
docs/kernels.md): with the window-start anchor they reached 12-19 % prefill sparsity at
any lambda < 1; with the diagonal anchor seeding every earlier tile, 48 / 51 / 51 % at
1k / 2k / 4k tokens on a curve of their own.  Layers without a window keep tile 0
(existing calibrations of such models stay valid).

KV *splits*: the KV axis is also cut into splits of ``split_k`` consecutive positions
(default :data:`SPLIT_K`, a multiple of ``TILE_K``), aligned to KV position 0, so split
``j`` holds KV tiles ``t0(j) = j * split_k / TILE_K ..`` up to the next split.  ``split_k``
is a constant of the rule, independent of batch size, phase and GPU: split-KV decode
(flash-decoding) processes splits in separate programs and merges the partial softmaxes
by log-sum-exp, and every other path (prefill, the torch implementation, counting mode)
applies the same split boundaries to the skip test even when it does not launch splits.
For visited KV tile ``t`` and valid row ``r``, with ``j(t)`` the split holding ``t``:

    tile_max[r, t] = max over the columns c of tile t row r sees of logit[r, c]    (-inf if none)
    seed[r]        = tile_max[r, anchor]          (anchor = last with a window, first = 0 without)
    m_before[r, t] = max(seed[r], tile_max[r, max(first, t0(j(t))) .. t-1])
                     (dense running max: it starts from the anchor's maxima, the SEED, and at
                     every split boundary RESTARTS from the seed instead of carrying the tiles
                     of earlier splits; the seed is -inf for a row that sees nothing of the
                     anchor tile, e.g. the first rows of a windowed query tile that straddles
                     a KV tile boundary; with the tile-0 anchor the seed is tile 0's own
                     maxima, so within the first split this is the plain running max)
    e[r, t]        = 0                                  if tile_max[r, t] = -inf (row r does not vote)
                     exp(tile_max[r, t] - m_before[r, t])  otherwise (+inf if m_before = -inf)
    ratio[t]       = max over valid rows r of e[r, t]

and the tile is *skippable under lambda* iff ``t != anchor`` (the first tile of a split is
tested against the seed like any other) and ``ratio[t] < lambda``.  Without a window every
row sees position 0, so the seed is finite and every ``e`` of a tile ``t > 0`` is a plain
ratio; with one, a row that sees nothing of the anchor tile starts at -inf and keeps its
first visible tile (``e = inf``).  Seeding keeps each split independent of the other
splits (a split program needs only its own tiles plus the anchor) while every tile is
still compared with the tokens that most often hold a query's largest scores (the sink
tokens, or for a local layer the most recent ones); a full restart at -inf compared a later
split's tiles with a local maximum only and, measured, needed 3-400x larger lambdas for
the same sparsity with 2-5x the mean error, where the seed matches the no-split rule on
decodes (benchmarks/RESULTS-kernels.md).
Cost: a program or walk that does not start at the anchor reads the anchor's K tile and
computes its Q.K^T once more up front (one extra K tile: a split-KV decode program after
the first split; every windowed query tile, 1/9 more Q.K^T for a 512-token window).

Serving mode with threshold ``lambda`` leaves skippable tiles out of the softmax (no
exp, no V read, no P.V), so the output is the softmax over all visible positions of the
non-skipped tiles (splits are an evaluation order only: the log-sum-exp merge makes the
result the same single softmax)::

    out[r] = v_scale * sum_c exp(logit[r, c]) v_c / (sum_c exp(logit[r, c]) + exp(sink_h))

with ``exp(sink_h)`` present only for a layer with learned sinks (one logit per query
head, in the denominator only, added exactly once however many splits there are; the
sink never enters the skip test).  The running max is the dense one in both modes: a
skipped tile's logits are still known (its Q.K^T is needed for the test), so
``m_before`` never depends on earlier decisions, and calibration counts taken in counting
mode are exactly the serving-mode skip counts, for any ``split_k`` as long as both modes
use the same one.  ``lambda = 0`` never skips (``e >= 0``).

The skip decision is per query head: a kernel that packs the query heads of a KV group
into one program (reading each K/V tile once) still tests each head's rows on their own,
and reads a V tile when any head of the program keeps it.

Counts.  ``visited`` counts the visited tiles of the sequences that some counted lambda
can skip in: in serving mode those whose lambda is > 0, in counting mode those with a
candidate > 0 (the anchor included, as the denominator of every sparsity).  A sequence
served dense (lambda 0, e.g. ``effective_lambda``'s ``lambda >= 1`` rule) adds nothing, so
a batched serving launch's ``skipped / visited`` is the ratio calibration pools from one
sequence and candidate at a time (``calibration/fit.py``), whatever the batch mixes.

Same rule, not the same bits.  For fp32 inputs every implementation (torch, Triton, the
C++ builds) makes the float64 reference's skip decisions in every tested case (counts
are compared exactly) and its outputs agree to fp32 rounding, not bit for bit (sums run
in different orders); a ratio within rounding of lambda could flip in principle.  For
16-bit inputs the Triton GPU kernel takes Q.K^T on 16-bit tensor cores while torch and C++
pre-scale in fp32, so GPU counts agree with a CPU calibration statistically, not tile for
tile.

NaN and infinities.  A NaN or +inf logit is a broken input (a NaN in Q or the cache, an
fp8 NaN byte, an overflow), and the policy is that no implementation hides one:

* maxima propagate NaN (``torch.maximum`` semantics): a row's tile maximum is NaN when a
  logit the row sees in the tile is NaN, and so are the running max and ratios built from
  it (until the next split restarts from the seed);
* a tile is skippable only where ``ratio < lambda`` holds, which is false for NaN: a NaN
  ratio keeps its tile (and is never counted as skippable), so the NaN reaches the
  softmax and every output row that sees it is NaN, at every lambda, as in dense
  attention and the float64 reference.  Why: a skip that dropped a NaN would make a
  broken cache look healthy at some lambdas and not others, and make sparse and dense
  outputs differ in kind;
* a +inf logit makes the rows that see it NaN (``inf - inf`` in the softmax), as in the
  reference; tiles after it test against a +inf running max (ratio 0, skippable);
* a -inf logit is weight 0, exactly like a masked position; a row whose logits in a tile
  are all -inf does not vote on it.
"""

from __future__ import annotations

#: Query rows per query tile (per query head).
TILE_Q = 64
#: KV positions per KV tile.
TILE_K = 64
#: KV positions per split of the skip rule (each later split's dense running max restarts
#: from the anchor's maxima; split-KV decode launches programs over whole splits).  Why 1024 (16
#: tiles), with the seeded rule: a batch-1 32k-token decode with 8 KV heads is
#: 8 * 32768 / 1024 = 256 programs on a 132-SM GPU (H100/H200), ~2 per SM, so every SM
#: has work and a second program to hide memory latency; 2048 would be 128 programs and
#: leave 4 SMs idle with nothing to overlap.  The seed costs every split program after the
#: first one extra K tile (the anchor) and its Q.K^T: 1/16 of the K reads at 1024, 1/8 at 512
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
