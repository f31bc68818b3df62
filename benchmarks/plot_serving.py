"""Draw a ``bench_serving.py --decode-timing steps`` run: speedup against context length, with its bound.

Reads the run's ``summary.json`` (``--workdir DIR`` writes ``DIR/summary.json``: one row per workload and phase
with f, s, the bounds and the achieved ratios) and writes one PNG of three panels:

* **prefill** and **decode**: per workload (context length on x, one marker shape per batch size), attention at
  target over our own dense (filled) under its bound 2 / (2 - s) (hollow, joined to it by a line), the whole
  step at target over own dense (filled) under its bound 1 / (1 - f (1 - 1 / bound)) (hollow), and own dense over
  native vLLM (x) so that "faster than native" from our dense kernel is told apart from sparsity paying;
* **sparsity**: the tiles each phase skipped per query head at the calibrated target, and (where the kernel
  counts them) the V tiles no head of a KV group read, the s of the bounds, against length.

    python benchmarks/plot_serving.py DIR/summary.json docs/serving-smollm2.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PHASES = ("prefill", "decode")
_WORKLOAD = re.compile(r"^(\d+) tok x (\d+)$")
_MARKERS = "os^Dv"


def parse_workload(name: str) -> tuple[int, int]:
    """``"2048 tok x 4"`` -> ``(2048, 4)``: context length (tokens) and concurrent sequences."""
    m = _WORKLOAD.match(name)
    if not m:
        raise ValueError(f"workload {name!r} is not 'LEN tok x N' (a bench_serving --decode-timing steps summary)")
    return int(m.group(1)), int(m.group(2))


def series(rows: list[dict], phase: str) -> dict[int, list[dict]]:
    """The ``phase`` rows by batch size, each list sorted by length, with ``length`` and ``batch`` added."""
    out: dict[int, list[dict]] = {}
    for row in rows:
        if row.get("phase") != phase:
            continue
        length, batch = parse_workload(row["workload"])
        out.setdefault(batch, []).append({**row, "length": length, "batch": batch})
    for rows_ in out.values():
        rows_.sort(key=lambda r: r["length"])
    return dict(sorted(out.items()))


def _ratio(row: dict, num: str, den: str) -> float | None:
    a, b = row.get(num), row.get(den)
    return a / b if a and b else None


def _length_axis(ax, rows: list[dict]) -> None:
    lengths = sorted({parse_workload(r["workload"])[0] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")


def draw(summary: dict, out: Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary.get("bound_table") or []
    if not rows:
        raise ValueError("the summary has no bound_table rows (a --decode-timing steps run writes them)")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, phase in zip(axes, PHASES):
        by_batch = series(rows, phase)
        for k, (batch, pts) in enumerate(by_batch.items()):
            mk = _MARKERS[k % len(_MARKERS)]
            x = [p["length"] for p in pts]
            for key, bound_key, colour, label in (("attention_achieved", "attention_bound", "C0", "attention"),
                                                  ("step_achieved", "step_bound", "C1", "step")):
                got = [p.get(key) for p in pts]
                bnd = [p.get(bound_key) for p in pts]
                ax.plot(x, got, mk + "-", color=colour, ms=7, label=f"{label} at target / own dense, x{batch}")
                ax.plot(x, bnd, mk + "--", color=colour, ms=7, mfc="none", alpha=0.7,
                        label=f"{label} bound, x{batch}")
            native = [_ratio(p, "plugin-dense", "native") for p in pts]
            ax.plot(x, native, "x:", color="C2", ms=8, label=f"own dense / native, x{batch}")
        ax.axhline(1.0, color="0.6", lw=0.8)
        _length_axis(ax, rows)
        ax.set_ylabel("speedup (x)")
        ax.set_title(f"{phase}: achieved vs bound")
    ax = axes[2]
    for j, phase in enumerate(PHASES):
        for k, (batch, pts) in enumerate(series(rows, phase).items()):
            mk, x = _MARKERS[k % len(_MARKERS)], [p["length"] for p in pts]
            ax.plot(x, [100 * p.get("s_head", p["s"]) for p in pts], mk + "-", color=f"C{3 + j}", ms=7,
                    label=f"{phase} per head, x{batch}")
            if any(p.get("s_is_v") for p in pts):  # the V tiles no head of the group read (the bound's s)
                ax.plot(x, [100 * p["s"] if p.get("s_is_v") else float("nan") for p in pts], mk + "--",
                        color=f"C{3 + j}", ms=7, mfc="none", label=f"{phase} V tiles unread, x{batch}")
    _length_axis(ax, rows)
    ax.set_ylim(0, 100)
    ax.set_ylabel("tile sparsity s (%)")
    ax.set_title("sparsity reached at the calibrated target")
    ax.legend(fontsize=7)
    handles, labels = axes[0].get_legend_handles_labels()  # the speed panels share their series
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * -(-len(labels) // 5), 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("summary", help="summary.json of a bench_serving.py --decode-timing steps run (its --workdir)")
    p.add_argument("out", help="PNG to write")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    try:
        summary = json.loads(Path(a.summary).read_text(encoding="utf-8"))
        print(f"wrote {draw(summary, Path(a.out), a.title)}")
    except (OSError, ValueError) as exc:
        print(f"plot_serving: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
