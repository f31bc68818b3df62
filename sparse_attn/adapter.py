"""The sparse attention impl that replaces a vLLM layer's ``impl``.

It becomes a subclass of the native impl's own class holding the native
instance's state (so vLLM's ``isinstance`` checks, ``do_kv_cache_update`` and
every initialised attribute stay as they were), and, per launch:

* runs the native path for profiling/warm-up (no metadata), cascade or
  non-causal launches, fused output quantisation, and launches whose phases
  are all uncalibrated or whose threshold is >= 1 (nothing would survive);
* otherwise stores new tokens through ``compat.cache_writer`` when the
  release's forward path owns the write (exactly once: never when the native
  path ran, which writes for itself), reads K/V through ``compat``'s views, and
  runs the skip-softmax kernel once per phase, each sequence with its own
  threshold ``lambda = a * exp(b * target) / kv_len`` (mixed decode+prefill
  batches are split so each phase gets its own fit);
* in calibration mode, runs the dense counting kernel for a grid of candidate
  scale factors and records integer counts per phase.

Nothing here knows a vLLM release or a cache layout: those are ``compat`` calls.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

import compat
from compat import runtime
from sparse_attn.kernels import paged_attention, paged_attention_counts
from sparse_attn.stats import STATS, WorkerStats

logger = logging.getLogger("sparse_attn")


@dataclass(frozen=True)
class Policy:
    """How a layer's launches are served.

    ``threshold(phase, kv_len)`` -> lambda or ``None`` (dense for that phase).
    ``calibration_scales``: when set, counting mode with these candidate scale
    factors (``lambda = scale / kv_len``); outputs stay dense.
    """

    threshold: Callable[[str, int], float | None]
    calibration_scales: tuple[float, ...] | None = None
    stats_interval_s: float = 60.0


_SPARSE_CLASSES: dict[type, type] = {}


def make_sparse(native: Any, info: runtime.LayerInfo, policy: Policy, stats: WorkerStats = STATS) -> Any:
    """A sparse impl carrying ``native``'s state, as an instance of a subclass of its class."""
    cls = type(native)
    sparse_cls = _SPARSE_CLASSES.get(cls)
    if sparse_cls is None:
        sparse_cls = _SPARSE_CLASSES[cls] = type(f"Sparse{cls.__name__}", (SparseAttentionMixin, cls), {})
    impl = object.__new__(sparse_cls)
    impl.__dict__.update(native.__dict__)
    impl._sa_info = info
    impl._sa_policy = policy
    impl._sa_stats = stats
    impl._sa_writer = compat.cache_writer(info.backend)
    impl._sa_last_log = time.monotonic()
    return impl


class SparseAttentionMixin:
    """``forward`` of the sparse impl; ``super().forward`` is the native path."""

    _sa_info: runtime.LayerInfo
    _sa_policy: Policy
    _sa_stats: WorkerStats
    _sa_writer: Callable[..., None] | None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        native_args = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if attn_metadata is None or output_scale is not None or output_block_scale is not None:
            return super().forward(*native_args)
        batch = runtime.describe_batch(attn_metadata)
        if batch.native_only:
            return super().forward(*native_args)
        num_tokens = batch.num_tokens
        starts = batch.query_start_loc.tolist()
        kv_lens = batch.seq_lens.tolist()
        num_seqs = len(kv_lens)
        q_lens = [starts[s + 1] - starts[s] for s in range(num_seqs)]
        phases = ["decode" if q == 1 else "prefill" for q in q_lens]

        if self._sa_policy.calibration_scales is None:
            lambdas = [self._lambda(phases[s], kv_lens[s]) for s in range(num_seqs)]
            if all(lam is None for lam in lambdas):
                for phase in set(phases):
                    self._sa_stats.add_native(phase)
                return super().forward(*native_args)

        self._sa_stats.adapter_calls += 1
        isa = runtime.layer_cpu_isa(layer)
        if self._sa_writer is not None:
            self._sa_writer(key[:num_tokens], value[:num_tokens], kv_cache, batch.slot_mapping[:num_tokens],
                        head_size=self._sa_info.head_size, backend=self._sa_info.backend, isa=isa)
        key_cache, value_cache = compat.kv_cache_views(kv_cache, head_size=self._sa_info.head_size, backend=self._sa_info.backend, isa=isa)
        q = query[:num_tokens].view(num_tokens, self._sa_info.num_heads, self._sa_info.head_size)
        out = output[:num_tokens].view(num_tokens, self._sa_info.num_heads, self._sa_info.head_size)
        by_phase: dict[str, list[int]] = {}
        for s in range(num_seqs):
            if q_lens[s]:
                by_phase.setdefault(phases[s], []).append(s)
        for phase, seqs in by_phase.items():
            if self._sa_policy.calibration_scales is not None:
                # Calibration feeds one sequence at a time, and a candidate's lambda
                # must be masked per sequence (>= 1 at short lengths): per-sequence launches.
                for s in seqs:
                    self._count(phase, q, out, key_cache, value_cache, batch, starts, [s], kv_lens[s])
                continue
            rows, block_table, seq_lens, query_start_loc = _select(batch, starts, seqs)
            phase_lambdas = [lambdas[s] or 0.0 for s in seqs]  # 0 = dense for that sequence
            if not any(phase_lambdas):
                out[rows] = paged_attention(q[rows], key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=self._sa_info.scale)
                self._sa_stats.add_dense(phase)
                continue
            result, skipped, visited = paged_attention(
                q[rows], key_cache, value_cache, block_table, seq_lens, query_start_loc,
                scale=self._sa_info.scale, threshold=phase_lambdas, return_counts=True,
            )
            out[rows] = result
            self._sa_stats.add(phase, int(skipped.sum()), int(visited.sum()))
        self._maybe_log()
        return output

    def _count(self, phase, q, out, key_cache, value_cache, batch, starts, seqs, kv_len) -> None:
        rows, block_table, seq_lens, query_start_loc = _select(batch, starts, seqs)
        candidates = [scale / kv_len for scale in self._sa_policy.calibration_scales]
        result, skipped, visited = paged_attention_counts(
            q[rows], key_cache, value_cache, block_table, seq_lens, query_start_loc, candidates, scale=self._sa_info.scale
        )
        out[rows] = result
        # Serving runs dense where lambda >= 1, so those candidates have no data at this length.
        usable = [lam < 1.0 for lam in candidates]
        tiles = int(visited.sum())
        self._sa_stats.add_candidates(
            phase,
            [int(n) if ok else 0 for n, ok in zip(skipped.sum(dim=1).tolist(), usable)],
            [tiles if ok else 0 for ok in usable],
        )

    def _lambda(self, phase: str, kv_len: int) -> float | None:
        lam = self._sa_policy.threshold(phase, kv_len)
        # lambda >= 1 would skip every tile whose max is below the running max:
        # no calibrated config asks for that, so such a launch stays dense.
        if lam is None or lam <= 0 or lam >= 1:
            return None
        return lam

    def _maybe_log(self) -> None:
        interval = self._sa_policy.stats_interval_s
        if interval <= 0 or time.monotonic() - self._sa_last_log < interval:
            return
        self._sa_last_log = time.monotonic()
        snap = self._sa_stats.snapshot()
        parts = []
        for phase, c in snap["phases"].items():
            ratio = f"{c['skipped'] / c['visited']:.1%}" if c["visited"] else "n/a"
            parts.append(f"{phase} {ratio} of {c['visited']} tiles ({c['launches']} sparse, {c['dense_launches']} dense, "
                         f"{c['native_launches']} native launches)")
        logger.info("sparse-attn: achieved sparsity: %s", "; ".join(parts))


def _select(batch: runtime.BatchDescription, starts: list[int], seqs: list[int]):
    """Query rows, block table ``[S', max_blocks]``, KV lengths ``[S']`` and query
    offsets ``[S' + 1]`` of the sequences ``seqs`` (a slice when they are adjacent)."""
    index = torch.tensor(seqs, device=batch.seq_lens.device)
    lens = [starts[s + 1] - starts[s] for s in seqs]
    offsets = torch.tensor([0, *itertools.accumulate(lens)], dtype=batch.query_start_loc.dtype, device=batch.query_start_loc.device)
    if seqs == list(range(seqs[0], seqs[-1] + 1)):
        rows = slice(starts[seqs[0]], starts[seqs[-1] + 1])
        return rows, batch.block_table[seqs[0] : seqs[-1] + 1], batch.seq_lens[seqs[0] : seqs[-1] + 1], offsets
    rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs]).to(batch.seq_lens.device)
    return rows, batch.block_table[index], batch.seq_lens[index], offsets
