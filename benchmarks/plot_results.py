"""Draw the README's results figure from ``benchmarks/results_data.json``.

Left: achieved speedup of skipping over our own dense kernel against the measured tile sparsity
``s``, beside the bound ``2 / (2 - s)`` (the rule computes every Q.K and skips exp, the V read and
P.V of a skipped tile; the engine rows time the whole prefill step, whose bound is lower by
attention's share, not measured here). ``s`` is the per-head tile sparsity the kernels count; with GQA packing
the V tiles actually not read are at most that, so the bound drawn is an upper one. Right: answer
match at each calibration target with its 95 % interval beside the dense score, and the achieved
sparsity per phase (a phase that ran dense by the rule is drawn at 0 and marked).

    python benchmarks/plot_results.py --out docs/results.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).with_name("results_data.json")


def bound(s: float) -> float:
    """Upper bound of attention's speedup at V-tile sparsity ``s`` (0 <= s <= 1)."""
    return 2.0 / (2.0 - s)


def draw(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    grid = [i / 100 for i in range(0, 96)]
    speed.plot(grid, [bound(s) for s in grid], color="0.4", label="bound 2 / (2 - s)")
    speed.axhline(1.0, color="0.8", lw=0.8)
    for row, marker in zip(data["speed"], "os^"):
        speed.plot(row["tile_sparsity"], row["speedup_vs_own_dense"], marker, ms=8,
                   label=f"{row['label']}: {row['speedup_vs_own_dense']:.2f}x "
                         f"({row['speedup_vs_own_dense'] / bound(row['tile_sparsity']):.0%} of bound)")
    speed.set(xlabel="tile sparsity s (per head)", ylabel="speedup over skipping off", xlim=(0, 0.95), ylim=(0.9, 2.15),
              title="Speed: skipping against its bound (2-core CPU, fp32)")
    speed.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, 0.88))
    speed.text(0.02, 0.93, "engine rows time the whole prefill step: attention's share is not measured,\n"
               "so their own bound lies below the curve", fontsize=6.5, color="0.3", va="top",
               transform=speed.transAxes)

    a = data["accuracy"]
    targets = [r["target"] for r in a["rows"]]
    acc.axhline(a["dense_match"] * 100, color="0.4", ls="--", label=f"dense match {a['dense_match']:.0%}")
    acc.errorbar(targets, [r["match"] * 100 for r in a["rows"]], yerr=[r["match_ci95"] * 100 for r in a["rows"]],
                 fmt="o", capsize=4, label="sparse match, 95 % CI")
    acc.set(xlabel="calibration target", ylabel="answer match (%)", ylim=(0, 100), xticks=targets,
            title=a["model"].split(",")[0] + ": accuracy and sparsity")
    twin = acc.twinx()
    twin.plot(targets, [(r["decode_sparsity"] or 0) * 100 for r in a["rows"]], "s:", color="tab:green",
              label="decode sparsity")
    twin.plot(targets, [(r["prefill_sparsity"] or 0) * 100 for r in a["rows"]], "d:", color="tab:red",
              label="prefill sparsity (0 = ran dense)")
    twin.plot(targets, [t * 100 for t in targets], color="0.85", lw=0.8, label="target")
    twin.set(ylabel="achieved tile sparsity (%)", ylim=(0, 100))
    lines = acc.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    labels = acc.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
    acc.legend(lines, labels, fontsize=7, loc="lower left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")   # written whole, then renamed: no half-written figure
    tmp.replace(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA, help="measured numbers (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="PNG to write, e.g. docs/results.png")
    a = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_results: matplotlib is missing; fix: pip install matplotlib", file=sys.stderr)
        return 2
    draw(json.loads(a.data.read_text()), a.out)
    print(f"plot_results: wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
