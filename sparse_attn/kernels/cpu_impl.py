"""Compiled CPU implementation of skip-softmax paged attention (``csrc/skip_attn_cpu.cpp``).

Same contract as :func:`sparse_attn.kernels.torch_impl.forward` (arguments, outputs, counts),
the same tile geometry and skip rule (``_common``), over the same zero-copy cache views with
any strides.  The library is compiled on first use (:mod:`.cpu_build`); :func:`status` says
whether it is available here and why not; :func:`cpu_kernel` is the one rule that picks the
CPU kernel (``impl="auto"`` in :mod:`sparse_attn.kernels.api`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import torch

from . import cpu_build
from ._common import SPLIT_K, TILE_K
from .batch import COUNTER_SLOTS, BatchMeta, LayerSpec, PagedBatch

logger = logging.getLogger("sparse_attn")

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Cache dtypes: the query's, or an fp8 cache (dequantised with the layer's k/v scales).
_KV_DTYPES = {**_DTYPES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
#: ``forward(counters=)``: the library adds a serving launch's counts into the stats' counter itself
#: (``COUNTER_SLOTS``, the V tiles it did not read included: the union over a KV group's query heads), as
#: Triton does with atomics: no tensor is allocated or read back per launch.
COUNTS_IN_KERNEL = True


@dataclass(frozen=True)
class Status:
    """Whether the compiled kernel serves in this process: ``available``, and either its
    ``target`` (one of ``cpu_build.ISAS``) / ``path`` / ``build_s`` (seconds this process spent
    compiling; None = cached) / ``tiles`` (the ``amx`` build: whether the OS granted the AMX tiles,
    without which it runs the ``avx512bf16`` code) or the ``reason`` it is not available."""

    available: bool
    target: str | None = None
    path: str | None = None
    build_s: float | None = None
    reason: str | None = None
    tiles: bool = False

    def describe(self) -> str:
        if not self.available:
            return f"torch (compiled kernel unavailable: {self.reason})"
        how = "cached" if self.build_s is None else f"built in {self.build_s:.1f} s"
        target = self.target
        if target == "amx":
            target += " tiles for bf16 prefill" if self.tiles else " build, tiles refused by the OS: avx512bf16 code"
        elif target == "avx512bf16":
            target += " dot products for bf16 prefill"
        return f"compiled ({target}, {how}, {self.path})"


_state: dict = {}
_state_lock = threading.Lock()


def status() -> Status:
    """Build or load the library once per process; never raises."""
    if "status" not in _state:
        with _state_lock:
            if "status" not in _state:
                try:
                    built = cpu_build.load()
                    _state["lib"] = built.lib
                    _state["status"] = Status(True, built.target, str(built.path), built.build_s,
                                              tiles=bool(built.lib.sa_tiles()))
                except (cpu_build.CpuKernelUnavailable, OSError) as exc:
                    _state["status"] = Status(False, reason=str(exc))
    return _state["status"]


def reset_for_tests() -> None:
    """Forget this process's build/load result (the next :func:`status` loads again)."""
    with _state_lock:
        _state.clear()


def use_library(lib) -> None:
    """Serve this process with ``lib`` from now on (a library :func:`cpu_build.load` returned, e.g. its
    timed ``profile=True`` variant for ``benchmarks/profile_cpu_kernel.py``)."""
    status()
    _state["lib"] = lib


def supports(batch: PagedBatch) -> bool:
    """Shapes the compiled kernel takes: head sizes that are a multiple of 8 (every head size
    vLLM's CPU attention accepts is), float32 / bfloat16 / float16 queries with a cache of
    the same dtype or fp8 (e4m3 / e5m2), CPU tensors."""
    query, key_cache = batch.query, batch.key_cache
    return query.device.type == "cpu" and query.dtype in _DTYPES and query.shape[-1] % 8 == 0 \
        and (key_cache.dtype == query.dtype or key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))


_warned: set[str] = set()


def cpu_kernel(batch: PagedBatch | None = None) -> str:
    """The one rule that picks the kernel for CPU tensors (``impl="auto"``): ``"compiled"`` or ``"torch"``.

    ``SPARSE_ATTN_CPU_KERNEL=torch`` -> torch; ``=compiled`` -> compiled (raises
    ``CpuKernelUnavailable`` when it cannot be built here, ``ValueError`` for shapes it does
    not take); ``=auto`` (default) -> compiled when it builds or loads here (:func:`status`,
    once per process) and takes the batch (:func:`supports`), else torch, with one warning line
    per process when the build is what failed.  Without a batch: the answer for shapes the
    compiled kernel takes.
    """
    from sparse_attn import settings

    choice = settings.get("SPARSE_ATTN_CPU_KERNEL")
    if choice == "torch":
        return "torch"
    if choice == "compiled":
        require(batch)
        return "compiled"
    st = status()
    if not st.available:
        if "unavailable" not in _warned:
            _warned.add("unavailable")
            logger.warning("sparse-attn: compiled CPU kernel unavailable (%s); the torch kernel serves. Fix: install a "
                           "C++ compiler (g++ or clang++) or point CXX at one; SPARSE_ATTN_CPU_KERNEL=torch silences "
                           "this", st.reason)
        return "torch"
    return "compiled" if batch is None or supports(batch) else "torch"


#: Build targets whose bf16 prefill multiplies bf16 pairs (csrc/sa_bf16.h, sa_amx.h), for head sizes a multiple of
#: this (the pair kernels' 32-column panels; the source's ``pairs`` condition).
PAIR_TARGETS = frozenset({"avx512bf16", "amx"})
PAIR_HEAD_MULTIPLE = 32


def bf16_prefill_on_pairs(head_size: int) -> bool:
    """Whether a bf16 prefill of ``head_size`` runs on this process's compiled kernel with bf16 pair products
    (the ``avx512bf16`` / ``amx`` builds, :data:`PAIR_HEAD_MULTIPLE`), i.e. where its dense prefill is measured
    1.8-2.1x vLLM's CPU kernel on the same pages (docs/kernels.md); ``False`` where the torch kernel
    serves or the build widens bf16 to fp32 (then within a few per cent of vLLM's, either side)."""
    if cpu_kernel() != "compiled":
        return False
    return status().target in PAIR_TARGETS and head_size % PAIR_HEAD_MULTIPLE == 0


def require(batch: PagedBatch | None = None) -> None:
    """Raise unless the compiled kernel is available here and takes ``batch``."""
    st = status()
    if not st.available:
        raise cpu_build.CpuKernelUnavailable(
            f"paged_attention: the compiled CPU kernel was asked for (impl='compiled' or SPARSE_ATTN_CPU_KERNEL="
            f"compiled) but is unavailable: {st.reason}. Fix: install a C++ compiler or set CXX, or use "
            f"SPARSE_ATTN_CPU_KERNEL=auto / torch")
    if batch is not None and not supports(batch):
        q = batch.query
        raise ValueError(f"paged_attention: the compiled CPU kernel takes CPU fp32/bf16/fp16 queries (cache: the same "
                         f"dtype or fp8) with a head size that is a multiple of 8, got {q.dtype} / "
                         f"{batch.key_cache.dtype} on {q.device}, head size {q.shape[-1]}; use impl='torch' (or "
                         f"SPARSE_ATTN_CPU_KERNEL=auto)")


def describe() -> str:
    """Which kernel serves CPU tensors in this process and why, for the plugin's install line
    (builds or loads the compiled kernel, once; raises like :func:`cpu_kernel` when
    ``SPARSE_ATTN_CPU_KERNEL=compiled`` cannot be honoured)."""
    from sparse_attn import settings

    choice = settings.get("SPARSE_ATTN_CPU_KERNEL")
    if cpu_kernel() == "torch":
        return "torch (SPARSE_ATTN_CPU_KERNEL=torch)" if choice == "torch" else status().describe()
    return status().describe() + (" (SPARSE_ATTN_CPU_KERNEL=compiled)" if choice == "compiled" else "")


def forward(
    batch: PagedBatch,
    spec: LayerSpec,
    meta: BatchMeta,
    *,
    threshold: torch.Tensor,
    count_thresholds: torch.Tensor | None,
    out: torch.Tensor,
    split_k: int = SPLIT_K,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backend contract of :mod:`sparse_attn.kernels.api`: fill ``out`` [T, Hq, D] and
    return ``(out, skipped int64 [n, Hq] | None, visited int64 [Hq] | None)`` for
    ``threshold`` (float32 ``[S]``, 0 = dense) and ``count_thresholds`` (float32 ``[n, S]``
    or None).  The layer features come from ``spec`` (:class:`LayerSpec`): ``window``
    (tokens, causal only), ``soft_cap``, ``sink_logits`` (``[Hq]`` logits, denominator only),
    ``k_scale`` / ``v_scale`` (floats or 1-element CPU tensors; fp8 caches ``float8_e4m3fn`` /
    ``float8_e5m2`` hold values / scale).

    ``counters`` (:data:`COUNTS_IN_KERNEL`, not with ``count_thresholds``): the stats' int64 CPU counter
    (``COUNTER_SLOTS``) the library adds this launch's counts to; the counts are then not returned.

    Needs :func:`status` ``().available`` and :func:`supports`; threads: ``torch.get_num_threads()``.
    """
    lib = _state.get("lib")
    if lib is None:
        require()
        lib = _state["lib"]
    call = make_call(batch, spec, threshold=threshold, count_thresholds=count_thresholds, out=out, split_k=split_k,
                     counters=counters)
    _launch(lib, call.c, batch)
    if count_thresholds is None:
        return out, None, None
    return out, call.skipped, call.visited


def _launch(lib, c: cpu_build.SaCall, batch: PagedBatch) -> None:
    rc = lib.sa_forward(ctypes.byref(c))
    if rc:
        _launch_failed(rc, batch)


def _launch_failed(rc: int, batch: PagedBatch) -> None:
    if rc in (cpu_build.BAD_BLOCK_ID, cpu_build.BAD_BLOCK_TABLE):
        # The library refused before reading anything; the checks say where (every argument
        # was validated unless check=False, so this is the caller's unchecked batch).
        from .checks import block_table_error

        block_table_error(batch)
    if rc:
        raise RuntimeError(f"sparse_attn CPU kernel failed (code {rc}: {cpu_build.RETURN_CODES.get(rc, 'unknown')})")


@dataclass
class Call:
    """One ``sa_forward`` argument block (``c``) and every tensor it points into, which must
    outlive the call: the counts it writes, ``out``, the batch's query, caches and host copies.
    A Call owns all of them, so a temporary passed as ``out`` cannot be freed before the
    library writes it (the use-after-free AddressSanitizer found)."""

    c: cpu_build.SaCall
    skipped: torch.Tensor
    visited: torch.Tensor
    keep: tuple


def make_call(batch: PagedBatch, spec: LayerSpec, *, threshold: torch.Tensor, count_thresholds: torch.Tensor | None,
              out: torch.Tensor, split_k: int = SPLIT_K, counters: torch.Tensor | None = None) -> Call:
    """The ``SaCall`` of :func:`forward`'s arguments (pointers into the batch's own tensors)."""
    query, hq = batch.query, batch.num_q_heads
    lam = threshold.to("cpu", torch.float32).contiguous()
    if counters is not None:
        if count_thresholds is not None:
            raise ValueError("counters: not together with count_thresholds (the launch counts under its own lambdas)")
        _check_counters(counters)
        count_thresholds = lam[None, :]  # counted under the serving lambdas, added into counters by the library
    n_counts = 0 if count_thresholds is None else int(count_thresholds.shape[0])
    count_lam = None if count_thresholds is None else count_thresholds.to("cpu", torch.float32).contiguous()
    # Uninitialised: the library writes every count before it returns 0 (an error raises).
    skipped = torch.empty(n_counts, hq, dtype=torch.int64)
    visited = torch.empty(hq, dtype=torch.int64)
    c = cpu_build.SaCall()
    layer_keep = _fill_layer(c, spec, query.dtype, batch.key_cache, batch.value_cache, hq, split_k)
    step = StepArgs(batch.block_table, batch.seq_lens, batch.query_start_loc, lam)
    step.fill(c)
    c.num_counts = n_counts
    c.count_lam = None if count_lam is None else count_lam.data_ptr()
    _fill_io(c, query, out)
    if counters is None:
        c.skipped = skipped.data_ptr()
        c.visited = visited.data_ptr()
    else:
        c.counters = counters.data_ptr()
    return Call(c, skipped, visited, (out, query, step, layer_keep, count_lam, counters))


def _check_counters(counters: torch.Tensor) -> None:
    if counters.dtype != torch.int64 or counters.device.type != "cpu" or counters.dim() != 1 \
            or counters.shape[0] <= max(COUNTER_SLOTS.values()) or not counters.is_contiguous():
        raise ValueError(f"counters: expected a contiguous int64 [>{max(COUNTER_SLOTS.values())}] CPU tensor, got "
                         f"{counters.dtype} {tuple(counters.shape)} on {counters.device}")


def _fill_layer(c: cpu_build.SaCall, spec: LayerSpec, dtype: torch.dtype, key_cache: torch.Tensor,
                value_cache: torch.Tensor, num_q_heads: int, split_k: int) -> tuple:
    """A layer's part of ``c``: its constants and its cache views; returns the tensors ``c`` points into."""
    sinks = spec.sink_logits
    sinks_f32 = None if sinks is None else sinks.detach().to("cpu", torch.float32).contiguous()
    # CPU tensors only reach this backend, so reading a tensor scale is no device sync.
    k_scale, v_scale = float(spec.k_scale), float(spec.v_scale)
    c.abi = cpu_build.ABI_VERSION
    c.dtype, c.kv_dtype = _DTYPES[dtype], _KV_DTYPES[key_cache.dtype]
    c.num_q_heads, c.num_kv_heads = num_q_heads, key_cache.shape[2]
    c.head_dim, c.page_size = key_cache.shape[3], key_cache.shape[1]
    c.causal, c.window = int(spec.causal), int(spec.window or 0)
    c.split_tiles = split_k // TILE_K
    c.num_blocks = key_cache.shape[0]
    c.scale, c.soft_cap, c.v_scale = float(spec.scale) * k_scale, float(spec.soft_cap or 0.0), v_scale
    c.k = key_cache.data_ptr()
    c.k_sb, c.k_st, c.k_sh, c.k_sd = key_cache.stride()
    c.v = value_cache.data_ptr()
    c.v_sb, c.v_st, c.v_sh, c.v_sd = value_cache.stride()
    c.sink_logits = None if sinks_f32 is None else sinks_f32.data_ptr()
    return key_cache, value_cache, sinks_f32


def _fill_io(c: cpu_build.SaCall, query: torch.Tensor, out: torch.Tensor) -> None:
    """The query ``[T, Hq, D]`` and output ``[T, Hq, D]`` of ``c`` (any strides)."""
    c.q = query.data_ptr()
    c.q_st, c.q_sh, c.q_sd = query.stride()
    c.out = out.data_ptr()
    c.o_st, c.o_sh, c.o_sd = out.stride()


class StepArgs:
    """The batch part of a launch (CPU tensors), built once per step and shared by every layer of it:
    block table ``[S, max_blocks]``, KV lengths ``[S]``, query offsets ``[S + 1]`` (int32 / int64, any
    stride) and the serving lambdas (float32 ``[S]``, 0 = dense).  Holds the tensors it points into."""

    __slots__ = ("block_table", "seq_lens", "query_start_loc", "lam", "num_seqs", "num_threads")

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 lam: torch.Tensor):
        self.block_table = block_table if block_table.dtype in (torch.int32, torch.int64) else block_table.long()
        # The lengths are read from the batch's own CPU tensors (a BatchMeta is their host copy).
        self.seq_lens, self.query_start_loc = _index_tensor(seq_lens), _index_tensor(query_start_loc)
        self.lam = lam.to("cpu", torch.float32).contiguous()
        self.num_seqs = int(seq_lens.shape[0])
        self.num_threads = torch.get_num_threads()

    def fill(self, c: cpu_build.SaCall) -> None:
        bt, seq_lens, qsl = self.block_table, self.seq_lens, self.query_start_loc
        c.num_seqs, c.num_threads = self.num_seqs, self.num_threads
        c.bt, c.bt_is64, c.bt_cols = bt.data_ptr(), int(bt.dtype == torch.int64), bt.shape[1]
        c.bt_s0, c.bt_s1 = bt.stride()
        c.seq_lens, c.sl_s, c.sl_is64 = seq_lens.data_ptr(), seq_lens.stride(0), int(seq_lens.dtype == torch.int64)
        c.qsl, c.qsl_s, c.qsl_is64 = qsl.data_ptr(), qsl.stride(0), int(qsl.dtype == torch.int64)
        c.lam = self.lam.data_ptr()


class LayerLaunch:
    """One layer's serving launches of the compiled kernel on its cache, prepared once (FlashInfer's plan /
    run split): the argument block holds the layer's constants and its cache views' pointers and strides; a
    launch sets the step's :class:`StepArgs`, the query and output, and calls the library, which adds the
    counts into the stats' counter itself.  About twenty field writes and no tensor op, where the general
    path (:func:`forward`) builds and validates everything per call: most of a short decode layer's cost.

    ``key_cache`` / ``value_cache``: the layer's cache views (``PagedBatch``'s shapes).  Only their pointers
    and strides are kept, not the tensors (a cache vLLM frees, e.g. in sleep mode, is not held here): the
    caller keeps the launch for the cache tensor it was built on and builds another for any other;
    ``dtype``: the query's."""

    def __init__(self, spec: LayerSpec, key_cache: torch.Tensor, value_cache: torch.Tensor, num_q_heads: int,
                 dtype: torch.dtype, split_k: int = SPLIT_K):
        if _state.get("lib") is None:
            require()
        self.c = cpu_build.SaCall()
        self._sinks = _fill_layer(self.c, spec, dtype, key_cache, value_cache, num_q_heads, split_k)[2]
        self.c.num_counts = 1  # counted under the serving lambdas (count_lam = lam), added into counters
        self._heads, self._head_dim = num_q_heads, key_cache.shape[3]

    def run(self, step: StepArgs, query: torch.Tensor, out: torch.Tensor, counters: torch.Tensor) -> None:
        """Attention of ``query`` into ``out`` (``[T, Hq, D]`` or ``[T, Hq * D]``, the last dims contiguous;
        only the step's ``T = query_start_loc[S]`` rows are read / written) for the step's batch; the counts
        are added to ``counters`` (the stats' int64 CPU counter, ``COUNTER_SLOTS``)."""
        c = self.c
        step.fill(c)
        c.count_lam = c.lam
        c.counters = counters.data_ptr()
        c.q, (c.q_st, c.q_sh, c.q_sd) = query.data_ptr(), self._rows(query)
        c.out, (c.o_st, c.o_sh, c.o_sd) = out.data_ptr(), self._rows(out)
        rc = _state["lib"].sa_forward(ctypes.byref(c))  # the library this process serves with (use_library)
        if rc:
            raise RuntimeError(f"sparse_attn CPU kernel failed (code {rc}: {cpu_build.RETURN_CODES.get(rc, 'unknown')}"
                               f"; a prepared launch validates nothing: check the step's block table and lengths)")

    def _rows(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(token, head, dim) strides of ``[T, Hq, D]`` or ``[T, Hq * D]`` rows."""
        st = t.stride()
        if len(st) == 3:
            return st
        if len(st) == 2 and st[1] == 1 and t.shape[1] == self._heads * self._head_dim:
            return st[0], self._head_dim, 1
        raise ValueError(f"LayerLaunch: expected [T, {self._heads}, {self._head_dim}] or [T, "
                         f"{self._heads * self._head_dim}] rows, got {tuple(t.shape)} with strides {st}")


def _index_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a CPU int32/int64 tensor the kernel can read in place (any stride)."""
    if t.device.type != "cpu" or t.dtype not in (torch.int32, torch.int64):
        t = t.to("cpu", torch.int64)
    return t
