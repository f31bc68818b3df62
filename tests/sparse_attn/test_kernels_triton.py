"""The Triton kernel, run by Triton's interpreter on CPU, against the torch implementation.

TRITON_INTERPRET must be set before triton (and the kernel module) is imported; shapes
are tiny because the interpreter executes every program in Python.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from sparse_attn.kernels import LayerSpec, paged_attention, paged_attention_counts  # noqa: E402

from .test_kernels import _seq_alone, add_sink_token, make_batch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a GPU", allow_module_level=True)

CASES = {
    # name: (kv_lens, q_lens, Hq, Hkv, D, page, layout)
    "mixed-gqa2-page16": ([150, 5, 70], [70, 1, 70], 4, 2, 16, 16, "contiguous"),
    "chunked-prefill-mqa-page7-dimmajor": ([140], [66], 2, 1, 16, 7, "dim_major_k"),
    "decode-gqa1-packed-d24": ([130, 1, 64], [1, 1, 1], 2, 2, 24, 16, "packed_kv"),
}


def _both(batch, scale, causal=True, **kw):
    spec = LayerSpec(scale, causal)
    out_t = paged_attention(batch, spec, impl="triton", **kw)
    out_c = paged_attention(batch, spec, impl="torch", **kw)
    return out_t, out_c


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_triton_matches_torch(case):
    kv_lens, q_lens, hq, hkv, d, page, layout = CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, seed=1))
    scale = 2.0 * d ** -0.5
    dense_t, dense_c = _both(batch, scale=scale)
    assert not dense_t.isnan().any()
    torch.testing.assert_close(dense_t, dense_c, atol=1e-5, rtol=1e-5)
    lams = [0.0, 0.05, 0.5]
    out_t, sk_t, vis_t = paged_attention_counts(batch, LayerSpec(scale), lams, impl="triton")
    out_c, sk_c, vis_c = paged_attention_counts(batch, LayerSpec(scale), lams, impl="torch")
    torch.testing.assert_close(out_t, out_c, atol=1e-5, rtol=1e-5)
    assert sk_t.tolist() == sk_c.tolist() and vis_t.tolist() == vis_c.tolist()
    (o_t, s_t, v_t), (o_c, s_c, v_c) = _both(batch, scale=scale, threshold=0.5, return_counts=True)
    torch.testing.assert_close(o_t, o_c, atol=1e-5, rtol=1e-5)
    assert s_t.tolist() == s_c.tolist() == sk_c[2].tolist() and v_t.tolist() == v_c.tolist()
    # the comparison covers skipping: at lambda 0.5 tiles were skipped, at 0 none
    assert int(s_t.sum()) > 0 and int(sk_t[0].sum()) == 0, (s_t.tolist(), sk_t.tolist())


def test_triton_non_causal_and_bf16():
    batch = add_sink_token(make_batch([300, 30], [40, 1], 2, 1, 16, 16, dtype=torch.bfloat16, seed=2), strength=5.0)
    (o_t, s_t, v_t), (o_c, s_c, v_c) = _both(batch, scale=0.5, threshold=0.3, causal=False, return_counts=True)
    assert o_t.dtype == torch.bfloat16
    torch.testing.assert_close(o_t.float(), o_c.float(), atol=2e-2, rtol=2e-2)
    # Both score bf16 inputs in fp32 (the interpreter upcasts the dot): the same tiles skip.
    assert s_t.tolist() == s_c.tolist() and v_t.tolist() == v_c.tolist() and int(s_c.sum()) > 0


def test_triton_empty_sequences_no_nan():
    batch = make_batch([0, 40, 20], [0, 0, 1], 2, 1, 16, 16)
    out_t, out_c = _both(batch, scale=0.25, threshold=0.1)
    assert not out_t.isnan().any()
    torch.testing.assert_close(out_t, out_c, atol=1e-5, rtol=1e-5)


def test_threshold_is_a_runtime_argument():
    """lambda must not be a constexpr: a new value would otherwise compile a new kernel."""
    import inspect

    from sparse_attn.kernels import triton_kernels

    params = inspect.signature(triton_kernels.paged_attn_kernel.fn).parameters

    def constexpr(name):
        return "constexpr" in str(params[name].annotation)

    assert constexpr("CAUSAL") and constexpr("BLOCK_N")
    assert not constexpr("LAM") and not constexpr("THRESH") and not constexpr("scale") and not constexpr("window")
    assert not constexpr("soft_cap") and not constexpr("v_scale")


def test_triton_per_sequence_lambda_equals_each_sequence_alone():
    batch = add_sink_token(make_batch([150, 5, 70, 90], [70, 1, 70, 1], 4, 2, 16, 16, layout="dim_major_k", seed=4))
    scale = 2.0 * 16 ** -0.5
    lams = [0.5, 0.0, 0.05, 0.3]
    out, sk, vis = paged_attention(batch, LayerSpec(scale), threshold=torch.tensor(lams), impl="triton",
                                   return_counts=True)
    out_c, sk_c, vis_c = paged_attention(batch, LayerSpec(scale), threshold=lams, impl="torch", return_counts=True)
    torch.testing.assert_close(out, out_c, atol=1e-5, rtol=1e-5)
    assert sk.tolist() == sk_c.tolist() and vis.tolist() == vis_c.tolist() and int(sk.sum()) > 0
    sk_sum, vis_sum = torch.zeros_like(sk), torch.zeros_like(vis)
    for s, lam in enumerate(lams):
        o_s, sk_s, vis_s = paged_attention(_seq_alone(batch, s), LayerSpec(scale), threshold=lam, impl="triton",
                                           return_counts=True)
        a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        # A decode alone takes the split-KV decode launch (heads packed differently, a
        # log-sum-exp merge), the batch the prefill launch: equal up to fp32 rounding.
        torch.testing.assert_close(out[a:b], o_s, atol=1e-6, rtol=1e-6)
        sk_sum += sk_s
        vis_sum += vis_s
    assert sk.tolist() == sk_sum.tolist() and vis.tolist() == vis_sum.tolist()
    # counting mode with [n, S] candidates predicts serving with those per-sequence lambdas
    per_seq = torch.tensor([[0.0] * 4, lams, [0.2, 0.01, 0.6, 0.05]])
    out_n, skipped, vis_n = paged_attention_counts(batch, LayerSpec(scale), per_seq, impl="triton")
    _, skipped_c, _ = paged_attention_counts(batch, LayerSpec(scale), per_seq, impl="torch")
    assert skipped.shape == (3, 4) and skipped.tolist() == skipped_c.tolist()
    assert skipped[0].tolist() == [0] * 4 and skipped[1].tolist() == sk.tolist()
    for j in range(3):
        _, sk_j, _ = paged_attention(batch, LayerSpec(scale), threshold=per_seq[j], impl="triton", return_counts=True)
        assert sk_j.tolist() == skipped[j].tolist()
