"""Fit the skip-softmax calibration curve ``scale = a * exp(b * sparsity)``.

Data flow
---------
Counting runs execute the calibration prompts once per candidate threshold
``lambda`` (see :func:`threshold_grid`) and record, for every measured
(sample, step) with its ``kv_len``, how many KV tiles were *visited* and how
many of those were *skipped*. Counts from every layer, head, worker and rank
are summed as integers first (:func:`merge_counts`), and only then turned into
a ratio, so large layers/ranks weigh in proportion to their work.

Each :class:`CountRecord` becomes one :class:`FitPoint`::

    scale    = lambda * kv_len         # the sequence-length-free threshold
    sparsity = skipped / visited

Points with sparsity outside ``[0.10, 0.90]`` (``sparsity_range``) are
dropped: at the extremes the curve saturates and the exponential model does
not hold. The remaining points are fitted, per phase:

``fit_logspace=True`` (default)
    Ordinary least squares of ``ln(scale) = ln(a) + b * sparsity``. Minimises
    *relative* error, so points whose scales span orders of magnitude count
    equally. ``r2`` is computed on ``ln(scale)``.
``fit_logspace=False``
    Least squares on ``scale`` itself (absolute error; ModelOpt's default),
    solved exactly in ``a`` for a given ``b`` and by a bracketed 1-D search in
    ``b`` started from the log-space solution. ``r2`` is computed on ``scale``.

At serve time ``lambda = a * exp(b * target) / kv_len``.

The candidate grid (:func:`threshold_grid`) spans ``1e-6 .. 0.9`` in
``lambda`` — geometric spacing by default (``logspace=True``) because the
sparsity response is roughly logarithmic in ``lambda``; linear spacing would
put almost every candidate in the saturated high-sparsity end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "DEFAULT_MIN_POINTS",
    "DEFAULT_SPARSITY_RANGE",
    "CalibrationError",
    "CountRecord",
    "FitPoint",
    "FitResult",
    "fit_phase",
    "merge_counts",
    "points_from_counts",
    "threshold_grid",
]

DEFAULT_SPARSITY_RANGE = (0.10, 0.90)
DEFAULT_MIN_POINTS = 3
DEFAULT_REFERENCE_KV_LEN = 8192


from .errors import CalibrationError  # noqa: E402  (defined in errors.py; re-exported here)


# --------------------------------------------------------------------------- #
# grid
# --------------------------------------------------------------------------- #
def threshold_grid(num: int = 20, *, low: float = 1e-6, high: float = 0.9, logspace: bool = True) -> list[float]:
    """``num`` candidate thresholds ``lambda`` from ``low`` to ``high`` inclusive, ascending.

    ``logspace=True`` spaces them geometrically (equal ratios), which covers the
    useful 10%..90% sparsity band evenly; ``logspace=False`` spaces them linearly.
    """
    if isinstance(num, bool) or not isinstance(num, int) or num < 2:
        raise CalibrationError(f"threshold grid needs num >= 2 candidates, got {num!r}")
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high):
        raise CalibrationError(f"threshold grid needs 0 < low < high (finite), got low={low!r}, high={high!r}")
    if logspace:
        lo, hi = math.log(low), math.log(high)
        grid = [math.exp(lo + (hi - lo) * i / (num - 1)) for i in range(num)]
    else:
        grid = [low + (high - low) * i / (num - 1) for i in range(num)]
    grid[0], grid[-1] = float(low), float(high)  # exact endpoints despite rounding
    return grid


# --------------------------------------------------------------------------- #
# counts
# --------------------------------------------------------------------------- #
def _as_count_pair(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, Mapping):
        try:
            pair = (value["skipped"], value["visited"])
        except KeyError as exc:
            raise CalibrationError(f"{where}: count dict lacks {exc.args[0]!r}; expected keys 'skipped' and 'visited'") from None
    elif hasattr(value, "tolist"):  # torch / numpy
        pair = tuple(value.tolist())
    else:
        pair = tuple(value)
    if len(pair) != 2:
        raise CalibrationError(f"{where}: expected a (skipped, visited) pair, got {value!r}")
    out = []
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CalibrationError(
                f"{where}: counts must be non-negative integers (sum raw tile counts, not ratios), got {v!r}"
            )
        out.append(v)
    skipped, visited = out
    if skipped > visited:
        raise CalibrationError(f"{where}: skipped={skipped} > visited={visited}; the counting kernel is miscounting")
    return skipped, visited


def _is_integer_tensor(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if hasattr(dtype, "is_floating_point"):  # torch.dtype
        return not dtype.is_floating_point and not getattr(dtype, "is_complex", False) and str(dtype) != "torch.bool"
    kind = getattr(dtype, "kind", None)  # numpy dtype
    return kind in ("i", "u")


def merge_counts(*parts: Any) -> Any:
    """Sum integer tile counts from several workers/ranks.

    Either every part is a mapping ``key -> (skipped, visited)`` (a pair,
    ``{"skipped": s, "visited": v}`` or a 2-element integer tensor) and the
    result is a dict of summed ``(skipped, visited)`` tuples over the union of
    keys; or every part is an integer tensor/array of the same shape and the
    result is their elementwise sum. Float counts are rejected: ratios must be
    formed only after summing.
    """
    if not parts:
        raise CalibrationError("merge_counts needs at least one part")
    if all(hasattr(p, "shape") and not isinstance(p, Mapping) for p in parts):
        first = parts[0]
        for i, p in enumerate(parts):
            if not _is_integer_tensor(p):
                raise CalibrationError(f"part {i}: count tensors must have an integer dtype, got {p.dtype}")
            if tuple(p.shape) != tuple(first.shape):
                raise CalibrationError(f"part {i}: shape {tuple(p.shape)} differs from part 0 shape {tuple(first.shape)}")
        total = first.clone() if hasattr(first, "clone") else first.copy()
        for p in parts[1:]:
            total = total + p
        return total
    merged: dict[Any, tuple[int, int]] = {}
    for i, part in enumerate(parts):
        if not isinstance(part, Mapping):
            raise CalibrationError(f"part {i}: expected a mapping key -> (skipped, visited) or an integer tensor, got {type(part).__name__}")
        for key, value in part.items():
            s, v = _as_count_pair(value, f"part {i}, key {key!r}")
            ps, pv = merged.get(key, (0, 0))
            merged[key] = (ps + s, pv + v)
    return merged


@dataclass(frozen=True)
class CountRecord:
    """Summed tile counts for one (candidate threshold, sample, step)."""

    threshold: float
    kv_len: int
    skipped: int
    visited: int


@dataclass(frozen=True)
class FitPoint:
    scale: float  # threshold * kv_len
    sparsity: float  # skipped / visited
    threshold: float | None = None
    kv_len: int | None = None


def points_from_counts(records: Iterable[CountRecord | Mapping[str, Any] | Sequence[Any]]) -> list[FitPoint]:
    """Turn count records into fit points; records with ``visited == 0`` are skipped.

    A record is a :class:`CountRecord`, a mapping with keys ``threshold``,
    ``kv_len``, ``skipped``, ``visited``, or a 4-tuple in that order.
    """
    points = []
    for i, rec in enumerate(records):
        if isinstance(rec, CountRecord):
            t, kv, s, v = rec.threshold, rec.kv_len, rec.skipped, rec.visited
        elif isinstance(rec, Mapping):
            try:
                t, kv, s, v = rec["threshold"], rec["kv_len"], rec["skipped"], rec["visited"]
            except KeyError as exc:
                raise CalibrationError(f"record {i}: missing key {exc.args[0]!r} (need threshold, kv_len, skipped, visited)") from None
        else:
            t, kv, s, v = rec
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise CalibrationError(f"record {i}: threshold must be a finite number > 0, got {t!r}")
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0:
            raise CalibrationError(f"record {i}: kv_len must be a positive integer, got {kv!r}")
        s, v = _as_count_pair((s, v), f"record {i}")
        if v == 0:
            continue
        points.append(FitPoint(scale=float(t) * kv, sparsity=s / v, threshold=float(t), kv_len=kv))
    return points


# --------------------------------------------------------------------------- #
# fit
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class FitResult:
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
    fit_logspace: bool
    warning: str | None = None

    def scale(self, sparsity: float) -> float:
        return self.a * math.exp(self.b * sparsity)

    def threshold(self, kv_len: int, sparsity: float | None = None) -> float:
        return self.scale(self.target_sparsity if sparsity is None else sparsity) / kv_len

    def summary(self) -> str:
        lo, hi = self.observed_sparsity_range
        text = (
            f"{self.phase}: scale = {self.a:.6g} * exp({self.b:.6g} * s), R^2={self.r2:.4f} "
            f"({'log' if self.fit_logspace else 'linear'} space), {self.points_used}/{self.points_total} points, "
            f"observed sparsity {lo:.1%}..{hi:.1%}; target {self.target_sparsity:.1%} -> scale {self.scale_at_target:.6g}, "
            f"lambda {self.lambda_at_reference:.3g} at kv_len {self.reference_kv_len}"
        )
        return text + (f" WARNING: {self.warning}" if self.warning else "")


def _loglinear(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """OLS of ln(y) on x; returns (a, b)."""
    n = len(xs)
    ly = [math.log(y) for y in ys]
    mx, my = sum(xs) / n, sum(ly) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ly))
    b = sxy / sxx
    return math.exp(my - b * mx), b


def _best_a(xs: Sequence[float], ys: Sequence[float], b: float) -> float:
    e = [math.exp(b * x) for x in xs]
    return sum(y * ei for y, ei in zip(ys, e)) / sum(ei * ei for ei in e)


def _sse_linear(xs: Sequence[float], ys: Sequence[float], b: float) -> float:
    a = _best_a(xs, ys, b)
    return sum((y - a * math.exp(b * x)) ** 2 for x, y in zip(xs, ys))


def _linear_space_fit(xs: Sequence[float], ys: Sequence[float], b0: float) -> tuple[float, float]:
    """Minimise sum (y - a e^{bx})^2: a in closed form, b by golden-section search around b0."""
    span = max(abs(b0), 1.0)
    lo, hi = b0 - 2 * span, b0 + 2 * span
    # widen until the minimum is bracketed inside (lo, hi)
    for _ in range(20):
        f_lo, f_mid, f_hi = _sse_linear(xs, ys, lo), _sse_linear(xs, ys, (lo + hi) / 2), _sse_linear(xs, ys, hi)
        if f_mid <= f_lo and f_mid <= f_hi:
            break
        if f_lo < f_hi:
            lo -= hi - lo
        else:
            hi += hi - lo
    g = (math.sqrt(5) - 1) / 2
    c, d = hi - g * (hi - lo), lo + g * (hi - lo)
    fc, fd = _sse_linear(xs, ys, c), _sse_linear(xs, ys, d)
    for _ in range(200):
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - g * (hi - lo)
            fc = _sse_linear(xs, ys, c)
        else:
            lo, c, fc = c, d, fd
            d = lo + g * (hi - lo)
            fd = _sse_linear(xs, ys, d)
        if hi - lo < 1e-12 * max(1.0, abs(hi)):
            break
    b = (lo + hi) / 2
    return _best_a(xs, ys, b), b


def _r2(observed: Sequence[float], predicted: Sequence[float]) -> float:
    mean = sum(observed) / len(observed)
    ss_tot = sum((o - mean) ** 2 for o in observed)
    ss_res = sum((o - p) ** 2 for o, p in zip(observed, predicted))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0


def fit_phase(
    points: Iterable[FitPoint | tuple[float, float]],
    target_sparsity: float,
    *,
    phase: str = "prefill",
    fit_logspace: bool = True,
    sparsity_range: tuple[float, float] = DEFAULT_SPARSITY_RANGE,
    min_points: int = DEFAULT_MIN_POINTS,
    reference_kv_len: int = DEFAULT_REFERENCE_KV_LEN,
) -> FitResult:
    """Fit ``scale = a * exp(b * sparsity)`` to one phase's points.

    ``points`` are :class:`FitPoint` or ``(scale, sparsity)`` pairs. Raises
    :class:`CalibrationError` when fewer than ``min_points`` points fall in
    ``sparsity_range`` (inclusive), when they do not vary in sparsity, or when
    the fit is not increasing (``b <= 0``). ``FitResult.warning`` is set when
    ``target_sparsity`` lies outside the sparsity range actually observed.
    """
    if not (isinstance(target_sparsity, (int, float)) and not isinstance(target_sparsity, bool) and 0.0 <= target_sparsity < 1.0):
        raise CalibrationError(f"{phase}: target sparsity must be in [0, 1), got {target_sparsity!r}")
    lo_s, hi_s = sparsity_range
    if not 0.0 <= lo_s < hi_s <= 1.0:
        raise CalibrationError(f"{phase}: sparsity_range must satisfy 0 <= low < high <= 1, got {sparsity_range!r}")
    if isinstance(min_points, bool) or not isinstance(min_points, int) or min_points < 2:
        raise CalibrationError(f"{phase}: min_points must be an integer >= 2, got {min_points!r}")
    pts = [p if isinstance(p, FitPoint) else FitPoint(scale=float(p[0]), sparsity=float(p[1])) for p in points]
    total = len(pts)
    for p in pts:
        if not (math.isfinite(p.scale) and p.scale > 0 and math.isfinite(p.sparsity)):
            raise CalibrationError(f"{phase}: invalid point scale={p.scale!r}, sparsity={p.sparsity!r}; scales must be finite and > 0")
    used = [p for p in pts if lo_s <= p.sparsity <= hi_s]
    if len(used) < min_points:
        observed = (
            f"observed sparsities {min(p.sparsity for p in pts):.1%}..{max(p.sparsity for p in pts):.1%}" if pts else "no points at all"
        )
        raise CalibrationError(
            f"{phase}: only {len(used)} of {total} measured points have sparsity in "
            f"{lo_s:.0%}..{hi_s:.0%} ({observed}); at least {min_points} are needed. "
            f"Fix: widen the threshold grid (more candidates, lower/higher lambda), "
            f"use more or longer calibration samples, or for decode measure more decode tokens."
        )
    xs = [p.sparsity for p in used]
    ys = [p.scale for p in used]
    if max(xs) - min(xs) < 1e-9:
        raise CalibrationError(
            f"{phase}: all {len(used)} usable points have the same sparsity {xs[0]:.3f}; the slope cannot be fitted. "
            f"Fix: use a denser threshold grid so several thresholds land in {lo_s:.0%}..{hi_s:.0%}."
        )
    a, b = _loglinear(xs, ys)
    if not fit_logspace:
        a, b = _linear_space_fit(xs, ys, b)
    if not (math.isfinite(a) and math.isfinite(b) and a > 0):
        raise CalibrationError(f"{phase}: fit diverged (a={a!r}, b={b!r}). Fix: check the counting run; scales must grow with sparsity.")
    if b <= 0:
        raise CalibrationError(
            f"{phase}: fitted slope b={b:.4g} <= 0, i.e. sparsity does not grow with the threshold; "
            f"the counts are inconsistent. Fix: check that counts were summed per threshold, not mixed across thresholds."
        )
    if fit_logspace:
        r2 = _r2([math.log(y) for y in ys], [math.log(a) + b * x for x in xs])
    else:
        r2 = _r2(ys, [a * math.exp(b * x) for x in xs])
    obs = (min(xs), max(xs))
    warning = None
    if not obs[0] <= target_sparsity <= obs[1]:
        warning = (
            f"{phase}: target sparsity {target_sparsity:.1%} is outside the observed range "
            f"{obs[0]:.1%}..{obs[1]:.1%}; the curve is extrapolated there. Widen the threshold grid "
            f"or pick a target inside the observed range."
        )
    scale_t = a * math.exp(b * target_sparsity)
    return FitResult(
        phase=phase,
        a=a,
        b=b,
        r2=r2,
        points_used=len(used),
        points_total=total,
        observed_sparsity_range=obs,
        target_sparsity=float(target_sparsity),
        scale_at_target=scale_t,
        reference_kv_len=reference_kv_len,
        lambda_at_reference=scale_t / reference_kv_len,
        fit_logspace=fit_logspace,
        warning=warning,
    )
