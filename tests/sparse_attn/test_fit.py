"""sparse_attn.calibration.fit (+ plot): grid, count merging, the exponential fit."""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from sparse_attn.calibration.fit import (
    CalibrationError,
    CountRecord,
    FitPoint,
    fit_phase,
    merge_counts,
    points_from_counts,
    threshold_grid,
)

A_TRUE, B_TRUE = 3.0, 9.0


def _exact_points(sparsities, a=A_TRUE, b=B_TRUE):
    return [FitPoint(scale=a * math.exp(b * s), sparsity=s) for s in sparsities]


# ---------------------------------------------------------------- grid ---- #
def test_log_grid_spans_range_geometrically():
    grid = threshold_grid(20)
    assert len(grid) == 20 and grid[0] == 1e-6 and grid[-1] == 0.9
    ratios = [b / a for a, b in zip(grid, grid[1:])]
    assert all(r == pytest.approx(ratios[0]) for r in ratios) and ratios[0] > 1


def test_linear_grid():
    grid = threshold_grid(5, low=0.1, high=0.5, logspace=False)
    assert grid == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


@pytest.mark.parametrize("kwargs", [{"num": 1}, {"low": 0.0}, {"low": 0.5, "high": 0.1}, {"high": float("inf")}],
                         ids=["one_point", "zero_low", "inverted", "infinite"])
def test_grid_rejects(kwargs):
    with pytest.raises(CalibrationError):
        threshold_grid(**kwargs)


# -------------------------------------------------------------- counts ---- #
def test_merge_count_dicts_sums_over_union_of_keys():
    rank0 = {("prefill", 0.01, 0): (10, 100), ("prefill", 0.1, 0): {"skipped": 50, "visited": 100}}
    rank1 = {("prefill", 0.01, 0): torch.tensor([5, 60]), ("decode", 0.01, 0): [1, 2]}
    merged = merge_counts(rank0, rank1)
    assert merged == {("prefill", 0.01, 0): (15, 160), ("prefill", 0.1, 0): (50, 100), ("decode", 0.01, 0): (1, 2)}


def test_merge_count_tensors_elementwise():
    a = torch.tensor([[1, 10], [2, 20]], dtype=torch.int64)
    b = torch.tensor([[3, 30], [4, 40]], dtype=torch.int64)
    out = merge_counts(a, b)
    assert out.tolist() == [[4, 40], [6, 60]]
    assert a.tolist() == [[1, 10], [2, 20]]  # inputs untouched


@pytest.mark.parametrize(
    "parts,match",
    [
        (({"k": (0.5, 1.0)},), "non-negative integers"),
        (({"k": (5, 3)},), "skipped=5 > visited=3"),
        (({"k": (1, 2, 3)},), "pair"),
        (({"k": {"skipped": 1}},), "'visited'"),
        ((torch.tensor([0.5, 1.0]),), "integer dtype"),
        ((torch.tensor([1, 2]), torch.tensor([1, 2, 3])), "shape"),
        ((), "at least one"),
    ],
    ids=["float_ratios", "skipped_gt_visited", "triple", "missing_visited", "float_tensor", "shape_mismatch", "nothing"],
)
def test_merge_counts_rejects(parts, match):
    with pytest.raises(CalibrationError, match=match):
        merge_counts(*parts)


def test_ratio_is_formed_after_summing():
    # two ranks at the same (threshold, kv_len): 90/100 and 0/900 -> 9%, not the 45% mean of ratios
    merged = merge_counts({"k": (90, 100)}, {"k": (0, 900)})
    (pt,) = points_from_counts([CountRecord(0.01, 1000, *merged["k"])])
    assert pt.sparsity == pytest.approx(0.09)


def test_points_from_counts_forms_and_skips_empty():
    pts = points_from_counts(
        [
            CountRecord(threshold=0.001, kv_len=4096, skipped=25, visited=100),
            {"threshold": 0.01, "kv_len": 2048, "skipped": 0, "visited": 0},
            (0.1, 1024, 9, 10),
        ]
    )
    assert [(p.scale, p.sparsity) for p in pts] == [(pytest.approx(4.096), 0.25), (pytest.approx(102.4), 0.9)]


@pytest.mark.parametrize(
    "record,match",
    [((0.0, 10, 1, 2), "threshold"), ((0.1, 0, 1, 2), "kv_len"), ((0.1, 10, 3, 2), "skipped=3 > visited=2"), ({"threshold": 0.1}, "missing key")],
    ids=["zero_threshold", "zero_kv_len", "skipped_gt_visited", "missing_keys"],
)
def test_points_from_counts_rejects(record, match):
    with pytest.raises(CalibrationError, match=match):
        points_from_counts([record])


# ----------------------------------------------------------------- fit ---- #
@pytest.mark.parametrize("logspace", [True, False], ids=["logspace", "linear"])
def test_fit_recovers_exact_curve_and_ignores_saturated_points(logspace):
    pts = _exact_points([0.1 + 0.08 * i for i in range(11)])
    # saturated points far off the curve: they would ruin the fit if used
    pts += [FitPoint(scale=1e-4, sparsity=0.0), FitPoint(scale=1e-3, sparsity=0.02), FitPoint(scale=1e9, sparsity=0.99)]
    fit = fit_phase(pts, 0.5, phase="prefill", fit_logspace=logspace, reference_kv_len=4096)
    assert fit.a == pytest.approx(A_TRUE, rel=1e-6) and fit.b == pytest.approx(B_TRUE, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.points_used == 11 and fit.points_total == 14
    assert fit.observed_sparsity_range == (pytest.approx(0.1), pytest.approx(0.9))
    assert fit.scale_at_target == pytest.approx(A_TRUE * math.exp(B_TRUE * 0.5), rel=1e-6)
    assert fit.lambda_at_reference == pytest.approx(fit.scale_at_target / 4096)
    assert fit.threshold(4096) == pytest.approx(fit.lambda_at_reference)
    assert fit.warning is None and fit.fit_logspace is logspace
    assert "prefill" in fit.summary()


def _sse(points, a, b, log):
    f = (lambda v: math.log(v)) if log else (lambda v: v)
    return sum((f(p.scale) - f(a * math.exp(b * p.sparsity))) ** 2 for p in points)


def test_each_mode_minimises_its_own_error():
    rng = random.Random(0)
    pts = [FitPoint(scale=A_TRUE * math.exp(B_TRUE * s) * math.exp(rng.gauss(0, 0.3)), sparsity=s)
           for s in [0.12 + 0.76 * i / 39 for i in range(40)]]
    log_fit = fit_phase(pts, 0.5, fit_logspace=True)
    lin_fit = fit_phase(pts, 0.5, fit_logspace=False)
    assert (log_fit.a, log_fit.b) != pytest.approx((lin_fit.a, lin_fit.b))
    assert _sse(pts, lin_fit.a, lin_fit.b, log=False) <= _sse(pts, log_fit.a, log_fit.b, log=False)
    assert _sse(pts, log_fit.a, log_fit.b, log=True) <= _sse(pts, lin_fit.a, lin_fit.b, log=True)
    # the optimum is a true local minimum in linear space
    for db in (-1e-3, 1e-3):
        assert _sse(pts, lin_fit.a, lin_fit.b, False) <= _sse(pts, lin_fit.a * math.exp(-db * 0.5), lin_fit.b + db, False)


def test_fit_end_to_end_from_counts():
    records = []
    for lam in threshold_grid(20):
        for kv in (1024, 4096, 16384):
            s = math.log(lam * kv / A_TRUE) / B_TRUE
            if s <= 0:
                records.append(CountRecord(lam, kv, 0, 10_000))
            else:
                records.append(CountRecord(lam, kv, min(int(round(s * 10_000)), 10_000), 10_000))
    fit = fit_phase(points_from_counts(records), 0.6, phase="decode")
    assert fit.a == pytest.approx(A_TRUE, rel=0.02) and fit.b == pytest.approx(B_TRUE, rel=0.01)


def test_too_few_points_is_a_clear_error():
    pts = _exact_points([0.05, 0.5, 0.95, 0.97])
    with pytest.raises(CalibrationError) as info:
        fit_phase(pts, 0.5, phase="decode")
    msg = str(info.value)
    assert "decode" in msg and "only 1 of 4" in msg and "widen the threshold grid" in msg


def test_no_points_at_all():
    with pytest.raises(CalibrationError, match="no points at all"):
        fit_phase([], 0.5)


def test_identical_sparsity_cannot_fit_slope():
    with pytest.raises(CalibrationError, match="same sparsity"):
        fit_phase([(1.0, 0.5), (2.0, 0.5), (3.0, 0.5)], 0.5)


def test_decreasing_curve_is_rejected():
    with pytest.raises(CalibrationError, match="slope"):
        fit_phase(_exact_points([0.2, 0.4, 0.6], b=-2.0), 0.5)


def test_target_outside_observed_range_warns():
    fit = fit_phase(_exact_points([0.2, 0.3, 0.4]), 0.8)
    assert fit.warning and "outside the observed range" in fit.warning and "80.0%" in fit.warning
    assert fit.scale_at_target == pytest.approx(A_TRUE * math.exp(B_TRUE * 0.8), rel=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"target_sparsity": 1.0}, "target sparsity"), ({"target_sparsity": 0.5, "min_points": 1}, "min_points"),
     ({"target_sparsity": 0.5, "sparsity_range": (0.9, 0.1)}, "sparsity_range")],
    ids=["target_one", "min_points_one", "inverted_range"],
)
def test_fit_rejects_bad_arguments(kwargs, match):
    with pytest.raises(CalibrationError, match=match):
        fit_phase(_exact_points([0.2, 0.4, 0.6]), **kwargs)


def test_fit_rejects_nonpositive_scale():
    with pytest.raises(CalibrationError, match="scales must be finite and > 0"):
        fit_phase([(0.0, 0.2), (1.0, 0.4), (2.0, 0.6)], 0.5)


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
