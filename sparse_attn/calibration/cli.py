"""``sparse-attn calibrate``: data -> vLLM counting run -> fit -> export.

Everything that can be checked before vLLM starts is checked first (checkpoint,
its ``sparse_attention_config`` under ``--update_checkpoint_config`` (a foreign
or malformed one is refused), output paths and their writability (never the
checkpoint's ``config.json`` or Qwen dual-chunk ``sparse_attention_config.json``), ``--plot``'s matplotlib, ``--engine_kwargs``,
lengths against the model's limit, data), and nothing is written until the fit
succeeded: an error or an interrupt leaves the checkpoint and ``--output``
untouched. The report and the checkpoint update are written before the plots,
so a plotting failure cannot lose the calibration.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Mapping

from sparse_attn.calibration.errors import CalibrationDataError, CalibrationError
from sparse_attn.calibration.export import (
    ExportError,
    build_sparse_attention_config,
    check_checkpoint_update,
    remove_stale_temp_files,
    update_checkpoint_config,
    write_json_atomic,
)
from sparse_attn.calibration.fit import fit_counts
from sparse_attn.calibration.outputs import DEFAULT_OUTPUT, QWEN_DUAL_CHUNK_FILE, check_destinations, describe_kind
from sparse_attn.calibration.runner import PHASES, candidate_scales, counting_mode_env, measure, served_layers
from sparse_attn.config import SparseAttentionConfigError, config_value, read_config_json
from sparse_attn.errors import CliError
from sparse_attn.jsonio import JsonInputError, loads, shorten
from sparse_attn.workloads.lengths import DEFAULT_CALIB_MAX_SEQLEN, TASK_PROMPT_MARGIN, length_bins
from sparse_attn.workloads.prompts import (
    CalibrationSample,
    ChatTemplatePrompts,
    check_lengths,
    check_vocabulary,
    load_prompts,
)
from sparse_attn.workloads.synthetic import generate_calibration_samples
from sparse_attn.workloads.tasks import EVAL_TASKS, build_samples

__all__ = ["DEFAULT_OUTPUT", "QWEN_DUAL_CHUNK_FILE", "calibrate"]

#: Upper bounds of the counts calibrate takes, each far above any real use and low enough
#: that a typo (``--calib_samples 100000000000000000000``) is an error, not hours of work or
#: an out-of-memory: synthetic samples (ModelOpt uses 24-64), candidate thresholds per phase
#: (each one is counted in every layer at every step), tensor-parallel ranks, and lengths in
#: tokens (2**24: beyond every model's context).
LIMITS: Mapping[str, int] = {"--calib_samples": 4096, "--num_candidates": 256, "--tensor_parallel_size": 1024, "--pipeline_parallel_size": 1024,
                             "--calib_max_seqlen": 1 << 24, "--calib_min_seqlen": 1 << 24, "--max_model_len": 1 << 24,
                             "--decode_tokens": 1 << 24}
#: ``--seed`` range: vLLM seeds numpy, which takes 0 <= seed < 2**32.
SEED_RANGE = (0, 2 ** 32 - 1)


@dataclass(frozen=True)
class _Plan:
    """What the early checks decided, before any tokenizer or engine is loaded."""

    ckpt: Path
    output: Path
    plot_prefix: Path | None
    calib_max_seqlen: int
    max_model_len: int
    engine_extra: Mapping[str, Any]
    #: the model's vocabulary size from config.json (token ids must be below it); None = unknown
    vocab_size: int | None = None


def _check_output(args, ckpt: Path, plot_paths: list[Path]) -> Path:
    """``--output`` (and the ``--plot`` files) decided by path alone, before anything loads
    (``sparse_attn.calibration.outputs``)."""
    output = Path(args.output)
    written = {"--output": output, **{f"--plot ({p.name})": p for p in plot_paths}}
    check_destinations(ckpt, written, filter(None, (args.prompts_file, args.calib_data_dir)))
    return output


def _check_plot(args) -> tuple[Path | None, list[Path]]:
    if not args.plot:
        return None, []
    from sparse_attn.calibration.plot import PlotUnavailableError, require_matplotlib

    try:
        require_matplotlib()
    except PlotUnavailableError as exc:
        raise CliError(f"--plot {args.plot}: {exc}") from None
    prefix = Path(args.plot)
    directory = Path(os.path.realpath(prefix)).parent
    if prefix.is_dir():
        raise CliError(f"--plot {prefix} is a directory; expected a path prefix. Fix: pass e.g. --plot {prefix / 'calibration'} "
                       f"(writes {prefix / 'calibration_prefill.png'} and {prefix / 'calibration_decode.png'})")
    if prefix.exists() and not prefix.is_file():
        # e.g. --plot /dev/null, meant as "no plots": the PNGs would land beside the device, in /dev.
        raise CliError(f"--plot {prefix} is {describe_kind(prefix)}; expected a path prefix for two new PNG files "
                       f"(it writes PREFIX_prefill.png and PREFIX_decode.png beside it). Fix: pass e.g. "
                       f"--plot ./calibration, or leave --plot out to write no plots")
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise CliError(f"--plot {args.plot}: directory {directory} does not exist or is not writable")
    # `--plot fit.png` means fit_prefill.png, not fit.png_prefill.png: the PNG suffix is the writer's. The
    # returned prefix is the one the writer composes its names from (it once wrote fit.png_prefill.png).
    stem = prefix.parent / (prefix.name[:-4] if prefix.name.lower().endswith(".png") else prefix.name)
    return stem, [stem.parent / f"{stem.name}_{phase}.png" for phase in PHASES]


_ENGINE_KWARGS_EXAMPLE = '{"kv_cache_memory_bytes": 1073741824}'


def _parse_engine_kwargs(raw: str) -> dict[str, Any]:
    from compat.launch import CALIBRATION_ENGINE_KWARGS

    try:
        extra = loads(raw, where="--engine_kwargs", fix=f"pass a JSON object, e.g. --engine_kwargs '{_ENGINE_KWARGS_EXAMPLE}'",
                      allow_nan=False)
    except JsonInputError as exc:
        raise CliError(str(exc)) from None
    if not isinstance(extra, dict):
        raise CliError(f"--engine_kwargs must be a JSON object, got {type(extra).__name__}; e.g. '{_ENGINE_KWARGS_EXAMPLE}'")
    owned = [key for key in extra if key in CALIBRATION_ENGINE_KWARGS]
    if owned:
        raise CliError(
            "--engine_kwargs may not set " + ", ".join(repr(k) for k in owned) + ", which calibration sets itself. Fix: "
            + "; ".join(f"{k}: {CALIBRATION_ENGINE_KWARGS[k]}" for k in owned)
        )
    for key in extra:  # "Model", "Max_Model_Len": a near miss of a key calibration sets
        close = difflib.get_close_matches(key.lower(), list(CALIBRATION_ENGINE_KWARGS), n=1, cutoff=0.8) if len(key) < 64 else []
        if close:
            raise CliError(f"--engine_kwargs key {shorten(key, 60)!r} is not an engine argument; did you mean {close[0]!r}? "
                           f"calibration sets that one itself. Fix: {CALIBRATION_ENGINE_KWARGS[close[0]]}")
    return extra


def _check_engine_choices(args, extra: Mapping[str, Any]) -> None:
    """``--dtype``, ``--attention_backend`` and the ``--engine_kwargs`` keys against what the
    installed vLLM accepts (``compat.launch.engine_choices``, imports vLLM); skipped where
    vLLM is not importable here (then vLLM itself refuses them when it starts)."""
    from compat.launch import engine_choices

    choices = engine_choices()
    if choices is None:
        return
    release = f"vLLM {choices.vllm_version}" if choices.vllm_version else "the installed vLLM"
    if choices.dtypes is not None and args.dtype not in choices.dtypes:
        raise CliError(f"--dtype {shorten(args.dtype, 60)!r} is not a dtype {release} accepts; expected one of "
                       f"{', '.join(choices.dtypes)}. Fix: pass e.g. --dtype bfloat16 (or omit it for auto)")
    if args.attention_backend and choices.backends is not None and args.attention_backend not in choices.backends:
        close = difflib.get_close_matches(args.attention_backend.upper(), list(choices.backends), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        raise CliError(f"--attention_backend {shorten(args.attention_backend, 60)!r} is not a backend {release} knows; "
                       f"{hint}expected one of {', '.join(choices.backends)}. Fix: pass one of them, or omit the flag "
                       f"to let vLLM choose")
    if choices.kwargs is not None:
        unknown = [k for k in extra if k not in choices.kwargs]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, sorted(choices.kwargs), n=1, cutoff=0.75) if len(key) < 64 else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise CliError(f"--engine_kwargs key {shorten(key, 60)!r} is not an argument of {release}'s LLM{hint}. "
                           f"Fix: use the names of vllm.LLM / EngineArgs (e.g. kv_cache_memory_bytes, gpu_memory_utilization)")


def _check_pipeline_parallel(args) -> None:
    """--pipeline_parallel_size > 1 where the installed vLLM cannot run it eagerly (calibration
    always runs eager): refused now, not after the engine has started and died on its first step."""
    from compat.launch import eager_cpu_pipeline_parallel_error

    error = eager_cpu_pipeline_parallel_error(args.pipeline_parallel_size)
    if error is not None:
        raise CliError(f"--pipeline_parallel_size {args.pipeline_parallel_size}: {error}")


def _read_model_config(ckpt: Path) -> dict:
    try:
        return read_config_json(ckpt)
    except SparseAttentionConfigError as exc:
        raise CliError(f"{exc}; calibrate needs a local Hugging Face checkpoint directory") from None


def _vocab_size(model_config: Mapping[str, Any]) -> int | None:
    """The model's vocabulary size (``vocab_size``, top level or in ``text_config``); None if absent or not a
    positive integer."""
    value = config_value(model_config, "vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _check_bounds(args) -> None:
    if not 0.0 < args.target_sparse_ratio < 1.0:
        raise CliError(f"--target_sparse_ratio {args.target_sparse_ratio} must be in (0, 1)")
    if (args.decode_tokens < 0 or args.calib_samples < 1 or args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1
            or args.num_candidates < 4):
        raise CliError("--decode_tokens must be >= 0, --calib_samples >= 1, --tensor_parallel_size >= 1, "
                       "--pipeline_parallel_size >= 1, --num_candidates >= 4")
    for flag, limit in LIMITS.items():
        value = getattr(args, flag[2:])
        if value is not None and value > limit:
            raise CliError(f"{flag} {shorten(str(value), 40)} is more than the {limit} calibrate accepts. "
                           f"Fix: pass {flag} {limit} or less")
    lo, hi = SEED_RANGE
    if not lo <= args.seed <= hi:
        raise CliError(f"--seed {shorten(str(args.seed), 40)} is outside {lo}..{hi} (vLLM seeds numpy, which takes an "
                       f"unsigned 32-bit seed). Fix: pass e.g. --seed 0")


def _lengths(args, model_config: Mapping[str, Any]) -> tuple[int, int]:
    """``(calib_max_seqlen, max_model_len)``, checked against the model's own limit."""
    from compat.launch import model_length_limit

    for flag, value in (("--max_model_len", args.max_model_len), ("--calib_max_seqlen", args.calib_max_seqlen),
                        ("--calib_min_seqlen", args.calib_min_seqlen)):
        if value is not None and value < 1:
            raise CliError(f"{flag} {value} must be a positive number of tokens"
                           + (" (omit it to use --calib_max_seqlen)" if flag == "--max_model_len" else ""))
    limit = model_length_limit(model_config)
    if limit is not None:
        limit_tokens, key = limit
        for flag, value in (("--max_model_len", args.max_model_len), ("--calib_max_seqlen", args.calib_max_seqlen)):
            if value is not None and value > limit_tokens:
                raise CliError(f"{flag} {value} exceeds the model's context limit of {limit_tokens} tokens "
                               f"(config.json {key}). Fix: pass {flag} {limit_tokens} or less")
    calib_max = args.calib_max_seqlen
    if calib_max is None:
        calib_max = DEFAULT_CALIB_MAX_SEQLEN
        if args.max_model_len is not None:
            calib_max = min(calib_max, args.max_model_len)
        if limit is not None and limit[0] < calib_max:
            print(f"calibrate: note: the model's context limit is {limit[0]} tokens (config.json {limit[1]}); "
                  f"using --calib_max_seqlen {limit[0]} instead of the default {DEFAULT_CALIB_MAX_SEQLEN}")
            calib_max = limit[0]
    max_model_len = args.max_model_len if args.max_model_len is not None else calib_max
    return calib_max, max_model_len


def _check_args(args) -> _Plan:
    """Every check that needs neither a tokenizer nor an engine (runs first; the last one,
    against what the installed vLLM accepts, imports vLLM)."""
    ckpt = Path(args.checkpoint)
    _check_bounds(args)
    model_config = _read_model_config(ckpt)
    if args.update_checkpoint_config:
        # The same refusals update_checkpoint_config makes after the fit (a foreign
        # sparse_attention_config such as MiniMax-M3's, a malformed one, an unwritable
        # directory), made now so a long calibration is not wasted on them.
        try:
            check_checkpoint_update(ckpt)
        except ExportError as exc:
            raise CliError(f"--update_checkpoint_config: {exc}") from None
    _calib_tasks(args)
    plot_prefix, plot_paths = _check_plot(args)
    output = _check_output(args, ckpt, plot_paths)
    extra = _parse_engine_kwargs(args.engine_kwargs)
    calib_max, max_model_len = _lengths(args, model_config)
    _check_engine_choices(args, extra)
    _check_pipeline_parallel(args)
    for directory in {ckpt.absolute(), output.absolute().parent}:
        for stale in remove_stale_temp_files(directory):
            print(f"calibrate: removed {stale}, left by a killed earlier run")
    return _Plan(ckpt=ckpt, output=output, plot_prefix=plot_prefix, calib_max_seqlen=calib_max,
                 max_model_len=max_model_len, engine_extra=extra, vocab_size=_vocab_size(model_config))


def _load_user_samples(args, plan: _Plan) -> list[CalibrationSample] | None:
    """--calib_data_dir / --prompts_file parsed and validated without a tokenizer
    (None for synthetic data), token ids against the model's vocabulary. Runs before
    transformers or vLLM is imported."""
    if not (args.calib_data_dir or args.prompts_file):
        return None
    samples: list[CalibrationSample] = []
    try:
        for source in filter(None, (args.calib_data_dir, args.prompts_file)):
            samples += load_prompts(source)
        if plan.vocab_size is not None:
            check_vocabulary(samples, plan.vocab_size, source=f"{plan.ckpt / 'config.json'} vocab_size")
    except CalibrationDataError as exc:
        raise CliError(str(exc)) from None
    return samples


def _calib_tasks(args) -> list[str]:
    """``--calib_tasks`` as a list (every eval kind when not given); refused unless ``--calib_set tasks``."""
    raw = getattr(args, "calib_tasks", None)
    if raw is None:
        return list(EVAL_TASKS)
    if getattr(args, "calib_set", "synthetic") != "tasks" or args.calib_data_dir or args.prompts_file:
        raise CliError("--calib_tasks chooses kinds of the built-in task prompts; it needs --calib_set tasks and no "
                       "--calib_data_dir / --prompts_file")
    kinds = [k.strip() for k in raw.split(",") if k.strip()]
    if not kinds or (unknown := [k for k in kinds if k not in EVAL_TASKS]):
        raise CliError(f"--calib_tasks {shorten(raw, 80)!r}: unknown or empty; choose from {', '.join(EVAL_TASKS)}")
    return list(dict.fromkeys(kinds))


def _task_samples(args, plan: _Plan, tokenizer) -> list[CalibrationSample]:
    """``--calib_set tasks``: the eval's kinds of prompt (chat-wrapped when the tokenizer has a template),
    from calibration's own random stream, ``--calib_samples`` of them round-robin over kinds and length bins."""
    kinds = _calib_tasks(args)
    bins = length_bins(plan.calib_max_seqlen, min(args.calib_min_seqlen, plan.calib_max_seqlen))
    per_cell = -(-args.calib_samples // (len(kinds) * len(bins)))
    built = build_samples(tokenizer, tasks=kinds, lengths=bins, per_cell=per_cell, seed=args.seed,
                          reserve=args.decode_tokens + TASK_PROMPT_MARGIN, stream="calib")
    order = sorted(built, key=lambda s: (s.index, bins.index(s.length), kinds.index(s.task)))
    return [CalibrationSample(prompt_token_ids=s.prompt_token_ids, task=s.task, target_len=s.length,
                              num_tokens=len(s.prompt_token_ids)) for s in order[:args.calib_samples]]


def _samples(args, plan: _Plan, tokenizer, loaded: list[CalibrationSample] | None) -> list[CalibrationSample]:
    try:
        if loaded is None and getattr(args, "calib_set", "synthetic") == "tasks":
            loaded = _task_samples(args, plan, tokenizer)
        if loaded is None:
            if _use_chat_template(args, tokenizer):
                # A chat model is served chat turns: its attention over a template-wrapped prompt
                # (system turn, role markers, the generation prompt) is what serving sees.
                tokenizer = ChatTemplatePrompts(tokenizer)
                print("calibrate: synthetic prompts wrapped in the tokenizer's chat template (--chat_template off: raw text)")
            loaded = generate_calibration_samples(
                tokenizer, num_samples=args.calib_samples, max_seqlen=plan.calib_max_seqlen,
                min_seqlen=min(args.calib_min_seqlen, plan.calib_max_seqlen), num_decode_tokens=args.decode_tokens, seed=args.seed,
            )
        return check_lengths(loaded, tokenizer, max_model_len=plan.max_model_len, decode_tokens=args.decode_tokens)
    except CalibrationDataError as exc:
        raise CliError(str(exc)) from None


def _use_chat_template(args, tokenizer) -> bool:
    mode = getattr(args, "chat_template", "auto")
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has:
        raise CliError("--chat_template on: the checkpoint's tokenizer has no chat template. Fix: --chat_template off")
    return mode == "on" or (mode == "auto" and has)


@contextlib.contextmanager
def _environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set ``updates`` in ``os.environ`` for the block, then restore what was there.

    vLLM's engine and worker processes inherit the environment when they start
    (inside ``LLM(...)``), which is how the counting-mode scales and the CPU
    thread binding reach them; the caller's environment is left as it was.
    """
    previous = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _label(kind: str, phase: str) -> str:
    """A curve's name in messages: ``prefill`` (global layers) or ``prefill of sliding-window layers``."""
    return phase if kind == "global" else f"{phase} of sliding-window layers"


def _fit_kinds(measurement, target: float) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """One fit per layer kind and phase that has counts (``fit_counts``), and the failures.

    Each kind gets its own curve because one pooled curve misses the target on both kinds
    (Gemma-3-270M, 50 % decode target: 65.5 % global / 35.3 % windowed held out, a curve per kind
    51.9 % / 46.4 %; docs/kernels.md). Windowed counts were taken at ``c / min(kv_len, w)``."""
    fits: dict[str, dict[str, Any]] = {}
    errors = []
    for kind in measurement.kinds:
        for phase in PHASES:
            samples = measurement.by_kind[kind][phase]
            if not samples:
                continue
            try:
                fit = fit_counts(measurement.scales, samples, target, phase=_label(kind, phase))
                fits.setdefault(kind, {})[phase] = fit if kind == "global" else replace(fit, normaliser="min(kv_len, w)")
            except CalibrationError as exc:
                errors.append(f"{_label(kind, phase)}: {exc}")
    for kfits in fits.values():
        for fit in kfits.values():
            print("fit " + fit.summary())
    return fits, errors


def calibrate(args) -> int:
    started = time.monotonic()
    plan = _check_args(args)
    loaded = _load_user_samples(args, plan)
    if loaded is not None and all(s.prompt_token_ids for s in loaded):
        tokenizer = None  # token-id prompts: lengths are checked without transformers
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(plan.ckpt))
    samples = _samples(args, plan, tokenizer, loaded)
    lengths = [s.num_tokens for s in samples]
    print(f"calibrate: {len(samples)} samples, {min(lengths)}..{max(lengths)} tokens, {args.decode_tokens} decode steps each")
    try:
        scales = candidate_scales(max(lengths) + args.decode_tokens, num=args.num_candidates)
    except ValueError as exc:
        raise CliError(str(exc)) from None

    from compat import launch
    from sparse_attn.protocol import STATS_RPC

    with _environ({**counting_mode_env(scales), **launch.cpu_parallel_env(args.tensor_parallel_size * args.pipeline_parallel_size)}):
        from tqdm import tqdm
        from vllm import LLM

        llm = LLM(**launch.calibration_engine_kwargs(
            model=str(plan.ckpt), dtype=args.dtype, max_model_len=plan.max_model_len,
            tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size, seed=args.seed,
            backend=args.attention_backend, extra=plan.engine_extra,
        ))
        # What each worker installed, before any sample runs: the layers served sparse are the
        # ones calibrated (the same rules decide at serving time), and a model none of whose
        # layers can be served is refused here rather than after the whole run.
        try:
            served = served_layers(llm.collective_rpc(STATS_RPC))
        except CalibrationError as exc:
            raise CliError(f"{exc}; nothing was calibrated or written") from None
        print(f"calibrate: {served.describe()}")
        with tqdm(total=len(samples), desc="calibrating", unit="sample") as progress:
            measurement = measure(llm, samples, scales, decode_tokens=args.decode_tokens, stats_rpc=STATS_RPC, progress=progress)
        del llm
    installed, total = measurement.layers_installed, measurement.layers_total
    if installed != list(served.installed) or total != list(served.total):
        raise CliError(f"the counting adapter ran on {installed} of {total} attention layers per worker, but the "
                       f"workers installed it on {list(served.installed)} of {list(served.total)} at start-up; "
                       f"nothing written (see the sparse-attn log lines)")

    fits_by_kind, errors = _fit_kinds(measurement, args.target_sparse_ratio)
    if errors or not fits_by_kind:
        raise CliError("fit failed, nothing written: " + "; ".join(errors or ["no phase produced data points"]))
    # The main curve (threshold_scale_factor, what ModelOpt / TensorRT-LLM read) is the global layers';
    # a model whose every served layer has a window has only the window curve, written in both keys.
    main_kind = "global" if "global" in fits_by_kind else "windowed"
    if main_kind == "windowed":
        print("calibrate: every served layer has a sliding window: threshold_scale_factor holds the window curve too "
              "(TensorRT-LLM divides it by kv_len, not min(kv_len, window), so it skips more there on prompts longer "
              "than the window)")
    fits = fits_by_kind[main_kind]
    window_fits = fits_by_kind.get("windowed")
    spread = {kind: {phase: measurement.spread_by_task(phase, fit.scale_at_target, kind) for phase, fit in kfits.items()}
              for kind, kfits in fits_by_kind.items()}
    for kind, by_phase in spread.items():
        for phase, tasks in by_phase.items():
            if len(tasks) > 1:
                print(f"calibrate: {_label(kind, phase)} sparsity at the fitted scale by prompt kind (pooled, prompts "
                      f"min..max): " + "; ".join(f"{t} {100 * v['pooled']:.1f}% ({100 * v['min']:.0f}..{100 * v['max']:.0f}, "
                                                f"n={v['n']})" for t, v in tasks.items()))

    section = build_sparse_attention_config(fits, target_classes=measurement.owner_classes or None, window_fits=window_fits)
    report = {
        "sparse_attention_config": section,
        "calibration": {phase: {**f.to_report(), "spread_by_task": spread[main_kind][phase]} for phase, f in fits.items()},
        "counts": measurement.counts_report(),
        "samples": len(samples),
        "decode_tokens": args.decode_tokens,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "layers_installed_per_worker": installed,
        "install_per_worker": measurement.installs,
        "layers_total_per_worker": total,
        "layers_native": served.native,
        "seconds": round(time.monotonic() - started, 1),
    }
    if window_fits is not None:
        report["calibration_windowed"] = {phase: {**f.to_report(), "spread_by_task": spread["windowed"][phase]}
                                          for phase, f in window_fits.items()}
    write_json_atomic(plan.output, report)
    print(f"wrote {plan.output}")
    if args.update_checkpoint_config:
        try:
            update_checkpoint_config(plan.ckpt, section)
        except ExportError as exc:  # e.g. config.json changed during the run; the report is safe
            raise CliError(f"--update_checkpoint_config: {exc} (the calibration report was written to {plan.output})") from None
        print(f"updated {plan.ckpt / 'config.json'} (sparse_attention_config)")
    if plan.plot_prefix is not None:
        from sparse_attn.calibration.plot import plot_fits

        try:
            paths = []
            for kind, kfits in fits_by_kind.items():
                name = plan.plot_prefix.name + ("_" if kind == "global" else "_windowed_")
                paths += plot_fits(measurement.kind_points(kind), kfits, plan.plot_prefix.parent, prefix=name)
        except (CalibrationError, OSError) as exc:
            raise CliError(f"--plot failed after the results were written ({plan.output}): {exc}") from None
        for path in paths:
            print(f"plot: {path}")
    print(f"calibration took {report['seconds']} s")
    return 0
