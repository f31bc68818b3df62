"""Triton implementation of skip-softmax paged attention (GPU; CPU under TRITON_INTERPRET=1).

The kernels are in :mod:`.triton_kernels`; this module decides their launch.

- *decode* (every query length <= 1): split-KV (flash-decoding).  Each sequence's walked
  tiles are cut into the rule's splits of ``split_k`` positions, and ``P`` programs per
  (sequence, KV head chunk) each walk a contiguous run of whole splits and write an
  unnormalised partial that a second kernel merges by log-sum-exp (the sink logit enters
  there, once).  ``P`` (:func:`kv_programs`) is bounded by a constant and shrinks as the
  batch grows, so the grid and the fp32 partials ``[S, P, Hq, D]`` never grow with the
  block table's width (``max_model_len``): a program loops over as many splits as its
  sequence has, restarting the dense running max from the anchor's maxima at each.  A
  program that does not start at the anchor (tile 0; a windowed row's diagonal tile) reads
  the anchor's K tile once more for that seed.
  With ``P == 1`` there are no partials and no merge.  Counts do not depend on ``P``.
- *prefill* (anything else): one program per query tile walks all of its tiles (a windowed
  one first computes its diagonal anchor's maxima, the seed of its walk).

Capture safety
--------------
:func:`prepare` is pure Python + torch ops on the call's device: it sizes the grid from
tensor shapes and host ints (upper bounds when no host copy of the batch is given),
maps query tiles to sequences on the device (``searchsorted`` over per-sequence tile
counts; surplus programs see an out-of-range sequence and do nothing) and allocates the
partial/count buffers.  :func:`launch` only calls the kernels.  With ``meta=None`` nothing
in :func:`prepare` or :func:`finish` reads device data on the host, so the whole call can
be captured in a CUDA graph; ``tests/sparse_attn/test_kernels_capture.py`` runs it on
meta tensors to prove it.
"""

from __future__ import annotations

import inspect
import os
import struct
from dataclasses import dataclass, field

import torch

from . import support
from ._common import SPLIT_K, TILE_K, TILE_Q, next_pow2
from .batch import COUNTER_SLOTS, BatchMeta, LayerSpec, PagedBatch
from .rule import LambdaRule
from .triton_kernels import MERGE_DO_NOT_SPECIALIZE, PAGED_DO_NOT_SPECIALIZE, merge_splits_kernel, paged_attn_kernel

@dataclass(frozen=True)
class TileConfig:
    """Launch constants of one (head size, dtype, phase): ``heads_per_program`` caps the
    query heads of a KV group packed into one program (a power of two; the packed block
    is ``heads * BLOCK_M`` rows), ``num_warps`` / ``num_stages`` are Triton's."""

    heads_per_program: int
    num_warps: int
    num_stages: int


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
#: Fixed tile configurations, keyed by (BLOCK_D = head size rounded up to a power of two,
#: dtype, phase).  No runtime autotuning: a CUDA graph captures one launch, and an
#: autotuner's benchmarking launches cannot run while a stream is capturing.
#: Decode packs the whole group (memory-bound: K/V read once per KV head); prefill packs
#: up to 128 rows (2 heads of a 64-row query tile) for 16-bit and 64 rows for fp32 or
#: head size 256, the register budget of one program's fp32 accumulator.
#: Not yet tuned on a GPU (see benchmarks/RESULTS-kernels.md).
TILE_CONFIGS: dict[tuple[int, torch.dtype, str], TileConfig] = {
    (64, _BF16, "decode"): TileConfig(16, 4, 2),
    (64, _F16, "decode"): TileConfig(16, 4, 2),
    (64, _F32, "decode"): TileConfig(16, 4, 2),
    (128, _BF16, "decode"): TileConfig(16, 4, 2),
    (128, _F16, "decode"): TileConfig(16, 4, 2),
    (128, _F32, "decode"): TileConfig(16, 4, 1),
    (256, _BF16, "decode"): TileConfig(8, 8, 2),
    (256, _F16, "decode"): TileConfig(8, 8, 2),
    (256, _F32, "decode"): TileConfig(8, 8, 1),
    (64, _BF16, "prefill"): TileConfig(2, 4, 3),
    (64, _F16, "prefill"): TileConfig(2, 4, 3),
    (64, _F32, "prefill"): TileConfig(1, 4, 2),
    (128, _BF16, "prefill"): TileConfig(2, 8, 3),
    (128, _F16, "prefill"): TileConfig(2, 8, 3),
    (128, _F32, "prefill"): TileConfig(1, 8, 2),
    (256, _BF16, "prefill"): TileConfig(1, 8, 2),
    (256, _F16, "prefill"): TileConfig(1, 8, 2),
    (256, _F32, "prefill"): TileConfig(1, 8, 1),
}


# The one table of what the Triton kernel takes (kernels.support) and the configurations agree.
assert set(TILE_CONFIGS) == {(d, t, p) for d in support.TRITON_BLOCK_D for t in support.KERNEL_DTYPES
                             for p in ("decode", "prefill")}, "TILE_CONFIGS vs kernels.support"


def tile_config(head_dim: int, dtype: torch.dtype, phase: str) -> TileConfig:
    """The :data:`TILE_CONFIGS` entry for ``head_dim`` (head sizes <= 64 use the 64 row)."""
    block_d = max(64, next_pow2(head_dim))
    key = (block_d, dtype, phase)
    if key not in TILE_CONFIGS:
        raise ValueError(f"paged_attention: no Triton tile configuration for head size {head_dim} "
                         f"(BLOCK_D={block_d}), dtype {dtype}, phase {phase}: expected head size <= 256")
    return TILE_CONFIGS[key]



#: Split-KV decode: at most this many programs per (sequence, KV head chunk), and about
#: this many programs in the whole grid (fewer per sequence as the batch grows).  On a
#: 132-SM H100/H200, 1024 programs are ~8 per SM: every SM busy with programs to overlap
#: memory latency; a batch-1 32k decode with 8 KV heads still gets 32 programs per
#: sequence (one per split, as before the bound), 128k gets 64 (two splits each), and a
#: batch of 128+ sequences one (no partials, no merge).  Not tuned on a GPU yet.
MAX_KV_PROGRAMS = 64
TARGET_PROGRAMS = 1024


def kv_programs(num_seqs: int, head_programs: int, max_kv: int, split_k: int, window: int | None) -> int:
    """Programs per (sequence, KV head chunk) of a decode launch, from host ints only:
    at most the splits a sequence can walk (``max_kv`` tokens, or a window's), at most
    :data:`MAX_KV_PROGRAMS`, and about :data:`TARGET_PROGRAMS` in the grid."""
    n_splits = max(1, -(-max_kv // split_k))
    if window is not None:               # a window of w tokens spans at most this many splits
        n_splits = min(n_splits, -(-(window + TILE_K) // split_k) + 1)
    want = -(-TARGET_PROGRAMS // max(1, num_seqs * head_programs))
    return max(1, min(n_splits, want, MAX_KV_PROGRAMS))


#: :mod:`.api`: this backend adds a launch's counts to a counter tensor itself (atomics), the V tiles it did not
#: read included (``COUNTER_SLOTS`` "v_tested" / "v_skipped", ACCUMULATE).
COUNTS_IN_KERNEL = True
#: :mod:`.api`: this backend takes a ``LambdaRule`` as is and computes each sequence's lambda in the kernel.
COMPUTES_LAMBDAS = True


def _interpreting() -> bool:
    # Triton's interpreter multiplies bf16 dot operands as raw integers (garbage), so
    # under it 16-bit inputs are upcast; compiled kernels use native 16-bit dots.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass
class KernelCall:
    """One kernel launch: ``kernel[grid](*args, **constexprs)``."""

    kernel: object
    grid: tuple[int, int, int] | tuple[int, int]
    args: tuple
    constexprs: dict


@dataclass(frozen=True)
class Grid:
    """What :func:`grid_for` decided from shapes and host ints.

    ``phase`` ``"decode"`` / ``"prefill"``; ``slots`` programs along axis 0 (query tiles,
    or sequences in decode); ``kv_progs`` programs per (slot, head chunk) along axis 2
    (``> 1``: split-KV with partials and a merge); ``heads`` query heads packed per
    program; ``block_m`` rows per head; ``block_d`` padded head size."""

    phase: str
    config: TileConfig
    slots: int
    head_chunks: int
    kv_progs: int
    heads: int
    block_m: int
    block_d: int

    @property
    def split(self) -> bool:
        return self.kv_progs > 1


@dataclass
class Plan:
    """What :func:`prepare` decided: the kernel calls and the buffers :func:`finish` reads.

    ``skip_cnt`` int32 ``[slots, kv_progs, Hq, BLOCK_T]`` and ``vis_cnt`` int32 ``[slots,
    kv_progs, Hq]`` (``None`` without counts); ``n_thr`` the number of counted lambdas;
    ``scratch_bytes`` the device memory the call allocates besides ``out`` (partials,
    counts, per-program arrays)."""

    grid: Grid
    calls: list[KernelCall] = field(default_factory=list)
    out: torch.Tensor | None = None
    skip_cnt: torch.Tensor | None = None
    vis_cnt: torch.Tensor | None = None
    n_thr: int = 0
    scratch_bytes: int = 0

    @property
    def phase(self) -> str:
        return self.grid.phase


def grid_for(batch: PagedBatch, spec: LayerSpec, meta: BatchMeta | None, split_k: int) -> Grid:
    """The launch geometry from shapes and host ints (``meta`` exact, else upper bounds:
    ``batch.max_query_len`` or ``T`` for query lengths, the block table's width for KV)."""
    num_tokens, hq, d = batch.query.shape
    hkv, page, n_seqs = batch.num_kv_heads, batch.page_size, batch.num_seqs
    if meta is not None:
        max_q, max_kv = max(meta.q_lens), max(meta.seq_lens)
    else:
        max_q = num_tokens if batch.max_query_len is None else min(int(batch.max_query_len), num_tokens)
        max_kv = batch.block_table.shape[1] * page
    phase = "decode" if max_q <= 1 else "prefill"
    cfg = tile_config(d, batch.query.dtype, phase)
    group = hq // hkv
    heads = min(cfg.heads_per_program, next_pow2(group))
    head_chunks = -(-group // heads)
    # A smaller row block is the same query tile when every sequence fits in it; the
    # packed block needs >= 16 rows for tl.dot.
    block_m = min(TILE_Q, max(next_pow2(max(max_q, 1)), -(-16 // heads)))
    if phase == "decode":
        slots = n_seqs                 # slot s is sequence s (the merge kernel relies on it)
        kv_progs = kv_programs(n_seqs, hkv * head_chunks, max_kv, split_k, spec.window)
    elif meta is not None:
        slots, kv_progs = max(1, sum(-(-n // block_m) for n in meta.q_lens)), 1
    else:
        slots, kv_progs = -(-num_tokens // block_m) + n_seqs, 1      # sum ceil(q_s / B) <= T / B + S
    return Grid(phase, cfg, slots, head_chunks, kv_progs, heads, block_m, max(16, next_pow2(d)))


def buffers_for(batch: PagedBatch, grid: Grid, n_thr: int, meta: BatchMeta | None = None) -> dict[str, torch.Tensor]:
    """Per-program arrays (query tile -> sequence, first row) on the device, and the
    partial / count buffers, each sized by the grid alone.  Decode needs no per-program
    arrays (program ``s`` is sequence ``s``) and serving without candidate counts no count
    buffers: those are 1-element allocations the kernel never reads (no kernel launch).
    The prefill tile map depends on the lengths alone: kept in ``meta.memo``, so the layers
    of a step that share one host copy build it once."""
    dev, n_seqs, hq = batch.query.device, batch.num_seqs, batch.num_q_heads
    f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
    memo_key = ("tile map", grid.block_m, grid.slots)
    if grid.phase == "decode":
        tile_seq = tile_row0 = torch.empty(1, **i32)
    elif meta is not None and memo_key in meta.memo:      # built by an earlier layer of this step
        tile_seq, tile_row0 = meta.memo[memo_key]
    else:
        # Tiles per sequence, their cumulative sum, and for each program slot the sequence
        # whose tiles cover it (S = a surplus slot, which does nothing).
        qsl = batch.query_start_loc.long()
        tiles = (qsl[1:] - qsl[:-1] + grid.block_m - 1) // grid.block_m
        cum = tiles.cumsum(0)
        slot = torch.arange(grid.slots, device=dev)
        seq = torch.searchsorted(cum, slot, right=True)
        first_tile = (cum - tiles)[seq.clamp(max=n_seqs - 1)]
        tile_row0 = ((slot - first_tile) * grid.block_m).to(torch.int32)
        tile_seq = seq.to(torch.int32)
        if meta is not None:
            meta.memo[memo_key] = (tile_seq, tile_row0)
    block_t = max(2, next_pow2(max(n_thr, 1)))
    if n_thr:
        skip_cnt = torch.zeros(grid.slots, grid.kv_progs, hq, block_t, **i32)
        vis_cnt = torch.zeros(grid.slots, grid.kv_progs, hq, **i32)
    else:
        skip_cnt = vis_cnt = torch.empty(1, **i32)
    bufs = dict(TILE_SEQ=tile_seq, TILE_ROW0=tile_row0, SKIP_CNT=skip_cnt, VIS_CNT=vis_cnt, BLOCK_T=block_t)
    if grid.split:
        part = (grid.slots, grid.kv_progs, hq)
        bufs.update(O_PART=torch.empty(*part, grid.block_d, **f32), M_PART=torch.empty(*part, **f32),
                    L_PART=torch.empty(*part, **f32))
    else:
        bufs.update(O_PART=torch.empty(1, **f32), M_PART=torch.empty(1, **f32), L_PART=torch.empty(1, **f32))
    return bufs


def f64_parts(value: float) -> tuple[float, float, float]:
    """Three fp32 numbers whose fp64 sum is ``value`` exactly (each part the fp32 rounding of
    what the ones before left): a float64 kernel argument, which Triton does not have (a Python
    float arrives as fp32)."""
    parts = []
    rest = float(value)
    for _ in range(3):
        part = struct.unpack("f", struct.pack("f", rest))[0]
        parts.append(part)
        rest -= part
    return tuple(parts)


def prepare(
    batch: PagedBatch,
    spec: LayerSpec,
    meta: BatchMeta | None,
    *,
    threshold: torch.Tensor | LambdaRule,
    count_thresholds: torch.Tensor | None,
    out: torch.Tensor,
    split_k: int = SPLIT_K,
    counters: torch.Tensor | None = None,
) -> Plan:
    """Grid, tensor arguments and constexprs of one forward; launches nothing.

    ``threshold``: float32 ``[S]`` on the device, or a :class:`LambdaRule` the kernel
    evaluates per sequence; ``count_thresholds``: float32 ``[n, S]`` or ``None``;
    ``counters``: int64 counter tensor the kernel adds its counts into
    (:data:`batch.COUNTER_SLOTS`), or ``None``.  Reads no device data on the host
    (``meta=None``: upper-bound grid); with a rule and ``counters`` a decode launch runs no
    torch op at all (allocations only)."""
    query, dev, n_seqs, hq = batch.query, batch.query.device, batch.num_seqs, batch.num_q_heads
    grid = grid_for(batch, spec, meta, split_k)
    counting = count_thresholds is not None
    n_thr = count_thresholds.shape[0] if counting else 0
    bufs = buffers_for(batch, grid, n_thr, meta)
    block_t = bufs.pop("BLOCK_T")
    # Per-sequence lambdas live in device arrays (pointers) or come from the rule's scalars:
    # new values never recompile.
    if counting:
        thresh = torch.full((n_seqs, block_t), -1.0, dtype=torch.float32, device=dev)
        thresh[:, :n_thr] = count_thresholds.T.to(dev, torch.float32)
    else:
        thresh = bufs["L_PART"]                        # unused pointer
    rule = isinstance(threshold, LambdaRule)
    if rule:
        lam, lam_parts, lam_window = bufs["L_PART"], f64_parts(threshold.scale_factor), int(threshold.window or 0)
    else:
        lam, lam_parts, lam_window = threshold, (0.0, 0.0, 0.0), 0
    accumulate = counters is not None
    if not accumulate:
        counters = torch.empty(1, dtype=torch.int64, device=dev)   # unused pointer
    # Scales: host floats fold into the logit scale / multiply the output; tensors stay on
    # the device and are read by the kernels (a captured graph sees in-place updates).
    scale_ptrs = isinstance(spec.k_scale, torch.Tensor) or isinstance(spec.v_scale, torch.Tensor)
    if scale_ptrs:
        k_scale = spec.k_scale if isinstance(spec.k_scale, torch.Tensor) else torch.full((1,), spec.k_scale, device=dev)
        v_scale = spec.v_scale if isinstance(spec.v_scale, torch.Tensor) else torch.full((1,), spec.v_scale, device=dev)
        scale, v_scale_f = float(spec.scale), 1.0
    else:
        k_scale = v_scale = bufs["L_PART"]             # unused pointers
        scale, v_scale_f = float(spec.scale) * float(spec.k_scale), float(spec.v_scale)
    sinks = spec.sink_logits if spec.sink_logits is not None else bufs["L_PART"]
    window = spec.window
    cap = spec.soft_cap

    plan = Plan(grid, out=out, skip_cnt=bufs["SKIP_CNT"] if counting else None,
                vis_cnt=bufs["VIS_CNT"] if counting else None, n_thr=n_thr)
    plan.scratch_bytes = sum(t.numel() * t.element_size() for t in bufs.values()) + \
        (thresh.numel() * 4 if counting else 0)
    cfg = grid.config
    plan.calls.append(KernelCall(
        paged_attn_kernel, (grid.slots, batch.num_kv_heads * grid.head_chunks, grid.kv_progs),
        (query, batch.key_cache, batch.value_cache, out, batch.block_table, batch.seq_lens, batch.query_start_loc,
         bufs["TILE_SEQ"], bufs["TILE_ROW0"], lam, thresh, bufs["SKIP_CNT"], bufs["VIS_CNT"],
         bufs["O_PART"], bufs["M_PART"], bufs["L_PART"], sinks, k_scale, v_scale, counters,
         scale, v_scale_f, float(cap or 1.0), int(window or 0), n_thr, batch.page_size, split_k // TILE_K, n_seqs,
         hq, *lam_parts, lam_window, *query.stride(), *batch.key_cache.stride(), *batch.value_cache.stride(),
         *out.stride(), *batch.block_table.stride()),
        dict(GROUP=batch.group, HEADS=grid.heads, HEAD_DIM=batch.head_dim, BLOCK_D=grid.block_d,
             BLOCK_M=grid.block_m, BLOCK_N=TILE_K, BLOCK_T=block_t, CAUSAL=bool(spec.causal),
             WINDOW=window is not None, SOFT_CAP=cap is not None, HAS_SINKS=spec.sink_logits is not None,
             SCALE_PTRS=scale_ptrs, COUNT=counting, SPLIT=grid.split,
             FP32_DOT=query.dtype == torch.float32 or _interpreting(),
             TILE_MAP=grid.phase != "decode", LAM_RULE=rule, ACCUMULATE=accumulate,
             SLOT_SKIPPED=COUNTER_SLOTS["skipped"], SLOT_VISITED=COUNTER_SLOTS["visited"],
             SLOT_LAUNCHES=COUNTER_SLOTS["launches"], SLOT_DENSE=COUNTER_SLOTS["dense_launches"],
             SLOT_V_TESTED=COUNTER_SLOTS["v_tested"], SLOT_V_SKIPPED=COUNTER_SLOTS["v_skipped"],
             num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    if grid.split:
        plan.calls.append(KernelCall(
            merge_splits_kernel, (n_seqs, hq),
            (bufs["O_PART"], bufs["M_PART"], bufs["L_PART"], out, batch.query_start_loc, sinks, v_scale, v_scale_f,
             grid.kv_progs, hq, *out.stride()),
            dict(HEAD_DIM=batch.head_dim, BLOCK_D=grid.block_d, BLOCK_S=max(2, next_pow2(grid.kv_progs)),
                 HAS_SINKS=spec.sink_logits is not None, SCALE_PTRS=scale_ptrs, num_warps=4)))
    return plan


#: Every kernel variant launched in this process (:func:`variant_key`): Triton compiles one
#: per key, so a key first seen inside a served forward is a compile on live traffic.
LAUNCHED_VARIANTS: set[tuple] = set()
_NOT_SPECIALISED = {paged_attn_kernel: set(PAGED_DO_NOT_SPECIALIZE), merge_splits_kernel: set(MERGE_DO_NOT_SPECIALIZE)}


def variant_key(call: KernelCall) -> tuple:
    """What Triton specialises a launch on, by its rules: the constexprs, each tensor argument's
    dtype and 16-byte alignment, and each int's ``== 1`` / divisibility by 16, except the
    arguments the kernel marks ``do_not_specialize``."""
    names = list(inspect.signature(call.kernel.fn).parameters)
    skip = _NOT_SPECIALISED[call.kernel]
    parts = []
    for name, arg in zip(names, call.args):
        if isinstance(arg, torch.Tensor):
            parts.append((name, arg.dtype, None if name in skip else arg.data_ptr() % 16 == 0))
        elif isinstance(arg, int) and not isinstance(arg, bool) and name not in skip:
            parts.append((name, arg == 1, arg % 16 == 0))
        else:
            parts.append((name, type(arg).__name__))
    return (call.kernel.fn.__name__, tuple(parts), tuple(sorted(call.constexprs.items())))


def launch(plan: Plan) -> None:
    """Run the prepared kernels (the only step that touches Triton)."""
    for call in plan.calls:
        LAUNCHED_VARIANTS.add(variant_key(call))
        call.kernel[call.grid](*call.args, **call.constexprs)


def finish(plan: Plan) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(out, skipped int64 [n, Hq], visited int64 [Hq])`` as device tensors (no host read)."""
    if plan.skip_cnt is None:
        return plan.out, None, None
    skipped = plan.skip_cnt[..., :plan.n_thr].sum((0, 1), dtype=torch.int64).T.contiguous()
    return plan.out, skipped, plan.vis_cnt.sum((0, 1), dtype=torch.int64)


def forward(batch: PagedBatch, spec: LayerSpec, meta: BatchMeta | None, **kw):
    """The backend contract of :mod:`sparse_attn.kernels.api`; ``meta=None`` is the
    capture-safe mode of :func:`prepare`."""
    plan = prepare(batch, spec, meta, **kw)
    launch(plan)
    return finish(plan)
