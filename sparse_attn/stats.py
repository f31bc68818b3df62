"""Achieved-sparsity counters of one vLLM worker process.

Integer tile counts, summed per phase (and per candidate threshold in
calibration) so they can be added across layers, steps and tensor-parallel
ranks before any ratio is taken. The snapshot is the ``STATS_RPC`` answer
(schema: ``sparse_attn.protocol.SNAPSHOT_KEYS``).

Serving launches add their counts to per-(phase, device) counter tensors
(``device_counter``, the kernels add into them) without reading them; ``snapshot()`` and the periodic
log line read them, outside any forward. ``adapter_calls`` counts Python calls
of the sparse forward: steps replayed from a CUDA graph do not run Python, so
they appear in the device counters only.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sparse_attn.protocol import LAYER_KINDS, PHASE_COUNTERS, PHASES

logger = logging.getLogger("sparse_attn")

#: Index of each counter in a device counter tensor ``[len(PHASE_COUNTERS)]``.
DEVICE_COUNTER_INDEX = {name: i for i, name in enumerate(PHASE_COUNTERS)}


@dataclass
class PhaseCounts:
    skipped: int = 0
    visited: int = 0
    launches: int = 0
    native_launches: int = 0
    #: every lambda of the launch was dense (uncalibrated phase in a mixed batch,
    #: or all KV lengths too short for the fit): served by the sparse kernel at lambda 0
    dense_launches: int = 0
    #: (KV head, tile) pairs tested, and those whose V no query head read (``protocol.PHASE_COUNTERS``)
    v_tested: int = 0
    v_skipped: int = 0

    @property
    def sparsity(self) -> float | None:
        return self.skipped / self.visited if self.visited else None


@dataclass
class WorkerStats:
    """Counters for serving (``phases``) and calibration (``candidates``)."""

    phases: dict[str, PhaseCounts] = field(default_factory=lambda: {p: PhaseCounts() for p in PHASES})
    #: calibration: kind (``protocol.LAYER_KINDS``) -> phase -> [skipped tiles per candidate],
    #: [visited tiles per candidate] (a candidate whose lambda would be >= 1 at a launch's KV
    #: length counts nothing there)
    candidate_skipped: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    candidate_visited: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    layers_installed: int = 0
    layers_total: int = 0
    #: classes of the modules owning the installed layers (checkpoint ``targets`` name these)
    owner_classes: tuple[str, ...] = ()
    #: the worker's install summary (``sparse_attn.plugin.install``'s return value)
    install: dict = field(default_factory=dict)
    adapter_calls: int = 0
    #: (phase, device) -> int64 ``[len(PHASE_COUNTERS)]`` accumulated on the device
    device_counts: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, repr=False)
    last_log: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, phase: str, skipped: int, visited: int) -> None:
        with self.lock:
            counts = self.phases[phase]
            counts.skipped += skipped
            counts.visited += visited
            counts.launches += 1

    def add_native(self, phase: str) -> None:
        with self.lock:
            self.phases[phase].native_launches += 1

    def add_dense(self, phase: str) -> None:
        with self.lock:
            self.phases[phase].dense_launches += 1

    def count_call(self) -> None:
        with self.lock:
            self.adapter_calls += 1

    def device_counter(self, phase: str, device: torch.device) -> torch.Tensor:
        """The persistent int64 ``[len(PHASE_COUNTERS)]`` accumulator of ``phase`` on ``device``,
        which kernels add their counts into (``paged_attention(counters=...)``, nothing read).
        Allocated once per (phase, device): by the install warm-up
        (``sparse_attn.warmup``) before vLLM captures, else at the first call (vLLM's eager
        warm-up), and only ever updated in place, so a captured graph keeps adding to the
        same memory on every replay."""
        key = (phase, str(device))
        total = self.device_counts.get(key)
        if total is None:
            with self.lock:
                total = self.device_counts.get(key)
                if total is None:
                    total = self.device_counts[key] = torch.zeros(len(PHASE_COUNTERS), dtype=torch.int64, device=device)
        return total

    def set_install(self, summary: dict, owner_classes: tuple[str, ...]) -> None:
        with self.lock:
            self.install = dict(summary)
            self.layers_installed, self.layers_total = int(summary["installed"]), int(summary["total"])
            self.owner_classes = tuple(owner_classes)

    def add_candidates(self, phase: str, skipped: list[int], visited: list[int], kind: str = "global") -> None:
        """Add one counting launch's per-candidate tiles of a layer of ``kind``."""
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {kind!r}")
        with self.lock:
            for totals, counts in ((self.candidate_skipped, skipped), (self.candidate_visited, visited)):
                current = totals.setdefault(kind, {}).setdefault(phase, [0] * len(counts))
                for i, value in enumerate(counts):
                    current[i] += value

    def snapshot(self, reset: bool = False) -> dict:
        """The integer counters (device counters read here); ``reset`` zeroes them
        (device accumulators in place: captured graphs hold their addresses)."""
        with self.lock:
            phases = {p: {k: getattr(c, k) for k in PHASE_COUNTERS} for p, c in self.phases.items()}
            for (phase, _device), total in self.device_counts.items():
                for name, value in zip(PHASE_COUNTERS, total.tolist()):
                    phases[phase][name] += int(value)
            data = {
                "phases": phases,
                "candidate_skipped": {k: {p: list(v) for p, v in by.items()} for k, by in self.candidate_skipped.items()},
                "candidate_visited": {k: {p: list(v) for p, v in by.items()} for k, by in self.candidate_visited.items()},
                "layers_installed": self.layers_installed,
                "layers_total": self.layers_total,
                "owner_classes": list(self.owner_classes),
                "adapter_calls": self.adapter_calls,
                "install": dict(self.install),
            }
            if reset:
                self.phases = {p: PhaseCounts() for p in PHASES}
                self.candidate_skipped.clear()
                self.candidate_visited.clear()
                # vLLM runs forwards under torch.inference_mode(), so the accumulators
                # are inference tensors: updating them in place needs that mode too.
                with torch.inference_mode():
                    for total in self.device_counts.values():
                        total.zero_()
                self.adapter_calls = 0
            return data

    def maybe_log(self, interval_s: float, now: float | None = None) -> bool:
        """Log the achieved-sparsity line if ``interval_s`` passed since the last one.
        Once per worker per interval, whichever layer asks (the check and the update
        of ``last_log`` happen under the lock). Returns True when it logged."""
        if interval_s <= 0:
            return False
        now = time.monotonic() if now is None else now
        with self.lock:
            if now - self.last_log < interval_s:
                return False
            self.last_log = now
        snap = self.snapshot()
        logger.info("sparse-attn: achieved sparsity: %s", format_phases(snap["phases"]))
        return True


def format_phases(phases: dict[str, Any]) -> str:
    """One human line for a snapshot's ``phases``."""
    parts = []
    for phase, c in phases.items():
        ratio = f"{c['skipped'] / c['visited']:.1%}" if c["visited"] else "n/a"
        v_unread = f", V unread {c['v_skipped'] / c['v_tested']:.1%}" if c.get("v_tested") else ""
        parts.append(f"{phase} {ratio} of {c['visited']} tiles{v_unread} ({c['launches']} sparse, "
                     f"{c['dense_launches']} dense, {c['native_launches']} native launches)")
    return "; ".join(parts)


STATS = WorkerStats()
