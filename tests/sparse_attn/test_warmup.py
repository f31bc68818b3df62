"""The install warm-up compiles every Triton variant a served forward launches: after it, a
decode step and a mixed step (both phases sparse, and a dense phase) launch no kernel variant
that had not run (``triton_impl.variant_key``: what Triton specialises on), under the
interpreter on CPU tensors, the launch path of a GPU (the kernel computes the lambdas)."""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch

import compat
from sparse_attn import adapter, warmup
from sparse_attn.adapter import Policy, make_sparse
from sparse_attn.stats import WorkerStats
from tests.sparse_attn.test_adapter import D, HKV, HQ, INFO, N, Metadata, NativeImpl

pytest.importorskip("triton")


@pytest.fixture
def gpu_launch_path(monkeypatch):
    from sparse_attn.kernels import triton_impl

    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "FLASH_ATTN=packed")
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "adapter")
    compat.reset_for_tests()
    monkeypatch.setattr(adapter, "_kernel_computes_lambdas", lambda device: True)
    monkeypatch.setattr(adapter, "paged_attention", functools.partial(adapter.paged_attention, impl="triton"))
    forward_keys = []
    real = triton_impl.launch

    def launch(plan):
        forward_keys.extend(triton_impl.variant_key(call) for call in plan.calls)
        real(plan)

    monkeypatch.setattr(triton_impl, "launch", launch)
    yield forward_keys
    compat.reset_for_tests()


def _step(impl, layer, q_lens, kv_lens, gen):
    s = len(q_lens)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    t = int(starts[-1])
    width = max(kv_lens) // N + 1
    md = Metadata(starts, torch.tensor(kv_lens, dtype=torch.int32),
                  torch.arange(s * width, dtype=torch.int32).view(s, width), torch.arange(t, dtype=torch.int64),
                  num_actual_tokens=t, max_query_len=max(q_lens), max_seq_len=max(kv_lens))
    f16 = dict(dtype=torch.float16)
    kv_cache = torch.randn(s * width, HKV, N, 2 * D, generator=gen).to(torch.float16)
    out = torch.zeros(t, HQ * D, **f16)
    impl.forward(layer, torch.randn(t, HQ * D, generator=gen).to(torch.float16),
                 torch.randn(t, HKV, D, generator=gen).to(torch.float16),
                 torch.randn(t, HKV, D, generator=gen).to(torch.float16), kv_cache, md, out)
    return out


def test_no_new_variant_is_launched_after_the_warm_up(gpu_launch_path):
    from sparse_attn.kernels import triton_impl

    info = dataclasses.replace(INFO, backend="FLASH_ATTN", cpu_isa=None)
    stats = WorkerStats()
    # prefill scale 30: the 20-token chunk's lambda is >= 1 (a dense phase), the 70-token one's is not
    layer = types.SimpleNamespace(impl=NativeImpl())
    impl = make_sparse(layer, info, Policy(scale_factors={"decode": 12.0, "prefill": 30.0}, stats_interval_s=0), stats)
    triton_impl.LAUNCHED_VARIANTS.clear()          # only what this warm-up launches counts as warm
    launches = warmup.warm_up([impl], stats, device=torch.device("cpu"), dtype=torch.float16, impl="triton")
    assert launches > 0 and {p for p, _ in stats.device_counts} == {"decode", "prefill"}
    warmed = set(triton_impl.LAUNCHED_VARIANTS)
    gpu_launch_path.clear()
    gen = torch.Generator().manual_seed(0)
    _step(impl, layer, [1, 1, 1], [40, 9, 63], gen)                     # decode
    _step(impl, layer, [1, 20, 1], [40, 20, 9], gen)                   # mixed, the prefill phase dense
    _step(impl, layer, [1, 70, 5], [300, 90, 5], gen)                  # mixed, both sparse
    assert layer.impl.forward_calls == 0 and len(gpu_launch_path) >= 5
    new = set(gpu_launch_path) - warmed
    assert not new, f"{len(new)} variant(s) first launched inside a forward: {sorted(k[2] for k in new)}"


def test_the_variant_check_sees_a_variant_the_warm_up_did_not_launch(gpu_launch_path):
    """Control: a forward's variants are new to a process that did not warm up that layer kind
    (another GQA group), so the test above can fail."""
    from sparse_attn.kernels import triton_impl

    info = dataclasses.replace(INFO, backend="FLASH_ATTN", cpu_isa=None)
    stats = WorkerStats()
    layer = types.SimpleNamespace(impl=NativeImpl())
    impl = make_sparse(layer, info, Policy(scale_factors={"decode": 12.0, "prefill": 30.0}, stats_interval_s=0), stats)
    other = make_sparse(types.SimpleNamespace(impl=NativeImpl()), dataclasses.replace(info, num_kv_heads=HQ),
                        Policy(scale_factors={"decode": 12.0, "prefill": 30.0}, stats_interval_s=0), stats)
    triton_impl.LAUNCHED_VARIANTS.clear()
    warmup.warm_up([other], stats, device=torch.device("cpu"), dtype=torch.float16, impl="triton")
    warmed = set(triton_impl.LAUNCHED_VARIANTS)
    gpu_launch_path.clear()
    _step(impl, layer, [1, 1, 1], [40, 9, 63], torch.Generator().manual_seed(0))
    assert gpu_launch_path and set(gpu_launch_path) - warmed, "the decode variant of this head layout is new"
