"""Tests of the torch (CPU) skip-softmax paged attention.

References here are written independently of the implementation: dense attention is
float64 softmax on K/V gathered token by token; the sparse reference walks every
(query head, query tile, KV tile) in Python loops and applies the documented skip rule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_attn.kernels import (SPLIT_K, TILE_K, TILE_Q, BatchMeta, LayerSpec, effective_lambda, never_skips,
                                 paged_attention, paged_attention_counts)

from .kernel_reference import add_sink_token, gather_seq, make_batch, reference  # noqa: F401  (re-exported)


# --------------------------------------------------------------------------- cases

CASES = {
    # name: (kv_lens, q_lens, Hq, Hkv, D, page)
    "prefill-1seq-gqa1-page16": ([200], [200], 2, 2, 32, 16),
    "mixed-ragged-gqa2-page16": ([300, 5, 77, 130, 64], [1, 5, 77, 70, 64], 4, 2, 32, 16),
    "chunked-prefill-gqa4-page32": ([333], [150], 4, 1, 16, 32),
    "decode-ragged-mqa-page16": ([1, 65, 128, 700], [1, 1, 1, 1], 4, 1, 16, 16),
    "mixed-gqa4-page7-fallback": ([150, 129, 3], [129, 1, 3], 8, 2, 16, 7),
    "prefill-gqa2-page128-split": ([290, 40], [100, 40], 4, 2, 16, 128),
}
LAYOUTS = ["contiguous", "dim_major_k", "packed_kv", "kv_interleaved_blocks"]


def _run(batch, scale, causal=True, **kw):
    return paged_attention(batch, LayerSpec(scale, causal), impl="torch", **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dense_matches_reference(case, layout):
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    batch = make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout)
    scale = d ** -0.5
    ref = reference(batch, scale)[0]
    out = _run(batch, scale=scale)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(_run(batch, scale=scale, threshold=0.0), out, atol=0, rtol=0)


@pytest.mark.parametrize("gqa", [1, 2, 4, 8], ids=["gqa1", "gqa2", "gqa4", "mqa8"])
def test_dense_gqa_ratios(gqa):
    batch = make_batch([190, 64, 1], [70, 64, 1], 8, 8 // gqa, 16, 16, seed=gqa)
    ref = reference(batch, 0.3)[0]
    torch.testing.assert_close(_run(batch, scale=0.3).double(), ref, atol=2e-5, rtol=1e-5)


def test_non_causal_matches_reference():
    batch = make_batch([300, 70], [100, 70], 4, 2, 16, 16)
    ref, sk, vis, _ = reference(batch, LayerSpec(0.25, causal=False), lam=0.3)
    out, sk2, vis2 = _run(batch, scale=0.25, threshold=0.3, causal=False, return_counts=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert sk2.tolist() == sk.tolist() and vis2.tolist() == vis.tolist()


@pytest.mark.parametrize("lam", [1e-3, 0.05, 0.3, 0.9], ids=lambda x: f"lambda={x}")
@pytest.mark.parametrize("case", ["mixed-ragged-gqa2-page16", "chunked-prefill-gqa4-page32",
                                  "decode-ragged-mqa-page16", "mixed-gqa4-page7-fallback",
                                  "prefill-gqa2-page128-split"])
@pytest.mark.parametrize("sink", [False, True], ids=["random", "sink"])
def test_sparse_matches_bruteforce(case, lam, sink):
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    batch = make_batch(kv_lens, q_lens, hq, hkv, d, page, layout="dim_major_k", seed=3)
    if sink:
        batch = add_sink_token(batch)
    scale = 2.0 * d ** -0.5  # peakier scores so that tiles get skipped
    ref, skipped, visited, _ = reference(batch, scale, lam=lam)
    out, sk, vis = _run(batch, scale=scale, threshold=lam, return_counts=True)
    assert sk.dtype == torch.int64 and vis.dtype == torch.int64 and sk.shape == (hq,)
    assert vis.tolist() == visited.tolist()
    assert sk.tolist() == skipped.tolist()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_sparse_actually_skips():
    batch = make_batch([700], [1], 4, 1, 16, 16, seed=5)
    _, sk, vis = _run(batch, scale=1.0, threshold=0.5, return_counts=True)
    assert (sk > 0).all() and (sk < vis).all()


def test_counting_mode_matches_bruteforce_and_serving():
    kv_lens, q_lens, hq, hkv, d, page = CASES["mixed-ragged-gqa2-page16"]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, seed=7))
    scale = 2.0 * d ** -0.5
    lams = [0.0, 1e-4, 1e-2, 0.1, 0.5, 1.0, 3.0]
    ref, _, visited, per_thr = reference(batch, scale, thresholds=lams)
    out, skipped, vis = paged_attention_counts(batch, LayerSpec(scale), torch.tensor(lams), impl="torch")
    assert skipped.shape == (len(lams), hq) and skipped.dtype == torch.int64
    assert skipped.tolist() == per_thr.tolist()
    assert vis.tolist() == visited.tolist()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    for j, lam in enumerate(lams):  # calibration predicts serving sparsity exactly
        _, sk, _ = _run(batch, scale=scale, threshold=lam, return_counts=True)
        assert sk.tolist() == skipped[j].tolist()


def test_error_grows_monotonically_with_lambda():
    batch = add_sink_token(make_batch([900, 400], [130, 1], 4, 2, 32, 16, seed=11), 2.0)
    scale = 1.5 * 32 ** -0.5
    dense = _run(batch, scale=scale).double()
    errs, skips = [], []
    for lam in [0.0, 1e-3, 1e-2, 0.05, 0.2, 0.5, 1.0]:
        out, sk, _ = _run(batch, scale=scale, threshold=lam, return_counts=True)
        errs.append((out.double() - dense).abs().mean().item())
        skips.append(int(sk.sum()))
    assert errs[0] == 0.0 and skips[0] == 0
    assert skips == sorted(skips) and skips[-1] > 0
    assert all(b >= a for a, b in zip(errs, errs[1:])), errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs(dtype):
    batch = make_batch([150, 40], [60, 1], 4, 2, 32, 16, dtype=dtype, layout="packed_kv")
    ref = reference(batch, 32 ** -0.5)[0]
    out = _run(batch, scale=32 ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    out_s, sk, _ = _run(batch, scale=32 ** -0.5, threshold=0.2, return_counts=True)
    assert out_s.dtype == dtype and not out_s.isnan().any()


def test_empty_and_zero_length_sequences():
    # kv 0 / q 0, kv > 0 / q 0 (no query this step), then a normal decode.
    batch = make_batch([0, 50, 30], [0, 0, 1], 2, 1, 16, 16)
    out, sk, vis = _run(batch, scale=0.25, threshold=0.5, return_counts=True)
    assert out.shape == (1, 2, 16) and not out.isnan().any()
    torch.testing.assert_close(out.double(), reference(batch, 0.25, lam=0.5)[0], atol=2e-5, rtol=1e-5)
    empty = make_batch([0, 0], [0, 0], 2, 1, 16, 16)
    out, sk, vis = _run(empty, scale=0.25, return_counts=True)
    assert out.shape == (0, 2, 16) and sk.tolist() == [0, 0] and vis.tolist() == [0, 0]
    out, skipped, vis = paged_attention_counts(empty, LayerSpec(0.25), [0.1, 0.2], impl="torch")
    assert skipped.shape == (2, 2)


def test_out_buffer_is_filled():
    batch = make_batch([100], [10], 2, 1, 16, 16)
    buf = torch.full_like(batch.query, float("nan"))
    res = _run(batch, scale=0.25, out=buf)
    assert res is buf and not buf.isnan().any()
    torch.testing.assert_close(buf, _run(batch, scale=0.25))


@pytest.mark.parametrize("kv_lens, q_lens", [
    pytest.param([1], [1], id="decode-first-token"),
    pytest.param([300], [1], id="decode-300"),
    pytest.param([200], [200], id="prefill-200"),
    pytest.param([130], [65], id="chunk-65-of-130"),
    pytest.param([64, 129, 7], [64, 2, 7], id="mixed"),
])
def test_visited_tiles_follow_the_documented_geometry(kv_lens, q_lens):
    """_common.py: a query tile is TILE_Q rows aligned to the sequence's first query row, and it
    visits KV tiles 0..last, last = the tile holding the last position its last valid row sees.
    The count per head is computed here from that text alone, independent of the kernels."""
    expected = 0
    for kv_len, q_len in zip(kv_lens, q_lens):
        for row0 in range(0, q_len, TILE_Q):
            last_row = min(row0 + TILE_Q, q_len) - 1
            expected += (kv_len - q_len + last_row) // TILE_K + 1
    batch = make_batch(kv_lens, q_lens, 4, 2, 32, 16)
    # Counted under a lambda > 0 (visited tiles count only where a tile could be skipped).
    _, _, visited = paged_attention_counts(batch, LayerSpec(32 ** -0.5), [0.5], impl="torch")
    assert visited.tolist() == [expected] * 4
    _, _, visited = _run(batch, scale=32 ** -0.5, threshold=0.0, return_counts=True)
    assert visited.tolist() == [0] * 4                     # lambda 0 everywhere: nothing countable


# --------------------------------------------------------------------------- validation

def _bad_inputs():
    """name -> function of a valid (batch, kwargs) returning an invalid one."""
    def field(name, fn):
        return lambda b, kw: (dataclasses.replace(b, **{name: fn(getattr(b, name))}), kw)

    def poke(name, index, value):
        def fn(t):
            t = t.clone()
            t[index] = value
            return t
        return field(name, fn)

    def option(**extra):
        return lambda b, kw: (b, {**kw, **extra})

    i32 = dict(dtype=torch.int32)
    return {
        "head-size-mismatch": field("query", lambda q: torch.randn(6, 4, 8)),
        "hq-not-multiple-of-hkv": field("query", lambda q: torch.randn(6, 3, 16)),
        "block-id-out-of-range": poke("block_table", (0, 1), 10_000),
        "block-id-negative": poke("block_table", (1, 0), -1),
        "block-table-too-narrow": field("block_table", lambda t: t[:, :1]),
        "negative-seq-len": poke("seq_lens", 1, -1),
        "q-len-exceeds-kv-len": field("seq_lens", lambda t: torch.tensor([4, 20], **i32)),
        "query-start-loc-wrong-total": field("query_start_loc", lambda t: torch.tensor([0, 5, 7], **i32)),
        "query-start-loc-decreasing": field("query_start_loc", lambda t: torch.tensor([0, 7, 6], **i32)),
        "query-start-loc-wrong-length": field("query_start_loc", lambda t: torch.tensor([0, 6], **i32)),
        "lambda-negative": option(threshold=-0.1),
        "lambda-nan": option(threshold=float("nan")),
        "kv-dtype-mismatch": field("key_cache", lambda t: t.to(torch.float16)),
        "query-dtype-int": field("query", lambda t: t.to(torch.int32)),
        "block-table-float": field("block_table", lambda t: t.float()),
        "k-v-shape-mismatch": field("value_cache", lambda t: t[:, :, :1]),
        "out-wrong-shape": option(out=torch.empty(5, 4, 16)),
        "bad-impl": option(impl="cuda-magic"),
        "bad-check": option(check="sometimes"),
    }


BAD = _bad_inputs()
#: Every implementation that runs on CPU tensors here; "compiled" fails (not skips) where the
#: library cannot be built, as test_kernels_cpu.py does.
CPU_IMPLS = ["torch", "compiled"]


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("host", [False, True], ids=["no-host-copy", "host-copy"])
@pytest.mark.parametrize("name", list(BAD), ids=list(BAD))
def test_bad_input_raises_value_error(name, host, impl):
    """Every bad input is refused with a ValueError by every CPU implementation, with or
    without a host copy of the lengths (block ids of CPU tensors are always checked)."""
    batch, kw = BAD[name](make_batch([40, 20], [5, 1], 4, 2, 16, 16), {"impl": impl})
    with pytest.raises(ValueError, match="paged_attention|BatchMeta"):
        if host:   # (the host copy itself refuses some bad lengths)
            batch = dataclasses.replace(batch, host=BatchMeta.from_host(batch.seq_lens, batch.query_start_loc))
        paged_attention(batch, LayerSpec(0.25), **kw)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("bad", ["past", 10**8, -1], ids=["one-past-the-cache", "1e8", "negative"])
def test_bad_block_id_message_names_the_id_the_range_and_the_fix(bad, impl):
    batch = make_batch([40, 20], [5, 1], 4, 2, 16, 16, host=True)
    n = batch.key_cache.shape[0]
    bad = n if bad == "past" else bad
    batch.block_table[0, 1] = bad
    with pytest.raises(ValueError) as err:
        paged_attention(batch, LayerSpec(0.25), threshold=0.1, impl=impl)
    msg = str(err.value)
    assert f"block_table[0, 1] out of range: got {bad}" in msg and f"[0, {n})" in msg and "Fix:" in msg, msg


@pytest.mark.parametrize("thresholds", [[0.1, -1.0], [float("nan")], torch.ones(2, 2)],
                         ids=["negative", "nan", "not-1d"])
def test_bad_counting_thresholds_raise(thresholds):
    batch = make_batch([40], [5], 2, 1, 16, 16)
    with pytest.raises(ValueError, match="threshold"):
        paged_attention_counts(batch, LayerSpec(0.25), thresholds, impl="torch")


# --------------------------------------------------------------------------- per-sequence lambda

def _seq_alone(batch, s):
    """Sequence ``s`` of a batch as a batch of its own (same caches, same block ids)."""
    qsl = batch.query_start_loc
    a, b = int(qsl[s]), int(qsl[s + 1])
    return dataclasses.replace(batch, query=batch.query[a:b], block_table=batch.block_table[s:s + 1],
                               seq_lens=batch.seq_lens[s:s + 1], query_start_loc=torch.tensor([0, b - a],
                                                                                              dtype=qsl.dtype))


PER_SEQ_CASES = {
    # kv_lens, q_lens, Hq, Hkv, D, page, per-sequence lambdas (0 = dense for that sequence)
    "mixed": ([300, 5, 77, 130, 64, 700], [1, 5, 77, 70, 64, 1], 4, 2, 32, 16, [0.3, 0.0, 0.05, 0.5, 0.1, 0.02]),
    "decode": ([65, 700, 128, 400, 1], [1, 1, 1, 1, 1], 4, 1, 16, 16, [0.5, 0.001, 0.0, 0.2, 0.9]),
    "chunked-page7": ([333, 150], [150, 129], 4, 2, 16, 7, [0.02, 0.4]),
}


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("case", list(PER_SEQ_CASES), ids=list(PER_SEQ_CASES))
def test_per_sequence_lambda_equals_each_sequence_alone(case, as_tensor):
    kv_lens, q_lens, hq, hkv, d, page, lams = PER_SEQ_CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout="dim_major_k", seed=13))
    scale = 2.0 * d ** -0.5
    thr = torch.tensor(lams) if as_tensor else lams
    out, sk, vis = _run(batch, scale=scale, threshold=thr, return_counts=True)
    sk_sum, vis_sum = torch.zeros_like(sk), torch.zeros_like(vis)
    for s, lam in enumerate(lams):
        alone = _seq_alone(batch, s)
        o_s, sk_s, vis_s = _run(alone, scale=scale, threshold=lam, return_counts=True)
        a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        torch.testing.assert_close(out[a:b], o_s, atol=1e-6, rtol=1e-6)
        ref, ref_sk, ref_vis, _ = reference(alone, scale, lam=lam)
        torch.testing.assert_close(out[a:b].double(), ref, atol=2e-5, rtol=1e-5)
        assert sk_s.tolist() == ref_sk.tolist() and vis_s.tolist() == ref_vis.tolist()
        sk_sum += sk_s
        vis_sum += vis_s
    assert sk.tolist() == sk_sum.tolist() and vis.tolist() == vis_sum.tolist()
    assert int(sk.sum()) > 0
    # A per-sequence lambda list whose entries are all equal is the scalar lambda.
    same = _run(batch, scale=scale, threshold=[0.05] * len(lams), return_counts=True)
    scalar = _run(batch, scale=scale, threshold=0.05, return_counts=True)
    torch.testing.assert_close(same[0], scalar[0], atol=0, rtol=0)
    assert same[1].tolist() == scalar[1].tolist()


def test_per_sequence_zero_lambda_is_dense_for_that_sequence():
    batch = add_sink_token(make_batch([700, 700], [1, 1], 4, 1, 16, 16, seed=5))
    out, sk, _ = _run(batch, scale=1.0, threshold=[0.0, 0.5], return_counts=True)
    dense = _run(batch, scale=1.0)
    # Sequence 0 is computed densely (up to fp32 summation order: its chunk shares the
    # sparse P.V path with sequence 1), sequence 1 is not.
    torch.testing.assert_close(out[0].double(), reference(_seq_alone(batch, 0), 1.0)[0][0], atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(out[0], dense[0], atol=1e-6, rtol=1e-6)
    assert (out[1] - dense[1]).abs().max() > 1e-4
    _, sk1, _ = _run(_seq_alone(batch, 1), scale=1.0, threshold=0.5, return_counts=True)
    assert sk.tolist() == sk1.tolist() and int(sk.sum()) > 0


def test_counting_mode_per_sequence_candidates():
    kv_lens, q_lens, hq, hkv, d, page, _ = PER_SEQ_CASES["mixed"]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, seed=7))
    scale = 2.0 * d ** -0.5
    n_seqs = len(kv_lens)
    base = torch.tensor([0.0, 1e-3, 0.05, 0.3, 1.0])
    # Candidate j for sequence s: base[j] scaled per sequence (as scale / kv_len would be).
    per_seq = base[:, None] * torch.tensor([1.0, 0.5, 2.0, 1.5, 0.25, 3.0])[None, :]
    out, skipped, vis = paged_attention_counts(batch, LayerSpec(scale), per_seq, impl="torch")
    assert skipped.shape == (len(base), hq) and skipped.dtype == torch.int64
    torch.testing.assert_close(out, _run(batch, scale=scale), atol=0, rtol=0)
    for j in range(len(base)):
        expect, expect_vis = torch.zeros(hq, dtype=torch.int64), torch.zeros(hq, dtype=torch.int64)
        for s in range(n_seqs):
            _, sk_s, vis_s, _ = reference(_seq_alone(batch, s), scale, lam=float(per_seq[j, s]))
            expect, expect_vis = expect + sk_s, expect_vis + vis_s
        assert skipped[j].tolist() == expect.tolist()
        # calibration predicts serving with the same per-sequence lambdas exactly; serving counts
        # visited tiles where its lambda is > 0 (none for candidate 0), counting mode where any is
        _, sk, v2 = _run(batch, scale=scale, threshold=per_seq[j], return_counts=True)
        assert sk.tolist() == skipped[j].tolist() and v2.tolist() == expect_vis.tolist()
        assert v2.tolist() == (vis.tolist() if bool((per_seq[j] > 0).all()) else [0] * hq)
    # 1-D candidates are the 2-D candidates broadcast over sequences; nested lists work too.
    one_d = paged_attention_counts(batch, LayerSpec(scale), base.tolist(), impl="torch")[1]
    two_d = paged_attention_counts(batch, LayerSpec(scale), base[:, None].expand(-1, n_seqs).tolist(), impl="torch")[1]
    assert one_d.tolist() == two_d.tolist()


@pytest.mark.parametrize("threshold", [[0.1], [0.1, 0.2, 0.3], [0.1, -0.2], [0.1, float("nan")],
                                       [0.1, float("inf")], torch.ones(2, 1), [[0.1, 0.2]], "abc"],
                         ids=["too-short", "too-long", "negative", "nan", "inf", "2d-tensor", "2d-list", "str"])
def test_bad_per_sequence_threshold_raises(threshold):
    batch = make_batch([40, 20], [5, 1], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="threshold"):
        _run(batch, scale=0.25, threshold=threshold)


@pytest.mark.parametrize("thresholds", [torch.ones(3, 3), [[0.1, 0.2, 0.3]], [[0.1, -0.2]], [[0.1, float("nan")]],
                                        torch.ones(2, 2, 2), [[0.1, 0.2], [0.3]]],
                         ids=["wrong-S-tensor", "wrong-S-list", "negative", "nan", "3d", "ragged"])
def test_bad_per_sequence_counting_thresholds_raise(thresholds):
    batch = make_batch([40, 20], [5, 1], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="threshold"):
        paged_attention_counts(batch, LayerSpec(0.25), thresholds, impl="torch")


# --------------------------------------------------------------------------- KV splits of the rule

SPLIT_CASES = {
    # kv_lens, q_lens, Hq, Hkv, D, page, split_k: every case crosses several split boundaries
    "decode-split128-gqa4": ([700, 65, 129, 1000], [1, 1, 1, 1], 8, 2, 16, 16, 128),
    "mixed-split192-gqa2-page7": ([650, 300, 40], [1, 150, 40], 4, 2, 16, 7, 192),
    "prefill-split64-every-tile": ([400], [200], 2, 1, 16, 32, 64),
    "decode-default-split-mqa": ([SPLIT_K * 2 + 300, 900], [1, 1], 4, 1, 16, 16, None),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES), ids=list(SPLIT_CASES))
def test_split_rule_matches_bruteforce_and_counting(case):
    kv_lens, q_lens, hq, hkv, d, page, split_k = SPLIT_CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout="dim_major_k", seed=21))
    scale = 2.0 * d ** -0.5
    rule = {} if split_k is None else {"split_k": split_k}
    lams = [0.0, 1e-3, 0.05, 0.3]
    ref_out, _, ref_vis, per_thr = reference(batch, scale, thresholds=lams, **rule)
    out, skipped, vis = paged_attention_counts(batch, LayerSpec(scale), lams, impl="torch", **rule)
    assert skipped.tolist() == per_thr.tolist() and vis.tolist() == ref_vis.tolist()
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    for j, lam in enumerate(lams[1:], 1):
        ref, ref_sk, _, _ = reference(batch, scale, lam=lam, **rule)
        o, sk, _ = _run(batch, scale=scale, threshold=lam, return_counts=True, **rule)
        assert sk.tolist() == ref_sk.tolist() == skipped[j].tolist()
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)
    # Every case skips something, split_k = TILE_K included: there every tile opens a split
    # and tiles after tile 0 are tested against tile 0's maxima alone (the seed).
    assert int(skipped[-1].sum()) > 0


def test_split_boundaries_change_counts():
    """The split is part of the rule: a later split's running max holds tile 0 and its own
    tiles only, a subset of what one split spanning the sequence holds, so a long decode
    never skips more tiles with splits (per head), and here skips fewer in total."""
    batch = add_sink_token(make_batch([SPLIT_K * 3], [1], 4, 1, 16, 16, seed=5))
    _, sk_split, vis = _run(batch, scale=1.0, threshold=0.5, return_counts=True)
    _, sk_one, vis_one = _run(batch, scale=1.0, threshold=0.5, return_counts=True, split_k=SPLIT_K * 4)
    assert vis.tolist() == vis_one.tolist()
    assert (sk_split <= sk_one).all() and int(sk_split.sum()) < int(sk_one.sum()) and (sk_split > 0).all()
    assert sk_split.tolist() == reference(batch, 1.0, lam=0.5)[1].tolist()
    assert sk_one.tolist() == reference(batch, 1.0, lam=0.5, split_k=SPLIT_K * 4)[1].tolist()


def test_later_splits_are_seeded_with_tile_0():
    """The first tile of a later split is skippable, against KV tile 0's maxima: with an
    attention sink at position 0 and a split per tile (every tile opens a split) most
    tiles after tile 0 are still skipped; a running max restarted at -inf would skip none."""
    batch = add_sink_token(make_batch([1000, 700], [1, 1], 4, 2, 16, 16, seed=12), strength=4.0)
    _, sk, vis = _run(batch, scale=1.0, threshold=0.5, return_counts=True, split_k=TILE_K)
    ref = reference(batch, 1.0, lam=0.5, split_k=TILE_K)
    assert sk.tolist() == ref[1].tolist() and vis.tolist() == ref[2].tolist()
    openers = vis - 2                                   # tiles after tile 0 of both sequences
    assert (2 * sk > openers).all(), (sk.tolist(), openers.tolist())
    # Tile 0 is the only tile never skipped: at an enormous lambda everything else is.
    _, sk_all, _ = _run(batch, scale=1.0, threshold=1e30, return_counts=True, split_k=TILE_K)
    assert sk_all.tolist() == openers.tolist()


@pytest.mark.parametrize("split_k", [0, 100, -64, 64.0, True], ids=["zero", "not-multiple", "negative", "float",
                                                                   "bool"])
def test_bad_split_raises(split_k):
    batch = make_batch([40], [5], 2, 1, 16, 16)
    with pytest.raises(ValueError, match="split_k"):
        _run(batch, scale=0.25, split_k=split_k)


def test_unchecked_call_on_cpu_equals_checked():
    """check=False on CPU (the torch implementation reads host tensors: no sync) gives the
    checked call's output and counts, for a float and a per-sequence tensor lambda."""
    batch = add_sink_token(make_batch([300, 5, 700], [1, 5, 1], 4, 2, 16, 16, seed=17))
    for thr in (0.3, torch.tensor([0.3, 0.0, 0.5])):
        a = _run(batch, scale=1.0, threshold=thr, return_counts=True)
        b = _run(dataclasses.replace(batch, max_query_len=5), scale=1.0, threshold=thr, return_counts=True,
                 check=False)
        torch.testing.assert_close(b[0], a[0], atol=0, rtol=0)
        assert b[1].tolist() == a[1].tolist() and b[2].tolist() == a[2].tolist() and int(a[1].sum()) > 0
    with pytest.raises(ValueError, match="one lambda per sequence"):
        _run(batch, scale=1.0, threshold=torch.zeros(2), check=False)


@pytest.mark.parametrize("tiles_per_chunk", [1, 3, 5], ids=["chunk1", "chunk3", "chunk5"])
def test_split_seed_carried_across_torch_chunks(tiles_per_chunk, monkeypatch):
    """The torch implementation walks KV in chunks of tiles; with small chunks they start
    inside a split, end inside the next and cross boundaries, so tile 0's maxima (seen in
    the first chunk only) must be carried to every later split opener."""
    from sparse_attn.kernels import torch_impl

    # Decode [700] with 4 query heads on 1 KV head: 4 score rows, 64 columns per tile.
    monkeypatch.setattr(torch_impl, "_SCORE_BUDGET", 4 * TILE_K * tiles_per_chunk)
    batch = add_sink_token(make_batch([700, 400], [1, 200], 4, 1, 16, 16, seed=3), strength=1.0)
    lams = [0.0, 0.05, 0.5]
    ref_out, _, ref_vis, per_thr = reference(batch, 1.0, thresholds=lams, split_k=128)
    out, skipped, vis = paged_attention_counts(batch, LayerSpec(1.0), lams, impl="torch", split_k=128)
    assert skipped.tolist() == per_thr.tolist() and vis.tolist() == ref_vis.tolist()
    assert int(skipped[-1].sum()) > 0
    ref, ref_sk, _, _ = reference(batch, 1.0, lam=0.5, split_k=128)
    o, sk, _ = _run(batch, scale=1.0, threshold=0.5, return_counts=True, split_k=128)
    assert sk.tolist() == ref_sk.tolist()
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


# --------------------------------------------------------------------------- effective lambda (one home of "dense")

@pytest.mark.parametrize("scale, kv_len, expected", [
    (12.0, 48, 0.25), (12.0, 12, 0.0), (12.0, 11, 0.0), (None, 100, 0.0), (0.0, 100, 0.0), (-3.0, 100, 0.0),
    (5.0, 0, 0.0), (float("inf"), 100, 0.0), (float("nan"), 100, 0.0), (1e-3, 4096, 1e-3 / 4096),
], ids=["quarter", "lambda-1", "lambda-above-1", "uncalibrated", "zero-scale", "negative-scale", "empty-seq",
        "inf-scale", "nan-scale", "tiny"])
def test_effective_lambda_host_and_device_forms_agree(scale, kv_len, expected):
    from sparse_attn.kernels import effective_lambda

    host = effective_lambda(scale, kv_len)
    assert isinstance(host, float) and host == pytest.approx(expected, rel=1e-12)
    device = effective_lambda(scale, torch.tensor([kv_len, kv_len], dtype=torch.int32))
    assert device.dtype == torch.float32 and device.shape == (2,)
    assert device.tolist() == [torch.tensor(expected, dtype=torch.float32).item()] * 2


@pytest.mark.parametrize("scale, kv_len, window, expected", [
    (128.0, 4096, 512, 0.25), (128.0, 256, 512, 0.5), (128.0, 512, 512, 0.25), (512.0, 4096, 512, 0.0),
    (600.0, 4096, 512, 0.0), (128.0, 0, 512, 0.0), (None, 4096, 512, 0.0), (128.0, 4096, None, 128.0 / 4096),
], ids=["beyond-window", "inside-window", "at-window", "lambda-1-at-window", "above-1", "empty-seq", "uncalibrated",
        "no-window"])
def test_effective_lambda_of_a_window_curve_divides_by_min_of_kv_len_and_window(scale, kv_len, window, expected):
    """lambda = scale / min(kv_len, window) (the sliding-window curve's rule), host and device alike."""
    from sparse_attn.kernels import effective_lambda

    host = effective_lambda(scale, kv_len, window)
    assert isinstance(host, float) and host == pytest.approx(expected, rel=1e-12)
    device = effective_lambda(scale, torch.tensor([kv_len], dtype=torch.int32), window)
    assert device.tolist() == [torch.tensor(expected, dtype=torch.float32).item()]


@pytest.mark.parametrize("scale, longest, expected", [
    (100.0, 101, False), (100.0, 100, True), (100.0, 50, True), (0.5, 1, False), (None, 4096, True), (3.0, 0, True),
], ids=["lambda-just-below-1", "lambda-1", "lambda-2", "lambda-half", "no-curve", "no-length"])
def test_never_skips_is_effective_lambda_zero_at_the_longest_normaliser(scale, longest, expected):
    assert never_skips(scale, longest) is expected
    assert expected == (effective_lambda(scale, longest) == 0.0)
    if not expected:     # lambda falls with the length: a phase that skips at `longest` skips beyond it too
        assert all(effective_lambda(scale, n) > 0 for n in (longest, 2 * longest, 10 * longest))


@pytest.mark.parametrize("window", [0, -1, 2.5, True], ids=["zero", "negative", "float", "bool"])
def test_effective_lambda_rejects_a_window_that_is_not_a_token_count(window):
    from sparse_attn.kernels import effective_lambda

    with pytest.raises(ValueError, match="window must be a positive number of tokens"):
        effective_lambda(1.0, 100, window)
