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
    _mixed_step, build_batch,
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


def _gpu_decode_layer(window):
    """A FlashInfer-style captured uniform decode step on meta tensors (as on a GPU)."""
    info = dataclasses.replace(INFO, backend="FLASHINFER", cpu_isa=None, needs_batch_capture=True,
                               features=cmodel.LayerFeatures(sliding_window=window))
    assert cmodel.prepare_layer(types.SimpleNamespace(impl=NativeImpl(), attn_backend=_FLASHINFER), info) is info
    layer = types.SimpleNamespace(impl=NativeImpl())
    impl = make_sparse(layer, info, Policy(window=window, **POLICY), WorkerStats())
    padded = 6
    md = _decode_metadata("flashinfer-captured", "meta", [40, 9, 63, 0], 2, padded)
    f16 = dict(dtype=torch.float16, device="meta")
    args = (torch.empty(padded, HQ * D, **f16), torch.empty(padded, HKV, D, **f16), torch.empty(padded, HKV, D, **f16),
            torch.empty(B, HKV, N, 2 * D, **f16), md, torch.empty(padded, HQ * D, **f16))
    return impl, layer, args


def _gpu_mixed_layer():
    info = dataclasses.replace(INFO, backend="FLASHINFER", cpu_isa=None, needs_batch_capture=True)
    assert cmodel.prepare_layer(types.SimpleNamespace(impl=NativeImpl(), attn_backend=_FLASHINFER), info) is info
    layer = types.SimpleNamespace(impl=NativeImpl())
    impl = make_sparse(layer, info, Policy(**POLICY), WorkerStats())
    md, t = _mixed_step({"query_start_loc_cpu": [0, 1, 101, 102, 139], "seq_lens_cpu": MIXED_KV})
    f16 = dict(dtype=torch.float16, device="meta")
    padded = t + 3
    args = (torch.empty(padded, HQ * D, **f16), torch.empty(padded, HKV, D, **f16), torch.empty(padded, HKV, D, **f16),
            torch.empty(B, HKV, N, 2 * D, **f16), md, torch.empty(padded, HQ * D, **f16))
    return impl, layer, args


def _cpu_layer(q_lens, kv_lens):
    """A CPU_ATTN step on real CPU tensors (the forward owns the cache write)."""
    layer = types.SimpleNamespace(impl=NativeImpl(), isa="vec")
    impl = make_sparse(layer, INFO, Policy(**POLICY), WorkerStats())
    query, key, value, kv_cache, md = build_batch(torch.Generator().manual_seed(0), q_lens, kv_lens)
    return impl, layer, (query, key, value, kv_cache, md, torch.empty_like(query))


@pytest.fixture
def flashinfer_builder(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "FLASHINFER=packed")
    monkeypatch.setattr(_FlashInferBuilder, "build", _FlashInferBuilder.build)  # undo prepare_layer's wrapper
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


@pytest.fixture
def cpu_attn(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "CPU_ATTN=cpu-packed")
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "adapter")
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


def _report(what: str, count: LayerCount) -> None:
    print(f"\n{what}: {len(count.torch_ops)} torch ops + {count.kernels} kernel launches = {count.total} "
          f"(writer {len(count.writer_ops)}): {count.torch_ops}")


@pytest.mark.parametrize("window", [None, 16], ids=["global-curve", "window-curve"])
def test_captured_decode_layer_launches(window, flashinfer_builder, monkeypatch):
    pytest.importorskip("triton")
    impl, layer, args = _gpu_decode_layer(window)
    count = _count_layer(impl, layer, args, monkeypatch, kernel="triton")
    _report(f"triton decode layer ({window=})", count)
    assert count.kernels >= 1
    assert count.total <= DECODE_LAYER_BUDGET, count.torch_ops


@pytest.mark.parametrize("kernel", ["torch", "compiled"])
def test_cpu_decode_layer_launches(kernel, cpu_attn, monkeypatch):
    impl, layer, args = _cpu_layer([1, 1, 1], [40, 9, 63])
    count = _count_layer(impl, layer, args, monkeypatch, kernel=kernel)
    _report(f"{kernel} decode layer", count)
    assert count.kernels == 1
    assert count.total <= DECODE_LAYER_BUDGET, count.torch_ops


def test_mixed_step_layer_launches(flashinfer_builder, monkeypatch):
    pytest.importorskip("triton")
    impl, layer, args = _gpu_mixed_layer()
    first = _count_layer(impl, layer, args, monkeypatch, kernel="triton")
    _report("triton mixed step, first layer", first)
    later = _count_layer(impl, layer, args, monkeypatch, kernel="triton")
    _report("triton mixed step, a later layer", later)
    assert later.kernels >= 2            # one launch per phase
    assert later.total <= MIXED_LAYER_BUDGET, later.torch_ops


@pytest.mark.parametrize("kernel", ["torch", "compiled"])
def test_cpu_mixed_step_layer_launches(kernel, cpu_attn, monkeypatch):
    impl, layer, args = _cpu_layer([1, 20, 1, 7], [40, 30, 9, 50])
    first = _count_layer(impl, layer, args, monkeypatch, kernel=kernel)
    _report(f"{kernel} mixed step, first layer", first)
    later = _count_layer(impl, layer, args, monkeypatch, kernel=kernel)
    _report(f"{kernel} mixed step, a later layer", later)
    assert later.kernels == 2
    assert later.total <= MIXED_LAYER_BUDGET, later.torch_ops


#: launches per layer (torch ops + kernels), measured at 0e49f20: decode 38-41, mixed 83-90
DECODE_LAYER_BUDGET = 41
MIXED_LAYER_BUDGET = 90
