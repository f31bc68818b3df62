"""Fit the skip-softmax calibration curve ``scale = a * exp(b * sparsity)`` per phase.

What runs (``sparse-attn calibrate``)
-------------------------------------
The counting run (:func:`sparse_attn.calibration.runner.measure`) executes each
calibration sample once, with every launch counting, for each candidate scale
factor ``c`` (``lambda = c / kv_len`` of that launch, exactly as serving computes
it), how many KV tiles were *visited* and how many of those would be *skipped*.
Integer counts of all layers, heads, decode steps, workers and tensor-parallel
ranks are summed per (sample, phase, candidate): one :class:`SampleCounts` per
sample and phase.

:func:`fit_counts` then

1. **pools** the samples per candidate: ``S(c) = sum skipped / sum visited``
   over all samples (:func:`pool`). This is the ratio serving reports for the
   same prompts at that scale: long samples weigh by their tiles, and a launch
   where ``c / kv_len >= 1`` (serving runs it dense, and the kernels count no
   visited tile of a sequence whose lambda is 0, in a batch too) counts nothing
   here either;
2. fits **where the target lies** (:func:`fit_phase`): ``scale_at_target`` is
   where the pooled curve, interpolated linearly in ``ln c`` between the two
   candidates that bracket the target, crosses it; the slope ``b`` comes from a
   weighted least-squares fit of ``S`` on ``ln c`` (the candidate grid is exact,
   the measured sparsity is the noisy variable) over the pooled points in
   ``sparsity_range``, weighted by visited tiles and by a Gaussian kernel of
   width ``bandwidth`` around the target; ``a = scale_at_target / exp(b * target)``
   so the exported curve passes through the target point;
3. estimates the **expected error** by leave-one-sample-out: each sample in turn
   is held out, the fit is redone on the others, and the held-out sample's own
   sparsity at that fit's scale is compared with the target (in sparsity points).

Why not one point per (sample, candidate), fitted as ``ln(scale)`` on
``sparsity`` (the earlier fit): samples differ in how sparse they are at the same
scale, so per-sample points scatter along the sparsity axis; regressing the exact
grid variable on that noisy one flattens the slope (regression dilution) and
pivots the line about the centre of the points, not about the target. On the
demo's recorded prefill counts that fit put the 50 % target at scale 4.90 (52.8 %
on the held-out prompts, replayed), the pooled anchored fit at 3.78 (50.4 %).
Scatter between prompts itself is not removed by any fit: the demo's decode
sparsity at one scale ranges 28 %..83 % by prompt (its old R^2 of 0.47), which is
what the leave-one-out error reports.

At serve time ``lambda = a * exp(b * target) / kv_len`` per sequence and launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from .errors import CalibrationError

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_MIN_POINTS",
    "DEFAULT_SPARSITY_RANGE",
    "CalibrationError",
    "FitPoint",
    "FitResult",
    "SampleCounts",
    "fit_counts",
    "fit_phase",
    "pool",
]

DEFAULT_SPARSITY_RANGE = (0.10, 0.90)
DEFAULT_MIN_POINTS = 3
#: width (in sparsity) of the Gaussian weight around the target in the slope fit
DEFAULT_BANDWIDTH = 0.15
DEFAULT_REFERENCE_KV_LEN = 8192


# --------------------------------------------------------------------------- #
# counts
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class SampleCounts:
    """Integer tile counts of one calibration sample in one phase, one entry per candidate scale.

    ``skipped[j]`` / ``visited[j]``: tiles summed over layers, heads, steps and
    ranks at candidate ``j``; ``visited[j] == 0`` where every launch of the sample
    had ``c_j / kv_len >= 1`` (no data there). ``kv_len``: prompt tokens.
    """

    skipped: tuple[int, ...]
    visited: tuple[int, ...]
    kv_len: int = 0
    task: str | None = field(default=None, compare=False)  # the prompt kind, for the per-task spread in the report

    def __post_init__(self) -> None:
        if len(self.skipped) != len(self.visited):
            raise CalibrationError(f"sample counts: {len(self.skipped)} skipped entries but {len(self.visited)} visited entries")
        for s, v in zip(self.skipped, self.visited):
            if isinstance(s, bool) or isinstance(v, bool) or not isinstance(s, int) or not isinstance(v, int) or s < 0 or v < 0:
                raise CalibrationError(f"sample counts must be non-negative integers (raw tile counts, not ratios), got {s!r}/{v!r}")
            if s > v:
                raise CalibrationError(f"sample counts: skipped={s} > visited={v}; the counting kernel is miscounting")

    def sparsity_at(self, scales: Sequence[float], scale: float) -> float | None:
        """This sample's sparsity at ``scale``, interpolated linearly in ``ln scale`` between
        the candidates around it; ``None`` where the sample has no data there."""
        pts = [(math.log(c), s / v) for c, s, v in zip(scales, self.skipped, self.visited) if v]
        return _interpolate(pts, math.log(scale))


@dataclass(frozen=True)
class FitPoint:
    """One point of a phase's curve: at scale factor ``scale``, ``sparsity`` of ``tiles`` visited tiles."""

    scale: float  # c = lambda * kv_len
    sparsity: float  # skipped / visited
    tiles: int = 1  # visited tiles behind the ratio: the point's weight


def pool(scales: Sequence[float], samples: Iterable[SampleCounts]) -> list[FitPoint]:
    """Per candidate scale, sum skipped and visited over ``samples``, then take the ratio.

    Candidates that no sample has data for are left out; the result is ascending in scale.
    """
    samples = list(samples)
    points = []
    for j, c in enumerate(scales):
        skipped = sum(s.skipped[j] for s in samples)
        visited = sum(s.visited[j] for s in samples)
        if visited:
            points.append(FitPoint(scale=float(c), sparsity=skipped / visited, tiles=visited))
    return points


def _interpolate(pts: Sequence[tuple[float, float]], x: float) -> float | None:
    """y at x on the polyline through ``pts`` (ascending x); clamped to the end values
    within one grid step beyond the ends, ``None`` further out or without points."""
    if not pts:
        return None
    if x <= pts[0][0]:
        step = pts[1][0] - pts[0][0] if len(pts) > 1 else 0.0
        return pts[0][1] if pts[0][0] - x <= step else None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    step = pts[-1][0] - pts[-2][0] if len(pts) > 1 else 0.0
    return pts[-1][1] if x - pts[-1][0] <= step else None


# --------------------------------------------------------------------------- #
# fit
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class FitResult:
    """One phase's curve ``scale = a * exp(b * s)`` and how well it is known.

    ``r2``: of the pooled points in ``sparsity_range`` against the curve, in sparsity.
    ``heldout_error`` / ``heldout_rms`` / ``heldout_max`` (sparsity, fractions; ``None``
    with fewer than 2 samples): leave-one-sample-out, the tile-weighted held-out
    sparsity at the refitted scale minus the target (what a batch of new prompts
    would miss by), and the per-prompt RMS and worst miss.
    """

    phase: str
    a: float
    b: float
    r2: float
    points_used: int
    points_total: int
    observed_sparsity_range: tuple[float, float]
    target_sparsity: float
    scale_at_target: float
    reference_kv_len: int
    lambda_at_reference: float
    warning: str | None = None
    samples: int = 0
    heldout_error: float | None = None
    heldout_rms: float | None = None
    heldout_max: float | None = None
    #: what lambda divides the scale by: ``kv_len``, or ``min(kv_len, w)`` for the sliding-window curve
    normaliser: str = "kv_len"

    def scale(self, sparsity: float) -> float:
        return self.a * math.exp(self.b * sparsity)

    def threshold(self, kv_len: int, sparsity: float | None = None, *, window: int | None = None) -> float:
        """The lambda serving uses at ``kv_len`` tokens (``kernels.effective_lambda``: 0.0 where
        the scale over the normaliser is >= 1); a window curve (``normaliser`` ``min(kv_len, w)``)
        needs the layer's ``window``."""
        from sparse_attn.kernels import effective_lambda   # lazily: the kernels import torch

        if self.normaliser != "kv_len" and window is None:
            raise ValueError(f"{self.phase}: this curve's lambda is scale / {self.normaliser}; pass window=w")
        scale = self.scale(self.target_sparsity if sparsity is None else sparsity)
        return effective_lambda(scale, kv_len, window if self.normaliser != "kv_len" else None)

    def summary(self) -> str:
        lo, hi = self.observed_sparsity_range
        text = (
            f"{self.phase}: scale = {self.a:.6g} * exp({self.b:.6g} * s), R^2={self.r2:.4f}, "
            f"{self.points_used}/{self.points_total} candidates in the fit, pooled sparsity {lo:.1%}..{hi:.1%}; "
            f"target {self.target_sparsity:.1%} -> scale {self.scale_at_target:.6g}, "
            + (f"lambda {self.lambda_at_reference:.3g} at kv_len {self.reference_kv_len}" if self.normaliser == "kv_len"
               else f"lambda = scale / {self.normaliser}")
        )
        if self.heldout_error is not None:
            text += (f"; expected error (leave one of {self.samples} samples out): {100 * self.heldout_error:+.1f} points "
                     f"pooled, per prompt RMS {100 * self.heldout_rms:.1f}, worst {100 * self.heldout_max:.1f}")
        return text + (f" WARNING: {self.warning}" if self.warning else "")

    def to_report(self) -> dict[str, Any]:
        """The JSON-ready fields of the calibration report (sparsities as fractions)."""
        return {"a": self.a, "b": self.b, "r2": self.r2, "points_used": self.points_used, "points_total": self.points_total,
                "observed_sparsity_range": list(self.observed_sparsity_range), "target_sparsity": self.target_sparsity,
                "scale_at_target": self.scale_at_target, "samples": self.samples, "heldout_error": self.heldout_error,
                "heldout_rms": self.heldout_rms, "heldout_max": self.heldout_max, "warning": self.warning,
                "lambda": f"scale / {self.normaliser}"}


def _weighted_line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    """Weighted least squares ``y = alpha + beta * x``; returns (alpha, beta)."""
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
    beta = sxy / sxx if sxx > 0 else 0.0
    return my - beta * mx, beta


def _r2(observed: Sequence[float], predicted: Sequence[float]) -> float:
    mean = sum(observed) / len(observed)
    ss_tot = sum((o - mean) ** 2 for o in observed)
    ss_res = sum((o - p) ** 2 for o, p in zip(observed, predicted))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0


def _check_arguments(phase: str, target_sparsity: float, sparsity_range: tuple[float, float], min_points: int, bandwidth: float) -> None:
    if not (isinstance(target_sparsity, (int, float)) and not isinstance(target_sparsity, bool) and 0.0 <= target_sparsity < 1.0):
        raise CalibrationError(f"{phase}: target sparsity must be in [0, 1), got {target_sparsity!r}")
    lo_s, hi_s = sparsity_range
    if not 0.0 <= lo_s < hi_s <= 1.0:
        raise CalibrationError(f"{phase}: sparsity_range must satisfy 0 <= low < high <= 1, got {sparsity_range!r}")
    if isinstance(min_points, bool) or not isinstance(min_points, int) or min_points < 2:
        raise CalibrationError(f"{phase}: min_points must be an integer >= 2, got {min_points!r}")
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise CalibrationError(f"{phase}: bandwidth must be a finite number > 0, got {bandwidth!r}")


def fit_phase(
    points: Iterable[FitPoint | tuple[float, float]],
    target_sparsity: float,
    *,
    phase: str = "prefill",
    sparsity_range: tuple[float, float] = DEFAULT_SPARSITY_RANGE,
    min_points: int = DEFAULT_MIN_POINTS,
    bandwidth: float = DEFAULT_BANDWIDTH,
    reference_kv_len: int = DEFAULT_REFERENCE_KV_LEN,
) -> FitResult:
    """Fit ``scale = a * exp(b * sparsity)`` to one phase's pooled curve, anchored at the target.

    ``points``: :class:`FitPoint` (or ``(scale, sparsity)`` pairs, weight 1), one per
    candidate scale, as :func:`pool` returns them. Raises :class:`CalibrationError`
    when the attention is too diffuse to reach ``sparsity_range`` at any scale, when
    fewer than ``min_points`` points fall in ``sparsity_range`` (inclusive), or when
    sparsity does not grow with the scale. ``FitResult.warning`` is set when the
    target lies outside the observed sparsity (the curve is then extrapolated).
    """
    _check_arguments(phase, target_sparsity, sparsity_range, min_points, bandwidth)
    lo_s, hi_s = sparsity_range
    pts = sorted((p if isinstance(p, FitPoint) else FitPoint(scale=float(p[0]), sparsity=float(p[1])) for p in points),
                 key=lambda p: p.scale)
    for p in pts:
        if not (math.isfinite(p.scale) and p.scale > 0 and math.isfinite(p.sparsity) and 0.0 <= p.sparsity <= 1.0 and p.tiles > 0):
            raise CalibrationError(f"{phase}: invalid point scale={p.scale!r}, sparsity={p.sparsity!r}, tiles={p.tiles!r}; "
                                   f"scales must be finite and > 0, sparsity in [0, 1], tiles > 0")
    total = len(pts)
    if not pts:
        raise CalibrationError(f"{phase}: no points at all (no launch of this phase was counted). "
                               f"Fix: check that the calibration prompts ran (for decode, --decode_tokens >= 1).")
    top = max(pts, key=lambda p: p.sparsity)
    if top.sparsity < lo_s:
        raise CalibrationError(
            f"{phase}: attention in this model is diffuse on these prompts: even the largest candidate scale "
            f"({top.scale:.4g}, i.e. lambda = {top.scale:.4g} / kv_len) skips only {top.sparsity:.1%} of the KV tiles, "
            f"below the {lo_s:.0%} needed to fit a curve, so a {target_sparsity:.0%} target cannot be calibrated. "
            f"Fix: calibrate with longer prompts (--calib_max_seqlen; sparsity grows with context length) or with prompts "
            f"like your traffic (--calib_data_dir / --prompts_file); if the model stays this dense, skip-softmax will not "
            f"save work on it: serve it without the sparse_attention_config section (or SPARSE_ATTN_DISABLE=1)."
        )
    used = [p for p in pts if lo_s <= p.sparsity <= hi_s]
    observed = (min(p.sparsity for p in pts), max(p.sparsity for p in pts))
    if len(used) < min_points:
        raise CalibrationError(
            f"{phase}: only {len(used)} of {total} candidate scales give a pooled sparsity in {lo_s:.0%}..{hi_s:.0%} "
            f"(observed {observed[0]:.1%}..{observed[1]:.1%}); at least {min_points} are needed. "
            f"Fix: raise --num_candidates for a denser grid, or use more or longer calibration samples "
            f"(--calib_samples, --calib_max_seqlen; for decode, --decode_tokens)."
        )
    xs = [math.log(p.scale) for p in used]
    ys = [p.sparsity for p in used]
    ws = [p.tiles * math.exp(-0.5 * ((p.sparsity - target_sparsity) / bandwidth) ** 2) for p in used]
    if max(ws) <= 0:  # target far outside the band: every kernel weight underflowed
        ws = [float(p.tiles) for p in used]
    _, beta = _weighted_line(xs, ys, ws)
    if not beta > 0:
        raise CalibrationError(
            f"{phase}: the pooled sparsity does not grow with the threshold (slope {beta:.3g} per e-fold of scale over "
            f"{len(used)} candidates, observed {observed[0]:.1%}..{observed[1]:.1%}): attention on these prompts barely "
            f"reacts to the skip threshold. Fix: calibrate with longer prompts (--calib_max_seqlen) or more samples "
            f"(--calib_samples), or prompts like your traffic (--calib_data_dir / --prompts_file)."
        )
    b = 1.0 / beta  # d ln(scale) / d sparsity
    # Anchor: where the pooled curve crosses the target (between the bracketing candidates);
    # outside the observed range, extrapolate along the fitted slope from the nearest end.
    curve = [(math.log(p.scale), p.sparsity) for p in pts]
    warning = None
    ln_c = None
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if y0 <= target_sparsity <= y1 and y1 > y0:
            ln_c = x0 + (x1 - x0) * (target_sparsity - y0) / (y1 - y0)
            break
    if ln_c is None:
        end = min(used, key=lambda p: abs(p.sparsity - target_sparsity))
        ln_c = math.log(end.scale) + b * (target_sparsity - end.sparsity)
        warning = (f"{phase}: target sparsity {target_sparsity:.1%} is outside the observed range "
                   f"{observed[0]:.1%}..{observed[1]:.1%}; the curve is extrapolated there. Pick a target inside the "
                   f"observed range, or use longer prompts (--calib_max_seqlen) to reach higher sparsity.")
    scale_t = math.exp(ln_c)
    a = scale_t / math.exp(b * target_sparsity)
    if not (math.isfinite(a) and a > 0 and math.isfinite(b)):
        raise CalibrationError(f"{phase}: fit diverged (a={a!r}, b={b!r}). Fix: check the counting run; scales must grow with sparsity.")
    predicted = [target_sparsity + (x - ln_c) / b for x in xs]
    return FitResult(
        phase=phase,
        a=a,
        b=b,
        r2=_r2(ys, predicted),
        points_used=len(used),
        points_total=total,
        observed_sparsity_range=observed,
        target_sparsity=float(target_sparsity),
        scale_at_target=scale_t,
        reference_kv_len=reference_kv_len,
        lambda_at_reference=scale_t / reference_kv_len,
        warning=warning,
    )


def fit_counts(
    scales: Sequence[float],
    samples: Sequence[SampleCounts],
    target_sparsity: float,
    *,
    phase: str = "prefill",
    **fit_kwargs: Any,
) -> FitResult:
    """Pool ``samples`` per candidate of ``scales``, fit (:func:`fit_phase`), and add the
    leave-one-sample-out expected error to the result."""
    for i, s in enumerate(samples):
        if len(s.visited) != len(scales):
            raise CalibrationError(f"{phase}: sample {i} has {len(s.visited)} counts, expected one per candidate ({len(scales)})")
    fit = fit_phase(pool(scales, samples), target_sparsity, phase=phase, **fit_kwargs)
    misses, weighted, tiles = [], 0.0, 0
    if len(samples) >= 2:
        for i, held in enumerate(samples):
            try:
                scale = fit_phase(pool(scales, samples[:i] + samples[i + 1:]), target_sparsity, phase=phase, **fit_kwargs).scale_at_target
            except CalibrationError:
                continue  # the other samples alone cannot be fitted: no estimate from this one
            achieved = held.sparsity_at(scales, scale)
            if achieved is None:
                continue  # too short for this scale: serving would run it dense
            weight = max(held.visited)
            misses.append(achieved - target_sparsity)
            weighted += weight * (achieved - target_sparsity)
            tiles += weight
    if not misses:
        return replace(fit, samples=len(samples))
    return replace(fit, samples=len(samples), heldout_error=weighted / tiles,
                    heldout_rms=math.sqrt(sum(m * m for m in misses) / len(misses)), heldout_max=max(abs(m) for m in misses))
