"""The eval report: JSON (atomic write) and the readable tables ``sparse-attn eval`` prints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: What each column means; printed under the tables and in ``sparse-attn eval --help``.
LEGEND = """\
N            prompts each number stands on (the independent unit: every +- is a 95 % interval over prompts,
             per-prompt means first; normal approximation 1.96 sd / sqrt(N))
tokens       positions the KL and top-1 stand on, all prompts together: every teacher-forced answer position
             (with --teacher_forced) and every greedy step up to and including the first one where sparse's token
             differs from dense's (after it the contexts differ)
KL           the headline: KL(dense || sparse) of the next-token distribution (nats, 0 = identical), mean over those
             positions per prompt, then over prompts, +- its interval; over dense's top 20 tokens plus one "rest"
             bucket (1 - their probability); a token of dense's top 20 outside sparse's gets sparse's 20th logprob
top-1 %      fraction of those positions where sparse's most likely token is dense's, per prompt, then over prompts
match        fraction of answers found in the greedy output (RULER string_match_all), mean over prompts
 (delta)     sparse minus dense on the same prompts, in points, +- its 95 % interval (paired)
first LP     log-probability of the answer's first token where the answer is read (first generated step;
             nats; 0 is certain): moves with the answer's probability, where match moves only when a token flips
 (delta)     sparse minus dense, paired; negative = the answer became less likely
KL first     the KL of the first generated step alone (the distribution the answer is read from)
answer LL    with --teacher_forced: mean log-likelihood of all answer tokens given the true ones before them
agree        greedy tokens equal to dense at the same position / tokens generated (prefix: before the first difference)
sparsity     KV tiles skipped / visited per phase (the workers' counters): prefill of every prompt token,
             decode of the generated steps (with --teacher_forced the prefill is that pass's, which the
             generate batch then reads from vLLM's prefix cache: one prefill per prompt for both)
gen s        wall time of the generate batches, plus the teacher-forced pass with --teacher_forced (native vLLM
             vs the plugin, same engine settings, same run)
prompts/min  the eval's own pace per engine run: its prompts over the wall time of its whole job (vLLM's import,
             engine start, warm-up and every pass; the job's seconds in brackets)
ref ...      with --references: native vLLM (no plugin) serving the model another way users already accept, scored
             against the same dense run exactly as a sparse row: ref bf16 = the model in bf16 instead of --dtype,
             ref fp8-KV = an fp8 KV cache at --dtype (sparsity "-": nothing is skipped)
KL x bf16    a row's KL as a multiple of the reference's (one column per reference that ran): sparse KL / ref KL,
             paired over the same prompts, +- its 95 % interval (delta method); 2.0 = this row moves the next-token
             distribution away from dense twice as far as serving in bf16 does"""


def write_report(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}"


def _delta(x: float | None, ci: float | None, scale: float = 100.0, digits: int = 1) -> str:
    if x is None:
        return ""
    return f"{scale * x:+.{digits}f}+-{scale * (ci or 0):.{digits}f}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _layers(config: dict) -> str:
    if config.get("reference"):
        return config.get("serves") or "native"
    if not config["layers"]:
        return "native"
    return ", ".join(f"{i}/{t}" for i, t in config["layers"]) + " layers sparse"


def _target(config: dict) -> str:
    if config.get("reference"):
        return config["label"]
    t = config["target"]
    if t is None:
        return "dense"
    if isinstance(t, dict):
        return "/".join(f"{v:g}" for v in t.values())
    return f"{t:g}"


def _phase_sp(config: dict, sparsity: dict | None, phase: str) -> str:
    """A sparsity column of a config or of one cell: "dense" where the target's curve gives lambda >= 1 at
    every KV length it serves (that phase never skips, so its tiles are not counted); a config's pooled
    value gets a "*" where some of its cells run that phase dense (the pool is then over the others)."""
    if phase in config.get("never_skips", ()):
        return "dense"
    text = _pct(sparsity.get(phase)) if sparsity else "-"
    return text + "*" if _dense_lengths(config, phase) else text


def _dense_lengths(config: dict, phase: str) -> list[int]:
    """The cell lengths at which ``phase`` runs dense although the config skips it at others."""
    if phase in config.get("never_skips", ()):
        return []
    return sorted({c["length"] for c in config.get("cells", ()) if phase in c.get("never_skips", ())})


def _kl(summary: dict, key: str = "kl_all") -> str:
    if summary.get(key) is None:
        return "-"
    ci = summary.get(key + "_ci")
    return f"{summary[key]:.4f}" + (f"+-{ci:.4f}" if ci is not None and key == "kl_all" else "")


def _pace(config: dict) -> str:
    t = config.get("throughput") or {}
    if not t.get("prompts_per_min"):
        return "-"
    return f"{t['prompts_per_min']:.1f} ({t['job_s']:.0f} s)"


def _ratio(config: dict, name: str) -> str:
    """A "KL x REF" cell: the row's KL over the reference's, +- its interval; "-" for dense and the reference itself."""
    x = (config["all"].get("kl_x") or {}).get(name)
    if x is None:
        return "-"
    if x["ratio"] is None:
        return "n/a"
    return f"{x['ratio']:.2f}+-{x['ratio_ci']:.2f}"


def _not_run(config: dict, columns: int) -> list[str]:
    """The row of a reference whose engine did not run: its label, dashes, and where the note is."""
    return [_target(config)] + ["-"] * (columns - 2) + ["not run: see the note below"]


def render(report: dict[str, Any]) -> str:
    configs = report["configs"]
    dense = configs[0]
    ran = [r for r in report.get("references", ()) if r.get("ran")]
    wall = lambda c: c["all"]["generate_s"] + c["all"].get("teacher_forced_s", 0.0)
    native_s = wall(dense)
    header = ["target", "N", "tokens", "KL (nats)", *(f"KL x {r['short']}" for r in ran), "top-1 %", "match %",
              "(delta pts)", "first LP", "(delta)", "KL first", "answer LL delta", "agree %", "prefill sp %", "decode sp %",
              "gen s (x native)", "prompts/min", "layers"]
    rows = []
    for c in configs:
        a = c["all"]
        if not a:
            rows.append(_not_run(c, len(header)))
            continue
        sp = a.get("sparsity") or {}
        rows.append([
            _target(c), str(a["n"]), str(a["tokens"]) if a.get("tokens") is not None else "-", _kl(a),
            *(_ratio(c, r["name"]) for r in ran),
            _pct(a["top1"]) + "+-" + _pct(a.get("top1_ci")) if a.get("top1") is not None else "-",
            _pct(a["match"]), _delta(a.get("d_match"), a.get("d_match_ci")),
            f"{a['first_lp']:.3f}", _delta(a.get("d_first_lp"), a.get("d_first_lp_ci"), 1.0, 3), _kl(a, "kl"),
            _delta(a.get("d_answer_ll"), a.get("d_answer_ll_ci"), 1.0, 3) if "answer_ll" in a else "-",
            _pct(a["agreement"]) if c is not dense else "-",
            _phase_sp(c, sp, "prefill"), _phase_sp(c, sp, "decode"),
            f"{wall(c):.1f} ({wall(c) / native_s:.2f}x)" if native_s else f"{wall(c):.1f}",
            _pace(c), _layers(c),
        ])
    out = [f"=== sparse-attn eval: {report['checkpoint']} | tasks {', '.join(report['tasks'])} | lengths "
           f"{', '.join(map(str, report['lengths']))} | {report['samples_per_cell']} prompts per cell | "
           f"{report['decode_tokens']} decode tokens | seed {report['seed']} ===", "", "all cells pooled:",
           _table(rows, header)]
    not_run = [c for c in configs if not c["all"]]
    if not_run:
        out += [""] + [f"note: {c['label']}: {c.get('note', 'not run')}" for c in not_run]
    for c in configs[1:]:
        if not c["all"]:
            continue
        detail = []
        for r, d in zip(c["cells"], dense["cells"]):
            sp = r.get("sparsity") or {}
            detail.append([r["task"], str(r["length"]), str(r["n"]), str(r.get("tokens", "-")), _kl(r),
                           _pct(r["top1"], 0) if r.get("top1") is not None else "-", _pct(d["match"], 0), _pct(r["match"], 0),
                           _delta(r.get("d_match"), r.get("d_match_ci"), digits=0), f"{d['first_lp']:.2f}",
                           _delta(r.get("d_first_lp"), r.get("d_first_lp_ci"), 1.0, 3), _pct(r["agreement"], 0),
                           # a cell of an older report has no never_skips of its own: its config's hold
                           *(_phase_sp({"never_skips": r.get("never_skips", c.get("never_skips", ()))}, sp, phase)
                             for phase in ("prefill", "decode"))])
        title = c["label"] if c.get("reference") else f"target {_target(c)}"
        out += ["", f"{title} per task and length (dense beside it):",
                _table(detail, ["task", "len", "N", "tokens", "KL", "top-1", "dense match", "match", "(delta)", "dense first LP", "first LP delta", "agree",
                                "prefill sp", "decode sp"])]
    partly = [f"target {_target(c)}: {phase} at {', '.join(map(str, lengths))} tokens"
              for c in configs for phase in ("prefill", "decode") if (lengths := _dense_lengths(c, phase))]
    if partly:
        out += ["", f"*: pooled over the lengths where that phase skips; it runs dense at the others ({'; '.join(partly)}): "
                    f"lambda = scale / kv_len >= 1 up to that length, which the kernels serve dense"]
    dense_phases = [f"target {_target(c)}: {', '.join(c['never_skips'])}" for c in configs if c.get("never_skips")]
    if dense_phases:
        out += ["", f"dense: runs that phase dense ({'; '.join(dense_phases)}): the curve at that target gives "
                    f"lambda = scale / kv_len >= 1 at every KV length served, i.e. a sparsity beyond what "
                    f"calibration observed; calibrate on longer prompts or lower the target"]
    load = report.get("load_average")
    out += ["", LEGEND, f"load average at the end: {', '.join(f'{x:.1f}' for x in load)}" if load else ""]
    return "\n".join(out)
