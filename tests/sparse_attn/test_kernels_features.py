"""Layer features of real models (issue 17): sliding windows, learned sinks, logit soft-cap,
fp8 K/V caches with per-tensor scales, alone and combined, in the torch implementation
and the Triton kernel (under ``TRITON_INTERPRET=1``), against the float64 reference of
``kernel_reference.py`` (written from the rule's text in ``_common.py``).

The combinations are a pairwise covering design, not the full product (3 x 2 x 2 x 3 x 2 x
2 x 2 = 288 cases would take the interpreter an hour): every pair of values of any two
factors (window, sinks, soft-cap, KV dtype, GQA, split length, batch kind) appears in at
least one row of :data:`ROWS`, which ``test_rows_cover_every_pair`` checks.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch

pytest.importorskip("triton")

from sparse_attn.kernels import TILE_K, TILE_Q, LayerSpec, paged_attention, paged_attention_counts  # noqa: E402

from .kernel_reference import add_recency, add_sink_token, make_batch, reference  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a GPU", allow_module_level=True)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
D, PAGE = 16, 16
#: query heads per GQA ratio: 2 heads on 2 KV heads (no packing), 4 heads on 1 KV head.
HEADS = {1: (2, 2), 4: (4, 1)}
BATCHES = {
    # kv_lens, q_lens: a decode batch (one sequence of length 1) and a mixed batch whose
    # 130-query prefill has three query tiles, each with its own window start.
    "decode": ([450, 65, 200, 1], [1, 1, 1, 1]),
    "mixed": ([300, 130, 200, 64], [1, 130, 70, 1]),
}
FACTORS = {
    "window": (None, 100, 192),
    "sinks": (False, True),
    "softcap": (None, 6.0),
    "kv": ("native", "e4m3", "e5m2"),
    "gqa": (1, 4),
    "split_k": (128, 192),
    "batch": ("decode", "mixed"),
}
#: (window, sinks, softcap, kv, gqa, split_k, batch): a pairwise covering array.
ROWS = [
    (None, False, None, "native", 1, 128, "decode"),
    (None, True, 6.0, "e4m3", 4, 192, "mixed"),
    (None, False, 6.0, "e5m2", 4, 128, "mixed"),
    (100, False, None, "e4m3", 1, 192, "mixed"),
    (100, True, 6.0, "e5m2", 1, 128, "decode"),
    (100, True, None, "native", 4, 192, "decode"),
    (192, False, 6.0, "native", 1, 192, "mixed"),
    (192, True, None, "e5m2", 4, 192, "decode"),
    (192, False, None, "e4m3", 4, 128, "decode"),
    (192, True, 6.0, "native", 4, 128, "mixed"),
    (None, True, None, "e5m2", 1, 192, "mixed"),
    (100, False, 6.0, "native", 4, 128, "mixed"),
    (None, False, None, "e4m3", 1, 128, "mixed"),
]


def _row_id(row) -> str:
    window, sinks, cap, kv, gqa, split_k, batch = row
    return "-".join([f"window{window}" if window else "full", "sinks" if sinks else "nosinks",
                     f"cap{cap:g}" if cap else "nocap", kv, f"gqa{gqa}", f"split{split_k}", batch])


def _problem(row, seed=0):
    """The batch and layer of one row.  The e5m2 rows give their scales as 1-element
    device tensors (read only inside the kernels), the e4m3 rows as floats."""
    window, sinks, cap, kv, gqa, split_k, batch_kind = row
    kv_lens, q_lens = BATCHES[batch_kind]
    kv_dtype = {"native": None, "e4m3": E4M3, "e5m2": E5M2}[kv]
    k_scale, v_scale = (0.5, 2.0) if kv != "native" else (1.0, 1.0)
    hq, hkv = HEADS[gqa]
    batch = make_batch(kv_lens, q_lens, hq, hkv, D, PAGE, layout="dim_major_k" if seed % 2 else "packed_kv",
                       seed=seed, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    # Peaks every 192 positions: windowed rows (which never see position 0) still have
    # tiles that dominate others, so the lambdas below skip something in every row.
    batch = add_sink_token(batch, strength=2.5 / k_scale ** 0.5, every=192)
    if window:      # windowed rows prefer recent keys (the diagonal anchor then has tiles to skip)
        batch = add_recency(batch, k_scale=k_scale, scale=2.0 * D ** -0.5)
    if kv == "e5m2":
        k_scale, v_scale = torch.tensor([k_scale]), torch.tensor(v_scale)
    gen = torch.Generator().manual_seed(seed + 1)
    spec = LayerSpec(2.0 * D ** -0.5, window=window, soft_cap=cap,
                     sink_logits=torch.randn(hq, generator=gen) * 2 if sinks else None, k_scale=k_scale, v_scale=v_scale)
    return batch, spec, split_k


LAMS = [0.0, 0.05, 0.4]


def test_rows_cover_every_pair():
    names = list(FACTORS)
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            assert any(r[i] == va and r[j] == vb for r in ROWS), f"no row has {a}={va} with {b}={vb}"


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_features_match_float64_reference_and_counts_match_serving(row):
    batch, spec, split_k = _problem(row, seed=ROWS.index(row))
    ref0, _, ref_vis, ref_thr = reference(batch, spec, thresholds=LAMS, split_k=split_k)
    ref_l, ref_sk, _, _ = reference(batch, spec, lam=LAMS[-1], split_k=split_k)
    assert int(ref_sk.sum()) > 0, "the row must skip something to test the rule"
    for impl in ("torch", "triton", "compiled"):
        kw = dict(impl=impl, split_k=split_k)
        # Counting mode: the dense output (lambda 0: every feature equals float64) and the
        # rule's counts per candidate ...
        out_c, skipped, vis = paged_attention_counts(batch, spec, LAMS, **kw)
        assert not out_c.isnan().any()
        torch.testing.assert_close(out_c.double(), ref0, atol=2e-5, rtol=1e-5, msg=f"{impl} dense")
        assert vis.tolist() == ref_vis.tolist(), impl
        assert skipped.tolist() == ref_thr.tolist(), impl
        # ... which are exactly the tiles serving skips under that lambda (every lambda on
        # torch and the compiled CPU kernel; the largest on Triton, whose interpreter is slow).
        for lam in LAMS[-1:] if impl == "triton" else LAMS[1:]:
            out, sk, v = paged_attention(batch, spec, threshold=lam, return_counts=True, **kw)
            assert sk.tolist() == skipped[LAMS.index(lam)].tolist() and v.tolist() == vis.tolist(), (impl, lam)
        torch.testing.assert_close(out.double(), ref_l, atol=2e-5, rtol=1e-5, msg=f"{impl} sparse")


@pytest.mark.parametrize("window, kv_lens, q_lens", [
    pytest.param(100, [700], [1], id="decode-window-mid-tile"),
    pytest.param(64, [700], [1], id="decode-window-one-tile"),
    pytest.param(1, [300, 5], [1, 5], id="window-1"),
    pytest.param(150, [330], [200], id="prefill-4-query-tiles"),
    pytest.param(1000, [300], [130], id="window-beyond-sequence"),
])
def test_windowed_tiles_follow_the_documented_geometry(window, kv_lens, q_lens):
    """_common.py: a query tile visits tiles first .. last, first = the tile of its first
    row's window start, last = the tile of its last row's position; tiles wholly outside
    are neither visited nor counted.  Computed here from that text alone."""
    expected = 0
    for kv_len, q_len in zip(kv_lens, q_lens):
        for row0 in range(0, q_len, TILE_Q):
            first_pos = kv_len - q_len + row0
            last_pos = kv_len - q_len + min(row0 + TILE_Q, q_len) - 1
            expected += last_pos // TILE_K - max(0, first_pos - window + 1) // TILE_K + 1
    batch = make_batch(kv_lens, q_lens, 4, 2, 16, 16)
    spec = LayerSpec(0.25, window=window)
    for impl in ("torch", "triton", "compiled"):
        _, _, visited = paged_attention_counts(batch, spec, [0.5], impl=impl)
        assert visited.tolist() == [expected] * 4, impl


def test_window_of_one_token_returns_each_rows_own_value():
    batch = make_batch([300, 5], [3, 5], 4, 2, 16, 16)
    out = paged_attention(batch, LayerSpec(0.25, window=1), impl="torch")
    v, bt = batch.value_cache, batch.block_table
    for s, (kv_len, q_len) in enumerate(([300, 3], [5, 5])):
        a = int(batch.query_start_loc[s])
        for i in range(q_len):
            p = kv_len - q_len + i
            own = v[int(bt[s, p // 16]), p % 16]                                 # [Hkv, D]
            torch.testing.assert_close(out[a + i], own.repeat_interleave(2, 0), atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["torch", "triton", "compiled"])
def test_window_covering_the_sequence_sees_what_full_attention_sees(impl):
    """A window longer than every sequence hides nothing: the dense output and the visited
    tiles are full attention's.  Its skip test is still the windowed layer's (the anchor is
    a property of the layer: the diagonal tile, not tile 0), so under a lambda its skips
    are the float64 reference's for the windowed spec."""
    batch = add_sink_token(make_batch([300, 130, 40], [1, 130, 40], 4, 2, 16, 16, seed=3))
    full, windowed = LayerSpec(0.5), LayerSpec(0.5, window=300)
    dense_full = paged_attention_counts(batch, full, [0.5], impl=impl, split_k=128)      # dense, counted
    dense_win = paged_attention_counts(batch, windowed, [0.5], impl=impl, split_k=128)
    # fp32 rounding only: the compiled kernel visits a windowed item's anchor (here its last
    # tile) first, so its online softmax adds the same terms in another order.
    torch.testing.assert_close(dense_win[0], dense_full[0], atol=2e-5, rtol=1e-5)
    assert dense_win[2].tolist() == dense_full[2].tolist()
    ref, ref_sk, ref_vis, _ = reference(batch, windowed, lam=0.3, split_k=128)
    out, sk, vis = paged_attention(batch, windowed, threshold=0.3, return_counts=True, impl=impl, split_k=128)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert sk.tolist() == ref_sk.tolist() and vis.tolist() == ref_vis.tolist() == dense_full[2].tolist()


def _recent_keys_batch():
    """Two sequences of a 512-token-window layer whose logits are set tile by tile (keys 0
    except dimension 0, queries on dimension 0 only, scale 1), so every tile maximum is
    known by hand.  Query head 0 has logit ``v[t]`` on KV tile ``t``, head 1 a tenth of it.

    * A, a decode at position 639 (visits tiles 2 .. 9): ``v = 0`` except tile 5 (an old
      peak, 5) and tile 9, its diagonal tile (the recent tokens, 3).
    * B, a 104-query prefill at positions 600 .. 703 (kv 704): ``v = 0`` except tile 10
      (3).  Its query tile 0 (positions 600 .. 663, tiles 1 .. 10) straddles the KV tile
      boundary at 640: its rows 600 .. 639 see nothing of their anchor tile 10 (seed -inf);
      its query tile 1 (664 .. 703) visits tiles 2 .. 10.
    """
    batch = make_batch([640, 704], [1, 104], 2, 1, D, PAGE, seed=40)
    k, bt = batch.key_cache, batch.block_table
    for s, (n, tiles) in enumerate(([640, {5: 5.0, 9: 3.0}], [704, {10: 3.0}])):
        pos = torch.arange(n)
        blk, off = bt[s].long()[pos // PAGE], pos % PAGE
        k[blk, off] = 0.0
        k[blk, off, 0, 0] = torch.tensor([tiles.get(int(p) // TILE_K, 0.0) for p in pos])
    q = torch.zeros_like(batch.query)
    q[:, 0, 0], q[:, 1, 0] = 1.0, 0.1
    return dataclasses.replace(batch, query=q)


#: Skips of query head 0 [lambda 0.5, lambda 0.03] per split length, by hand from the
#: pattern with the diagonal anchor (head 1's ratios are all >= exp(-0.5) = 0.61: none).
#: A (anchor tile 9, seed 3): lambda 0.5 skips tiles 2, 3, 4 (exp(0 - 3) = 0.050) and 6, 7, 8
#: (exp(0 - 5) against the peak; with 256-position splits tile 8 restarts from the seed:
#: 0.050, still skipped) = 6; lambda 0.03 only those tested against the peak: 6, 7, 8 = 3,
#: or 6, 7 = 2 when tile 8 opens a split.  B's query tile 1 (seed 3): lambda 0.5 skips
#: tiles 2 .. 9 = 8, lambda 0.03 none; its query tile 0: rows 600 .. 639 start at -inf
#: (e = inf on their first visible tile, then exp(0 - 0) = 1 on the rest; a restart goes
#: back to -inf), so it keeps all 10.  Visited: A 8, B 9 + 10.
#: The window-start anchor (the old rule) would skip 4 (A: 6, 7, 8 and the diagonal tile 9,
#: exp(3 - 5)) and 0 in B at lambda 0.5.
RECENT_SKIPS = {1024: [14, 3], 256: [14, 2]}


@pytest.mark.parametrize("split_k", sorted(RECENT_SKIPS), ids=lambda n: f"split{n}")
@pytest.mark.parametrize("impl", ["torch", "triton", "compiled"])
def test_diagonal_anchor_skips_old_window_tiles_counted_by_hand(impl, split_k):
    """_common.py: a windowed query tile's anchor is its diagonal tile, whose maxima seed the
    running max of every earlier tile (and of every split restart); a row that sees nothing
    of the anchor tile starts at -inf and keeps its tiles.  Counts, serving skips and the
    output against the pattern's hand count and the float64 reference."""
    batch, spec = _recent_keys_batch(), LayerSpec(1.0, window=512)
    want = [[RECENT_SKIPS[split_k][0], 0], [RECENT_SKIPS[split_k][1], 0]]
    _, _, ref_vis, ref_thr = reference(batch, spec, thresholds=[0.5, 0.03], split_k=split_k)
    assert ref_thr.tolist() == want and ref_vis.tolist() == [27, 27]
    _, skipped, vis = paged_attention_counts(batch, spec, [0.5, 0.03], impl=impl, split_k=split_k)
    assert skipped.tolist() == want and vis.tolist() == [27, 27], impl
    ref = reference(batch, spec, lam=0.5, split_k=split_k)[0]
    out, sk, _ = paged_attention(batch, spec, threshold=0.5, return_counts=True, impl=impl, split_k=split_k)
    assert sk.tolist() == want[0], impl
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_programs", [1, 3, 64], ids=lambda n: f"max-programs{n}")
def test_sink_enters_once_however_the_decode_is_split(kv_programs, monkeypatch):
    """Split-KV decode programs each walk several rule splits (the grid is bounded); the
    sink joins the denominator once, in the merge (or in the program when it is alone):
    every program count gives the float64 reference."""
    from sparse_attn.kernels import triton_impl

    monkeypatch.setattr(triton_impl, "MAX_KV_PROGRAMS", kv_programs)
    batch = add_sink_token(make_batch([1000, 300, 65], [1, 1, 1], 8, 2, 16, 16, seed=4), every=192)
    spec = LayerSpec(0.5, sink_logits=torch.tensor([3.0, -1.0, 0.5, 8.0, -20.0, 1.0, 2.0, 0.0]), window=700)
    ref, ref_sk, ref_vis, _ = reference(batch, spec, lam=0.3, split_k=128)
    out, sk, vis = paged_attention(batch, spec, threshold=0.3, return_counts=True, impl="triton", split_k=128)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert sk.tolist() == ref_sk.tolist() and vis.tolist() == ref_vis.tolist() and int(sk.sum()) > 0


def test_sinks_and_scales_behave_as_the_formula_says():
    """A very negative sink is no sink; a sink only rescales (the skip test never sees
    it: counts are unchanged); v_scale multiplies the output; a tensor k_scale equals the
    float one and is the same as scaling the logits.  (torch only: the reference rows above
    hold both implementations to the same formula.)"""
    impl = "torch"
    batch = add_sink_token(make_batch([300, 130], [1, 130], 4, 2, 16, 16, seed=6))
    base = LayerSpec(0.5)
    out, sk, _ = paged_attention(batch, base, threshold=0.2, return_counts=True, impl=impl)
    none = paged_attention(batch, dataclasses.replace(base, sink_logits=torch.full((4,), -1e4)), threshold=0.2,
                           return_counts=True, impl=impl)
    torch.testing.assert_close(none[0], out, atol=1e-6, rtol=1e-6)
    strong = paged_attention(batch, dataclasses.replace(base, sink_logits=torch.full((4,), 5.0)), threshold=0.2,
                             return_counts=True, impl=impl)
    assert strong[1].tolist() == sk.tolist() and int(sk.sum()) > 0
    assert (strong[0].norm(dim=-1) < out.norm(dim=-1)).all()          # the sink takes probability mass
    scaled_v = paged_attention(batch, dataclasses.replace(base, v_scale=3.0), threshold=0.2, impl=impl)
    torch.testing.assert_close(scaled_v, 3.0 * out, atol=1e-5, rtol=1e-5)
    k_float = paged_attention(batch, dataclasses.replace(base, k_scale=2.0), threshold=0.2, impl=impl)
    k_tensor = paged_attention(batch, dataclasses.replace(base, k_scale=torch.tensor([2.0])), threshold=0.2,
                               impl=impl)
    logit_scale = paged_attention(batch, LayerSpec(1.0), threshold=0.2, impl=impl)
    torch.testing.assert_close(k_tensor, k_float, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_float, logit_scale, atol=1e-6, rtol=1e-6)


def test_unchecked_capture_path_with_every_feature_equals_checked():
    """check=False (the capture path: grid from shapes, a wider block table, device scales
    and sinks) gives the checked call's output and counts."""
    batch, spec, split_k = _problem((100, True, 6.0, "e5m2", 4, 128, "decode"), seed=2)
    bt = batch.block_table
    wide = dataclasses.replace(batch, block_table=torch.cat([bt, torch.full((bt.shape[0], 9), -1, dtype=bt.dtype)], 1),
                               max_query_len=1)
    lam = torch.tensor([0.3, 0.0, 0.05, 0.5])
    kw = dict(impl="triton", return_counts=True, split_k=split_k)
    checked = paged_attention(batch, spec, threshold=lam, **kw)
    unchecked = paged_attention(wide, spec, threshold=lam, check=False, **kw)
    torch.testing.assert_close(unchecked[0], checked[0], atol=1e-6, rtol=1e-6)
    assert unchecked[1].tolist() == checked[1].tolist() and unchecked[2].tolist() == checked[2].tolist()
    assert int(checked[1].sum()) > 0


def _bad_specs():
    return {
        "window-zero": dict(window=0),
        "window-float": dict(window=64.0),
        "window-not-causal": dict(window=64, causal=False),
        "softcap-negative": dict(soft_cap=-1.0),
        "softcap-nan": dict(soft_cap=float("nan")),
        "sinks-wrong-length": dict(sink_logits=torch.zeros(3)),
        "sinks-int": dict(sink_logits=torch.zeros(4, dtype=torch.int32)),
        "k-scale-zero": dict(k_scale=0.0),
        "v-scale-2-elements": dict(v_scale=torch.ones(2)),
        "v-scale-str": dict(v_scale="1.0"),
    }


@pytest.mark.parametrize("name", list(_bad_specs()), ids=list(_bad_specs()))
def test_bad_layer_spec_raises(name):
    batch = make_batch([40], [5], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(batch, LayerSpec(0.25, **_bad_specs()[name]), impl="torch")


@pytest.mark.parametrize("query_dtype, kv_dtype", [(E4M3, E4M3), (torch.float32, torch.int8),
                                                   (torch.float16, torch.bfloat16)],
                         ids=["fp8-query", "int8-cache", "bf16-cache-fp16-query"])
def test_bad_cache_dtype_raises(query_dtype, kv_dtype):
    batch = make_batch([40], [5], 4, 2, 16, 16)
    batch = dataclasses.replace(batch, query=batch.query.to(query_dtype), key_cache=batch.key_cache.to(kv_dtype),
                                value_cache=batch.value_cache.to(kv_dtype))
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(batch, LayerSpec(0.25), impl="torch")
