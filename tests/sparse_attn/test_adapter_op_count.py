"""What one layer of the sparse forward launches, counted, not estimated.

A CUDA graph records every kernel a captured forward launches; at a few microseconds each,
tiny torch ops around the attention kernel cost as much as the attention itself. Here one
full layer (``SparseAttentionMixin.forward`` on the fake vLLM metadata of test_adapter.py)
runs under a ``TorchDispatchMode`` that counts every aten op that would launch a device
kernel (views, allocations and metadata ops launch none and are not counted), and every
attention-kernel launch (Triton: each prepared kernel call; CPU: each call of the torch or
compiled kernel, whose insides are the kernel and are not counted as torch ops).

The cache write compat performs where the forward owns it (``writer == "adapter"``) is counted
apart: it belongs to compat, and vLLM releases whose impls write the cache themselves never
run it.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import compat
from compat import model as cmodel
from sparse_attn.adapter import Policy, make_sparse
from sparse_attn.stats import WorkerStats
from tests.sparse_attn.test_adapter import (
    _FLASHINFER, B, D, HKV, HQ, INFO, MIXED_KV, MIXED_Q, N, NativeImpl, _decode_metadata, _FlashInferBuilder,
    _mixed_step, build_batch, forward_owns_the_write,  # noqa: F401  (autouse: CPU_ATTN, the forward writes)
)

#: ops that launch no device kernel: allocations (a captured graph takes them from its pool)
#: and metadata-only ops; every view op (``OpOverload.is_view``) is skipped as well.
_NO_KERNEL = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::detach", "aten::lift_fresh",
    "aten::_local_scalar_dense", "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::is_nonzero",
}


class OpCounter(TorchDispatchMode):
    """Counts device-kernel-launching aten ops by name, while ``active``."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.active = True

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        name = func._schema.name
        if self.active and not func.is_view and name not in _NO_KERNEL:
            self.ops.append(name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass
class LayerCount:
    """One layer's launches: ``torch_ops`` around the kernel, ``kernels`` attention-kernel
    launches, ``writer_ops`` compat's cache write."""

    torch_ops: list[str]
    kernels: int
    writer_ops: list[str]

    @property
    def total(self) -> int:
        return len(self.torch_ops) + self.kernels


def _count_layer(impl, layer, args, monkeypatch, *, kernel: str) -> LayerCount:
    """Run ``impl.forward(layer, *args)`` once and count what it launches."""
    import sparse_attn.adapter as adapter
    from sparse_attn.kernels import cpu_impl, torch_impl, triton_impl

    counter = OpCounter()
    kernels = [0]
    writer_ops: list[str] = []

    def opaque(fn):
        """The attention kernel is one launch; its insides (torch reference ops, the C++ call)
        are not torch ops around it."""
        @functools.wraps(fn)
        def wrapped(*a, **k):
            kernels[0] += 1
            was, counter.active = counter.active, False
            try:
                return fn(*a, **k)
            finally:
                counter.active = was
        return wrapped

    if kernel == "triton":
        def launch(plan):
            kernels[0] += len(plan.calls)       # the launch itself needs a GPU (meta tensors here)
        monkeypatch.setattr(triton_impl, "launch", launch)
        monkeypatch.setattr(adapter, "paged_attention", functools.partial(adapter.paged_attention, impl="triton"))
    elif kernel == "compiled":
        if not cpu_impl.status().available:
            pytest.skip(f"compiled CPU kernel unavailable: {cpu_impl.status().reason}")
        lib = cpu_impl._state["lib"]
        monkeypatch.setitem(cpu_impl._state, "lib", types.SimpleNamespace(sa_forward=opaque(lib.sa_forward)))
        monkeypatch.setattr(adapter, "paged_attention", functools.partial(adapter.paged_attention, impl="compiled"))
    else:
        # the torch kernel is a reference made of torch ops: its insides are the kernel
        monkeypatch.setattr(torch_impl, "forward", opaque(torch_impl.forward))
        monkeypatch.setattr(adapter, "paged_attention", functools.partial(adapter.paged_attention, impl="torch"))
    writer = impl._sa_writer
    if writer is not None:
        def counted_writer(*a, **k):
            before = len(counter.ops)
            writer(*a, **k)
            writer_ops.extend(counter.ops[before:])
            del counter.ops[before:]
        impl._sa_writer = counted_writer
    with counter:
        impl.forward(layer, *args)
    impl._sa_writer = writer
    return LayerCount(counter.ops, kernels[0], writer_ops)


POLICY = dict(scale_factors={"decode": 12.0, "prefill": 3.0}, stats_interval_s=0)


def _gpu_decode_layer(window, stats=None):
    """A FlashInfer-style captured uniform decode step on meta tensors (as on a GPU)."""
    info = dataclasses.replace(INFO, backend="FLASHINFER", cpu_isa=None, needs_batch_capture=True,
                               features=cmodel.LayerFeatures(sliding_window=window))
    assert cmodel.prepare_layer(types.SimpleNamespace(impl=NativeImpl(), attn_backend=_FLASHINFER), info) is info
    layer = types.SimpleNamespace(impl=NativeImpl())
    impl = make_sparse(layer, info, Policy(window=window, **POLICY), stats or WorkerStats())
    padded = 6
    md = _decode_metadata("flashinfer-captured", "meta", [40, 9, 63, 0], 2, padded)
    f16 = dict(dtype=torch.float16, device="meta")
    args = (torch.empty(padded, HQ * D, **f16), torch.empty(padded, HKV, D, **f16), torch.empty(padded, HKV, D, **f16),
            torch.empty(B, HKV, N, 2 * D, **f16), md, torch.empty(padded, HQ * D, **f16))
    return impl, layer, args


def _gpu_mixed_layer(stats=None):
    info = dataclasses.replace(INFO, backend="FLASHINFER", cpu_isa=None, needs_batch_capture=True)
    assert cmodel.prepare_layer(types.SimpleNamespace(impl=NativeImpl(), attn_backend=_FLASHINFER), info) is info
    layer = types.SimpleNamespace(impl=NativeImpl())
    impl = make_sparse(layer, info, Policy(**POLICY), stats or WorkerStats())
    md, t = _mixed_step({"query_start_loc_cpu": [0, 1, 101, 102, 139], "seq_lens_cpu": MIXED_KV})
    f16 = dict(dtype=torch.float16, device="meta")
    padded = t + 3
    args = (torch.empty(padded, HQ * D, **f16), torch.empty(padded, HKV, D, **f16), torch.empty(padded, HKV, D, **f16),
            torch.empty(B, HKV, N, 2 * D, **f16), md, torch.empty(padded, HQ * D, **f16))
    return impl, layer, args


def _cpu_layer(q_lens, kv_lens, stats=None):
    """A CPU_ATTN step on real CPU tensors (the forward owns the cache write)."""
    layer = types.SimpleNamespace(impl=NativeImpl(), isa="vec")
    impl = make_sparse(layer, INFO, Policy(**POLICY), stats or WorkerStats())
    query, key, value, kv_cache, md = build_batch(torch.Generator().manual_seed(0), q_lens, kv_lens)
    return impl, layer, (query, key, value, kv_cache, md, torch.empty_like(query))


@pytest.fixture
def flashinfer_builder(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "FLASHINFER=packed")
    monkeypatch.setattr(_FlashInferBuilder, "build", _FlashInferBuilder.build)  # undo prepare_layer's wrapper
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


def _report(what: str, count: LayerCount) -> None:
    print(f"\n{what}: {len(count.torch_ops)} torch ops + {count.kernels} kernel launches = {count.total} "
          f"(writer {len(count.writer_ops)}): {count.torch_ops}")


def _step(make, kernel, monkeypatch, layers=3) -> list[LayerCount]:
    """``layers`` layers of one step (one metadata object, the layers' impls sharing one stats
    object, as in a worker), each counted; a warm-up step first (the install warm-up allocates the
    stats counters before any capture: ``sparse_attn.warmup``)."""
    impl, layer, args = make()
    _count_layer(impl, layer, args, monkeypatch, kernel=kernel)          # warm-up step
    impl, layer, args = make(stats=impl._sa_stats)
    return [_count_layer(impl, layer, args, monkeypatch, kernel=kernel) for _ in range(layers)]


def _check_step(what, counts, per_layer_budget, kernels):
    first, *later = counts
    for i, count in enumerate(counts):
        _report(f"{what}, layer {i}", count)
    assert all(c.kernels == kernels for c in counts), [c.kernels for c in counts]
    # the plan is built once per step: every layer after the first launches the same, few ops
    assert all(c.torch_ops == later[0].torch_ops for c in later)
    assert later[0].total <= per_layer_budget, later[0].torch_ops
    return first.total - later[0].total


@pytest.mark.parametrize("window", [None, 16], ids=["global-curve", "window-curve"])
def test_captured_decode_layer_launches(window, flashinfer_builder, monkeypatch):
    """A captured decode layer on a GPU is the attention kernel alone: lambda, the decode test
    and the counts are in it; nothing per step either (no host data on this path)."""
    pytest.importorskip("triton")
    counts = _step(functools.partial(_gpu_decode_layer, window), "triton", monkeypatch)
    plan_ops = _check_step(f"triton decode ({window=})", counts, DECODE_LAYER_BUDGET, kernels=1)
    assert counts[1].torch_ops == [] and plan_ops == 0


@pytest.mark.parametrize("kernel", ["torch", "compiled"])
def test_cpu_decode_layer_launches(kernel, monkeypatch):
    counts = _step(functools.partial(_cpu_layer, [1, 1, 1], [40, 9, 63]), kernel, monkeypatch)
    plan_ops = _check_step(f"{kernel} decode", counts, CPU_DECODE_LAYER_BUDGET[kernel], kernels=1)
    assert plan_ops <= PLAN_BUDGET, counts[0].torch_ops


def test_cpu_decode_layer_where_vllm_writes_the_cache_is_the_kernel_alone(monkeypatch):
    """vLLM 0.29+ writes the cache itself: a CPU decode layer served by the compiled kernel is then the
    layer's prepared launch (``kernels.layer_launch``): the library call and no torch op, the counts
    added by the library; the step's plan (its lambdas and batch part) is built by the first layer."""
    def vllm_writes(q_lens, kv_lens, stats=None):
        impl, layer, args = _cpu_layer(q_lens, kv_lens, stats)
        impl._sa_writer = None
        return impl, layer, args

    counts = _step(functools.partial(vllm_writes, [1, 1, 1], [40, 9, 63]), "compiled", monkeypatch)
    plan_ops = _check_step("compiled decode, vLLM writes", counts, 1, kernels=1)
    assert all(c.torch_ops == [] and c.writer_ops == [] for c in counts[1:])
    assert plan_ops <= PLAN_BUDGET, counts[0].torch_ops


def test_mixed_step_layer_launches(flashinfer_builder, monkeypatch):
    pytest.importorskip("triton")
    counts = _step(_gpu_mixed_layer, "triton", monkeypatch)
    plan_ops = _check_step("triton mixed step", counts, MIXED_LAYER_BUDGET, kernels=2)
    assert plan_ops <= GPU_PLAN_BUDGET, counts[0].torch_ops


@pytest.mark.parametrize("kernel", ["torch", "compiled"])
def test_cpu_mixed_step_layer_launches(kernel, monkeypatch):
    counts = _step(functools.partial(_cpu_layer, [1, 20, 1, 7], [40, 30, 9, 50]), kernel, monkeypatch)
    plan_ops = _check_step(f"{kernel} mixed step", counts, CPU_MIXED_LAYER_BUDGET[kernel], kernels=2)
    assert plan_ops <= PLAN_BUDGET, counts[0].torch_ops


#: Launches per layer after the step's first (torch ops + kernels). Measured at 0e49f20, before
#: the kernels computed lambdas and counts themselves: decode 38 (Triton), 39 (torch), 41
#: (compiled); a later layer of a mixed step 83 / 72 / 76.
#: Decode on a GPU: the attention kernel (and, split, its merge).
DECODE_LAYER_BUDGET = 2
#: CPU decode: the kernel and one add of its counts (the compiled kernel writes its count buffers
#: itself, ABI 5: before that it was 4, two fills of them included).
CPU_DECODE_LAYER_BUDGET = {"torch": 2, "compiled": 2}
#: Mixed: a kernel per phase, and per phase whose sequences are not adjacent the gather of its
#: query rows and the scatter of its output (``q[rows]``, ``out[rows] = ...``).
MIXED_LAYER_BUDGET = 6
#: CPU mixed: the same, plus per phase an add of its counts (compiled: 12 before ABI 5).
CPU_MIXED_LAYER_BUDGET = {"torch": 8, "compiled": 8}
#: The step's plan (its first layer only, measured): the phases' row indices (compat), the
#: prefill tile map (GPU), the host lambdas, and the one validation per phase (on CPU with the
#: block-id check, a reduction over the table).
GPU_PLAN_BUDGET = 35
PLAN_BUDGET = 50
