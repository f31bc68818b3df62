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
  CUDA graphs): a capture-safe path that reads no device data on the host. On a GPU
  the layer is the attention kernel alone (and its split merge): it computes each
  sequence's ``lambda = scale / min(kv_len, w)`` and the dense rule from the policy's
  scalars (``kernels.LambdaRule``), tells padded requests from the query offsets, and
  adds its counts to the stats' persistent device counter (``WorkerStats.device_counter``);
* **prefill and mixed batches** (vLLM runs attention eagerly there): one plan per step,
  phase and policy (``_step_plan``, memoised on the step's ``compat.model.BatchDescription``:
  the phase's rows and host copy, whether any lambda is > 0, the threshold, the tile map),
  shared by every layer; one launch per phase, the step's first validated, the others
  with ``check=False``; counts added to the device counters;
* in calibration mode, the dense counting kernel for a grid of candidate scale
  factors, integer counts per phase (always eager: calibration runs enforce_eager).

Each layer's ``LayerSpec`` (window, soft-cap, sink logits, fp8 scales: ``layer_spec``) is built
once at install from compat's ``LayerFeatures``; every launch of the layer passes it to the kernels.
New tokens are stored through ``compat.cache_writer`` when the release's
forward path owns the write (exactly once: never when the native path ran,
which writes for itself). Nothing here knows a vLLM release or a cache layout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

import compat
from compat import envs
from compat import model as cmodel
from compat import worker as cworker
from sparse_attn.kernels import (BatchMeta, LambdaRule, LayerSpec, PagedBatch, effective_lambda, layer_launch, paged_attention,
                                 paged_attention_counts, step_args)
from sparse_attn import settings
from sparse_attn.kernels import support
from sparse_attn.kernels.batch import COUNTER_SLOTS
from sparse_attn.protocol import PHASES
from sparse_attn.stats import DEVICE_COUNTER_INDEX, STATS, WorkerStats

logger = logging.getLogger("sparse_attn")

DECODE, PREFILL = "decode", "prefill"
assert set(PHASES) == {DECODE, PREFILL}
# The kernels add their counts into the stats' device counters themselves (``counters=``).
assert all(DEVICE_COUNTER_INDEX[name] == slot for name, slot in COUNTER_SLOTS.items()), COUNTER_SLOTS


@dataclass(frozen=True)
class Policy:
    """How a layer's launches are served.

    ``scale_factors``: phase -> threshold scale factor (``lambda = scale / kv_len``, or
    ``scale / min(kv_len, window)`` when ``window`` is set: a layer served by, or calibrated
    for, the sliding-window curve), ``None`` or missing = that phase runs dense.
    ``calibration_scales``: when set, counting mode with these candidate scale factors;
    outputs stay dense, counts go to the layer kind ``kind`` names.
    """

    scale_factors: Mapping[str, float | None] = field(default_factory=dict)
    calibration_scales: tuple[float, ...] | None = None
    stats_interval_s: float = 60.0
    #: the window ``w`` (tokens) that caps lambda's normaliser; None = ``kv_len`` itself
    window: int | None = None
    #: a prefill / mixed step in which no lambda is > 0 runs vLLM's own impl (True) or this layer's kernel with
    #: the rule off (False); ``sparse_attn.plugin.dense_steps`` decides it per layer
    dense_native: bool = True

    @property
    def kind(self) -> str:
        """The layer kind (``protocol.LAYER_KINDS``) whose calibration counts this policy adds to."""
        return "windowed" if self.window is not None else "global"

    def lambda_for(self, phase: str, kv_len: int) -> float | None:
        """Host lambda of one sequence, or ``None`` (dense: ``kernels.effective_lambda``)."""
        return effective_lambda(self.scale_factors.get(phase), kv_len, self.window) or None


def make_sparse(layer: Any, info: cmodel.LayerInfo, policy: Policy, stats: WorkerStats = STATS) -> Any:
    """Replace ``layer.impl`` by a sparse impl carrying its state; returns the new impl.
    Raises ``compat.ImplReplacementError`` when the impl cannot be replaced, ``ValueError`` for a
    layer ``kernels.support.unsupported`` refuses (the plugin keeps those native)."""
    return cworker.replace_impl(layer, SparseAttentionMixin, {
        "_sa_info": info, "_sa_policy": policy, "_sa_stats": stats, "_sa_writer": compat.cache_writer(info.backend),
        "_sa_spec": layer_spec(layer, info),
    })


def layer_spec(layer: Any, info: cmodel.LayerInfo) -> LayerSpec:
    """The layer's ``LayerSpec``, built once at install from compat's ``LayerFeatures``: its window,
    soft-cap, sink logits (the impl's ``[num_heads]`` tensor as loaded; install runs after the
    weights are) and, for an fp8 cache, the layer's own ``k_scale`` / ``v_scale`` tensors (0-d,
    on its device, updated in place by vLLM: the kernels read them on the device, so a scale
    vLLM computes at the first forward is the one they use)."""
    k_scale, v_scale = cmodel.layer_kv_scales(layer)
    return support.spec_for(info.features, scale=info.scale, sink_logits=cmodel.layer_sinks(layer),
                            k_scale=k_scale, v_scale=v_scale, head_size=info.head_size, device=layer_device(info))


def layer_device(info: cmodel.LayerInfo) -> str:
    """``"cpu"`` for a layer of a CPU backend, else ``"cuda"`` (where the layer's kernels run)."""
    return "cpu" if info.backend in envs.CPU_BACKENDS else "cuda"


class SparseAttentionMixin:
    """``forward`` of the sparse impl; the native class's ``forward`` is the native path."""

    _sa_info: cmodel.LayerInfo
    _sa_policy: Policy
    _sa_stats: WorkerStats
    _sa_writer: Callable[..., None] | None
    _sa_spec: LayerSpec

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
    def _views(self, call: cworker.ImplCall, batch: cmodel.BatchDescription):
        """Store this step's new tokens where the sparse path owns the write, and return the
        query ``[T, Hq, D]``, the output ``[T, Hq, D]`` and the K/V cache views. The write is
        the capture-safe one (``check=False``): no host read, padding slots skipped by shape."""
        info = self._sa_info
        n = batch.num_tokens
        isa = cmodel.layer_cpu_isa(call.layer)
        kv_dtype = info.features.kv_cache_dtype
        if self._sa_writer is not None and not call.tokens_stored:  # a fused op may have stored them (0.33+)
            k_scale, v_scale = cmodel.layer_kv_scales(call.layer)
            self._sa_writer(call.key[:n], call.value[:n], call.kv_cache, batch.slot_mapping[:n],
                            head_size=info.head_size, backend=info.backend, isa=isa, check=False,
                            kv_cache_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
        key_cache, value_cache = compat.kv_cache_views(call.kv_cache, head_size=info.head_size, backend=info.backend,
                                                       isa=isa, kv_cache_dtype=kv_dtype)
        q = call.query[:n].view(n, info.num_heads, info.head_size)
        out = call.output[:n].view(n, info.num_heads, info.head_size)
        return q, out, key_cache, value_cache

    # ------------------------------------------------------------------ uniform decode (capture-safe)
    def _decode(self, call: cworker.ImplCall, batch: cmodel.BatchDescription) -> None:
        """Every query length <= 1. Reads no device data on the host: shapes and host
        ints (``num_tokens``, ``max_query_len``) only. On a GPU the layer is the attention
        kernel (and its split merge) alone: it computes each sequence's lambda from the
        policy's scale and window (``LambdaRule``) and adds its counts to the stats' device
        counter. On CPU the step's plan holds the host lambdas (tensors there are host data)."""
        self._sa_stats.count_call()
        step = _step_plan(batch, DECODE, self._sa_policy, None)
        counters = self._sa_stats.device_counter(DECODE, call.query.device)
        if step.cpu_args is not None and (self._sa_writer is None or call.tokens_stored):
            launch = self._launch(call, batch)
            if launch is not None:  # no view, no tensor op: the layer's prepared launch
                launch.run(step.cpu_args, call.query, call.output, counters)
                return
        q, out, key_cache, value_cache = self._views(call, batch)
        paged_attention(
            PagedBatch(q, key_cache, value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                       max_query_len=int(batch.max_query_len), host=step.host),
            self._sa_spec, threshold=step.threshold, out=out, check=False, counters=counters,
        )

    def _launch(self, call: cworker.ImplCall, batch: cmodel.BatchDescription):
        """The layer's prepared launch (``kernels.layer_launch``), built at its first decode on a cache and kept
        for that cache tensor's geometry (pointer, shape, strides) and the query dtype; ``None`` where the kernel
        serving this layer has none (the step then launches through ``paged_attention``)."""
        kv = call.kv_cache
        key = (kv.data_ptr(), kv.shape, kv.stride(), kv.dtype, call.query.dtype)
        held = self.__dict__.get("_sa_launch")
        if held is not None and held[0] == key:
            return held[1]
        q, _, key_cache, value_cache = self._views(call, batch)
        launch = layer_launch(self._sa_spec, PagedBatch(q, key_cache, value_cache, batch.block_table, batch.seq_lens,
                                                        batch.query_start_loc))
        self._sa_launch = (key, launch)
        return launch

    # ------------------------------------------------------------------ prefill / mixed / calibration (eager)
    def _eager(self, call: cworker.ImplCall, batch: cmodel.BatchDescription):
        """Prefill and mixed batches (vLLM runs attention eagerly there), and calibration.

        The step's plan (``_step_plan``, built by the first layer of the step and shared by the
        others) holds each phase's rows with their host copy, whether any lambda is > 0, the
        threshold, and the tile map the first launch builds; that first launch validates
        everything, the others launch with ``check=False``: one launch per phase, counts
        added to the stats' device counters, no device data read on the host."""
        policy = self._sa_policy
        phases = batch.phase_rows()
        if policy.calibration_scales is None:
            plans = {phase: _step_plan(batch, phase, policy, rows) for phase, rows in phases.items()}
            if policy.dense_native and not any(plan.sparse for plan in plans.values()):
                for phase in phases:
                    self._sa_stats.add_native(phase)
                return cworker.call_native(self, call)

        self._sa_stats.count_call()
        q, out, key_cache, value_cache = self._views(call, batch)
        spec = self._sa_spec
        for phase, rows in phases.items():
            if policy.calibration_scales is not None:
                # Calibration feeds one sequence at a time, and a candidate's lambda
                # must be masked per sequence (>= 1 at short lengths): per-sequence launches.
                for seq in rows.seqs:
                    self._count(phase, q, out, key_cache, value_cache, spec, batch.rows_of((seq,)))
                continue
            plan = plans[phase]
            paged = _paged(q, key_cache, value_cache, rows, plan.host)
            check = plan.check_once()
            if not plan.sparse:
                _store(out, rows, paged_attention(paged, spec, out=_out_view(out, rows), check=check))
                self._sa_stats.add_dense(phase)
                continue
            _store(out, rows, paged_attention(paged, spec, threshold=plan.threshold, out=_out_view(out, rows),
                                              check=check, counters=self._sa_stats.device_counter(phase, q.device)))
        self._sa_stats.maybe_log(policy.stats_interval_s)
        return call.output

    def _count(self, phase, q, out, key_cache, value_cache, spec, rows) -> None:
        (kv_len,) = rows.kv_lens
        policy = self._sa_policy
        candidates = [effective_lambda(scale, kv_len, policy.window) for scale in policy.calibration_scales]
        result, skipped, visited = paged_attention_counts(_paged(q, key_cache, value_cache, rows), spec, candidates)
        _store(out, rows, result)
        # Serving runs dense where lambda >= 1 (effective lambda 0), so those candidates have no data here.
        usable = [lam > 0 for lam in candidates]
        tiles = int(visited.sum())  # calibration only (CPU, eager): integer counts for the driver's fit
        self._sa_stats.add_candidates(
            phase,
            [int(n) if ok else 0 for n, ok in zip(skipped.sum(dim=1).tolist(), usable)],
            [tiles if ok else 0 for ok in usable],
            kind=policy.kind,
        )


@dataclass
class StepPlan:
    """What one (step, phase, policy) launches with, built once per step (FlashInfer's plan /
    run split) and shared by every layer of that policy: ``host`` the phase's host copy
    (``None`` on the capture-safe decode path of a GPU), ``sparse`` whether any of its lambdas
    is > 0, ``threshold`` a ``LambdaRule`` the kernel evaluates (GPU) or the float32 host
    lambdas (CPU tensors); ``validated`` once the first launch checked every argument."""

    host: BatchMeta | None
    sparse: bool
    threshold: LambdaRule | torch.Tensor | None
    validated: bool = False
    #: CPU uniform decode: the batch part of every layer's prepared launch (``kernels.step_args``)
    cpu_args: Any = None

    def check_once(self) -> bool:
        """``True`` for the step's first launch (full validation), ``False`` after, unless
        ``SPARSE_ATTN_CHECK_EVERY_LAUNCH`` asks for every launch."""
        first, self.validated = not self.validated, True
        return first or bool(settings.get("SPARSE_ATTN_CHECK_EVERY_LAUNCH"))


def _step_plan(batch: cmodel.BatchDescription, phase: str, policy: Policy, rows: cmodel.PhaseRows | None) -> StepPlan:
    """The step's plan for ``phase`` under ``policy`` (``rows`` None: the whole uniform decode
    batch), memoised on the step's ``BatchDescription``."""
    scale = policy.scale_factors.get(phase)

    def build() -> StepPlan:
        rule = None if scale is None else LambdaRule(float(scale), policy.window)
        cpu = not _kernel_computes_lambdas(batch.seq_lens.device)
        if rows is None:
            # Uniform decode, capture-safe: no host data. A phase whose every lambda is 0 still
            # runs the kernel, which counts the launch as dense (no branch on device data).
            # CPU: the rule's device form once per step (the CPU kernels take lambda tensors), and the batch part
            # of the layers' prepared launches.
            if cpu and rule:
                lam = rule.lambdas(batch.seq_lens)
                return StepPlan(None, True, lam, cpu_args=step_args(batch.block_table, batch.seq_lens,
                                                                    batch.query_start_loc, lam))
            return StepPlan(None, rule is not None, rule)
        host = BatchMeta(rows.kv_lens, rows.q_starts, rows.q_lens, rows.kv_lens_exact)
        lams = rule.host_lambdas(host.seq_lens) if rule is not None else []
        sparse = any(lam > 0 for lam in lams) if host.seq_lens_exact else rule is not None
        return StepPlan(host, sparse, torch.tensor(lams, dtype=torch.float32) if cpu and sparse else rule)

    return batch.memo(("sparse-attn plan", phase, scale, policy.window, rows is None), build)


def _kernel_computes_lambdas(device: torch.device) -> bool:
    """Whether the kernel serving ``device`` takes a ``LambdaRule`` as is (Triton on a GPU);
    the CPU kernels take lambda tensors (the step's plan builds them once)."""
    return device.type != "cpu"


def _paged(q, key_cache, value_cache, rows: cmodel.PhaseRows, host: BatchMeta | None = None) -> PagedBatch:
    """One phase's launch, with its host copy (``host``, else built from ``rows``): the kernel
    reads no device data on the host."""
    host = host or BatchMeta(rows.kv_lens, rows.q_starts, rows.q_lens, rows.kv_lens_exact)
    return PagedBatch(q[rows.rows], key_cache, value_cache, rows.block_table, rows.seq_lens, rows.query_start_loc, host=host)


def _out_view(out: torch.Tensor, rows: cmodel.PhaseRows) -> torch.Tensor | None:
    """The phase's rows of ``out`` when they are a view (adjacent sequences): the kernel writes there."""
    return out[rows.rows] if isinstance(rows.rows, slice) else None


def _store(out: torch.Tensor, rows: cmodel.PhaseRows, result: torch.Tensor) -> None:
    if not isinstance(rows.rows, slice):
        out[rows.rows] = result
    elif result.data_ptr() != out[rows.rows].data_ptr():
        out[rows.rows] = result


def _capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (a host query)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
