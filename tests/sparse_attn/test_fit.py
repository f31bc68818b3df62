"""sparse_attn.calibration.fit (+ plot): pooling per candidate, the anchored fit, its expected error.

References are analytic curves, independent of the fit: a sample whose sparsity is
``S(c) = clip((ln c - m) / B)`` has counts ``round(S * tiles)``; the pooled curve of
several such samples is solved for the target by bisection on the analytic
expressions (not through the code's interpolation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest

from sparse_attn.calibration.fit import CalibrationError, FitPoint, SampleCounts, fit_counts, fit_phase, pool
from sparse_attn.kernels import effective_lambda

A_TRUE, B_TRUE = 3.0, 9.0
#: geometric candidate grid like runner.candidate_scales: 0.01 .. ~1900, 24 candidates
SCALES = [math.exp(math.log(0.01) + i * (math.log(1900.0) - math.log(0.01)) / 23) for i in range(24)]


def _exact_points(sparsities, a=A_TRUE, b=B_TRUE):
    return [FitPoint(scale=a * math.exp(b * s), sparsity=s) for s in sparsities]


def _linear_sparsity(c, offset, slope):
    """Analytic sample: sparsity linear in ln c, clipped to [0, 1]."""
    return min(max((math.log(c) - offset) / slope, 0.0), 1.0)


def _logistic_sparsity(c, offset, width):
    """Analytic sample with an S-shaped response (not the exponential model)."""
    return 1.0 / (1.0 + math.exp(-(math.log(c) - offset) / width))


def _sample(fn, tiles, *args, scales=SCALES):
    skipped = tuple(int(round(fn(c, *args) * tiles)) for c in scales)
    return SampleCounts(skipped=skipped, visited=(tiles,) * len(scales))


def _bisect(f, lo, hi, target):
    """ln c where the increasing f(ln c) crosses target."""
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


# ---------------------------------------------------------------- counts ---- #
def test_pool_sums_before_the_ratio():
    # Two samples at one candidate: 90/100 and 0/900 -> 9 %, not the 45 % mean of ratios.
    pts = pool([1.0, 2.0], [SampleCounts((90, 0), (100, 0)), SampleCounts((0, 0), (900, 0))])
    assert pts == [FitPoint(scale=1.0, sparsity=pytest.approx(0.09), tiles=1000)]  # candidate 2.0 has no data: left out


@pytest.mark.parametrize(
    "skipped,visited,match",
    [((0.5,), (1,), "non-negative integers"), ((5,), (3,), "skipped=5 > visited=3"), ((1, 2), (3,), "1 visited"),
     ((-1,), (3,), "non-negative"), ((True,), (3,), "non-negative integers")],
    ids=["float_ratio", "skipped_gt_visited", "length_mismatch", "negative", "bool"],
)
def test_sample_counts_rejects(skipped, visited, match):
    with pytest.raises(CalibrationError, match=match):
        SampleCounts(skipped, visited)


def test_sample_sparsity_interpolates_in_log_scale():
    s = SampleCounts((10, 30, 0), (100, 100, 0))
    assert s.sparsity_at([1.0, 4.0, 16.0], 2.0) == pytest.approx(0.2)  # halfway in ln c
    assert s.sparsity_at([1.0, 4.0, 16.0], 4.0) == pytest.approx(0.3)
    assert s.sparsity_at([1.0, 4.0, 16.0], 1000.0) is None  # far beyond the last candidate with data


# ------------------------------------------------------------------- fit ---- #
def test_fit_recovers_exact_curve_and_ignores_saturated_points():
    pts = _exact_points([0.1 + 0.08 * i for i in range(11)])
    # saturated points far off the curve: they would ruin the fit if used
    pts += [FitPoint(scale=1e-4, sparsity=0.0), FitPoint(scale=1e-3, sparsity=0.02), FitPoint(scale=1e9, sparsity=0.99)]
    fit = fit_phase(pts, 0.5, phase="prefill", reference_kv_len=4096)
    assert fit.a == pytest.approx(A_TRUE, rel=1e-9) and fit.b == pytest.approx(B_TRUE, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.points_used == 11 and fit.points_total == 14
    assert fit.observed_sparsity_range == (pytest.approx(0.0), pytest.approx(0.99))
    assert fit.scale_at_target == pytest.approx(A_TRUE * math.exp(B_TRUE * 0.5), rel=1e-9)
    assert fit.lambda_at_reference == pytest.approx(fit.scale_at_target / 4096)
    assert fit.threshold(4096) == pytest.approx(fit.lambda_at_reference)
    assert fit.threshold(16) == 0.0 == effective_lambda(fit.scale_at_target, 16)   # >= 1: serving runs it dense
    window_fit = dataclasses.replace(fit, normaliser="min(kv_len, w)")
    assert window_fit.threshold(4096, window=512) == pytest.approx(fit.scale_at_target / 512)
    with pytest.raises(ValueError, match="pass window"):
        window_fit.threshold(4096)
    assert fit.warning is None and "prefill" in fit.summary()


@pytest.mark.parametrize("target", [0.2, 0.5, 0.8], ids=["t20", "t50", "t80"])
def test_anchored_fit_hits_the_target_of_a_curved_response(target):
    # An S-shaped response: a global exponential fit cannot match it everywhere, the
    # anchored one must still put the target scale where the true curve crosses the target.
    sample = _sample(_logistic_sparsity, 10**6, 1.0, 2.0)
    fit = fit_counts(SCALES, [sample], target, phase="decode")
    truth = 1.0 + 2.0 * math.log(target / (1 - target))  # ln c of the analytic crossing
    assert _logistic_sparsity(fit.scale_at_target, 1.0, 2.0) == pytest.approx(target, abs=0.01)
    assert math.log(fit.scale_at_target) == pytest.approx(truth, abs=0.05)
    assert fit.scale(target) == pytest.approx(fit.scale_at_target)


def test_pooled_target_of_heterogeneous_samples():
    """Samples as the demo's decode counts behave: offsets differ by sample and long samples
    carry more tiles. The fit must land where the tile-weighted pooled curve crosses the target."""
    shapes = [(-4.0, 8.0, 4000), (-1.0, 8.0, 4000), (-3.0, 6.0, 1000), (0.5, 9.0, 1000), (-2.0, 7.0, 2000)]
    samples = [_sample(_linear_sparsity, tiles, off, slope) for off, slope, tiles in shapes]
    fit = fit_counts(SCALES, samples, 0.5, phase="decode")
    total = sum(t for *_, t in shapes)

    def pooled(ln_c):
        return sum(t * _linear_sparsity(math.exp(ln_c), off, slope) for off, slope, t in shapes) / total

    truth = _bisect(pooled, math.log(SCALES[0]), math.log(SCALES[-1]), 0.5)
    assert pooled(math.log(fit.scale_at_target)) == pytest.approx(0.5, abs=0.005)
    assert math.log(fit.scale_at_target) == pytest.approx(truth, abs=0.05)
    # The per-(sample, candidate) fit of ln(scale) on sparsity that this replaced lands elsewhere:
    pts = [(c, s / v) for smp in samples for c, s, v in zip(SCALES, smp.skipped, smp.visited) if 0.1 <= s / v <= 0.9]
    xs, ys = [p[1] for p in pts], [math.log(p[0]) for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    old_ln_c = my + slope * (0.5 - mx)
    assert abs(pooled(old_ln_c) - 0.5) > 0.03


def test_leave_one_out_error_matches_the_analytic_miss():
    # Equal-tile samples linear in ln c with offsets d_i and one slope B: without sample i the
    # fit puts ln c* = 0.5 B + mean_{k != i} d_k, where sample i has 0.5 + (mean_{k != i} d_k - d_i) / B.
    offsets, slope, tiles = [-3.0, -2.0, -1.5, 0.0], 8.0, 10**6
    samples = [_sample(_linear_sparsity, tiles, d, slope) for d in offsets]
    fit = fit_counts(SCALES, samples, 0.5, phase="decode")
    misses = []
    for i, d in enumerate(offsets):
        rest = [o for k, o in enumerate(offsets) if k != i]
        misses.append((sum(rest) / len(rest) - d) / slope)
    assert fit.samples == 4
    assert fit.heldout_error == pytest.approx(sum(misses) / 4, abs=1e-3)
    assert fit.heldout_rms == pytest.approx(math.sqrt(sum(m * m for m in misses) / 4), abs=1e-3)
    assert fit.heldout_max == pytest.approx(max(abs(m) for m in misses), abs=1e-3)
    assert fit.heldout_rms > 0.05  # these samples really disagree
    assert "leave one of 4 samples out" in fit.summary()
    report = json.loads(json.dumps(fit.to_report()))
    assert report["heldout_rms"] == pytest.approx(fit.heldout_rms) and report["samples"] == 4


def test_identical_samples_have_no_expected_error():
    samples = [_sample(_linear_sparsity, 5000, -2.0, 8.0)] * 3
    fit = fit_counts(SCALES, samples, 0.4, phase="prefill")
    assert fit.heldout_rms == pytest.approx(0.0, abs=1e-9) and fit.heldout_max == pytest.approx(0.0, abs=1e-9)


def test_one_sample_has_no_expected_error():
    fit = fit_counts(SCALES, [_sample(_linear_sparsity, 5000, -2.0, 8.0)], 0.5)
    assert fit.samples == 1 and fit.heldout_rms is None and "leave one" not in fit.summary()


def test_diffuse_attention_is_said_in_plain_words():
    # A model whose attention is spread out: even the largest scale skips 4 % of the tiles.
    samples = [_sample(lambda c: 0.04 * c / SCALES[-1], 5000)]
    with pytest.raises(CalibrationError) as info:
        fit_counts(SCALES, samples, 0.5, phase="decode")
    msg = str(info.value)
    assert "diffuse" in msg and "4.0%" in msg and "--calib_max_seqlen" in msg and "inconsistent" not in msg


def test_too_coarse_grid_is_a_clear_error():
    pts = _exact_points([0.05, 0.5, 0.95, 0.97])
    with pytest.raises(CalibrationError) as info:
        fit_phase(pts, 0.5, phase="decode")
    msg = str(info.value)
    assert "decode" in msg and "only 1 of 4" in msg and "--num_candidates" in msg


def test_no_points_at_all():
    with pytest.raises(CalibrationError, match="no points at all"):
        fit_phase([], 0.5)


def test_sparsity_that_falls_with_the_threshold_is_rejected():
    with pytest.raises(CalibrationError, match="does not grow with the threshold"):
        fit_phase(_exact_points([0.2, 0.4, 0.6], b=-2.0), 0.5)


def test_target_outside_observed_range_warns():
    fit = fit_phase(_exact_points([0.2, 0.3, 0.4]), 0.8)
    assert fit.warning and "outside the observed range" in fit.warning and "80.0%" in fit.warning
    assert fit.scale_at_target == pytest.approx(A_TRUE * math.exp(B_TRUE * 0.8), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"target_sparsity": 1.0}, "target sparsity"), ({"target_sparsity": 0.5, "min_points": 1}, "min_points"),
     ({"target_sparsity": 0.5, "sparsity_range": (0.9, 0.1)}, "sparsity_range"),
     ({"target_sparsity": 0.5, "bandwidth": 0.0}, "bandwidth")],
    ids=["target_one", "min_points_one", "inverted_range", "zero_bandwidth"],
)
def test_fit_rejects_bad_arguments(kwargs, match):
    with pytest.raises(CalibrationError, match=match):
        fit_phase(_exact_points([0.2, 0.4, 0.6]), **kwargs)


def test_fit_rejects_nonpositive_scale():
    with pytest.raises(CalibrationError, match="scales must be finite and > 0"):
        fit_phase([(0.0, 0.2), (1.0, 0.4), (2.0, 0.6)], 0.5)


def test_fit_counts_rejects_counts_of_another_grid():
    with pytest.raises(CalibrationError, match="expected one per candidate"):
        fit_counts(SCALES, [SampleCounts((1, 2), (4, 4))], 0.5)


# ---------------------------------------------------------------- plot ---- #
def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from sparse_attn.calibration.plot import plot_fits

    pts = _exact_points([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
    fit = fit_phase(pts, 0.5, phase="prefill")
    (out,) = plot_fits({"prefill": pts}, {"prefill": fit}, tmp_path / "plots")
    assert out == tmp_path / "plots" / "calibration_prefill.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    from sparse_attn.calibration import plot

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    fit = fit_phase(_exact_points([0.2, 0.4, 0.6]), 0.5)
    with pytest.raises(plot.PlotUnavailableError, match="pip install matplotlib"):
        plot.plot_fit([], fit, 0.5, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
