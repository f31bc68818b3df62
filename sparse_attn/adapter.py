"""The sparse attention impl that replaces a vLLM layer's ``impl``.

``make_sparse`` asks ``compat.worker.replace_impl`` for a subclass of the native
impl's class holding the native instance's state (so vLLM's ``isinstance``
checks, ``do_kv_cache_update`` and every initialised attribute stay as they
were). Per launch (``forward(*args, **kwargs)``, normalised by
``compat.worker.describe_call``):

* the native path (``compat.worker.call_native``, exactly what vLLM passed) for
  profiling/warm-up (no metadata), fused output quantisation, unknown
  arguments, cascade or non-causal launches, and launches whose phases are all
  uncalibrated;
* **uniform decode** (every query length <= 1: the batches vLLM captures in full
  CUDA graphs): a capture-safe path that reads no device data on the host.
  Lambdas ``scale / seq_len`` are computed on the device (``>= 1`` -> 0 = dense),
  the phase mask comes from ``compat.model.BatchDescription.decode_mask``, the
  kernel runs once with ``check=False``, and its counts are added to device
  counters (``WorkerStats.add_device``);
* **prefill and mixed batches** (vLLM runs attention eagerly there): host-side
  batch lists, one kernel launch per phase, each sequence with its own threshold
  ``lambda = a * exp(b * target) / kv_len``;
* in calibration mode, the dense counting kernel for a grid of candidate scale
  factors, integer counts per phase (always eager: calibration runs enforce_eager).

New tokens are stored through ``compat.cache_writer`` when the release's
forward path owns the write (exactly once: never when the native path ran,
which writes for itself). Nothing here knows a vLLM release or a cache layout.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

import compat
from compat import model as cmodel
from compat import worker as cworker
from sparse_attn.kernels import LayerSpec, PagedBatch, effective_lambda, paged_attention, paged_attention_counts
from sparse_attn.protocol import PHASES
from sparse_attn.stats import DEVICE_COUNTER_INDEX, STATS, WorkerStats

logger = logging.getLogger("sparse_attn")

DECODE, PREFILL = "decode", "prefill"
assert set(PHASES) == {DECODE, PREFILL}


@dataclass(frozen=True)
class Policy:
    """How a layer's launches are served.

    ``scale_factors``: phase -> threshold scale factor (``lambda = scale / kv_len``),
    ``None`` or missing = that phase runs dense. ``calibration_scales``: when set,
    counting mode with these candidate scale factors; outputs stay dense.
    """

    scale_factors: Mapping[str, float | None] = field(default_factory=dict)
    calibration_scales: tuple[float, ...] | None = None
    stats_interval_s: float = 60.0

    def lambda_for(self, phase: str, kv_len: int) -> float | None:
        """Host lambda of one sequence, or ``None`` (dense: ``kernels.effective_lambda``)."""
        return effective_lambda(self.scale_factors.get(phase), kv_len) or None


def make_sparse(layer: Any, info: cmodel.LayerInfo, policy: Policy, stats: WorkerStats = STATS) -> Any:
    """Replace ``layer.impl`` by a sparse impl carrying its state; returns the new impl.
    Raises ``compat.ImplReplacementError`` when the impl cannot be replaced."""
    return cworker.replace_impl(layer, SparseAttentionMixin, {
        "_sa_info": info, "_sa_policy": policy, "_sa_stats": stats, "_sa_writer": compat.cache_writer(info.backend),
    })


class SparseAttentionMixin:
    """``forward`` of the sparse impl; the native class's ``forward`` is the native path."""

    _sa_info: cmodel.LayerInfo
    _sa_policy: Policy
    _sa_stats: WorkerStats
    _sa_writer: Callable[..., None] | None

    def forward(self, *args, **kwargs):
        call = cworker.describe_call(*args, **kwargs)
        if call.native_only:
            return cworker.call_native(self, call)
        batch = cmodel.describe_batch(call.attn_metadata)
        if batch.native_only:
            return cworker.call_native(self, call)
        policy = self._sa_policy
        if policy.calibration_scales is None and batch.uniform_decode:
            if policy.scale_factors.get(DECODE) is None:  # uncalibrated decode: a host fact, no data read
                self._sa_stats.add_native(DECODE)
                return cworker.call_native(self, call)
            self._decode(call, batch)
            if not _capturing():
                self._sa_stats.maybe_log(policy.stats_interval_s)
            return call.output
        return self._eager(call, batch)

    # ------------------------------------------------------------------ shared
    def _views(self, call: cworker.ImplCall, batch: cmodel.BatchDescription, *, check: bool):
        info = self._sa_info
        n = batch.num_tokens
        isa = cmodel.layer_cpu_isa(call.layer)
        if self._sa_writer is not None:
            self._sa_writer(call.key[:n], call.value[:n], call.kv_cache, batch.slot_mapping[:n],
                            head_size=info.head_size, backend=info.backend, isa=isa, check=check)
        key_cache, value_cache = compat.kv_cache_views(call.kv_cache, head_size=info.head_size, backend=info.backend, isa=isa)
        q = call.query[:n].view(n, info.num_heads, info.head_size)
        out = call.output[:n].view(n, info.num_heads, info.head_size)
        return q, out, key_cache, value_cache

    # ------------------------------------------------------------------ uniform decode (capture-safe)
    def _decode(self, call: cworker.ImplCall, batch: cmodel.BatchDescription) -> None:
        """Every query length <= 1. Reads no device data on the host: shapes and host
        ints (``num_tokens``, ``max_query_len``) only."""
        self._sa_stats.count_call()
        q, out, key_cache, value_cache = self._views(call, batch, check=False)
        scale = float(self._sa_policy.scale_factors[DECODE])
        lam = effective_lambda(scale, batch.seq_lens)  # the host path's rule, on the device
        lam = torch.where(batch.decode_mask(), lam, torch.zeros_like(lam))  # q_len 0: dense (nothing to do)
        result, skipped, visited = paged_attention(
            PagedBatch(q, key_cache, value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                       max_query_len=int(batch.max_query_len)),
            LayerSpec(self._sa_info.scale), threshold=lam, return_counts=True, out=out, check=False,
        )
        # A launch whose every lambda is 0 counts as dense (as the eager path does); otherwise
        # as one sparse launch with its tiles. Computed on the device, read by snapshot().
        sparse = (lam > 0).any().to(torch.int64)
        counts = torch.zeros(len(DEVICE_COUNTER_INDEX), dtype=torch.int64, device=skipped.device)
        counts[DEVICE_COUNTER_INDEX["skipped"]] = skipped.sum() * sparse
        counts[DEVICE_COUNTER_INDEX["visited"]] = visited.sum() * sparse
        counts[DEVICE_COUNTER_INDEX["launches"]] = sparse
        counts[DEVICE_COUNTER_INDEX["dense_launches"]] = 1 - sparse
        self._sa_stats.add_device(DECODE, counts)
        if result is not out:  # the kernel returns ``out`` itself; a copy only if an impl did not
            out.copy_(result)

    # ------------------------------------------------------------------ prefill / mixed / calibration (eager)
    def _eager(self, call: cworker.ImplCall, batch: cmodel.BatchDescription):
        policy = self._sa_policy
        starts = batch.query_start_loc.tolist()
        kv_lens = batch.seq_lens.tolist()
        num_seqs = len(kv_lens)
        q_lens = [starts[s + 1] - starts[s] for s in range(num_seqs)]
        phases = [DECODE if cmodel.BatchDescription.is_decode(q) else PREFILL for q in q_lens]

        lambdas: list[float | None] = [None] * num_seqs
        if policy.calibration_scales is None:
            lambdas = [policy.lambda_for(phases[s], kv_lens[s]) for s in range(num_seqs)]
            if all(lam is None for lam in lambdas):
                for phase in set(phases):
                    self._sa_stats.add_native(phase)
                return cworker.call_native(self, call)

        self._sa_stats.count_call()
        q, out, key_cache, value_cache = self._views(call, batch, check=True)
        by_phase: dict[str, list[int]] = {}
        for s in range(num_seqs):
            if q_lens[s]:
                by_phase.setdefault(phases[s], []).append(s)
        for phase, seqs in by_phase.items():
            if policy.calibration_scales is not None:
                # Calibration feeds one sequence at a time, and a candidate's lambda
                # must be masked per sequence (>= 1 at short lengths): per-sequence launches.
                for s in seqs:
                    self._count(phase, q, out, key_cache, value_cache, batch, starts, [s], kv_lens[s])
                continue
            rows, block_table, seq_lens, query_start_loc = _select(batch, starts, seqs)
            phase_lambdas = [lambdas[s] or 0.0 for s in seqs]  # 0 = dense for that sequence
            if not any(phase_lambdas):
                out[rows] = paged_attention(PagedBatch(q[rows], key_cache, value_cache, block_table, seq_lens, query_start_loc),
                                            LayerSpec(self._sa_info.scale))
                self._sa_stats.add_dense(phase)
                continue
            result, skipped, visited = paged_attention(
                PagedBatch(q[rows], key_cache, value_cache, block_table, seq_lens, query_start_loc),
                LayerSpec(self._sa_info.scale), threshold=phase_lambdas, return_counts=True,
            )
            out[rows] = result
            self._sa_stats.add(phase, int(skipped.sum()), int(visited.sum()))
        self._sa_stats.maybe_log(policy.stats_interval_s)
        return call.output

    def _count(self, phase, q, out, key_cache, value_cache, batch, starts, seqs, kv_len) -> None:
        rows, block_table, seq_lens, query_start_loc = _select(batch, starts, seqs)
        candidates = [effective_lambda(scale, kv_len) for scale in self._sa_policy.calibration_scales]
        result, skipped, visited = paged_attention_counts(
            PagedBatch(q[rows], key_cache, value_cache, block_table, seq_lens, query_start_loc),
            LayerSpec(self._sa_info.scale), candidates,
        )
        out[rows] = result
        # Serving runs dense where lambda >= 1 (effective lambda 0), so those candidates have no data here.
        usable = [lam > 0 for lam in candidates]
        tiles = int(visited.sum())
        self._sa_stats.add_candidates(
            phase,
            [int(n) if ok else 0 for n, ok in zip(skipped.sum(dim=1).tolist(), usable)],
            [tiles if ok else 0 for ok in usable],
        )


def _capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (a host query)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _select(batch: cmodel.BatchDescription, starts: list[int], seqs: list[int]):
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
