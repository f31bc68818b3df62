"""PNG of a calibration fit: measured points, fitted curve, target marker.

Uses matplotlib's object API with the Agg canvas (no pyplot global state, no
display needed). matplotlib is optional: without it :func:`plot_fit` raises
:class:`PlotUnavailableError` telling how to install it or skip plotting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .errors import CalibrationError
from .fit import FitPoint, FitResult

__all__ = ["PlotUnavailableError", "plot_fit", "plot_fits", "require_matplotlib"]


class PlotUnavailableError(CalibrationError):
    """matplotlib is not installed."""


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            f"plotting the calibration fit needs matplotlib ({exc}). "
            "Fix: `pip install matplotlib`, or run calibration without --plot"
        ) from None
    return Figure, FigureCanvasAgg


def require_matplotlib() -> None:
    """Raise :class:`PlotUnavailableError` now if plotting would fail later (``--plot`` checks this before vLLM starts)."""
    _matplotlib()


def plot_fit(
    points: Iterable[FitPoint | tuple[float, float]],
    fit: FitResult,
    target: float | None,
    path: str | Path,
    *,
    title: str | None = None,
) -> Path:
    """Write one PNG: scale (log axis) against sparsity, with the fitted curve and the target.

    Points outside the fitted sparsity band are drawn hollow so the excluded
    saturation regions stay visible. Returns the path written.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    pts = [p if isinstance(p, FitPoint) else FitPoint(scale=float(p[0]), sparsity=float(p[1])) for p in points]
    target = fit.target_sparsity if target is None else float(target)
    lo, hi = fit.observed_sparsity_range
    inside = [p for p in pts if lo <= p.sparsity <= hi]
    outside = [p for p in pts if not lo <= p.sparsity <= hi]

    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if inside:
        ax.scatter([p.sparsity for p in inside], [p.scale for p in inside], s=14, label="measured (fitted)", color="tab:blue")
    if outside:
        ax.scatter(
            [p.sparsity for p in outside], [p.scale for p in outside], s=14, label="measured (excluded)",
            facecolors="none", edgecolors="tab:gray",
        )
    xmin = min([lo, target] + [p.sparsity for p in pts])
    xmax = max([hi, target] + [p.sparsity for p in pts])
    n = 200
    xs = [xmin + (xmax - xmin) * i / (n - 1) for i in range(n)]
    ax.plot(xs, [fit.scale(x) for x in xs], color="tab:red", label=f"{fit.a:.4g}·exp({fit.b:.4g}·s), R²={fit.r2:.3f}")
    ax.scatter([target], [fit.scale(target)], marker="*", s=160, color="tab:green", zorder=5,
               label=f"target {target:.0%} → scale {fit.scale(target):.4g}")
    ax.axvspan(lo, hi, color="tab:blue", alpha=0.06)
    ax.set_yscale("log")
    ax.set_xlabel("sparsity (skipped / visited tiles)")
    ax.set_ylabel("threshold scale factor (λ · kv_len)")
    ax.set_title(title or f"skip-softmax calibration: {fit.phase}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_fits(
    points_by_phase: Mapping[str, Sequence[FitPoint | tuple[float, float]]],
    fits: Mapping[str, FitResult],
    out_dir: str | Path,
    *,
    prefix: str = "calibration_",
) -> list[Path]:
    """One PNG per fitted phase, ``out_dir/{prefix}{phase}.png``."""
    written = []
    for phase, fit in fits.items():
        written.append(plot_fit(points_by_phase.get(phase, ()), fit, fit.target_sparsity, Path(out_dir) / f"{prefix}{phase}.png"))
    return written

