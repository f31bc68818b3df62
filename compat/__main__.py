"""``python -m compat``: what compat decided about the installed vLLM, and why.

The first thing to run inside a vLLM environment where sparse attention fails.
"""

from __future__ import annotations

import argparse
import json
import sys

from compat import envs, layouts


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m compat`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m compat",
        description=(
            "Probe the installed vLLM and print, per attention backend, the KV-cache layout its impl "
            "receives, who writes new tokens into the cache, and which step decided each fact "
            "(env override, capability probe, or release table)."
        ),
        epilog="Overrides: " + ", ".join(envs.variables()) + " (see docs/compat.md).",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON for machines")
    parser.add_argument(
        "--check", action="store_true",
        help="print one line and exit 0 when this vLLM release is in the proven matrix (README's release table), "
             "1 when it is not but every capability probe answered (the line lists the facts probed), "
             "2 when a probe failed or an override is invalid (the line says what and the fix)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import compat

    # Every registered variable is checked, not only those the probe reads, so a
    # typo in e.g. SPARSE_ATTN_STRICT fails here rather than at a worker's start.
    errors = envs.validate_all()
    try:
        report = compat.probe()
    except compat.CompatError as exc:
        report = None
        if str(exc) not in errors.values():
            errors["probe"] = str(exc)
    if args.check:
        from compat.proven import check

        verdict = check(report, errors)
        print(f"compat --check: {verdict.line}")
        return verdict.code
    if report is not None:
        ops = None
        if report.vllm_version is not None:
            try:
                ops = compat.cpu_ops_decision()
            except compat.CompatError as exc:
                errors["SPARSE_ATTN_CPU_OPS_MODULE"] = str(exc)
        if args.json:
            print(json.dumps({**report.as_dict(), "cpu_ops": ops.as_dict() if ops else None}, indent=2, sort_keys=True))
        else:
            print(render(report, invalid=errors, cpu_ops=ops))
    for message in errors.values():
        print(f"compat: {message}", file=sys.stderr)
    for warning in envs.unknown_warnings():
        print(f"compat: warning: {warning}", file=sys.stderr)
    return 2 if errors else 0


def render(report, invalid=(), cpu_ops=None) -> str:
    """The human-readable report; ``invalid`` names the variables that failed to parse; ``cpu_ops``:
    ``compat.cpu_ops_decision()`` where vLLM is installed."""
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
    lines += [f"fp8 cache writes {name}: {layouts.fp8_rounding(b.layout)}" for name, b in report.backends.items() if b.layout]
    lines += [f"kv-cache update bypass {name}: declared (a fused op may store the tokens and call forward with key/value "
              "None; the sparse path then only reads the cache)" for name, b in report.backends.items() if b.kv_update_bypass]
    if cpu_ops is not None:
        lines.append(f"cpu attention ops: {cpu_ops.module or 'NOT FOUND'} ({cpu_ops.source}: {cpu_ops.detail})")
    lines.append("")
    if report.overrides:
        lines.append("overrides: " + ", ".join(f"{k}={envs.cut(v)}" + (" (INVALID)" if k in invalid else "")
                                               for k, v in report.overrides.items()))
    else:
        lines.append("overrides: none (set " + " or ".join([var.name for var in envs.COMPAT_VARIABLES[:2]]) + " to force a decision)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
