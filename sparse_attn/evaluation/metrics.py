"""Scores of one eval run, per configuration and (task, length) cell, each sparse one against dense.

Per sample (inputs from :mod:`sparse_attn.evaluation.engine`):

* ``match``: fraction of the sample's answers found in the generated text (RULER's
  ``string_match_all``; 0 or 1 for one answer);
* ``first_lp``: log-probability of the answer's first token where the answer is read (the first
  generated step; from its top-20, a token outside it counts as the 20th's value); a low-variance
  measure: it moves with every change in the answer's probability, where ``match`` moves only when a
  token flips;
* ``kl``: KL(dense || sparse) of that step's next-token distribution (nats, over dense's top-20);
* ``answer_ll`` / ``forced_exact`` (``--teacher_forced``): mean log-likelihood per answer token given the
  true tokens before it, and whether every answer token is the argmax there;
* ``agreement``: generated tokens equal to dense's at the same position / tokens generated.

A cell's sparse score is shown with its paired difference to dense over the same prompts and a
95 % confidence interval of that difference (normal approximation, ``1.96 * sd / sqrt(n)``; with
``n`` under ~30 read it as a rough band).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

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


def _kl(dense: dict[str, float], sparse: dict[str, float]) -> float:
    """KL(dense || sparse) in nats over dense's top-k tokens; a token missing from sparse's top-k is given
    sparse's smallest top-k logprob (an upper bound on its logprob, so the KL is a lower bound)."""
    floor = min(sparse.values())
    return sum(math.exp(lp) * (lp - sparse.get(t, floor)) for t, lp in dense.items())


def sample_scores(cell: dict[str, Any], answers: Sequence[Sequence[str]], answer_ids: Sequence[Sequence[int]],
                  dense_cell: dict[str, Any] | None = None) -> list[dict[str, float]]:
    """Per-sample scores of one engine cell; ``answers[i]`` / ``answer_ids[i]``: sample ``i``'s answers and
    answer tokens; ``dense_cell``: the native run of the same cell (for the KL)."""
    out = []
    for i, (text, wanted, ids) in enumerate(zip(cell["text"], answers, answer_ids)):
        first = cell["first_step"][i]
        score = {"match": sum(a in text for a in wanted) / len(wanted),
                 "first_lp": first.get(str(ids[0]), min(first.values())) if first else float("nan")}
        if dense_cell is not None and first and dense_cell["first_step"][i]:
            score["kl"] = _kl(dense_cell["first_step"][i], first)
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
    """Means (with 95 % half-widths) of each score, and paired differences against dense when given."""
    out: dict[str, Any] = {"n": len(scores)}
    for key in ("match", "first_lp", "answer_ll", "forced_exact", "kl"):
        if not scores or key not in scores[0]:
            continue
        out[key], out[key + "_ci"] = mean_ci([s[key] for s in scores])
        if dense_scores is not None and key != "kl":
            out["d_" + key], out["d_" + key + "_ci"] = mean_ci([s[key] - d[key] for s, d in zip(scores, dense_scores)])
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
