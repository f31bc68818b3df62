"""The serving launch whose kernel computes the lambdas and adds the counts itself
(``threshold=LambdaRule(...)``, ``counters=...``: the capture-safe decode layer and the eager
phases of the serving path) against the float64 reference, sequence by sequence, for the torch,
compiled CPU and Triton (interpreter) kernels."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparse_attn.kernels import LambdaRule, LayerSpec, effective_lambda, paged_attention  # noqa: E402
from sparse_attn.kernels import cpu_impl  # noqa: E402
from sparse_attn.protocol import PHASE_COUNTERS  # noqa: E402

from .kernel_reference import add_sink_token, make_batch, reference  # noqa: E402

try:  # the rule's Triton helper, probed alone (a module-level kernel: the interpreter reads its globals)
    import triton
    import triton.language as tl

    from sparse_attn.kernels.triton_kernels import _rule_lambda

    @triton.jit
    def _probe(KV, OUT, n, hi, mid, lo, window, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(OUT + offs, _rule_lambda(tl.load(KV + offs, mask=ok, other=0), hi, mid, lo, window), mask=ok)
except ImportError:
    _probe = None
from .test_kernels import _seq_alone  # noqa: E402

CASES = {
    # kv_lens, q_lens, Hq, Hkv, D, page, rule window: a padded request (q 0, kv 0), a sequence
    # whose lambda is >= 1 (kv 9: dense), split-KV decode at kv 700
    "decode": ([700, 65, 9, 400, 0], [1, 1, 1, 1, 0], 4, 2, 16, 16, None),
    "decode-window-curve": ([700, 65, 9, 400], [1, 1, 1, 1], 4, 1, 16, 16, 256),
    "mixed-prefill": ([300, 140, 30, 77], [1, 70, 30, 77], 4, 2, 16, 16, None),
}
#: not an fp32 number: the kernel must reproduce the float64 rule from its three fp32 parts
SCALE_FACTOR = 35.3


def _impls():
    impls = ["torch", "compiled", "triton"]
    return [pytest.param(i, marks=pytest.mark.skipif(i == "compiled" and not cpu_impl.status().available,
                                                     reason="compiled CPU kernel unavailable")) for i in impls]


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rule_and_counters_equal_the_reference_sequence_by_sequence(case, impl):
    if impl == "triton":
        pytest.importorskip("triton")
    kv_lens, q_lens, hq, hkv, d, page, window = CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, seed=3))
    spec = LayerSpec(2.0 * d ** -0.5)
    counters = torch.zeros(len(PHASE_COUNTERS), dtype=torch.int64)
    out = paged_attention(batch, spec, threshold=LambdaRule(SCALE_FACTOR, window), counters=counters, impl=impl,
                          check=False)
    lams = effective_lambda(SCALE_FACTOR, batch.seq_lens, window).tolist()
    assert 0.0 in lams and any(lam > 0 for lam in lams)
    # The V tiles a launch leaves unread depend on how many of a group's query heads one program packs: the CPU
    # kernel packs the whole group (up to 256 rows), Triton what its launch geometry says.
    packed = None
    if impl == "triton":
        from sparse_attn.kernels import triton_impl
        from sparse_attn.kernels._common import SPLIT_K

        packed = triton_impl.grid_for(batch, spec, None, SPLIT_K).heads
    skipped = visited = v_tested = v_skipped = 0
    for s, lam in enumerate(lams):
        if q_lens[s] == 0:
            continue
        alone = _seq_alone(batch, s)
        v_tiles = {}
        ref, ref_skipped, ref_visited, _ = reference(alone, spec, lam=lam, v_tiles=v_tiles, heads_per_item=packed)
        v_tested, v_skipped = v_tested + v_tiles["tested"], v_skipped + v_tiles["skipped"]
        a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        torch.testing.assert_close(out[a:b].double(), ref, atol=2e-5, rtol=1e-5)
        if lam > 0:                 # counted only where the sequence's lambda is > 0 (every kernel)
            skipped += int(ref_skipped.sum())
            visited += int(ref_visited.sum())
    assert skipped > 0
    expected = dict.fromkeys(PHASE_COUNTERS, 0) | dict(skipped=skipped, visited=visited, launches=1)
    if impl in ("compiled", "triton"):  # the kernels that count the V tiles they did not read (torch does not)
        # the V tiles no packed query head kept: fewer than the per-head skips imply where heads are packed
        assert 0 < v_skipped <= v_tested and (v_skipped / v_tested < skipped / visited or packed == 1)
        expected |= dict(v_tested=v_tested, v_skipped=v_skipped)
    assert dict(zip(PHASE_COUNTERS, counters.tolist())) == expected
    # a second launch adds to the same counters
    paged_attention(batch, spec, threshold=LambdaRule(SCALE_FACTOR, window), counters=counters, impl=impl, check=False)
    assert counters.tolist() == [2 * v for v in expected.values()]


@pytest.mark.parametrize("impl", ["compiled", "triton"])
def test_a_decode_launch_that_packs_the_group_counts_the_v_tiles_no_head_read(impl):
    """The capture-safe decode launch (``max_query_len=1``: Triton's split-KV decode, which packs a KV group's
    query heads in one program; the CPU kernel always does): V tiles unread = (sequence, KV head, tile) visits
    every query head of the group skipped, the float64 reference's union, fewer than the per-head skips."""
    if impl == "triton":
        pytest.importorskip("triton")
    elif not cpu_impl.status().available:
        pytest.skip("compiled CPU kernel unavailable")
    import dataclasses

    batch = dataclasses.replace(make_batch([700, 300, 1200], [1, 1, 1], 8, 2, 16, 16, seed=5), max_query_len=1)
    if impl == "triton":
        from sparse_attn.kernels import triton_impl
        from sparse_attn.kernels._common import SPLIT_K

        assert triton_impl.grid_for(batch, LayerSpec(0.5), None, SPLIT_K).heads == 4  # the whole group
    spec = LayerSpec(2.0 * 16 ** -0.5)
    counters = torch.zeros(len(PHASE_COUNTERS), dtype=torch.int64)
    factor = 250.0  # lambda 0.21-0.83: a tile every one of 4 heads skips is common enough to count
    paged_attention(batch, spec, threshold=LambdaRule(factor), counters=counters, impl=impl, check=False)
    v_tested = v_skipped = 0
    for s, lam in enumerate(effective_lambda(factor, batch.seq_lens, None).tolist()):
        v_tiles = {}
        reference(_seq_alone(batch, s), spec, lam=lam, v_tiles=v_tiles)
        v_tested, v_skipped = v_tested + v_tiles["tested"], v_skipped + v_tiles["skipped"]
    got = dict(zip(PHASE_COUNTERS, counters.tolist()))
    assert (got["v_tested"], got["v_skipped"]) == (v_tested, v_skipped)
    assert 0 < v_skipped and v_skipped / v_tested < got["skipped"] / got["visited"]


@pytest.mark.parametrize("impl", _impls())
def test_a_launch_whose_every_lambda_is_zero_counts_as_dense(impl):
    if impl == "triton":
        pytest.importorskip("triton")
    batch = make_batch([60, 9], [1, 1], 2, 1, 16, 16, seed=4)
    spec = LayerSpec(0.25)
    counters = torch.zeros(len(PHASE_COUNTERS), dtype=torch.int64)
    out = paged_attention(batch, spec, threshold=LambdaRule(60.0), counters=counters, impl=impl, check=False)
    torch.testing.assert_close(out.double(), reference(batch, spec)[0], atol=2e-5, rtol=1e-5)
    assert dict(zip(PHASE_COUNTERS, counters.tolist())) == dict.fromkeys(PHASE_COUNTERS, 0) | {"dense_launches": 1}


def test_the_kernels_lambda_is_bit_identical_to_the_rule():
    """The Triton rule (float64 from three fp32 parts, ``scale * (1 / norm)``) against
    ``effective_lambda``'s device form, bit for bit, over lengths and scale factors that are not
    fp32 numbers, with and without a window, including the dense cases (0, >= 1)."""
    pytest.importorskip("triton")
    from sparse_attn.kernels.triton_impl import f64_parts

    assert _probe is not None
    probe = _probe
    kv = torch.tensor([0, 1, 2, 3, 7, 9, 12, 13, 100, 333, 1000, 4097, 65536, 131071, 1 << 20], dtype=torch.int32)
    for scale in (12.0, 35.3, 0.1, 1e-10, 1 / 3, 2.0 ** 0.5 * 1000, 0.0):
        for window in (None, 7, 4096):
            got = torch.empty(kv.shape[0], dtype=torch.float32)
            probe[(1,)](kv, got, kv.shape[0], *f64_parts(scale), int(window or 0), BLOCK=16)
            want = effective_lambda(scale, kv, window)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (scale, window, got, want)


def test_f64_parts_sum_to_the_double():
    from sparse_attn.kernels.triton_impl import f64_parts

    for value in (35.3, 1 / 3, 1e-10, 12.0, 2.0 ** 0.5 * 1000, 0.0):
        parts = f64_parts(value)
        assert all(torch.tensor(p, dtype=torch.float32).item() == p for p in parts)   # each an fp32 number
        assert (parts[0] + parts[1]) + parts[2] == value
