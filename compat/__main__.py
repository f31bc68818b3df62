"""``python -m compat``: what compat decided about the installed vLLM, and why.

The first thing to run inside a vLLM environment where sparse attention fails.
"""

from __future__ import annotations

import argparse
import json
import sys

from compat import envs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compat",
        description=(
            "Probe the installed vLLM and print, per attention backend, the KV-cache layout its impl "
            "receives, who writes new tokens into the cache, and which step decided each fact "
            "(env override, capability probe, or release table)."
        ),
        epilog="Overrides: " + ", ".join(envs.REGISTRY) + " (see README.md).",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON for machines")
    args = parser.parse_args(argv)

    import compat

    try:
        report = compat.probe()
    except compat.CompatError as exc:
        print(f"compat: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, sort_keys=True))
        return 0
    print(render(report))
    return 0


def render(report) -> str:
    """The human-readable report."""
    if report.vllm_version is None:
        head = "vLLM: not installed (compat works on plain tensors; backends cannot be probed)"
    else:
        head = f"vLLM: {report.vllm_version} (distribution {report.vllm_distribution or 'unknown'}, from {report.version_source})"
    lines = [head, ""]
    rows = [("backend", "layout", "source", "cache writer", "source", "evidence")]
    for name, b in report.backends.items():
        if not b.importable:
            rows.append((name, b.layout.value if b.layout else "-", b.layout_source or "-", b.writer or "-", b.writer_source or "-", f"not importable: {b.import_error}"))
            continue
        rows.append((name, b.layout.value if b.layout else "UNKNOWN", b.layout_source or "-", b.writer or "-", b.writer_source or "-", f"{b.layout_detail}; {b.writer_detail}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5])
    lines.append("")
    lines += [f"cuda graphs {name}: {b.graphs.describe()}" for name, b in report.backends.items() if b.graphs]
    lines.append("")
    if report.overrides:
        lines.append("overrides: " + ", ".join(f"{k}={v}" for k, v in report.overrides.items()))
    else:
        lines.append("overrides: none (set " + " or ".join(list(envs.REGISTRY)[:2]) + " to force a decision)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
