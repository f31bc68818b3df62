"""PNG of an eval report (``sparse-attn eval --plot PATH``): accuracy and achieved sparsity against the target.

Four panels, each sparse configuration at its target on the x axis: answer match (%) with its 95 % interval
and dense's as a horizontal line; the paired log-likelihood delta against dense with its interval (the
teacher-forced answer LL with ``--teacher_forced``, else the first answer token's LP); the headline KL
(dense || sparse) over every comparable position with its interval; achieved tile sparsity per phase with the
y = x line. A target given per phase (a checkpoint served as calibrated) is drawn at its phase's value in the
sparsity panel and at the mean of its phases' values in the others. Each ``--references`` configuration that ran
(``ref bf16``, ``ref fp8-KV``) is a horizontal dashed line at its KL and at its match, labelled with its value:
how far a sparse point sits above the bf16 line is its "KL x bf16".

Uses matplotlib's object API with the Agg canvas, as :mod:`sparse_attn.calibration.plot` does (no pyplot state,
no display); matplotlib is optional and imported only here. Redraw from a written report without an engine:
``python -m sparse_attn.evaluation.plot REPORT.json OUT.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from sparse_attn.errors import CliError

__all__ = ["PlotError", "figure", "plot_report", "require_matplotlib"]

PHASE_COLOURS = {"prefill": "tab:blue", "decode": "tab:orange"}
#: The references' lines, in the report's order.
REFERENCE_COLOURS = ("tab:brown", "tab:cyan", "tab:olive", "tab:pink")


class PlotError(CliError):
    """The report cannot be drawn, or matplotlib is missing."""


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotError(f"--plot needs matplotlib ({exc}). Fix: `pip install matplotlib`, or run eval without --plot") from None
    return Figure, FigureCanvasAgg


def require_matplotlib() -> None:
    """Raise :class:`PlotError` now if plotting would fail later (``--plot`` checks this before any engine starts)."""
    _matplotlib()


def _x(target: Any, phase: str | None = None) -> float | None:
    """A configuration's target as an x value: the number, or a per-phase target's value at ``phase`` (the mean of
    its phases' values without one)."""
    if isinstance(target, (int, float)):
        return float(target)
    if isinstance(target, dict) and target:
        if phase is not None:
            v = target.get(phase)
            return None if v is None else float(v)
        return sum(float(v) for v in target.values()) / len(target)
    return None


def _sparse_configs(report: Any) -> tuple[dict, list[dict]]:
    configs = report.get("configs") if isinstance(report, dict) else None
    if not isinstance(configs, list) or not configs or not all(isinstance(c, dict) and isinstance(c.get("all"), dict)
                                                              for c in configs):
        raise PlotError("the report has no configurations ('configs' with an 'all' summary each): pass the JSON "
                        "`sparse-attn eval --output` wrote")
    if not configs[0].get("native"):
        raise PlotError("the report's first configuration is not native vLLM (dense): nothing to compare against")
    sparse = [c for c in configs[1:] if not c.get("reference") and _x(c.get("target")) is not None
              and c["all"].get("match") is not None]
    if not sparse:
        raise PlotError("the report has no sparse configuration with a target to draw (a `--targets none` run holds "
                        "native vLLM alone). Fix: rerun with --targets, e.g. --targets 0.5,0.7 and the same --workdir")
    return configs[0], sorted(sparse, key=lambda c: _x(c["target"]))


def _errorbar(ax, xs: Sequence[float], ys: Sequence[float | None], errs: Sequence[float | None], scale: float, **kw) -> bool:
    pts = [(x, y * scale, (e or 0.0) * scale) for x, y, e in zip(xs, ys, errs) if y is not None]
    if not pts:
        return False
    ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3, **kw)
    return True


def _absent(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}\nnot in this report", ha="center", va="center", transform=ax.transAxes, color="tab:gray")


def _references(report: dict) -> list[tuple[dict, str]]:
    """The reference configurations that ran, each with its line colour."""
    refs = [c for c in report["configs"] if c.get("reference") and c["all"]]
    return list(zip(refs, REFERENCE_COLOURS))


def plot_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write the report's PNG to ``path``; returns it. :class:`PlotError` when the report holds nothing to draw
    (no sparse configuration) or matplotlib is missing."""
    fig = figure(report)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def figure(report: dict[str, Any]):
    """The report's matplotlib ``Figure`` (panels: match, LL delta, KL, sparsity; see the module docstring)."""
    dense, sparse = _sparse_configs(report)
    Figure, FigureCanvasAgg = _matplotlib()
    xs = [_x(c["target"]) for c in sparse]
    alls = [c["all"] for c in sparse]
    fig = Figure(figsize=(10.0, 7.6), dpi=100)
    FigureCanvasAgg(fig)
    (m_ax, ll_ax), (kl_ax, sp_ax) = fig.subplots(2, 2)

    _errorbar(m_ax, xs, [a["match"] for a in alls], [a.get("match_ci") for a in alls], 100.0, color="tab:red",
              label="sparse (95 % interval)")
    d = dense["all"]
    if d.get("match") is not None:
        m_ax.axhline(100.0 * d["match"], color="black", linestyle="--", label=f"dense {100 * d['match']:.1f} %")
    refs = _references(report)
    for ref, colour in refs:
        if ref["all"].get("match") is not None:
            m_ax.axhline(100.0 * ref["all"]["match"], color=colour, linestyle="--",
                         label=f"{ref['label']} {100 * ref['all']['match']:.1f} %")
    m_ax.set_ylabel("answer match (%)")
    m_ax.set_title(f"match, N = {alls[0].get('n')} prompts per target")
    m_ax.legend(fontsize=8)

    key = "answer_ll" if any(a.get("d_answer_ll") is not None for a in alls) else "first_lp"
    if _errorbar(ll_ax, xs, [a.get("d_" + key) for a in alls], [a.get(f"d_{key}_ci") for a in alls], 1.0, color="tab:purple"):
        ll_ax.axhline(0.0, color="black", linestyle="--", linewidth=1)
    else:
        _absent(ll_ax, "LL delta")
    ll_ax.set_ylabel("answer LL delta (nats / token)" if key == "answer_ll" else "first-token LP delta (nats)")
    ll_ax.set_title("sparse minus dense, paired" + ("" if key == "answer_ll" else " (no --teacher_forced)"))

    if not _errorbar(kl_ax, xs, [a.get("kl_all") for a in alls], [a.get("kl_all_ci") for a in alls], 1.0, color="tab:green",
                     label="sparse (95 % interval)"):
        _absent(kl_ax, "KL over all positions")
    ref_lines = [(ref, colour) for ref, colour in refs if ref["all"].get("kl_all") is not None]
    for ref, colour in ref_lines:
        kl_ax.axhline(ref["all"]["kl_all"], color=colour, linestyle="--", label=f"{ref['label']} {ref['all']['kl_all']:.4f}")
    if ref_lines:
        kl_ax.legend(fontsize=8)
    tokens = [a.get("tokens") for a in alls if a.get("tokens") is not None]
    kl_ax.set_ylabel("KL(dense || sparse) (nats / position)")
    kl_ax.set_title("KL, every comparable position" + (f" ({min(tokens)}-{max(tokens)} positions)" if tokens and min(tokens) != max(tokens)
                                                         else f" ({tokens[0]} positions)" if tokens else ""))

    drawn = []
    for phase, colour in PHASE_COLOURS.items():
        pts = [(_x(c["target"], phase), c["all"].get("sparsity", {}).get(phase)) for c in sparse
               if phase not in c.get("never_skips", ())]
        pts = [(x, y) for x, y in pts if x is not None and y is not None]
        if pts:
            sp_ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colour, label=f"{phase} achieved")
            drawn += [v for p in pts for v in p]
    if drawn:
        lo, hi = min(0.0, min(drawn)), max(1.0, max(drawn))
        sp_ax.plot([lo, hi], [lo, hi], color="gray", linestyle=":", label="y = x")
        sp_ax.legend(fontsize=8)
    else:
        _absent(sp_ax, "sparsity")
    sp_ax.set_ylabel("achieved sparsity (skipped / visited tiles)")
    sp_ax.set_title("achieved sparsity per phase")
    for ax in (m_ax, ll_ax, kl_ax, sp_ax):
        ax.set_xlabel("target sparsity")
        ax.grid(True, alpha=0.3)
    # The checkpoint's name, not its path: the picture is published, and a directory means nothing elsewhere.
    fig.suptitle(f"sparse-attn eval: {Path(str(report.get('checkpoint', ''))).name}", fontsize=10)
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    from sparse_attn.jsonio import JsonInputError, read_json_file

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m sparse_attn.evaluation.plot REPORT.json OUT.png", file=sys.stderr)
        return 2
    try:
        report = read_json_file(argv[0], what="eval report", max_bytes=256 << 20,
                                fix="pass the JSON `sparse-attn eval --output` wrote")
        print(f"wrote {plot_report(report, argv[1])}")
    except (CliError, JsonInputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
