"""Measure skip-softmax sparsity through vLLM's own serving path.

The engine is started with the sparse adapters in counting mode (outputs stay
dense): every attention launch records, for each candidate scale factor
``c`` (``lambda = c / kv_len``), how many KV tiles would be skipped. Samples run
one at a time: a prefill, then ``decode_tokens`` decode steps; after each, the
integer counts are pulled from every worker (tensor-parallel ranks and pipeline stages included)
with ``collective_rpc`` and summed before any ratio is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from sparse_attn.calibration.fit import CalibrationError, FitPoint, SampleCounts, pool
from sparse_attn.protocol import LAYER_KINDS, PHASES, calibration_env, merge_worker_counts
from sparse_attn.workloads.prompts import CalibrationSample

#: The plugin's log interval variable (declared in sparse_attn.settings); 0 turns the periodic lines off.
STATS_INTERVAL_ENV = "SPARSE_ATTN_STATS_INTERVAL_S"

__all__ = ["PHASES", "Measurement", "ServedLayers", "candidate_scales", "counting_mode_env", "measure", "merge_worker_counts",
           "served_layers"]


def candidate_scales(max_kv_len: int, num: int = 24, low: float = 1e-2) -> list[float]:
    """``num`` candidate scale factors ``c`` (``lambda = c / kv_len``), geometric from ``low``
    up to ``0.95 * max_kv_len`` (sparsity grows roughly with ``ln c``, so equal ratios
    cover the useful band evenly). At a launch where ``lambda >= 1`` a candidate records
    no data (serving runs such launches dense), so long prompts reach the high end."""
    high = 0.95 * max_kv_len
    if isinstance(num, bool) or not isinstance(num, int) or num < 2:
        raise CalibrationError(f"the candidate grid needs at least 2 scales, got {num!r}; pass --num_candidates >= 4")
    if not high > low:
        raise CalibrationError(f"calibration prompts are too short ({max_kv_len} tokens incl. decode) for a scale grid "
                               f"from {low}; use longer prompts (--calib_max_seqlen / --calib_min_seqlen)")
    step = (math.log(high) - math.log(low)) / (num - 1)
    return [math.exp(math.log(low) + i * step) for i in range(num)]


@dataclass
class Measurement:
    """Integer counts of one calibration run: per layer kind and phase, one :class:`SampleCounts`
    per sample (index ``j`` of its lists = ``scales[j]``), plus what the workers reported about
    themselves. ``samples`` is the global layers' (the main curve's); a model without sliding
    windows has no ``windowed`` counts."""

    scales: list[float]
    by_kind: dict[str, dict[str, list[SampleCounts]]] = field(
        default_factory=lambda: {k: {p: [] for p in PHASES} for k in LAYER_KINDS})
    layers_installed: list[int] = field(default_factory=list)
    layers_total: list[int] = field(default_factory=list)
    owner_classes: list[str] = field(default_factory=list)
    #: each worker's install summary (``sparse_attn.plugin.install``'s), in rank order
    installs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def samples(self) -> dict[str, list[SampleCounts]]:
        """The global layers' counts, phase -> samples."""
        return self.by_kind["global"]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds that produced counts, in ``LAYER_KINDS`` order."""
        return tuple(k for k in LAYER_KINDS if any(self.by_kind[k].values()))

    def kind_points(self, kind: str) -> dict[str, list[FitPoint]]:
        """Per phase, the pooled curve of one layer kind: one point per candidate (:func:`pool`)."""
        return {phase: pool(self.scales, samples) for phase, samples in self.by_kind[kind].items() if samples}

    @property
    def points(self) -> dict[str, list[FitPoint]]:
        """Per phase, the global layers' pooled curve: one point per candidate (:func:`~sparse_attn.calibration.fit.pool`)."""
        return self.kind_points("global")

    def spread_by_task(self, phase: str, scale: float, kind: str = "global") -> dict[str, dict[str, float | int]]:
        """Each prompt kind's sparsity at ``scale`` (the fitted scale at the target): its pooled
        value (tiles summed over its prompts, as serving would report it), and its prompts'
        min / max, so the report says how far another mix of prompts may land from the target."""
        by_task: dict[str, list[SampleCounts]] = {}
        for s in self.by_kind[kind].get(phase, []):
            by_task.setdefault(s.task or "unlabelled", []).append(s)
        out = {}
        for task, samples in sorted(by_task.items()):
            per = [v for v in (s.sparsity_at(self.scales, scale) for s in samples) if v is not None]
            pooled = [p for p in pool(self.scales, samples)]
            value = _interpolate_points(pooled, scale)
            if per and value is not None:
                out[task] = {"n": len(per), "pooled": value, "min": min(per), "max": max(per)}
        return out

    def counts_report(self) -> dict[str, Any]:
        """The raw counts as JSON-ready data (kept in the calibration report, so a fit can be replayed
        offline): ``samples`` the global layers', ``samples_windowed`` the sliding-window layers' (when any)."""
        def rows(by_phase: dict[str, list[SampleCounts]]) -> dict[str, list[dict[str, Any]]]:
            return {phase: [{"kv_len": s.kv_len, "task": s.task, "skipped": list(s.skipped), "visited": list(s.visited)}
                            for s in samples]
                    for phase, samples in by_phase.items()}
        report = {"scales": list(self.scales), "samples": rows(self.samples)}
        if "windowed" in self.kinds:
            report["samples_windowed"] = rows(self.by_kind["windowed"])
        return report


def _interpolate_points(points: Sequence[FitPoint], scale: float) -> float | None:
    """Sparsity of a pooled curve at ``scale``, linear in ``ln scale`` between its candidates."""
    return SampleCounts(skipped=tuple(round(p.sparsity * 10**9) for p in points), visited=tuple(10**9 for _ in points)) \
        .sparsity_at([p.scale for p in points], scale) if points else None


def measure(llm: Any, samples: Sequence[CalibrationSample], scales: Sequence[float], *, decode_tokens: int,
            stats_rpc: str, progress: Any = None, sampling_params: Any = None) -> Measurement:
    """Run every sample through ``llm`` (a ``vllm.LLM`` started in counting mode), one at a time.

    After each sample the workers' counters are read and reset through
    ``llm.collective_rpc(stats_rpc, kwargs={"reset": True})`` and summed over workers
    (:func:`merge_worker_counts`); a phase the sample produced no launch of (decode
    with ``decode_tokens=0``) gets no entry. ``sampling_params`` defaults to greedy
    sampling (``compat.offline.sampling_params``) of ``decode_tokens + 1`` new tokens (the
    first comes from the prefill, each further one is a decode step). Every sample has
    token ids (``workloads.prompts.check_lengths`` gives them)."""
    from compat import offline

    if sampling_params is None:
        sampling_params = offline.sampling_params(max_tokens=decode_tokens + 1)
    result = Measurement(scales=list(scales))
    llm.collective_rpc(stats_rpc, kwargs={"reset": True})  # warm-up launches are not calibration data
    for i, sample in enumerate(samples):
        if not sample.prompt_token_ids:
            raise CalibrationError(f"sample {i} ({sample.source or sample.task}) has no token ids; measure() takes the "
                                   f"samples check_lengths returned")
        kv_len = len(offline.generate(llm, [sample.prompt_token_ids], sampling_params)[0].prompt_token_ids)
        snapshots = llm.collective_rpc(stats_rpc, kwargs={"reset": True})
        result.layers_installed = [s["layers_installed"] for s in snapshots]
        result.layers_total = [s["layers_total"] for s in snapshots]
        result.owner_classes = sorted({c for s in snapshots for c in s["owner_classes"]})
        result.installs = [dict(s["install"]) for s in snapshots]
        for kind, by_phase in merge_worker_counts(snapshots, len(scales)).items():
            for phase, (skipped, visited) in by_phase.items():
                if any(visited):
                    result.by_kind[kind][phase].append(SampleCounts(skipped=tuple(skipped), visited=tuple(visited),
                                                                    kv_len=kv_len, task=sample.task))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(tokens=kv_len, decode_steps=decode_tokens)
    return result


def counting_mode_env(scales: Sequence[float]) -> dict[str, str]:
    """Environment that puts every worker's adapters in counting mode (inherited by worker processes).
    The periodic achieved-sparsity log lines are off: counting mode skips nothing, they would say
    "n/a of 0 tiles" every minute."""
    return {**calibration_env(scales), STATS_INTERVAL_ENV: "0"}


@dataclass(frozen=True)
class ServedLayers:
    """What the workers installed at start-up (their install summaries): per worker the layers
    counted, the attention layers found, and why the others stay native (reason -> layer count)."""

    installed: tuple[int, ...]
    total: tuple[int, ...]
    native: dict[str, int]

    def describe(self) -> str:
        per = ", ".join(f"{i}/{t}" for i, t in zip(self.installed, self.total))
        why = "; ".join(f"{n} x {reason}" for reason, n in sorted(self.native.items(), key=lambda kv: -kv[1]))
        return (f"counting skippable tiles on {per} attention layers per worker (the layers that will be served sparse)"
                + (f"; left native, and not calibrated: {why}" if why else ""))


def served_layers(snapshots: Sequence[dict]) -> ServedLayers:
    """The workers' install summaries (stats RPC snapshots) as :class:`ServedLayers`; raises
    :class:`CalibrationError` when no worker can serve any layer, naming each reason."""
    if not snapshots or not any(int(s["layers_total"]) for s in snapshots):
        raise CalibrationError("the workers found no attention layer to calibrate (the model has none vLLM reports)")
    native: dict[str, int] = {}
    for reason, n in (snapshots[0].get("install") or {}).get("native", {}).items():  # every rank holds the same layers
        native[reason] = native.get(reason, 0) + int(n)
    served = ServedLayers(installed=tuple(int(s["layers_installed"]) for s in snapshots),
                          total=tuple(int(s["layers_total"]) for s in snapshots), native=native)
    if not all(served.installed):
        reasons = "; ".join(f"{n} layer(s): {r}" for r, n in native.items()) or "no reason reported"
        raise CalibrationError(
            f"no attention layer of this model can be served sparse ({served.installed} of {served.total} per worker), "
            f"so there is nothing to calibrate: {reasons}. Fix: serve it natively (no calibration needed), or use a "
            f"vLLM release / attention backend that serves these layers (README: layers that stay native)")
    return served
