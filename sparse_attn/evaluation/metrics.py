"""Scores of one eval run, per configuration and (task, length) cell, each sparse one against dense.

Per sample (inputs from :mod:`sparse_attn.evaluation.engine`):

* ``match``: fraction of the sample's answers found in the generated text (RULER's
  ``string_match_all``; 0 or 1 for one answer);
* ``answer_ll``: mean log-likelihood per answer token, teacher-forced (nats/token; closer to 0 is
  better); a low-variance measure: it moves with every change in the answer's probability, where
  ``match`` moves only when a token flips;
* ``forced_exact``: every answer token is the model's argmax given the true tokens before it;
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


def sample_scores(cell: dict[str, Any], answers: Sequence[Sequence[str]]) -> list[dict[str, float]]:
    """Per-sample scores of one engine cell; ``answers[i]``: the answers of sample ``i``."""
    out = []
    for text, logprobs, wanted in zip(cell["text"], cell["answer_logprobs"], answers):
        lps = [lp for lp, _rank in logprobs]
        out.append({
            "match": sum(a in text for a in wanted) / len(wanted),
            "answer_ll": sum(lps) / len(lps),
            "forced_exact": float(all(rank == 1 for _lp, rank in logprobs)),
        })
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
    for key in ("match", "answer_ll", "forced_exact"):
        out[key], out[key + "_ci"] = mean_ci([s[key] for s in scores])
        if dense_scores is not None:
            out["d_" + key], out["d_" + key + "_ci"] = mean_ci([s[key] - d[key] for s, d in zip(scores, dense_scores)])
    return out


def add_counts(a: dict[str, dict[str, int]] | None, b: dict[str, dict[str, int]] | None) -> dict[str, dict[str, int]] | None:
    if a is None:
        return None if b is None else {p: dict(c) for p, c in b.items()}
    if b is None:
        return a
    return {p: {k: a[p][k] + b[p][k] for k in a[p]} for p in a}
