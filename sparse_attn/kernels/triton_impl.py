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

import os
from dataclasses import dataclass, field

import torch

from ._common import SPLIT_K, TILE_K, TILE_Q, next_pow2
from .batch import BatchMeta, LayerSpec, PagedBatch
from .triton_kernels import merge_splits_kernel, paged_attn_kernel

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


def buffers_for(batch: PagedBatch, grid: Grid, n_thr: int) -> dict[str, torch.Tensor]:
    """Per-program arrays (query tile -> sequence, first row) on the device, and the
    partial / count buffers, each sized by the grid alone."""
    dev, n_seqs, hq = batch.query.device, batch.num_seqs, batch.num_q_heads
    f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
    if grid.phase == "decode":
        tile_seq, tile_row0 = torch.arange(n_seqs, **i32), torch.zeros(n_seqs, **i32)
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
    block_t = max(2, next_pow2(max(n_thr, 1)))
    cnt_shape = (grid.slots, grid.kv_progs) if n_thr else (1, 1)
    bufs = dict(TILE_SEQ=tile_seq, TILE_ROW0=tile_row0,
                SKIP_CNT=torch.zeros(*cnt_shape, hq, block_t, **i32), VIS_CNT=torch.zeros(*cnt_shape, hq, **i32))
    if grid.split:
        part = (grid.slots, grid.kv_progs, hq)
        bufs.update(O_PART=torch.empty(*part, grid.block_d, **f32), M_PART=torch.empty(*part, **f32),
                    L_PART=torch.empty(*part, **f32))
    else:
        bufs.update(O_PART=torch.empty(1, **f32), M_PART=torch.empty(1, **f32), L_PART=torch.empty(1, **f32))
    return bufs


def prepare(
    batch: PagedBatch,
    spec: LayerSpec,
    meta: BatchMeta | None,
    *,
    threshold: torch.Tensor,
    count_thresholds: torch.Tensor | None,
    out: torch.Tensor,
    split_k: int = SPLIT_K,
) -> Plan:
    """Grid, tensor arguments and constexprs of one forward; launches nothing.

    ``threshold``: float32 ``[S]`` on the device; ``count_thresholds``: float32 ``[n, S]``
    or ``None``.  Reads no device data on the host (``meta=None``: upper-bound grid)."""
    query, dev, n_seqs, hq = batch.query, batch.query.device, batch.num_seqs, batch.num_q_heads
    grid = grid_for(batch, spec, meta, split_k)
    counting = count_thresholds is not None
    n_thr = count_thresholds.shape[0] if counting else 0
    bufs = buffers_for(batch, grid, n_thr)
    block_t = bufs["SKIP_CNT"].shape[-1]
    # Per-sequence lambdas live in device arrays (pointers): new values never recompile.
    thresh = torch.full((n_seqs, block_t), -1.0, dtype=torch.float32, device=dev)
    if n_thr:
        thresh[:, :n_thr] = count_thresholds.T.to(dev, torch.float32)
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
    plan.scratch_bytes = sum(t.numel() * t.element_size() for t in bufs.values()) + thresh.numel() * 4
    cfg = grid.config
    plan.calls.append(KernelCall(
        paged_attn_kernel, (grid.slots, batch.num_kv_heads * grid.head_chunks, grid.kv_progs),
        (query, batch.key_cache, batch.value_cache, out, batch.block_table, batch.seq_lens, batch.query_start_loc,
         bufs["TILE_SEQ"], bufs["TILE_ROW0"], threshold, thresh, bufs["SKIP_CNT"], bufs["VIS_CNT"],
         bufs["O_PART"], bufs["M_PART"], bufs["L_PART"], sinks, k_scale, v_scale,
         scale, v_scale_f, float(cap or 1.0), int(window or 0), n_thr, batch.page_size, split_k // TILE_K, n_seqs,
         hq, *query.stride(), *batch.key_cache.stride(), *batch.value_cache.stride(), *out.stride(),
         *batch.block_table.stride()),
        dict(GROUP=batch.group, HEADS=grid.heads, HEAD_DIM=batch.head_dim, BLOCK_D=grid.block_d,
             BLOCK_M=grid.block_m, BLOCK_N=TILE_K, BLOCK_T=block_t, CAUSAL=bool(spec.causal),
             WINDOW=window is not None, SOFT_CAP=cap is not None, HAS_SINKS=spec.sink_logits is not None,
             SCALE_PTRS=scale_ptrs, COUNT=counting, SPLIT=grid.split,
             FP32_DOT=query.dtype == torch.float32 or _interpreting(),
             num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    if grid.split:
        plan.calls.append(KernelCall(
            merge_splits_kernel, (n_seqs, hq),
            (bufs["O_PART"], bufs["M_PART"], bufs["L_PART"], out, batch.query_start_loc, sinks, v_scale, v_scale_f,
             grid.kv_progs, hq, *out.stride()),
            dict(HEAD_DIM=batch.head_dim, BLOCK_D=grid.block_d, BLOCK_S=max(2, next_pow2(grid.kv_progs)),
                 HAS_SINKS=spec.sink_logits is not None, SCALE_PTRS=scale_ptrs, num_warps=4)))
    return plan


def launch(plan: Plan) -> None:
    """Run the prepared kernels (the only step that touches Triton)."""
    for call in plan.calls:
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
