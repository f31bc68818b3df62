"""The contract between the drivers (calibrate, serve, the demo, tests) and the
sparse-attn code inside vLLM workers. Standard library only: importing it pulls
in neither vLLM nor torch nor ``compat``, so a driver or an HTTP harness can
use it in any process.

* ``PHASES``: the phase names (which sequence is in which phase is decided by
  ``compat.model.BatchDescription``);
* ``STATS_RPC``: the worker method ``collective_rpc`` calls; it returns one
  snapshot per worker (``SNAPSHOT_KEYS``, integer counters, plus ``install``:
  that worker's install summary);
* ``CALIBRATION_ENV`` and ``calibration_env(scales)``: how ``calibrate`` puts the
  workers in counting mode (parsed in the worker by ``compat.envs``);
* ``merge_worker_counts`` and ``phase_totals``: sums over workers, taken before
  any ratio.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

PHASES: tuple[str, ...] = ("prefill", "decode")
#: The kinds of layer calibration fits a curve for: ``global`` (no window: ``lambda = c / kv_len``)
#: and ``windowed`` (a sliding window of ``w`` tokens: ``lambda = c / min(kv_len, w)``).
LAYER_KINDS: tuple[str, ...] = ("global", "windowed")

#: Worker method name: ``llm.collective_rpc(STATS_RPC)`` -> one snapshot per worker;
#: ``kwargs={"reset": True}`` also zeroes the counters.
STATS_RPC = "sparse_attn_stats"

#: Set by ``sparse-attn calibrate`` for the engine it starts: a JSON list of
#: candidate scale factors (``lambda = scale / kv_len``). Workers inherit it and
#: run in counting mode. Declared (internal) in ``sparse_attn.settings``.
CALIBRATION_ENV = "SPARSE_ATTN_CALIBRATION_SCALES"

#: Integer counters of one phase in a snapshot's ``phases[phase]``: tiles skipped / visited per query head, launches
#: (sparse, native, dense), and (from kernels that count them: the compiled CPU and Triton ones) the (KV head, tile) pairs
#: tested and those whose V no query head of the group read: ``v_skipped / v_tested`` is the V-tile fraction
#: actually not read, at most ``skipped / visited``.
PHASE_COUNTERS: tuple[str, ...] = ("skipped", "visited", "launches", "native_launches", "dense_launches",
                                   "v_tested", "v_skipped")
#: Keys of one worker's snapshot.
SNAPSHOT_KEYS: tuple[str, ...] = (
    "phases", "candidate_skipped", "candidate_visited", "layers_installed", "layers_total", "owner_classes",
    "adapter_calls", "install", "rank",
)


def calibration_env(scales: Sequence[float]) -> dict[str, str]:
    """The environment entry that puts every worker in counting mode with ``scales``.
    Raises ``ValueError`` unless ``scales`` is a non-empty list of finite numbers > 0."""
    values = [float(s) for s in scales]
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"calibration scales must be a non-empty list of finite numbers > 0, got {list(scales)!r}")
    return {CALIBRATION_ENV: json.dumps(values)}


def merge_worker_counts(snapshots: Sequence[Mapping[str, Any]],
                        num_scales: int) -> dict[str, dict[str, tuple[list[int], list[int]]]]:
    """Sum the integer candidate counts of all workers: kind -> phase -> (skipped, visited), one per
    scale (``LAYER_KINDS`` x ``PHASES``; a snapshot holds ``candidate_skipped[kind][phase]``).

    Each worker counts only what it serves: a tensor-parallel rank its heads of every
    layer, a pipeline stage its own layers; counts are additive over heads and layers,
    so the sum over all workers is the count of the whole model. A worker that
    saw no launch of a phase or kind contributes zeros."""
    merged: dict[str, dict[str, tuple[list[int], list[int]]]] = {}
    for kind in LAYER_KINDS:
        merged[kind] = {}
        for phase in PHASES:
            columns = []
            for key in ("candidate_skipped", "candidate_visited"):
                per_worker = [s[key].get(kind, {}).get(phase, [0] * num_scales) for s in snapshots]
                if any(len(counts) != num_scales for counts in per_worker):
                    raise ValueError(f"{kind} {phase}: workers reported {[len(c) for c in per_worker]} {key} entries, "
                                     f"expected {num_scales} each")
                columns.append([sum(int(c) for c in column) for column in zip(*per_worker)])
            merged[kind][phase] = (columns[0], columns[1])
    return merged


def phase_totals(snapshots: Sequence[Mapping[str, Any]], phase: str) -> dict[str, int]:
    """Sum one phase's integer counters (``PHASE_COUNTERS``) over workers."""
    return {k: sum(int(s["phases"][phase][k]) for s in snapshots) for k in PHASE_COUNTERS}
