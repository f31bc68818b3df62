"""Measure skip-softmax sparsity through vLLM's own serving path.

The engine is started with the sparse adapters in counting mode (outputs stay
dense): every attention launch records, for each candidate scale factor
``c`` (``lambda = c / kv_len``), how many KV tiles would be skipped. Samples run
one at a time: a prefill, then ``decode_tokens`` decode steps; after each, the
integer counts are pulled from every worker (tensor-parallel ranks included)
with ``collective_rpc`` and summed before any ratio is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from sparse_attn.calibration.data import CalibrationSample
from sparse_attn.calibration.fit import FitPoint
from sparse_attn.protocol import PHASES, calibration_env, merge_worker_counts

__all__ = ["PHASES", "Measurement", "candidate_scales", "counting_mode_env", "measure", "merge_worker_counts"]


def candidate_scales(max_kv_len: int, num: int = 24, low: float = 1e-2, logspace: bool = True) -> list[float]:
    """Candidate scale factors ``c`` (``lambda = c / kv_len``) from ``low`` up to
    ``0.95 * max_kv_len``. At a launch where ``lambda >= 1`` a candidate records no
    data (serving runs such launches dense), so long prompts reach the high end."""
    high = 0.95 * max_kv_len
    if not high > low:
        raise ValueError(f"calibration prompts are too short ({max_kv_len} tokens) for a scale grid from {low}")
    if logspace:
        step = (math.log(high) - math.log(low)) / (num - 1)
        return [math.exp(math.log(low) + i * step) for i in range(num)]
    return [low + i * (high - low) / (num - 1) for i in range(num)]


@dataclass
class Measurement:
    """Per-phase fit points and totals of one calibration run."""

    scales: list[float]
    points: dict[str, list[FitPoint]] = field(default_factory=lambda: {p: [] for p in PHASES})
    layers_installed: list[int] = field(default_factory=list)
    layers_total: list[int] = field(default_factory=list)
    owner_classes: list[str] = field(default_factory=list)


def measure(llm: Any, samples: Sequence[CalibrationSample], scales: Sequence[float], *, decode_tokens: int,
            stats_rpc: str, progress: Any = None) -> Measurement:
    """Run every sample through ``llm`` (a ``vllm.LLM`` started in counting mode)."""
    from vllm import SamplingParams

    result = Measurement(scales=list(scales))
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    llm.collective_rpc(stats_rpc, kwargs={"reset": True})  # warm-up launches are not calibration data
    for sample in samples:
        prompt = {"prompt_token_ids": list(sample.prompt_token_ids)} if sample.prompt_token_ids else sample.prompt
        outputs = llm.generate([prompt], params, use_tqdm=False)
        kv_len = len(outputs[0].prompt_token_ids)
        snapshots = llm.collective_rpc(stats_rpc, kwargs={"reset": True})
        result.layers_installed = [s["layers_installed"] for s in snapshots]
        result.layers_total = [s["layers_total"] for s in snapshots]
        result.owner_classes = sorted({c for s in snapshots for c in s["owner_classes"]})
        for phase, (skipped, visited) in merge_worker_counts(snapshots, len(scales)).items():
            for scale, skip, seen in zip(scales, skipped, visited):
                if seen:
                    result.points[phase].append(FitPoint(scale=scale, sparsity=skip / seen, threshold=scale / kv_len, kv_len=kv_len))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(tokens=kv_len, decode_steps=decode_tokens)
    return result


def counting_mode_env(scales: Sequence[float]) -> dict[str, str]:
    """Environment that puts every worker's adapters in counting mode (inherited by worker processes)."""
    return calibration_env(scales)
