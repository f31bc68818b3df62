"""``sparse-attn calibrate``: data -> vLLM counting run -> fit -> export.

Everything that can be checked before vLLM starts is checked first (checkpoint,
writability, data, lengths), and nothing is written until the fit succeeded:
an error or an interrupt leaves the checkpoint and ``--output`` untouched.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sparse_attn.calibration import CalibrationError
from sparse_attn.calibration.data import (
    CalibrationDataError,
    CalibrationSample,
    generate_calibration_samples,
    load_calibration_dir,
)
from sparse_attn.calibration.export import build_sparse_attention_config, update_checkpoint_config, write_json_atomic
from sparse_attn.calibration.fit import fit_phase
from sparse_attn.calibration.runner import PHASES, candidate_scales, counting_mode_env, measure
from sparse_attn.errors import CliError


def _check_checkpoint(args) -> Path:
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        raise CliError(f"{ckpt} has no config.json; pass a local Hugging Face checkpoint directory")
    if args.update_checkpoint_config and not os.access(ckpt, os.W_OK):
        raise CliError(f"--update_checkpoint_config: {ckpt} is not writable; drop the flag and use --output, or fix permissions")
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
        raise CliError(f"--output {args.output}: directory {out_dir} does not exist or is not writable")
    if not 0.0 < args.target_sparse_ratio < 1.0:
        raise CliError(f"--target_sparse_ratio {args.target_sparse_ratio} must be in (0, 1)")
    if args.decode_tokens < 0 or args.calib_samples < 1 or args.tensor_parallel_size < 1 or args.num_candidates < 4:
        raise CliError("--decode_tokens must be >= 0, --calib_samples >= 1, --tensor_parallel_size >= 1, --num_candidates >= 4")
    return ckpt


def _engine_kwargs(args, max_model_len: int) -> dict[str, Any]:
    try:
        extra = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as exc:
        raise CliError(f"--engine_kwargs is not JSON ({exc}); e.g. '{{\"kv_cache_memory_bytes\": 1073741824}}'") from None
    if not isinstance(extra, dict):
        raise CliError(f"--engine_kwargs must be a JSON object, got {type(extra).__name__}")
    from compat import launch

    return launch.calibration_engine_kwargs(
        model=args.checkpoint, dtype=args.dtype, max_model_len=max_model_len, tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed, backend=args.attention_backend, extra=extra,
    )


def _load_user_samples(args) -> list[CalibrationSample] | None:
    """--calib_data_dir / --prompts_file parsed and validated without a tokenizer
    (None for synthetic data). Runs before transformers or vLLM is imported."""
    if not (args.calib_data_dir or args.prompts_file):
        return None
    samples: list[CalibrationSample] = []
    try:
        for source in filter(None, (args.calib_data_dir, args.prompts_file)):
            samples += load_calibration_dir(source)
    except CalibrationDataError as exc:
        raise CliError(str(exc)) from None
    if not samples:
        raise CliError("the calibration set is empty; pass a non-empty --calib_data_dir/--prompts_file")
    return samples


def _samples(args, tokenizer, max_model_len: int, loaded: list[CalibrationSample] | None = None) -> list[CalibrationSample]:
    try:
        if loaded is not None:
            samples = list(loaded)
        else:
            samples = generate_calibration_samples(
                tokenizer, num_samples=args.calib_samples, max_seqlen=args.calib_max_seqlen,
                min_seqlen=min(args.calib_min_seqlen, args.calib_max_seqlen), num_decode_tokens=args.decode_tokens, seed=args.seed,
            )
    except CalibrationDataError as exc:
        raise CliError(str(exc)) from None
    if not samples:
        raise CliError("the calibration set is empty; pass --calib_samples >= 1 or a non-empty --calib_data_dir/--prompts_file")
    tokenised = []
    for i, sample in enumerate(samples):
        ids = list(sample.prompt_token_ids) if sample.prompt_token_ids else tokenizer.encode(sample.prompt)
        if len(ids) + args.decode_tokens > max_model_len:
            raise CliError(
                f"sample {i} ({sample.source or sample.task}) has {len(ids)} tokens + {args.decode_tokens} decode tokens "
                f"> --max_model_len {max_model_len}; raise --max_model_len or shorten the sample"
            )
        tokenised.append(CalibrationSample(prompt_token_ids=tuple(ids), task=sample.task, target_len=sample.target_len,
                                           num_tokens=len(ids), source=sample.source))
    return tokenised


def calibrate(args) -> int:
    started = time.monotonic()
    ckpt = _check_checkpoint(args)
    max_model_len = args.max_model_len or args.calib_max_seqlen
    loaded = _load_user_samples(args)
    if loaded is not None and all(s.prompt_token_ids for s in loaded):
        tokenizer = None  # token-id prompts: lengths are checked without transformers
        samples = _samples(args, tokenizer, max_model_len, loaded)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        samples = _samples(args, tokenizer, max_model_len, loaded)
    lengths = [s.num_tokens for s in samples]
    print(f"calibrate: {len(samples)} samples, {min(lengths)}..{max(lengths)} tokens, {args.decode_tokens} decode steps each")
    try:
        scales = candidate_scales(max(lengths) + args.decode_tokens, num=args.num_candidates, logspace=args.fit_logspace)
    except ValueError as exc:
        raise CliError(str(exc)) from None

    from compat import launch
    from sparse_attn.protocol import STATS_RPC

    os.environ.update(counting_mode_env(scales))
    os.environ.update(launch.cpu_tensor_parallel_env(args.tensor_parallel_size))
    from tqdm import tqdm
    from vllm import LLM

    llm = LLM(**_engine_kwargs(args, max_model_len))
    with tqdm(total=len(samples), desc="calibrating", unit="sample") as progress:
        measurement = measure(llm, samples, scales, decode_tokens=args.decode_tokens, stats_rpc=STATS_RPC, progress=progress)
    del llm
    installed, total = measurement.layers_installed, measurement.layers_total
    if not total or any(i != t or t == 0 for i, t in zip(installed, total)):
        raise CliError(f"the counting adapter ran on {installed} of {total} attention layers per worker; "
                       f"expected all (see the sparse-attn log lines for the layers left native and why)")

    phases = [p for p in PHASES if measurement.points[p]]
    fits, errors = {}, []
    for phase in phases:
        try:
            fits[phase] = fit_phase(measurement.points[phase], args.target_sparse_ratio, phase=phase, fit_logspace=args.fit_logspace)
        except CalibrationError as exc:
            errors.append(f"{phase}: {exc}")
    if errors or not fits:
        raise CliError("fit failed, nothing written: " + "; ".join(errors or ["no phase produced data points"]))
    for fit in fits.values():
        print("fit " + fit.summary())

    section = build_sparse_attention_config(fits, target_classes=measurement.owner_classes or None)
    report = {
        "sparse_attention_config": section,
        "calibration": {
            phase: {"a": f.a, "b": f.b, "r2": f.r2, "points_used": f.points_used, "points_total": f.points_total,
                    "observed_sparsity_range": list(f.observed_sparsity_range), "target_sparsity": f.target_sparsity,
                    "scale_at_target": f.scale_at_target, "warning": f.warning}
            for phase, f in fits.items()
        },
        "samples": len(samples),
        "decode_tokens": args.decode_tokens,
        "tensor_parallel_size": args.tensor_parallel_size,
        "layers_installed_per_worker": installed,
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.plot:
        from sparse_attn.calibration.plot import plot_fits

        for path in plot_fits(measurement.points, fits, Path(args.plot).parent, prefix=Path(args.plot).name + "_"):
            print(f"plot: {path}")
    write_json_atomic(args.output, report)
    print(f"wrote {args.output}")
    if args.update_checkpoint_config:
        update_checkpoint_config(ckpt, section)
        print(f"updated {ckpt / 'config.json'} (sparse_attention_config)")
    print(f"calibration took {report['seconds']} s")
    return 0
