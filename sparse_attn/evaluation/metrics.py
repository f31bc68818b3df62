"""Scores of one eval run, per configuration and (task, length) cell, each sparse one against dense.

Per sample (inputs from :mod:`sparse_attn.evaluation.engine`):

* ``kl_all`` (the headline): mean KL(dense || sparse) of the next-token distribution over the sample's
  comparable positions (:func:`positions`), and ``top1``: the fraction of those positions where sparse's
  argmax is dense's; ``tokens``: how many positions (``kl_generated`` / ``kl_forced``: the two kinds apart);
* ``match``: fraction of the sample's answers found in the generated text (RULER's
  ``string_match_all``; 0 or 1 for one answer);
* ``first_lp``: log-probability of the answer's first token where the answer is read (the first
  generated step; from its top-20, a token outside it counts as the 20th's value); a low-variance
  measure: it moves with every change in the answer's probability, where ``match`` moves only when a
  token flips;
* ``kl``: the KL of the first generated step alone (:func:`kl_topk`);
* ``answer_ll`` / ``forced_exact`` (``--teacher_forced``): mean log-likelihood per answer token given the
  true tokens before it, and whether every answer token is the argmax there;
* ``agreement``: generated tokens equal to dense's at the same position / tokens generated.

Prompts are the independent unit: a per-position score is averaged within its prompt first, and every
interval is over prompts. A cell's sparse score is shown with its paired difference to dense over the
same prompts and a 95 % confidence interval of that difference (normal approximation,
``1.96 * sd / sqrt(n)`` over the ``n`` prompts; with ``n`` under ~30 read it as a rough band).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

Z95 = 1.96


def mean_ci(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and the half-width of its 95 % interval (None for no data; 0 for one value)."""
    n = len(values)
    if not n:
        return None, None
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, Z95 * math.sqrt(var / n)


def ratio_ci(num: Sequence[float], den: Sequence[float]) -> tuple[float | None, float | None]:
    """``R = mean(num) / mean(den)`` over paired values (prompt ``i``'s ``num[i]`` and ``den[i]``) and the half-width
    of its 95 % interval by the delta method: ``1.96 * sd(num_i - R den_i) / (sqrt(n) * mean(den))`` (0 for one
    pair). None, None for no pairs or ``mean(den) <= 0`` (a reference that costs nothing is no unit)."""
    n = len(num)
    if not n or len(den) != n:
        return None, None
    mean_den = sum(den) / n
    if mean_den <= 0:
        return None, None
    ratio = (sum(num) / n) / mean_den
    if n == 1:
        return ratio, 0.0
    resid = [a - ratio * b for a, b in zip(num, den)]
    sd = math.sqrt(sum(r * r for r in resid) / (n - 1))  # the residuals' mean is 0 by the choice of R
    return ratio, Z95 * sd / (math.sqrt(n) * mean_den)


#: Smallest probability the "rest" bucket is given (float rounding and underflow only: see :func:`kl_topk`).
REST_FLOOR = 1e-12


def kl_topk(dense: Mapping[str, float], sparse: Mapping[str, float], k: int | None = None) -> float:
    """KL(dense || sparse) in nats of one position's next-token distribution, from top-k logprobs.

    ``dense`` / ``sparse``: token id -> logprob, as vLLM returns them (its top ``k``, plus the sampled or the
    prompt token when that is outside them); ``k``: the top-k requested (default: the smaller dict's size).
    The vocabulary is coarse-grained into ``D``, dense's ``k`` most likely tokens, and one bucket ``R`` for
    every other token:

        KL = sum_{t in D} p_t * log(p_t / q_t)  +  p_R * log(p_R / q_R),
        p_R = 1 - sum_{t in D} p_t,   q_R = max(1 - sum_{t in D} q_t, REST_FLOOR)

    ``p_t = exp(dense[t])``; ``q_t = exp(sparse[t])`` where sparse returned ``t``, else ``exp(q_(k))``,
    sparse's ``k``-th largest logprob, an upper bound on ``q_t`` (a token vLLM did not return ranks below
    ``k``). With exact ``q_t`` the bucketed KL is a lower bound on the full-vocabulary KL (log-sum
    inequality); a ``q_t`` taken at its bound lowers that token's term and raises the rest bucket's. ``q_R``
    is never negative in exact arithmetic (each of the ``m`` tokens of ``D`` outside sparse's top k has
    ``q_t <= q_(k)``, and each of the ``m`` tokens of sparse's top k outside ``D`` has at least ``q_(k)``, so
    ``sum_D q_t <= sum of sparse's top k <= 1``); the floor only absorbs rounding and underflow (a peaked
    float32 distribution whose top logprob is 0.0). A ``p_R`` at or below 0 contributes nothing.
    """
    k = min(len(dense), len(sparse)) if k is None else k
    top = sorted(dense.items(), key=lambda kv: kv[1], reverse=True)[:k]
    bound = sorted(sparse.values(), reverse=True)[min(k, len(sparse)) - 1]
    kl = p_sum = q_sum = 0.0
    for t, lp in top:
        lq = sparse.get(t, bound)
        kl += math.exp(lp) * (lp - lq)
        p_sum += math.exp(lp)
        q_sum += math.exp(lq)
    p_rest, q_rest = 1.0 - p_sum, max(1.0 - q_sum, REST_FLOOR)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return kl


def argmax(dist: Mapping[str, float]) -> str:
    """The most likely token of a top-k dict (a tie goes to the smaller token id, as torch's argmax picks the first)."""
    return max(dist.items(), key=lambda kv: (kv[1], -int(kv[0])))[0]


def positions(cell: dict[str, Any], dense_cell: dict[str, Any], i: int) -> dict[str, list[tuple[dict, dict]]]:
    """Sample ``i``'s positions where sparse's and dense's next-token distributions are comparable (the same
    context), as ``(dense, sparse)`` top-k pairs, by kind:

    * ``generated``: greedy steps ``0 .. d``, where ``d`` is the first step whose tokens differ (all steps when
      none do): step ``j``'s distribution is conditioned on the prompt and the ``j`` tokens before it, which are
      the same in both up to and including the first divergence; after it the contexts differ and the two
      distributions answer different questions. Step 0 comes from the prefill, the later ones from decode.
    * ``forced`` (``--teacher_forced``): every answer position, given the prompt and the true answer tokens
      before it: always the same context in both (computed by the prefill).

    A generated step and an answer position with the same context are both kept: the first was computed by a
    decode step (decode's threshold), the second by the prefill (prefill's).
    """
    out: dict[str, list[tuple[dict, dict]]] = {"generated": [], "forced": []}
    steps, dsteps = (cell.get("steps") or ())[i:i + 1], (dense_cell.get("steps") or ())[i:i + 1]
    if steps and dsteps:
        a, d = cell["generated"][i], dense_cell["generated"][i]
        first_diff = next((j for j, (x, y) in enumerate(zip(a, d)) if x != y), None)
        n = min(len(steps[0]), len(dsteps[0]))
        n = n if first_diff is None else min(n, first_diff + 1)
        out["generated"] = [(dd, ss) for dd, ss in zip(dsteps[0][:n], steps[0][:n]) if dd and ss]
    if cell.get("answer_top") and dense_cell.get("answer_top"):
        out["forced"] = [(dd, ss) for dd, ss in zip(dense_cell["answer_top"][i], cell["answer_top"][i]) if dd and ss]
    return out


def position_kls(cell: dict[str, Any], dense_cell: dict[str, Any], i: int,
                 top_k: int | None = None) -> tuple[dict[str, list[tuple[dict, dict]]], dict[str, list[float]]]:
    """Sample ``i``'s comparable positions (:func:`positions`) and one KL(dense || sparse) per position, by kind
    (:func:`kl_topk` with ``top_k``): the eval's ``kl_all`` is the mean of the two kinds' KLs pooled."""
    by_kind = positions(cell, dense_cell, i)
    return by_kind, {kind: [kl_topk(d, s, top_k) for d, s in pairs] for kind, pairs in by_kind.items()}


def sample_scores(cell: dict[str, Any], answers: Sequence[Sequence[str]], answer_ids: Sequence[Sequence[int]],
                  dense_cell: dict[str, Any] | None = None, top_k: int | None = None) -> list[dict[str, float]]:
    """Per-sample scores of one engine cell; ``answers[i]`` / ``answer_ids[i]``: sample ``i``'s answers and
    answer tokens; ``dense_cell``: the native run of the same cell (for the KL and top-1 agreement);
    ``top_k``: the logprobs the engines requested (:func:`kl_topk`'s ``k``)."""
    out = []
    for i, (text, wanted, ids) in enumerate(zip(cell["text"], answers, answer_ids)):
        first = cell["first_step"][i]
        score = {"match": sum(a in text for a in wanted) / len(wanted),
                 "first_lp": first.get(str(ids[0]), min(first.values())) if first else float("nan")}
        if dense_cell is not None and first and dense_cell["first_step"][i]:
            score["kl"] = kl_topk(dense_cell["first_step"][i], first, top_k)
        if dense_cell is not None:
            by_kind, kls = position_kls(cell, dense_cell, i, top_k)
            pairs, pooled = by_kind["generated"] + by_kind["forced"], kls["generated"] + kls["forced"]
            if pooled:
                score["kl_all"] = sum(pooled) / len(pooled)
                score["top1"] = sum(argmax(d) == argmax(s) for d, s in pairs) / len(pairs)
                score["tokens"] = len(pooled)
                for kind, values in kls.items():
                    if values:
                        score[f"kl_{kind}"] = sum(values) / len(values)
                        score[f"tokens_{kind}"] = len(values)
        if cell.get("answer_logprobs"):
            logprobs = cell["answer_logprobs"][i]
            score["answer_ll"] = sum(lp for lp, _rank in logprobs) / len(logprobs)
            score["forced_exact"] = float(all(rank == 1 for _lp, rank in logprobs))
        out.append(score)
    return out


def agreement(tokens: Sequence[Sequence[int]], dense: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """``(equal position-wise, in the common prefix, total)`` generated tokens against dense."""
    equal = sum(x == y for a, d in zip(tokens, dense) for x, y in zip(a, d))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, d)) if x != y), min(len(a), len(d))) for a, d in zip(tokens, dense))
    return equal, prefix, sum(len(d) for d in dense)


def sparsity(counts: dict[str, dict[str, int]] | None) -> dict[str, float | None]:
    if not counts:
        return {}
    return {phase: (c["skipped"] / c["visited"] if c["visited"] else None) for phase, c in counts.items()}


def summarise(scores: list[dict[str, float]], dense_scores: list[dict[str, float]] | None) -> dict[str, Any]:
    """Means (with 95 % half-widths over prompts) of each score, and paired differences against dense when given.
    ``kl_all`` / ``top1`` come with ``kl_n`` (prompts with a comparable position) and ``tokens`` (positions, all
    prompts together); they are paired against dense already, so they have no ``d_`` difference."""
    out: dict[str, Any] = {"n": len(scores)}
    for key in ("match", "first_lp", "answer_ll", "forced_exact", "kl", "kl_all", "top1", "kl_generated", "kl_forced"):
        values = [s[key] for s in scores if key in s]
        if not values:
            continue
        out[key], out[key + "_ci"] = mean_ci(values)
        if dense_scores is not None and not key.startswith("kl") and key != "top1":
            out["d_" + key], out["d_" + key + "_ci"] = mean_ci([s[key] - d[key] for s, d in zip(scores, dense_scores)])
    if any("kl_all" in s for s in scores):
        out["kl_n"] = sum("kl_all" in s for s in scores)
        for key in ("tokens", "tokens_generated", "tokens_forced"):
            out[key] = sum(s.get(key, 0) for s in scores)
    return out


def cell_counts(cell: dict[str, Any]) -> dict[str, dict[str, int]] | None:
    """The tile counts of one engine cell's prompts, per phase. When the teacher-forced pass shared its prefill
    with the generate batch (``prefill_shared``: the generate batch read the prompts' KV from the prefix cache),
    the prefill is that pass's (every prompt token, plus the answer's few) and the decode steps the generate
    batch's; otherwise the generate batch's for both."""
    counts = cell.get("counts")
    if counts is None or not cell.get("prefill_shared") or not cell.get("teacher_forced_counts"):
        return counts
    return {**counts, "prefill": dict(cell["teacher_forced_counts"]["prefill"])}


def add_counts(a: dict[str, dict[str, int]] | None, b: dict[str, dict[str, int]] | None) -> dict[str, dict[str, int]] | None:
    if a is None:
        return None if b is None else {p: dict(c) for p, c in b.items()}
    if b is None:
        return a
    return {p: {k: a[p][k] + b[p][k] for k in a[p]} for p in a}
