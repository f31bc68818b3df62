"""Rules of ``_common.py`` that every implementation must follow the same way, checked for
each of them (torch, the compiled CPU kernel of this machine's ISA, its portable
``generic`` build, Triton under ``TRITON_INTERPRET=1``) against the float64 reference of
``kernel_reference.py``:

* ``visited`` counts only the sequences a lambda can skip in (serving's achieved sparsity
  and calibration's counts share one denominator);
* the NaN / inf policy: NaN propagates through maxima, a NaN ratio keeps its tile, the
  output rows that see a NaN or +inf logit are NaN, a -inf logit weighs 0.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from sparse_attn.kernels import (LayerSpec, cpu_build, cpu_impl, effective_lambda,  # noqa: E402
                                 paged_attention, paged_attention_counts)

from .kernel_reference import add_sink_token, make_batch, reference  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a GPU", allow_module_level=True)

IMPLS = ["torch", "compiled", "compiled-generic", "triton"]
D = 16


@pytest.fixture(scope="module")
def generic_lib():
    """The portable build (the ISA build is what ``impl="compiled"`` loads on this machine)."""
    st = cpu_impl.status()
    assert st.available, st.reason
    return cpu_build.load(isa="generic").lib


@pytest.fixture
def impl_name(request, monkeypatch):
    """``paged_attention``'s impl for a test id; ``compiled-generic`` swaps the library in."""
    name = request.param
    if name.startswith("compiled"):
        st = cpu_impl.status()
        assert st.available, st.reason
        if name == "compiled-generic":
            monkeypatch.setitem(cpu_impl._state, "lib", request.getfixturevalue("generic_lib"))
        return "compiled"
    return name


def _ids(x):
    return x if isinstance(x, str) else None


# --------------------------------------------------------------------------- visited counts

#: A prefill chunk served dense by the rule (scale 200 / kv 130 >= 1), and two sparse decodes.
MIXED = ([130, 450, 320], [70, 1, 1])
SCALE_FACTOR = 200.0


@pytest.mark.parametrize("impl_name", IMPLS, indirect=True)
def test_visited_counts_only_sequences_a_lambda_can_skip_in(impl_name):
    """One batched launch mixing a dense-by-rule sequence with sparse ones counts the
    float64 reference's tiles (the dense one's are not in ``visited``), its achieved
    sparsity is the pooled ratio of one-sequence launches (what calibration measures), and
    counting mode with the same lambdas counts the same tiles."""
    kv_lens, q_lens = MIXED
    batch = add_sink_token(make_batch(kv_lens, q_lens, 4, 2, D, 16, seed=5))
    lam = effective_lambda(SCALE_FACTOR, batch.seq_lens)
    assert lam[0] == 0 and (lam[1:] > 0).all()
    scale = 2.0 * D ** -0.5
    spec = LayerSpec(scale)
    ref, ref_sk, ref_vis, _ = reference(batch, scale, lam=lam.tolist())
    out, sk, vis = paged_attention(batch, spec, threshold=lam, return_counts=True, impl=impl_name)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert sk.tolist() == ref_sk.tolist() and vis.tolist() == ref_vis.tolist()
    assert int(sk.sum()) > 0
    # The dense sequence's tiles are not counted: the reference with it sparse counts more.
    assert (reference(batch, scale, lam=[1e-9, *lam[1:].tolist()])[2] > ref_vis).all()
    # Calibration pools one-sequence launches, counting nothing where lambda is 0: the same totals.
    alone = [reference(_seq_alone(batch, s), scale, lam=float(lam[s]))[1:3] for s in range(3) if lam[s] > 0]
    assert (int(sk.sum()), int(vis.sum())) == (sum(int(a.sum()) for a, _ in alone), sum(int(v.sum()) for _, v in alone))
    _, csk, cvis = paged_attention_counts(batch, spec, lam[None, :], impl=impl_name)
    assert csk[0].tolist() == sk.tolist() and cvis.tolist() == vis.tolist()


def _seq_alone(batch, s):
    qsl = batch.query_start_loc
    a, b = int(qsl[s]), int(qsl[s + 1])
    return dataclasses.replace(batch, query=batch.query[a:b], block_table=batch.block_table[s:s + 1],
                               seq_lens=batch.seq_lens[s:s + 1],
                               query_start_loc=torch.tensor([0, b - a], dtype=qsl.dtype))


# --------------------------------------------------------------------------- NaN and infinities

#: sequence 0 decodes at 260 keys, sequence 1 is a 40-row chunk at positions 60..99.
KV, QL = [260, 100], [1, 40]
#: where the broken value goes: sequence 0 position 150 (its decode row sees it), sequence 1
#: position 80 (rows 20.. of its chunk see it, rows before it do not).
BROKEN = ((0, 150), (1, 80))


def _broken_batch(kind):
    batch = add_sink_token(make_batch(KV, QL, 4, 2, D, 16, seed=9))
    q, k, bt = batch.query.clone(), batch.key_cache, batch.block_table
    q[..., 1] = q[..., 1].abs() + 0.5            # dimension 1 carries +-inf: every q_1 > 0
    for s, pos in BROKEN:
        slot = k[int(bt[s, pos // 16]), pos % 16]          # [Hkv, D]
        if kind == "nan-in-k":
            slot[:, 3] = float("nan")
        elif kind == "neg-inf-logit":
            slot[:, 1] = float("-inf")
        elif kind == "pos-inf-logit":
            slot[:, 1] = float("inf")
    if kind == "nan-in-q":
        q[int(batch.query_start_loc[1]) + 30, 2, 5] = float("nan")    # one row of one head
    return dataclasses.replace(batch, query=q)


_REFS: dict = {}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # numpy, in Triton's interpreter
@pytest.mark.parametrize("impl_name", IMPLS, indirect=True)
@pytest.mark.parametrize("kind", ["nan-in-k", "nan-in-q", "neg-inf-logit", "pos-inf-logit"])
def test_nan_and_inf_follow_the_policy(kind, impl_name):
    """Served at lambda 0.9 (most tiles skipped) and counted at three candidates: the NaN
    pattern of the output, the finite values, the skip and visited counts are the float64
    reference's; a NaN tile is never skipped away (the decode row that sees it is NaN)."""
    batch = _broken_batch(kind)
    scale = 2.0 * D ** -0.5
    spec = LayerSpec(scale)
    thresholds = [0.01, 0.3, 0.9]
    if kind not in _REFS:
        _REFS[kind] = reference(batch, scale, lam=0.9), reference(batch, scale, thresholds=thresholds)[3]
    (ref, ref_sk, ref_vis, _), ref_per = _REFS[kind]
    out, sk, vis = paged_attention(batch, spec, threshold=0.9, return_counts=True, impl=impl_name)
    nan = ref.isnan()
    assert (nan.any() if kind != "neg-inf-logit" else not nan.any()), "the case is not the one described"
    assert torch.equal(out.isnan(), nan), (out.isnan().nonzero()[:5], nan.nonzero()[:5])
    torch.testing.assert_close(out.double()[~nan], ref[~nan], atol=2e-5, rtol=1e-5)
    assert sk.tolist() == ref_sk.tolist() and vis.tolist() == ref_vis.tolist()
    if kind == "nan-in-k":
        assert out[0].isnan().all() and int(sk.sum()) > 0
    _, per, _ = paged_attention_counts(batch, spec, thresholds, impl=impl_name)
    assert per.tolist() == ref_per.tolist()
