"""The issue-13 Triton kernel (GQA-packed programs, split-KV decode) under Triton's interpreter.

Every output is compared with the float64 brute-force reference of ``test_kernels`` (which
applies the documented rule, KV splits included), and calibration counts with serving
skips, for the torch implementation and the Triton kernel alike.  Small ``split_k`` values
(a parameter of the rule that counting takes too) make short sequences cross several
splits; one case uses the default ``SPLIT_K``.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from sparse_attn.kernels import SPLIT_K, TILE_K, LayerSpec, paged_attention, paged_attention_counts  # noqa: E402

from .kernel_reference import add_sink_token, make_batch, reference  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a GPU", allow_module_level=True)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}

CASES = {
    # name: (kv_lens, q_lens, Hq, Hkv, D, page, layout, split_k)
    "gqa1-decode-3-splits": ([600, 65], [1, 1], 2, 2, 16, 16, "contiguous", 256),
    "gqa4-mixed-batch": ([300, 40, 200, 0], [1, 40, 1, 0], 8, 2, 16, 16, "dim_major_k", 128),
    "gqa8-decode-page7-packed": ([600, 129], [1, 1], 8, 1, 32, 7, "packed_kv", 192),
    "gqa4-default-split-decode": ([SPLIT_K * 2 + 300, 100], [1, 1], 4, 1, 16, 16, "contiguous", None),
}
LAMS = [0.0, 0.05, 0.4]


def _device(batch):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return dataclasses.replace(batch, **{f: getattr(batch, f).cuda() for f in (
            "query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc")})
    return batch


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_triton_split_gqa_matches_float64_reference(case, dtype):
    kv_lens, q_lens, hq, hkv, d, page, layout, split_k = CASES[case]
    if split_k is None and dtype != "fp32":
        pytest.skip("the default-split case runs once (fp32): long sequences are slow under the interpreter")
    dt = DTYPES[dtype]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, dtype=dt, seed=31))
    rule = {} if split_k is None else {"split_k": split_k}
    scale = 2.0 * d ** -0.5
    ref0, _, ref_vis, ref_thr = reference(batch, scale, thresholds=LAMS, **rule)
    args = _device(batch)

    # lambda = 0: the new kernel equals the float64 reference.
    out0 = paged_attention(args, LayerSpec(scale), impl="triton", **rule)
    assert out0.dtype == dt and not out0.isnan().any()
    torch.testing.assert_close(out0.cpu().double(), ref0, **TOL[dt])

    # Counting mode: dense output, counts per candidate == serving skips under that lambda.
    out_c, skipped, vis = paged_attention_counts(args, LayerSpec(scale), LAMS, impl="triton", **rule)
    torch.testing.assert_close(out_c, out0, atol=0, rtol=0)
    assert vis.cpu().tolist() == ref_vis.tolist()
    assert skipped[0].cpu().tolist() == [0] * hq and int(skipped[-1].sum()) > 0
    for j, lam in list(enumerate(LAMS))[1:]:
        o, sk, v = paged_attention(args, LayerSpec(scale), threshold=lam, impl="triton", return_counts=True, **rule)
        assert sk.cpu().tolist() == skipped[j].cpu().tolist() and v.cpu().tolist() == vis.cpu().tolist()
        if j == len(LAMS) - 1:
            ref_l = reference(batch, scale, lam=lam, **rule)[0]
            torch.testing.assert_close(o.cpu().double(), ref_l, **TOL[dt])
    if dt == torch.float32:
        # fp32: the documented rule exactly, in both implementations.
        assert skipped.cpu().tolist() == ref_thr.tolist()
        _, sk_torch, vis_torch = paged_attention_counts(batch, LayerSpec(scale), LAMS, impl="torch", **rule)
        assert sk_torch.tolist() == ref_thr.tolist() and vis_torch.tolist() == ref_vis.tolist()


def test_triton_split_boundaries_are_in_the_counts():
    """Triton counts follow the split rule: a long decode skips no more tiles per head, and
    fewer in total, with splits (a later split's running max holds tile 0 and its own tiles only) than with one split
    spanning it, the first tile of a later split is skippable against tile 0's maxima
    (split_k = TILE_K: every tile opens a split), and each count equals the reference."""
    batch = add_sink_token(make_batch([1100], [1], 4, 1, 16, 16, seed=5), strength=1.0)   # a weak sink: splits matter
    ref_split = reference(batch, 1.0, lam=0.5, split_k=256)[1]
    ref_one = reference(batch, 1.0, lam=0.5, split_k=2048)[1]
    _, sk_split, _ = paged_attention(batch, LayerSpec(1.0), threshold=0.5, return_counts=True, impl="triton",
                                     split_k=256)
    _, sk_one, _ = paged_attention(batch, LayerSpec(1.0), threshold=0.5, return_counts=True, impl="triton",
                                   split_k=2048)
    _, sk_tile, _ = paged_attention(batch, LayerSpec(1.0), threshold=0.5, return_counts=True, impl="triton",
                                    split_k=TILE_K)
    ref_tile = reference(batch, 1.0, lam=0.5, split_k=TILE_K)[1]
    assert sk_split.tolist() == ref_split.tolist() and sk_one.tolist() == ref_one.tolist()
    assert sk_tile.tolist() == ref_tile.tolist() and (sk_tile > 0).all()
    assert (sk_split <= sk_one).all() and int(sk_split.sum()) < int(sk_one.sum())


def test_per_sequence_lambda_in_split_decode():
    batch = add_sink_token(make_batch([500, 300, 90, 700], [1, 1, 1, 1], 8, 2, 16, 16, seed=8))
    scale = 2.0 * 16 ** -0.5
    lams = [0.3, 0.0, 0.05, 0.5]
    out, sk, vis = paged_attention(batch, LayerSpec(scale), threshold=torch.tensor(lams), impl="triton",
                                   return_counts=True, split_k=128)
    expect = torch.zeros(8, dtype=torch.int64)
    for s, lam in enumerate(lams):
        one = dataclasses.replace(batch, query=batch.query[s:s + 1], block_table=batch.block_table[s:s + 1],
                                  seq_lens=batch.seq_lens[s:s + 1],
                                  query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
        ref, ref_sk, _, _ = reference(one, scale, lam=lam, split_k=128)
        torch.testing.assert_close(out[s:s + 1].double(), ref, atol=2e-5, rtol=1e-5)
        expect += ref_sk
    assert sk.tolist() == expect.tolist() and int(sk.sum()) > 0


def test_tile_table_covers_the_head_sizes_it_claims():
    """Every head size up to 256, in every dtype and phase, has a tile configuration (the rows
    are compiled for sm_90 in test_kernels_compile.py); larger ones are refused before any launch.
    Nothing autotunes: a CUDA graph captures one launch."""
    from sparse_attn.kernels import triton_impl, triton_kernels

    for d in range(1, 257):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for phase in ("decode", "prefill"):
                assert isinstance(triton_impl.tile_config(d, dtype, phase), triton_impl.TileConfig), (d, dtype, phase)
    with pytest.raises(ValueError, match="head size"):
        triton_impl.tile_config(512, torch.bfloat16, "prefill")
    assert not hasattr(triton_kernels.paged_attn_kernel, "configs")


CAPTURE_CASES = {
    # kv_lens, q_lens, Hq, Hkv, D, page, max_query_len given to check=False
    "uniform-decode": ([300, 129, 64, 1], [1, 1, 1, 1], 8, 2, 16, 16, 1),
    "mixed-exact-bound": ([300, 80, 20], [1, 80, 20], 4, 2, 16, 16, 80),
}


@pytest.mark.parametrize("case", list(CAPTURE_CASES), ids=list(CAPTURE_CASES))
def test_unchecked_launch_equals_checked(case):
    """check=False (grid from shapes and host ints, tiles mapped on the device, surplus
    programs idle) gives the checked call's output and counts."""
    kv_lens, q_lens, hq, hkv, d, page, max_q = CAPTURE_CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, seed=9))
    # A wider block table than needed, as vLLM's is (max_model_len / page columns).
    bt = batch.block_table
    batch = dataclasses.replace(batch, block_table=torch.cat([bt, torch.full((bt.shape[0], 6), -1, dtype=bt.dtype)], 1))
    spec = LayerSpec(2.0 * d ** -0.5)
    lam = torch.tensor([0.3, 0.0, 0.05, 0.5][:len(kv_lens)], dtype=torch.float32)
    kw = dict(impl="triton", return_counts=True, split_k=128)
    o1, s1, v1 = paged_attention(batch, spec, threshold=lam, **kw)
    o2, s2, v2 = paged_attention(dataclasses.replace(batch, max_query_len=max_q), spec, threshold=lam, check=False,
                                 **kw)
    torch.testing.assert_close(o2, o1, atol=0, rtol=0)
    assert s2.dtype == v2.dtype == torch.int64 and s2.shape == v2.shape == (hq,)
    assert s2.tolist() == s1.tolist() and v2.tolist() == v1.tolist() and int(s1.sum()) > 0
    # Without a query bound the grid covers T query rows per sequence: same result.
    o3, s3, _ = paged_attention(batch, spec, threshold=lam, check=False, **kw)
    torch.testing.assert_close(o3, o1, atol=1e-6, rtol=1e-6)
    assert s3.tolist() == s1.tolist()
