"""The ``vllm.general_plugins`` entry point: installs sparse attention in every
vLLM worker right after it loads the model.

vLLM calls ``register()`` once in each of its processes (API server, engine
core, workers; vLLM's plugin filter variable still applies). ``register`` only hooks the
end of model loading (``compat.worker.on_model_loaded``); the install itself
runs in worker processes, reads ``sparse_attention_config`` from the HF
config vLLM loaded (local directory or hub ID alike) and replaces each
matching attention layer's impl.
Without a config, vLLM stays untouched and one log line says so.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

import compat
from compat import envs, graphs, patches
from compat import model as cmodel
from compat import worker as cworker
from sparse_attn import settings, warmup
from sparse_attn.adapter import Policy, layer_device, make_sparse
from sparse_attn.config import SECTION_KEY, SparseAttentionConfig, StartupRefused, startup_notes
from sparse_attn.kernels import support
from sparse_attn.kernels import cpu_impl, never_skips
from sparse_attn.protocol import CALIBRATION_ENV, PHASES, STATS_RPC
from sparse_attn.stats import STATS

logger = logging.getLogger("sparse_attn")

__all__ = ["CALIBRATION_ENV", "STATS_RPC", "SparseAttentionStartupError", "install", "install_in_worker", "register",
           "sparsity_stats", "uninstall"]


class SparseAttentionStartupError(RuntimeError):
    """The checkpoint asks for sparse attention that cannot be installed (strict mode, bad config)."""


def register() -> None:
    """Entry point, run in every vLLM process (API server, engine core, workers).

    Cheap and safe there: parses the environment (a malformed ``SPARSE_ATTN_*`` variable
    fails start-up here with its fix, before any model loads) and hooks model loading.
    It probes nothing and imports no vLLM module: the worker class is hooked when vLLM
    imports it, so the API server, which never does, is left alone; the probe runs in
    the worker, at install."""
    _log_to_stderr()
    if settings.get("SPARSE_ATTN_DISABLE"):
        logger.info("sparse-attn: SPARSE_ATTN_DISABLE=1, vLLM attention left native")
        return
    for name in envs.validate_all():
        envs.get(name)  # raises that variable's InvalidOverrideError (what was seen, the valid choices)
    cworker.on_model_loaded(install_in_worker)
    cworker.add_worker_rpc(STATS_RPC, sparsity_stats)


def _log_to_stderr() -> None:
    # vLLM configures only its own "vllm" logger, so without a handler our INFO
    # lines (the per-worker install report) would be dropped. Attach one only
    # where nothing would print them: no handler on our logger, none on the
    # root logger (an application's logging.basicConfig / pytest's caplog), and
    # keep propagation, so an application that configures logging sees them.
    # The level is raised to INFO only where nobody chose one.
    for name in ("sparse_attn", "compat"):
        log = logging.getLogger(name)
        if log.handlers or logging.getLogger().handlers:
            continue
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("(pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)


def _load_config(worker: Any, *, calibrating: bool = False) -> tuple[SparseAttentionConfig | None, tuple[str, ...]]:
    """The skip-softmax config of the model this worker loaded (None = native attention), and
    the start-up warnings it logged (they also go into the install summary, so a caller reads
    them from the stats RPC instead of the log's wording).

    Read from the HF config vLLM parsed (``compat.cworker.worker_hf_config_section``),
    so hub IDs, ``--revision`` and ``--hf-overrides`` behave like a local
    directory. What it means is decided by ``sparse_attn.config.startup_notes``,
    the policy ``sparse-attn serve --validate-only`` previews, with the worker's
    ``max_model_len`` as the served length.
    """
    model = cworker.worker_checkpoint(worker)
    try:
        startup = startup_notes(cworker.worker_hf_config_section(worker, SECTION_KEY), source=f"the HF config of {model}",
                                model=str(model), max_kv_len=cworker.worker_max_model_len(worker), strict=settings.get("SPARSE_ATTN_STRICT"))
    except StartupRefused as exc:
        raise SparseAttentionStartupError(f"sparse-attn: {exc}") from None
    warned = (*envs.unknown_warnings(), *startup.warnings)
    for note in warned:
        logger.warning("sparse-attn: %s", note)
    if not calibrating:  # counting mode installs without a config; "left native" would be false
        for note in startup.info:
            logger.info("sparse-attn: %s", note)
    return startup.config, tuple(warned)


def install_in_worker(worker: Any) -> dict:
    """Replace the impl of every attention layer the checkpoint's config targets.
    Returns (and logs) the worker's install report."""
    scales = settings.get(CALIBRATION_ENV)
    config, warned = _load_config(worker, calibrating=scales is not None)
    if config is None and scales is None:
        summary = {"rank": cworker.worker_rank(worker), "installed": 0, "total": 0,
                   "reason": "no skip-softmax sparse_attention_config", "startup_warnings": list(warned)}
        STATS.set_install(summary, ())
        return summary
    policy = Policy(
        scale_factors={p: config.scale_factor(p) for p in PHASES} if config else {},
        calibration_scales=scales,
        stats_interval_s=settings.get("SPARSE_ATTN_STATS_INTERVAL_S"),
    )
    return install(cworker.worker_model(worker), config, policy, rank=cworker.worker_rank(worker), startup_warnings=warned)


def install(model: Any, config: SparseAttentionConfig | None, policy: Policy, rank: int = 0,
            startup_warnings: tuple[str, ...] = ()) -> dict:
    """Make every attention layer of ``model`` that ``config`` targets and the kernels serve
    sparse; returns (and logs) the install summary the stats RPC also returns.
    ``startup_warnings``: what reading the config warned about, kept in the summary."""
    strict = settings.get("SPARSE_ATTN_STRICT")
    report = compat.probe()
    installed, native, backends, owners, features, curves, never_skip = 0, {}, set(), set(), {}, {}, {}
    dense_by: dict[str, int] = {}
    sparse_impls = []
    where = warmup.model_device_dtype(model)
    # A second install starts from the native model, so that its summary is the whole truth:
    # a layer it leaves native runs native, a layer it makes sparse runs with its policy.
    for layer, _ in cmodel.attention_layers(model):
        cworker.restore_impl(layer)
    layers = list(cmodel.attention_layers(model))
    for layer, info in layers:
        if config is not None and not config.matches(info.name, [info.owner_class, type(layer).__name__]):
            native[info.name] = NOT_TARGETED
            continue
        reason = _native_reason(info, report)
        if reason is None:
            info = cmodel.prepare_layer(layer, info)
            reason = info.compat_refusal
        if reason is None:
            layer_policy = policy_for_layer(policy, config, info)
            run_native, decided = dense_steps(info, where)
            if layer_policy.dense_native != run_native:
                layer_policy = dataclasses.replace(layer_policy, dense_native=run_native)
            try:
                sparse_impls.append(make_sparse(layer, info, layer_policy, STATS))
            except (compat.ImplReplacementError, ValueError) as exc:   # ValueError: kernels.support.spec_for
                reason = str(exc)
        if reason:
            native[info.name] = reason
            continue
        installed += 1
        backends.add(info.backend)
        owners.add(info.owner_class)
        used = info.features.in_use()
        features[used] = features.get(used, 0) + 1
        key = f"{'native' if run_native else 'own'} ({decided})"
        dense_by[key] = dense_by.get(key, 0) + 1
        rule = describe_lambda(layer_policy)
        curves[rule] = curves.get(rule, 0) + 1
        for phase in _phases_that_never_skip(layer_policy):
            key = f"{phase}, window {layer_policy.window}"
            never_skip[key] = never_skip.get(key, 0) + 1
    problems = {name: why for name, why in native.items() if why != NOT_TARGETED}
    if strict and problems:
        raise SparseAttentionStartupError(
            f"SPARSE_ATTN_STRICT=1 and {len(problems)} attention layer(s) cannot run sparse: "
            + "; ".join(f"{n}: {w}" for n, w in sorted(problems.items())[:8])
            + ". Fix: unset SPARSE_ATTN_STRICT to serve them natively, or list them in the config's `ignore`."
        )
    reasons: dict[str, int] = {}
    for why in native.values():
        reasons[why] = reasons.get(why, 0) + 1
    entry = {b: report.backends[b] for b in backends if b in report.backends}
    summary = {
        "rank": rank,
        "installed": installed,
        "total": len(layers),
        "backends": sorted(backends),
        "layout": {b: (e.layout.value if e.layout else None) for b, e in entry.items()},
        "cache_writer": {b: e.writer for b, e in entry.items()},
        "mode": "calibration (counting, dense outputs)" if policy.calibration_scales else "serving",
        "targets": list(config.group.targets) if config else ["all (calibration)"],
        "sparse_features": features,
        # Which curve and normaliser each sparse layer's lambda uses (policy_for_layer).
        "lambda": curves,
        # Window-curve phases whose scale at the target is >= the layer's window: dense at every length.
        "window_curve_never_skips": never_skip,
        # Which attention serves a sparse layer's prefill / mixed steps that cannot skip (dense_steps), and why.
        "dense_steps": dense_by,
        "native": reasons,
        "cuda_graphs": {b: d.describe() for b, d in graphs.installed().items() if b in backends},
        # Which skip-softmax kernel runs the CPU layers (built or loaded here, once per worker).
        "cpu_kernel": cpu_impl.describe() if installed and _on_cpu(model) else None,
        # The start-up policy's warnings for this config (sparse_attn.config.startup_notes), as logged.
        "startup_warnings": list(startup_warnings),
    }
    STATS.set_install(summary, tuple(sorted(owners)))
    if installed and where is not None:     # every kernel variant compiled and the counters allocated before any capture
        warmup.warm_up(sparse_impls, STATS, device=where[0], dtype=where[1])
    for key, n in sorted(never_skip.items()):
        phase, window = key.split(", window ")
        logger.warning(
            "sparse-attn: %d sliding-window layer(s) with a %s-token window never skip a tile in %s: the %s scale factor "
            "of sliding_window_threshold_scale_factor at its target_sparsity is >= %s, so lambda = scale / min(kv_len, %s) "
            ">= 1 at every KV length and that phase of these layers runs dense. Fix: lower target_sparsity, or re-run "
            "`sparse-attn calibrate`", n, window, phase, phase, window, window)
    logger.info(
        "sparse-attn[rank %d]: %d/%d attention layers sparse, backend %s, layout %s, cache writer %s, mode %s, "
        "targets %s, features %s, lambda %s, steps that cannot skip %s%s%s",
        rank, installed, len(layers), ",".join(summary["backends"]) or "-", summary["layout"], summary["cache_writer"],
        summary["mode"], summary["targets"], features or "-", curves or "-", dense_by or "-",
        f", native: {reasons}" if reasons else "",
        f", CPU kernel {summary['cpu_kernel']}" if summary["cpu_kernel"] else "",
    )
    return summary


def dense_steps(info: cmodel.LayerInfo, where: tuple[torch.device, torch.dtype] | None) -> tuple[bool, str]:
    """Whether a sparse layer's prefill / mixed steps in which no lambda is > 0 run vLLM's own impl: ``(native,
    decided by)``, the one place that joins what the layer computes (``where``: the model's device and dtype,
    ``info``: its cache dtype and head size) with what the kernels do fastest.

    ``SPARSE_ATTN_DENSE_STEPS=native`` / ``own`` decides; ``auto``: the plugin's kernel where the compiled CPU kernel
    multiplies a bf16 cache's prefill as bf16 pairs (``cpu_impl.bf16_prefill_on_pairs``: 1.8-2.1x vLLM's CPU kernel
    dense, so falling back to vLLM there made a step whose windowed layers cannot skip slower than skipping off),
    vLLM's own impl elsewhere (an fp32 CPU prefill: vLLM's kernel 3-6 % faster; a GPU: vLLM's FlashAttention /
    FlashInfer; an fp8 cache: not measured)."""
    choice = settings.get("SPARSE_ATTN_DENSE_STEPS")
    if choice != "auto":
        return choice == "native", f"SPARSE_ATTN_DENSE_STEPS={choice}"
    bf16_cpu = where is not None and where[0].type == "cpu" and where[1] == torch.bfloat16 \
        and info.features.kv_cache_dtype in ("auto", "bfloat16")
    if bf16_cpu and cpu_impl.bf16_prefill_on_pairs(info.head_size):
        return False, "auto: bf16 pair products on CPU"
    return True, "auto"


def policy_for_layer(policy: Policy, config: SparseAttentionConfig | None, info: cmodel.LayerInfo) -> Policy:
    """The policy of one layer: the one place that joins the layer's window (compat's
    ``LayerFeatures``) with the checkpoint's curves.

    * a layer without a window: ``policy`` (the main curve, ``lambda = scale / kv_len``);
    * calibration (counting): a windowed layer counts for the window curve, with
      ``lambda = c / min(kv_len, w)``;
    * serving a checkpoint that has the window curve: a windowed layer uses it, normalised
      by ``min(kv_len, w)``; without it, the main curve and ``kv_len`` (TensorRT-LLM's rule,
      so checkpoints calibrated before the window curve existed keep their meaning).
    """
    window = info.features.sliding_window
    if window is None:
        return policy
    if policy.calibration_scales is not None:
        return dataclasses.replace(policy, window=window)
    if config is None or not config.has_window_curve:
        return policy
    return dataclasses.replace(policy, window=window,
                               scale_factors={p: config.scale_factor(p, windowed=True) for p in PHASES})


def _phases_that_never_skip(policy: Policy) -> list[str]:
    """Serving phases of a window-curve policy that never skip (``kernels.never_skips`` at the window:
    ``lambda = scale / min(kv_len, w) >= 1`` at every length). The config alone
    cannot tell (it does not know the windows; ``SparseAttentionConfig.never_skip_warnings`` checks
    ``max_kv_len``): e.g. Gemma-3-270M's windowed prefill curve reaches 512 just above its 50 % target."""
    if policy.window is None or policy.calibration_scales is not None:
        return []
    return [phase for phase in PHASES
            if (scale := policy.scale_factors.get(phase)) is not None and never_skips(scale, policy.window)]


def describe_lambda(policy: Policy) -> str:
    """How a layer's lambda is computed, for the install summary: ``"c / kv_len"`` (counting) or
    ``"scale / kv_len"``, with ``min(kv_len, w)`` on a window curve."""
    scale = "c" if policy.calibration_scales is not None else "scale"
    norm = f"min(kv_len, {policy.window})" if policy.window is not None else "kv_len"
    return f"{scale} / {norm}" if policy.window is None or scale == "c" else f"{scale}_window / {norm}"


def _on_cpu(model: Any) -> bool:
    """True when the model's weights live on the CPU (its attention then runs a CPU kernel)."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return param is not None and param.device.type == "cpu"


def uninstall(model: Any) -> int:
    """Give every attention layer of ``model`` its native impl back and undo what ``install``
    patched in vLLM's metadata builders (batch capture, CUDA-graph declaration); returns how
    many layers were sparse. The model-load hook ``register`` added stays."""
    restored = sum(cworker.restore_impl(layer) for layer, _ in cmodel.attention_layers(model))
    patches.undo_all("layers")
    STATS.set_install({"rank": STATS.install.get("rank", 0), "installed": 0, "total": 0, "reason": "uninstalled"}, ())
    return restored


#: The native reason of a layer the checkpoint's ``targets`` / ``ignore`` leave out (not a problem).
NOT_TARGETED = "not targeted by the config"


def _native_reason(info: cmodel.LayerInfo, report: compat.CompatReport) -> str | None:
    """Why ``info``'s layer must stay native, or ``None``: the one place that joins what
    the kernels serve (``kernels.support``) with what compat says the layer is and has."""
    reasons = list(support.unsupported(info.features, head_size=info.head_size, device=layer_device(info)))
    if info.compat_refusal:
        reasons.append(info.compat_refusal)
    entry = report.backends.get(info.backend)
    if entry is None:
        reasons.append(f"backend {info.backend} is not served (served: {', '.join(report.backends)})")
    elif entry.layout is None:
        reasons.append(f"backend {info.backend}: no known KV-cache layout ({entry.import_error or entry.layout_detail})")
    if info.num_heads % info.num_kv_heads:
        reasons.append(f"{info.num_heads} query heads are not a multiple of {info.num_kv_heads} KV heads")
    return ", ".join(reasons) or None


def sparsity_stats(worker: Any = None, reset: bool = False) -> dict:
    """Worker RPC ``STATS_RPC``: this worker's integer counters and install summary
    (``protocol.SNAPSHOT_KEYS``); ``reset=True`` zeroes the counters. Sum them
    across workers before any ratio."""
    snap = STATS.snapshot(reset=reset)
    snap["rank"] = cworker.worker_rank(worker) if worker is not None else 0
    return snap
