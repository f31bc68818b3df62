"""Achieved-sparsity counters of one vLLM worker process.

Integer tile counts, summed per phase (and per candidate threshold in
calibration) so they can be added across layers, steps and tensor-parallel
ranks before any ratio is taken.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

PHASES = ("prefill", "decode")


@dataclass
class PhaseCounts:
    skipped: int = 0
    visited: int = 0
    launches: int = 0
    native_launches: int = 0
    #: uncalibrated phase inside a mixed batch: served by the sparse kernel at lambda 0
    dense_launches: int = 0

    @property
    def sparsity(self) -> float | None:
        return self.skipped / self.visited if self.visited else None


@dataclass
class WorkerStats:
    """Counters for serving (``phases``) and calibration (``candidates``)."""

    phases: dict[str, PhaseCounts] = field(default_factory=lambda: {p: PhaseCounts() for p in PHASES})
    #: calibration: phase -> [skipped tiles per candidate], [visited tiles per candidate]
    #: (a candidate whose lambda would be >= 1 at a launch's KV length counts nothing there)
    candidate_skipped: dict[str, list[int]] = field(default_factory=dict)
    candidate_visited: dict[str, list[int]] = field(default_factory=dict)
    layers_installed: int = 0
    layers_total: int = 0
    #: classes of the modules owning the installed layers (checkpoint ``targets`` name these)
    owner_classes: tuple[str, ...] = ()
    adapter_calls: int = 0
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

    def add_candidates(self, phase: str, skipped: list[int], visited: list[int]) -> None:
        with self.lock:
            for totals, counts in ((self.candidate_skipped, skipped), (self.candidate_visited, visited)):
                current = totals.setdefault(phase, [0] * len(counts))
                for i, value in enumerate(counts):
                    current[i] += value

    def snapshot(self, reset: bool = False) -> dict:
        with self.lock:
            data = {
                "phases": {p: {"skipped": c.skipped, "visited": c.visited, "launches": c.launches, "native_launches": c.native_launches,
                           "dense_launches": c.dense_launches}
                           for p, c in self.phases.items()},
                "candidate_skipped": {p: list(v) for p, v in self.candidate_skipped.items()},
                "candidate_visited": {p: list(v) for p, v in self.candidate_visited.items()},
                "layers_installed": self.layers_installed,
                "layers_total": self.layers_total,
                "owner_classes": list(self.owner_classes),
                "adapter_calls": self.adapter_calls,
            }
            if reset:
                self.phases = {p: PhaseCounts() for p in PHASES}
                self.candidate_skipped.clear()
                self.candidate_visited.clear()
                self.adapter_calls = 0
            return data


STATS = WorkerStats()
