"""The compiled CPU kernel (sparse_attn/kernels/csrc/skip_attn_cpu.cpp) against independent references.

Outputs are compared with float64 attention (``kernel_reference.reference``, Python loops over
the documented rule), skip counts with the reference's counts exactly, counting mode with
serving mode exactly, and the torch implementation's counts with the compiled ones, over every
layout the views produce (vLLM's cpu-packed page included) x fp32/bf16/fp16 x GQA ratios x
split lengths x mixed batches.  The build tests start from empty cache directories.

The library is compiled once per session into ``SPARSE_ATTN_CPU_KERNEL_CACHE`` (tox points
it at a directory shared by every env) or a temporary directory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compat import envs
from sparse_attn import settings
from sparse_attn.kernels import (SPLIT_K, TILE_K, TILE_Q, BatchMeta, LayerSpec, PagedBatch, cpu_build, cpu_impl,
                                 paged_attention, paged_attention_counts)

from .kernel_reference import add_sink_token, make_batch, reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def compiled(tmp_path_factory):
    """The library of this CPU's ISA, built (or found) once for the module."""
    saved = os.environ.get("SPARSE_ATTN_CPU_KERNEL_CACHE")
    if not saved:
        os.environ["SPARSE_ATTN_CPU_KERNEL_CACHE"] = str(tmp_path_factory.mktemp("cpu-kernel-cache"))
    envs.reset_for_tests()
    cpu_impl.reset_for_tests()
    st = cpu_impl.status()
    assert st.available, st.reason
    yield st
    cpu_impl.reset_for_tests()
    if not saved:
        del os.environ["SPARSE_ATTN_CPU_KERNEL_CACHE"]
    envs.reset_for_tests()


_REFERENCES: dict = {}


def cached_reference(tag, batch, scale, **kw):
    """``reference(batch, scale, **kw)``, computed once per ``tag``: make_batch fills the same
    values whatever the layout (one generator, one order), so layouts share a reference."""
    key = (tag, scale, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(kw.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(batch, scale, **kw)
    return _REFERENCES[key]


def _run(batch, scale, impl="compiled", causal=True, **kw):
    return paged_attention(batch, LayerSpec(scale, causal), impl=impl, **kw)


def _counts(batch, scale, thresholds, impl="compiled", **kw):
    return paged_attention_counts(batch, LayerSpec(scale), thresholds, impl=impl, **kw)


# --------------------------------------------------------------------------- cases

CASES = {
    # name: (kv_lens, q_lens, Hq, Hkv, D, page)
    "prefill-1seq-gqa1-page16": ([200], [200], 2, 2, 32, 16),
    "mixed-ragged-gqa2-page16": ([300, 5, 77, 130, 64], [1, 5, 77, 70, 64], 4, 2, 32, 16),
    "chunked-prefill-gqa4-page32": ([333], [150], 4, 1, 16, 32),
    "decode-ragged-mqa8-page16": ([1, 65, 128, 700], [1, 1, 1, 1], 8, 1, 16, 16),
    "mixed-gqa4-page7-gather": ([150, 129, 3], [129, 1, 3], 8, 2, 16, 7),
    "prefill-gqa3-page128-d64": ([290, 40], [100, 40], 9, 3, 64, 128),
    "mixed-gqa3-page64-d24": ([180, 70], [1, 70], 6, 2, 24, 64),
}
#: The layouts of kernel_reference: contiguous, dim-major K (read in place), packed (per-token
#: K | V), blocks interleaved with K/V, and vLLM's cpu-packed page (K dim-major in place).
LAYOUTS = ["contiguous", "dim_major_k", "packed_kv", "kv_interleaved_blocks", "cpu_packed"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Output tolerance vs float64: fp32 accumulation, then the output dtype's rounding.
TOL = {"fp32": dict(atol=2e-5, rtol=1e-5), "bf16": dict(atol=1e-2, rtol=1e-2), "fp16": dict(atol=2e-3, rtol=2e-3)}


def _page_ok(layout, page):
    return layout != "cpu_packed" or page % 16 == 0  # vLLM's CPU pages are 16-aligned (16..128)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_dense_matches_float64_reference(case, layout, dtype):
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    if not _page_ok(layout, page):
        pytest.skip("cpu-packed pages are multiples of 16 tokens")
    batch = make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, dtype=DTYPES[dtype])
    scale = d ** -0.5
    ref, _, visited, _ = cached_reference((case, dtype), batch, scale)
    out = _run(batch, scale)
    assert out.dtype == DTYPES[dtype] and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    # lambda 0 through the counting path is the same dense computation, bit for bit
    o2, sk, vis = _run(batch, scale, threshold=0.0, return_counts=True)
    torch.testing.assert_close(o2, out, atol=0, rtol=0)
    assert int(sk.sum()) == 0 and vis.tolist() == visited.tolist()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["contiguous", "cpu_packed"])
def test_half_precision_output_is_the_rounded_fp32_result(monkeypatch, layout, dtype):
    """bf16/fp16 inputs are read exactly (upcast) and accumulated in fp32: the output is
    torch's round-to-nearest-even of the fp32 kernel on the upcast inputs, bit for bit.  (The
    ``avx512bf16`` and ``amx`` builds' bf16 prefill runs on pair products, which round P to bf16: held by
    the pair-product tests below; here their avx512 code, which they run for everything else.)"""
    if dtype == "bf16" and cpu_impl.status().target in ("amx", "avx512bf16"):
        monkeypatch.setitem(cpu_impl._state, "lib", cpu_build.load(isa="avx512").lib)
    batch = add_sink_token(make_batch([290, 40], [100, 1], 6, 2, 32, 32, layout=layout, dtype=DTYPES[dtype], seed=4))
    up = dataclasses.replace(batch, query=batch.query.float(), key_cache=batch.key_cache.float(),
                             value_cache=batch.value_cache.float())
    for lam in (0.0, 0.3):
        out, sk, _ = _run(batch, 0.4, threshold=lam, return_counts=True)
        ref32, sk32, _ = _run(up, 0.4, threshold=lam, return_counts=True)
        assert torch.equal(out, ref32.to(DTYPES[dtype])) and sk.tolist() == sk32.tolist()


@pytest.mark.parametrize("lam", [1e-3, 0.05, 0.3, 0.9], ids=lambda x: f"lambda={x}")
@pytest.mark.parametrize("layout", ["contiguous", "cpu_packed", "packed_kv"])
@pytest.mark.parametrize("case", ["mixed-ragged-gqa2-page16", "chunked-prefill-gqa4-page32", "decode-ragged-mqa8-page16",
                                  "prefill-gqa3-page128-d64", "mixed-gqa3-page64-d24"])
def test_sparse_matches_bruteforce(case, layout, lam):
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, seed=3))
    scale = 2.0 * d ** -0.5  # peakier scores so that tiles get skipped
    ref, skipped, visited, _ = cached_reference((case, "sink-3"), batch, scale, lam=lam)
    out, sk, vis = _run(batch, scale, threshold=lam, return_counts=True)
    assert sk.dtype == torch.int64 and sk.shape == (hq,) and vis.shape == (hq,)
    assert sk.tolist() == skipped.tolist() and vis.tolist() == visited.tolist()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["dim_major_k", "cpu_packed"])
@pytest.mark.parametrize("case", ["mixed-ragged-gqa2-page16", "prefill-gqa3-page128-d64", "decode-ragged-mqa8-page16"])
def test_counting_mode_equals_reference_and_serving_skips(case, layout):
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, seed=7))
    scale = 2.0 * d ** -0.5
    lams = [0.0, 1e-4, 1e-2, 0.1, 0.5, 1.0, 3.0]
    ref, _, visited, per_thr = cached_reference((case, "sink-7"), batch, scale, thresholds=lams)
    out, skipped, vis = _counts(batch, scale, torch.tensor(lams))
    assert skipped.shape == (len(lams), hq) and skipped.tolist() == per_thr.tolist()
    assert vis.tolist() == visited.tolist()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    for j, lam in enumerate(lams):  # calibration counts are exactly the serving skips
        _, sk, _ = _run(batch, scale, threshold=lam, return_counts=True)
        assert sk.tolist() == skipped[j].tolist()
    assert int(skipped[-1].sum()) > 0


def test_library_writes_its_counts_into_uninitialised_buffers():
    """ABI 5: the counts are written, not added to, so the caller's buffers need no zeroing
    (two fills per served layer saved).  Buffers full of garbage, the same call twice: the counts
    equal the float64 reference's each time."""
    kv_lens, q_lens, hq, hkv, d, page = CASES["mixed-ragged-gqa2-page16"]
    batch = make_batch(kv_lens, q_lens, hq, hkv, d, page, layout="cpu_packed", seed=7)
    scale, lams = 2.0 * d ** -0.5, [0.0, 0.1, 1.0]
    _, _, visited, per_thr = cached_reference(("mixed-ragged-gqa2-page16", "plain-7"), batch, scale, thresholds=lams)
    lib = cpu_impl._state["lib"]
    for _ in range(2):
        call = cpu_impl.make_call(batch, LayerSpec(scale), threshold=torch.zeros(len(kv_lens)),
                                  count_thresholds=torch.tensor(lams)[:, None].expand(-1, len(kv_lens)),
                                  out=torch.empty_like(batch.query))
        call.skipped.fill_(-12345)
        call.visited.fill_(987654321)
        assert lib.sa_forward(ctypes.byref(call.c)) == 0
        assert call.skipped.tolist() == per_thr.tolist() and call.visited.tolist() == visited.tolist()
    assert int(per_thr[-1].sum()) > 0


SPLIT_CASES = {
    # kv_lens, q_lens, Hq, Hkv, D, page, split_k: each crosses several split boundaries
    "decode-split128-gqa4": ([700, 65, 129, 1000], [1, 1, 1, 1], 8, 2, 16, 16, 128),
    "mixed-split192-gqa2-page7": ([650, 300, 40], [1, 150, 40], 4, 2, 16, 7, 192),
    "prefill-split64-every-tile": ([400], [200], 2, 1, 16, 32, 64),
    "decode-default-split-gqa3": ([SPLIT_K * 2 + 300, 900], [1, 1], 6, 2, 16, 128, None),
    # Decode and short query tiles over more than one KV part (2048 positions at these splits): run as parts
    # and merged; the rule's counts stay the reference's.
    "decode-kv-parts-split128": ([5000, 2100, 64, 2049], [1, 3, 1, 16], 8, 2, 16, 16, 128),
    "decode-kv-parts-split192-gqa3": ([4000, 2200], [1, 2], 6, 2, 16, 16, 192),
    "decode-kv-parts-uneven-default-split": ([2049, 6200, SPLIT_K * 4 + 1], [1, 1, 1], 4, 2, 16, 16, None),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_rule_matches_bruteforce_torch_and_counting(case):
    kv_lens, q_lens, hq, hkv, d, page, split_k = SPLIT_CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout="dim_major_k", seed=21))
    scale = 2.0 * d ** -0.5
    rule = {} if split_k is None else {"split_k": split_k}
    lams = [0.0, 1e-3, 0.05, 0.3]
    ref_out, _, ref_vis, per_thr = reference(batch, scale, thresholds=lams, **rule)
    out, skipped, vis = _counts(batch, scale, lams, **rule)
    assert skipped.tolist() == per_thr.tolist() and vis.tolist() == ref_vis.tolist()
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    t_out, t_skipped, t_vis = _counts(batch, scale, lams, impl="torch", **rule)
    assert t_skipped.tolist() == skipped.tolist() and t_vis.tolist() == vis.tolist()
    for j, lam in enumerate(lams[1:], 1):
        ref, ref_sk, _, _ = reference(batch, scale, lam=lam, **rule)
        o, sk, _ = _run(batch, scale, threshold=lam, return_counts=True, **rule)
        assert sk.tolist() == ref_sk.tolist() == skipped[j].tolist()
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)
    assert int(skipped[-1].sum()) > 0


PER_SEQ = {
    # kv_lens, q_lens, Hq, Hkv, D, page, per-sequence lambdas (0 = dense for that sequence)
    "mixed": ([300, 5, 77, 130, 64, 700], [1, 5, 77, 70, 64, 1], 4, 2, 32, 16, [0.3, 0.0, 0.05, 0.5, 0.1, 0.02]),
    "decode-gqa3": ([65, 700, 128, 400, 1], [1, 1, 1, 1, 1], 9, 3, 64, 128, [0.5, 0.001, 0.0, 0.2, 0.9]),
    "chunked-page7": ([333, 150], [150, 129], 4, 2, 16, 7, [0.02, 0.4]),
}


@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
@pytest.mark.parametrize("case", list(PER_SEQ))
def test_per_sequence_lambdas_match_reference_and_torch(case, as_tensor):
    kv_lens, q_lens, hq, hkv, d, page, lams = PER_SEQ[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout="cpu_packed" if page % 16 == 0 else "contiguous",
                                seed=13))
    scale = 2.0 * d ** -0.5
    thr = torch.tensor(lams) if as_tensor else lams
    out, sk, vis = _run(batch, scale, threshold=thr, return_counts=True)
    t_out, t_sk, t_vis = _run(batch, scale, impl="torch", threshold=thr, return_counts=True)
    assert sk.tolist() == t_sk.tolist() and vis.tolist() == t_vis.tolist() and int(sk.sum()) > 0
    torch.testing.assert_close(out, t_out, atol=2e-5, rtol=1e-5)
    qsl = batch.query_start_loc
    for s, lam in enumerate(lams):
        a, b = int(qsl[s]), int(qsl[s + 1])
        alone = PagedBatch(batch.query[a:b], batch.key_cache, batch.value_cache, batch.block_table[s:s + 1],
                           batch.seq_lens[s:s + 1], torch.tensor([0, b - a], dtype=qsl.dtype))
        torch.testing.assert_close(out[a:b].double(), reference(alone, scale, lam=lam)[0], atol=2e-5, rtol=1e-5)


def test_non_causal_matches_reference():
    batch = add_sink_token(make_batch([300, 70], [100, 70], 6, 2, 16, 16, layout="cpu_packed"))
    ref, sk, vis, _ = reference(batch, LayerSpec(0.5, causal=False), lam=0.3)
    out, sk2, vis2 = _run(batch, 0.5, threshold=0.3, causal=False, return_counts=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert sk2.tolist() == sk.tolist() and vis2.tolist() == vis.tolist() and int(sk.sum()) > 0


@pytest.mark.parametrize("kv_lens, q_lens", [([700, 5, 300, 1200], [1, 5, 300, 1]), ([5000, 5, 2300], [1, 5, 2])],
                         ids=["items", "decode-kv-parts"])
def test_threads_do_not_change_results(kv_lens, q_lens):
    """Items are independent and their accumulation order is fixed (a split decode item's parts are merged in
    part order, whichever thread ran them): 1 and 2 threads agree bit for bit."""
    batch = add_sink_token(make_batch(kv_lens, q_lens, 9, 3, 64, 128, layout="cpu_packed", seed=9))
    n = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_run(batch, 0.25, threshold=0.1, return_counts=True))
    finally:
        torch.set_num_threads(n)
    (o1, s1, v1), (o2, s2, v2) = results
    assert torch.equal(o1, o2) and s1.tolist() == s2.tolist() and v1.tolist() == v2.tolist() and int(s1.sum()) > 0


def test_strided_query_and_out_views():
    """Query and output may be views with any strides (a slice of a fused QKV buffer)."""
    batch = add_sink_token(make_batch([300, 64], [70, 1], 4, 2, 32, 16, layout="cpu_packed", seed=2))
    q = batch.query
    fused = torch.full((q.shape[0], q.shape[1], 3 * q.shape[2]), float("nan"))
    fused[..., 32:64] = q
    q_view = fused[..., 32:64]
    out_buf = torch.full((q.shape[1], q.shape[0], q.shape[2]), float("nan"))
    out_view = out_buf.transpose(0, 1)
    res = _run(dataclasses.replace(batch, query=q_view), 0.3, threshold=0.2, out=out_view)
    assert res is out_view and not out_buf.isnan().any()
    torch.testing.assert_close(out_view.double(), reference(batch, 0.3, lam=0.2)[0], atol=2e-5, rtol=1e-5)


def test_empty_and_zero_length_sequences():
    batch = make_batch([0, 50, 30], [0, 0, 1], 2, 1, 16, 16)
    out, sk, vis = _run(batch, 0.25, threshold=0.5, return_counts=True)
    assert out.shape == (1, 2, 16) and not out.isnan().any()
    torch.testing.assert_close(out.double(), reference(batch, 0.25, lam=0.5)[0], atol=2e-5, rtol=1e-5)
    empty = make_batch([0, 0], [0, 0], 2, 1, 16, 16)
    out, sk, vis = _run(empty, 0.25, return_counts=True)
    assert out.shape == (0, 2, 16) and sk.tolist() == [0, 0] and vis.tolist() == [0, 0]


def test_int64_block_table_and_seq_tensors():
    batch = add_sink_token(make_batch([300, 40], [1, 40], 4, 2, 16, 16, seed=6))
    long_batch = dataclasses.replace(batch, block_table=batch.block_table.long(), seq_lens=batch.seq_lens.long(),
                                     query_start_loc=batch.query_start_loc.long())
    a = _run(batch, 1.0, threshold=0.3, return_counts=True)
    b = _run(long_batch, 1.0, threshold=0.3, return_counts=True)
    assert torch.equal(a[0], b[0]) and a[1].tolist() == b[1].tolist() and int(a[1].sum()) > 0


def test_unchecked_call_equals_checked():
    batch = add_sink_token(make_batch([300, 5, 700], [1, 5, 1], 6, 2, 32, 128, layout="cpu_packed", seed=17))
    for thr in (0.3, torch.tensor([0.3, 0.0, 0.5])):
        a = _run(batch, 1.0, threshold=thr, return_counts=True)
        b = _run(dataclasses.replace(batch, max_query_len=5), 1.0, threshold=thr, return_counts=True, check=False)
        assert torch.equal(a[0], b[0]) and b[1].tolist() == a[1].tolist() and int(a[1].sum()) > 0


_REFUSE_SCRIPT = """
import ctypes, sys, torch
from sparse_attn.kernels import LayerSpec, cpu_build, cpu_impl, paged_attention
from tests.sparse_attn.kernel_reference import make_batch
case, value = sys.argv[1], sys.argv[2]
batch = make_batch([40, 20], [5, 1], 4, 2, 16, 16)
value = batch.key_cache.shape[0] if value == "past" else int(value)
if case == "id":
    batch.block_table[0, 1] = value          # sequence 0 (40 tokens) uses columns 0 and 1
else:
    batch.seq_lens[0] = value                # more blocks than the table has columns
lib = cpu_impl._state["lib"] if cpu_impl.status().available else None
assert lib is not None, cpu_impl.status().reason
out = torch.full_like(batch.query, 7.0)
call = cpu_impl.make_call(batch, LayerSpec(0.25), threshold=torch.zeros(2), count_thresholds=None, out=out)
rc = lib.sa_forward(ctypes.byref(call.c))    # the library itself, past every Python check
assert bool((out == 7.0).all()), "the kernel wrote output before refusing"
try:
    paged_attention(batch, LayerSpec(0.25), impl="compiled", check=False)
except ValueError as exc:
    print("RC", rc, "|", exc)
else:
    print("RC", rc, "| no error")
"""


@pytest.mark.parametrize("case, value, code", [
    pytest.param("id", "past", cpu_build.BAD_BLOCK_ID, id="id-one-past-the-cache"),
    pytest.param("id", 10**8, cpu_build.BAD_BLOCK_ID, id="id-1e8"),
    pytest.param("id", -1, cpu_build.BAD_BLOCK_ID, id="id-negative"),
    pytest.param("len", 16 * 5, cpu_build.BAD_BLOCK_TABLE, id="table-too-narrow"),   # 4 columns
])
def test_library_refuses_bad_block_ids_itself(case, value, code):
    """The compiled kernel called directly (no validation: ``check=False`` and the raw
    ``sa_forward``) with a block id outside the cache or a table too narrow returns its
    error code before reading anything, and the loader turns it into a ValueError.  In a
    subprocess: a crash (the old SIGSEGV at id 1e8) fails this test instead of pytest."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _REFUSE_SCRIPT, case, str(value)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    rc, msg = proc.stdout.strip().split(" | ", 1)
    assert rc == f"RC {code}", proc.stdout
    n_blocks = make_batch([40, 20], [5, 1], 4, 2, 16, 16).key_cache.shape[0]
    seen = n_blocks if value == "past" else value
    expect = f"got {seen}, expected a block id in [0, {n_blocks})" if case == "id" \
        else "block_table too narrow for sequence 0"
    assert expect in msg, msg


def test_library_layout_matches_the_ctypes_mirror_and_common():
    """sa_layout reports the ABI, sizeof(SaCall), its field count and offsets, TILE_Q and
    TILE_K; the loader compares them with cpu_build.SaCall and _common (and refuses on a
    difference, which is what loading at all proves; here the values are read out)."""
    lib = cpu_impl._state["lib"]
    want = cpu_build.expected_layout()
    buf = (ctypes.c_int64 * (len(want) + 8))()
    n = lib.sa_layout(buf, len(buf))
    assert n == len(want) and list(buf[:n]) == want
    assert want[:5] == [cpu_build.ABI_VERSION, ctypes.sizeof(cpu_build.SaCall), len(cpu_build.SaCall._fields_),
                        TILE_Q, TILE_K]


def test_loader_refuses_a_library_with_another_layout(monkeypatch):
    """A mirror that differs from the library (one field fewer on the Python side) is refused
    at load with the field, both values and the rebuild hint."""
    lib = cpu_impl._state["lib"]

    class Short(ctypes.Structure):
        _fields_ = [f for f in cpu_build.SaCall._fields_ if f[0] != "bt_cols"]

    lib_size, short_size = ctypes.sizeof(cpu_build.SaCall), ctypes.sizeof(Short)
    monkeypatch.setattr(cpu_build, "SaCall", Short)
    with pytest.raises(cpu_build.CpuKernelUnavailable, match=rf"sizeof\(SaCall\) is {lib_size} in the library, "
                                                             rf"{short_size} .*Fix:.*delete .* so it rebuilds"):
        cpu_build.check_layout(lib, Path("lib.so"))


def test_exp_approximation_accuracy():
    """The kernel's vector exp against float64 over the range it sees (x = s - m <= 8 after the
    lazy rescale; below -87 it returns 0, exp(-87) = 1.6e-38 being negligible next to the
    row's largest term, exp(0) or more): at most 2 ulp (2.4e-7) relative error."""
    lib = cpu_impl._state["lib"]
    x = torch.cat([torch.linspace(-87.0, 8.0, 1 << 20), torch.tensor([0.0, -1e-8, 1e-8, -0.5, 0.5, -86.99, 7.99, 8.0])])
    x = torch.cat([x, x.new_zeros((-x.numel()) % 8)])
    y = torch.empty_like(x)
    lib.sa_exp(x.data_ptr(), y.data_ptr(), x.numel())
    rel = ((y.double() - x.double().exp()) / x.double().exp()).abs()
    assert rel.max().item() < 2.4e-7, rel.max().item()
    z = torch.tensor([-87.5, -100.0, -1e30, float("-inf"), -88.0, -87.01, -90.0, -200.0])
    out = torch.empty_like(z)
    lib.sa_exp(z.data_ptr(), out.data_ptr(), 8)
    assert out.tolist() == [0.0] * 8


# --------------------------------------------------------------------------- the portable build

@pytest.fixture(scope="module")
def generic_build(tmp_path_factory):
    """The portable (``generic``) build, compiled by three processes starting at once in an
    empty cache directory that also holds a killed build's leftover temporary file."""
    root = tmp_path_factory.mktemp("fresh-cache")
    key = cpu_build.cache_key("generic")
    stale = root / f".sparse_attn_cpu-{key}.12345.tmp"
    stale.write_bytes(b"half a library")
    env = {**os.environ, "SPARSE_ATTN_CPU_KERNEL_CACHE": str(root), "PYTHONPATH": str(ROOT)}
    code = ("from sparse_attn.kernels import cpu_build; b = cpu_build.load(isa='generic'); "
            "print('BUILT' if b.build_s is not None else 'CACHED', b.path)")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    results = [p.communicate(timeout=900) + (p.returncode,) for p in procs]
    return root, key, results


def test_concurrent_first_builds_share_one_library(generic_build):
    root, key, results = generic_build
    assert all(rc == 0 for _, _, rc in results), [err[-2000:] for _, err, _ in results]
    outs = [out.split() for out, _, _ in results]
    assert sorted(o[0] for o in outs) == ["BUILT", "CACHED", "CACHED"]
    assert len({o[1] for o in outs}) == 1
    names = sorted(p.name for p in root.iterdir())
    assert names == [f"sparse_attn_cpu-{key}.lock", f"sparse_attn_cpu-{key}.so"], names


@pytest.mark.parametrize("case", ["mixed-ragged-gqa2-page16", "mixed-gqa4-page7-gather", "prefill-gqa3-page128-d64",
                                  "mixed-gqa3-page64-d24"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_generic_build_matches_reference(generic_build, monkeypatch, case, dtype):
    root, key, _ = generic_build
    lib = cpu_build._open(root / f"sparse_attn_cpu-{key}.so", "generic")
    monkeypatch.setitem(cpu_impl._state, "lib", lib)
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    layout = "cpu_packed" if page % 16 == 0 else "packed_kv"
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, dtype=DTYPES[dtype], seed=3))
    scale = 2.0 * d ** -0.5
    ref, skipped, visited, _ = cached_reference((case, dtype, "sink-3"), batch, scale, lam=0.9)
    out, sk, vis = _run(batch, scale, threshold=0.9, return_counts=True)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    assert int(skipped.sum()) > 0
    if dtype == "fp32":  # half-precision scores may straddle a decision boundary the float64 one does not
        assert sk.tolist() == skipped.tolist()
    assert vis.tolist() == visited.tolist()


@pytest.mark.parametrize("build", ["isa", "generic"])
def test_exp_and_max_special_values_follow_the_nan_policy(build, generic_build):
    """_common's NaN policy at the vector exp (NaN -> NaN, -inf -> 0, +inf -> +inf, in the
    ISA build and the portable one alike; the AVX2 exp once turned NaN into 1.6e-38) and
    tanh (NaN -> NaN, +-inf -> +-1 within 1 ulp)."""
    if build == "isa":
        lib = cpu_impl._state["lib"]
    else:
        root, key, _ = generic_build
        lib = cpu_build._open(root / f"sparse_attn_cpu-{key}.so", "generic")
    x = torch.tensor([float("nan"), float("-inf"), float("inf"), -100.0, 0.0, 1.0, 89.0, 1e30])
    # 16 values: the AVX-512 build's exp pass takes them as one 16-lane vector, 8 as one 8-lane tail
    for n in (8, 16):
        xs = x.repeat(n // 8)
        y = torch.full_like(xs, -7.0)
        lib.sa_exp(xs.data_ptr(), y.data_ptr(), n)
        for half in y.view(-1, 8):
            assert half[0].isnan() and half[1:].tolist() == [0.0, math.inf, 0.0, 1.0,
                                                             pytest.approx(math.e, rel=2.4e-7), math.inf, math.inf]
    y = torch.empty_like(x)
    lib.sa_tanh(x.data_ptr(), y.data_ptr(), 8)
    assert y[0].isnan() and y[1:3].tolist() == [pytest.approx(-1.0, abs=1e-7), pytest.approx(1.0, abs=1e-7)]


# --------------------------------------------------------------------------- the AVX-512 build

@pytest.mark.parametrize("case", ["mixed-ragged-gqa2-page16", "decode-ragged-mqa8-page16", "prefill-gqa3-page128-d64",
                                  "mixed-gqa3-page64-d24"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_avx512_build_is_bit_identical_to_the_avx2_build(monkeypatch, case, dtype):
    """Its 512-bit micro-kernels run each lane's FMA sequence of the AVX2 build, so outputs and counts are
    equal bit for bit (and the float64 tests above hold for whichever of the two this CPU serves with)."""
    have = cpu_build.supported_isas()
    if "avx512" not in have:
        pytest.skip(f"this CPU runs {', '.join(have)}: no AVX-512 build to compare")
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    layout = "cpu_packed" if page % 16 == 0 else "packed_kv"
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, dtype=DTYPES[dtype], seed=3))
    scale = 2.0 * d ** -0.5
    results = {}
    for isa in ("avx512", "avx2"):
        built = cpu_build.load(isa=isa)
        assert built.target == isa and built.lib.sa_isa().decode() == isa
        monkeypatch.setitem(cpu_impl._state, "lib", built.lib)
        results[isa] = _run(batch, scale, threshold=0.9, return_counts=True)
    (o512, sk512, vis512), (o2, sk2, vis2) = results["avx512"], results["avx2"]
    assert torch.equal(o512, o2)
    assert sk512.tolist() == sk2.tolist() and vis512.tolist() == vis2.tolist() and int(sk2.sum()) > 0


# ------------------------------------------------------ the pair-product builds: avx512bf16 and amx

def _pair_and_avx512_libs(build):
    """The ``build`` library (``avx512bf16``: AVX512-BF16 dot products; ``amx``: AMX tiles) and the avx512
    one, or a skip where this CPU runs neither (a CPU that has the flags runs the test: it fails, not skips)."""
    have = cpu_build.supported_isas()
    if build not in have:
        pytest.skip(f"this CPU runs {', '.join(have)}: no {build} build")
    lib = cpu_build.load(isa=build)
    assert lib.target == build and lib.lib.sa_isa().decode() == build
    if build == "amx" and not lib.lib.sa_tiles():
        pytest.skip("the OS did not grant this process the AMX tile state")
    return lib.lib, cpu_build.load(isa="avx512").lib


#: bf16 cases with head sizes the pair products take (D % 32 == 0) and items of >= 16 rows, some with rows left
#: over for the fp32 micro-kernels (a 36-row query tile of 3 heads: 96 rows on pair products, 12 not).
PAIR_CASES = ["prefill-gqa3-page128-d64", "mixed-ragged-gqa2-page16", "prefill-1seq-gqa1-page16"]
PAIR_BUILDS = ["avx512bf16", "amx"]


@pytest.mark.parametrize("build", PAIR_BUILDS)
@pytest.mark.parametrize("layout", ["cpu_packed", "contiguous", "packed_kv"])
@pytest.mark.parametrize("case", PAIR_CASES)
def test_pair_builds_run_bf16_prefill_within_bf16_rounding_of_float64(monkeypatch, case, layout, build):
    """Pair products (AVX512-BF16 dot products, or AMX tiles) multiply bf16 Q and K, and P rounded to bf16 with V,
    into fp32 (what vLLM's AMX kernel does): not bit-identical to the fp32 micro-kernels, so held to the float64
    reference at the bf16 tolerance, dense and sparse, with a NaN in every cache slot no sequence owns (a
    repacked tile must not carry one into P.V)."""
    pairs, avx512 = _pair_and_avx512_libs(build)
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, dtype=torch.bfloat16, seed=3))
    scale = 2.0 * d ** -0.5
    outs = {}
    for name, lib in (("pairs", pairs), ("avx512", avx512)):
        monkeypatch.setitem(cpu_impl._state, "lib", lib)
        outs[name] = [_run(batch, scale, threshold=lam, return_counts=True) for lam in (0.0, 0.9)]
    for lam, (out, sk, vis) in zip((0.0, 0.9), outs["pairs"]):
        ref, skipped, visited, _ = cached_reference((case, "bf16", "sink-3", lam), batch, scale, lam=lam)
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), ref, **TOL["bf16"])
        assert vis.tolist() == visited.tolist()
        if lam:
            assert int(sk.sum()) > 0
    # the pair products ran: bf16 prefill is not the fp32 micro-kernels' result bit for bit
    assert not torch.equal(outs["pairs"][0][0], outs["avx512"][0][0])


@pytest.mark.parametrize("build", PAIR_BUILDS)
@pytest.mark.parametrize("case, dtype", [
    ("prefill-gqa3-page128-d64", "fp32"), ("prefill-gqa3-page128-d64", "fp16"),
    ("decode-ragged-mqa8-page16", "bf16"),   # decode: fewer than 16 rows an item
    ("mixed-gqa3-page64-d24", "bf16"),       # D % 32 != 0
    ("chunked-prefill-gqa4-page32", "bf16"),  # D = 16
])
def test_pair_builds_are_the_avx512_build_where_no_pair_product_runs(monkeypatch, case, dtype, build):
    """Pair products serve only bf16 items of >= 16 rows with D % 32 == 0; everything else is the avx512 code, bit
    for bit."""
    pairs, avx512 = _pair_and_avx512_libs(build)
    kv_lens, q_lens, hq, hkv, d, page = CASES[case]
    layout = "cpu_packed" if page % 16 == 0 else "packed_kv"
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout=layout, dtype=DTYPES[dtype], seed=3))
    results = {}
    for name, lib in (("pairs", pairs), ("avx512", avx512)):
        monkeypatch.setitem(cpu_impl._state, "lib", lib)
        results[name] = _run(batch, 2.0 * d ** -0.5, threshold=0.9, return_counts=True)
    (oa, ska, visa), (ob, skb, visb) = results["pairs"], results["avx512"]
    assert torch.equal(oa, ob) and ska.tolist() == skb.tolist() and visa.tolist() == visb.tolist()


@pytest.mark.parametrize("flags, pinned, expected", [
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}, None, "amx"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}, "avx512", "avx512"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}, "avx512bf16", "avx512bf16"),
    ({"avx2", "fma", "f16c", "avx512f", "amx_tile"}, None, "avx512"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16"}, None, "avx512bf16"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}, None, "avx512"),
    ({"avx2", "fma", "f16c", "avx512f"}, None, "avx512"),
    ({"avx2", "fma", "f16c", "avx512f"}, "avx2", "avx2"),
    ({"avx2", "fma", "f16c", "avx512f"}, "generic", "generic"),
    ({"avx2", "fma", "f16c"}, "auto", "avx2"),
    ({"avx2", "fma"}, None, "generic"),
    (set(), None, "generic"),
], ids=["amx-auto", "amx-pinned-avx512", "amx-pinned-avx512bf16", "amx-tile-without-bf16", "avx512bf16-auto",
        "bf16-without-avx512bw", "avx512-auto", "avx512-pinned-avx2",
        "avx512-pinned-generic", "avx2-auto", "no-f16c", "not-x86"])
def test_isa_is_the_widest_this_cpu_runs_unless_pinned(monkeypatch, flags, pinned, expected):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: set(flags))
    if pinned is None:
        monkeypatch.delenv("SPARSE_ATTN_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("SPARSE_ATTN_CPU_ISA", pinned)
    envs.reset_for_tests()
    try:
        assert cpu_build.cpu_isa() == expected
    finally:
        envs.reset_for_tests()


@pytest.mark.parametrize("isa", cpu_build.ISAS)
def test_every_isa_the_setting_offers_is_a_build_target_with_cpu_flags_and_compiler_flags(isa):
    assert isa in cpu_build._ISA_CPU_FLAGS
    flags = cpu_build.isa_flags(isa)
    # each -m flag asks the compiler for an extension that the CPU flags the target requires must include
    # (-mamx-tile is /proc/cpuinfo's amx_tile; -mavx512bf16 its avx512_bf16)
    needs = {f[2:].replace("-", "_") for f in flags if f.startswith("-m")}
    needs = {"avx512_bf16" if n == "avx512bf16" else n for n in needs}
    assert needs <= cpu_build._ISA_CPU_FLAGS[isa]


def test_the_setting_lists_every_build_target_widest_first():
    assert "auto" in settings.CPU_ISA_CHOICES and "auto" not in cpu_build.ISAS
    assert set(cpu_build._ISA_CPU_FLAGS) == set(cpu_build.ISAS)
    # widest first holds when each target's CPU flags include the next one's (supported_isas relies on it)
    for wider, narrower in zip(cpu_build.ISAS, cpu_build.ISAS[1:]):
        assert cpu_build._ISA_CPU_FLAGS[narrower] <= cpu_build._ISA_CPU_FLAGS[wider], (wider, narrower)
    with pytest.raises(KeyError):
        cpu_build.isa_flags("sse2")


def test_an_isa_pinned_that_this_cpu_lacks_is_refused_with_the_ones_it_has(monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv("SPARSE_ATTN_CPU_ISA", "avx512")
    envs.reset_for_tests()
    try:
        with pytest.raises(cpu_build.CpuKernelUnavailable, match=r"runs avx2, generic, not avx512\. Fix: "):
            cpu_build.cpu_isa()
        monkeypatch.setenv("SPARSE_ATTN_CPU_ISA", "sse2")
        envs.reset_for_tests()
        with pytest.raises(ValueError, match="auto, amx, avx512bf16, avx512, avx2, generic"):
            cpu_build.cpu_isa()
    finally:
        envs.reset_for_tests()


@pytest.mark.parametrize("build", PAIR_BUILDS)
@pytest.mark.parametrize("d", [64, 256, 48, 40], ids=["d64", "d256", "d48", "d40"])
def test_bf16_prefill_on_pairs_says_where_the_library_multiplies_pairs(monkeypatch, build, d):
    """``cpu_impl.bf16_prefill_on_pairs`` (what the plugin's dense_steps reads) against what the library does: a bf16
    prefill differs from the fp32-product ``avx512`` build's exactly where the answer is True."""
    pairs, avx512 = _pair_and_avx512_libs(build)
    batch = make_batch([80], [80], 4, 1, d, 16, dtype=torch.bfloat16, seed=5)
    outs = []
    for lib in (pairs, avx512):
        monkeypatch.setitem(cpu_impl._state, "lib", lib)
        outs.append(_run(batch, d ** -0.5))
    monkeypatch.setitem(cpu_impl._state, "status", dataclasses.replace(cpu_impl.status(), target=build))
    assert cpu_impl.bf16_prefill_on_pairs(d) == (not torch.equal(*outs))


def test_bf16_prefill_on_pairs_is_false_where_no_pair_build_serves(monkeypatch):
    st = cpu_impl.status()
    for target in ("avx512", "avx2", "generic"):
        monkeypatch.setitem(cpu_impl._state, "status", dataclasses.replace(st, target=target))
        assert not cpu_impl.bf16_prefill_on_pairs(64)
    monkeypatch.setitem(cpu_impl._state, "status", dataclasses.replace(st, target="avx512bf16"))
    assert cpu_impl.bf16_prefill_on_pairs(64)
    monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL", "torch")
    envs.reset_for_tests()
    try:
        assert not cpu_impl.bf16_prefill_on_pairs(64)
    finally:
        monkeypatch.delenv("SPARSE_ATTN_CPU_KERNEL")
        envs.reset_for_tests()
    monkeypatch.setitem(cpu_impl._state, "status", cpu_impl.Status(False, reason="no compiler"))
    assert not cpu_impl.bf16_prefill_on_pairs(64)


# --------------------------------------------------------------------------- build, cache, choice rule

@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """An empty cache directory and no loaded library; restored afterwards."""
    monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL_CACHE", str(tmp_path / "cache"))
    saved = dict(cpu_impl._state)
    cpu_impl.reset_for_tests()
    envs.reset_for_tests()
    cpu_impl._warned.clear()
    yield tmp_path / "cache"
    cpu_impl.reset_for_tests()
    cpu_impl._state.update(saved)
    envs.reset_for_tests()
    cpu_impl._warned.clear()


def test_without_a_compiler_the_torch_kernel_serves_with_one_warning(fresh_state, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nowhere/c++")
    batch = add_sink_token(make_batch([300, 40], [1, 40], 4, 2, 16, 16, seed=3))
    with caplog.at_level(logging.WARNING, logger="sparse_attn"):
        outs = [_run(batch, 1.0, impl="auto", threshold=0.3, return_counts=True) for _ in range(3)]
        assert cpu_impl.cpu_kernel() == "torch"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert "/nowhere/c++" in msg and "not found" in msg and "SPARSE_ATTN_CPU_KERNEL=torch" in msg
    ref = _run(batch, 1.0, impl="torch", threshold=0.3, return_counts=True)
    assert all(torch.equal(o[0], ref[0]) and o[1].tolist() == ref[1].tolist() for o in outs)
    st = cpu_impl.status()
    assert not st.available and "torch" in st.describe()
    assert not fresh_state.exists() or not any(fresh_state.glob("*.so"))


def test_compiled_required_without_a_compiler_is_an_error(fresh_state, monkeypatch):
    monkeypatch.setenv("CXX", "/nowhere/c++")
    monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL", "compiled")
    batch = make_batch([40], [1], 2, 1, 16, 16)
    with pytest.raises(cpu_build.CpuKernelUnavailable, match="Fix: install a C.. compiler"):
        _run(batch, 1.0, impl="auto")
    with pytest.raises(cpu_build.CpuKernelUnavailable, match="not found"):
        _run(batch, 1.0, impl="compiled")


def test_compile_error_is_reported_not_raised(fresh_state, monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_build, "SOURCE", broken)
    monkeypatch.setattr(cpu_build, "HEADERS", ())
    st = cpu_impl.status()
    assert not st.available and "failed" in st.reason and "broken.cpp" in st.reason
    assert cpu_impl.cpu_kernel() == "torch"
    assert not any(fresh_state.glob("*.so")) and not any(fresh_state.glob(".*.tmp"))


def test_choice_rule(monkeypatch):
    """SPARSE_ATTN_CPU_KERNEL x availability x shapes (the library of the module fixture is loaded)."""
    monkeypatch.setattr(envs, "_cache", {})
    ok = make_batch([40], [1], 4, 1, 64, 16)
    odd = make_batch([40], [1], 4, 1, 20, 16)  # head size not a multiple of 8: the torch kernel serves it
    assert cpu_impl.cpu_kernel(ok) == "compiled" and cpu_impl.cpu_kernel(odd) == "torch"
    for value, expected in (("torch", "torch"), ("compiled", "compiled"), ("auto", "compiled")):
        monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL", value)
        envs.reset_for_tests()
        assert cpu_impl.cpu_kernel(ok) == expected
    torch.testing.assert_close(_run(odd, 0.5, impl="auto").double(), reference(odd, 0.5)[0], atol=2e-5, rtol=1e-5)
    monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL", "compiled")
    envs.reset_for_tests()
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_impl.cpu_kernel(odd)
    monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL", "fast")
    envs.reset_for_tests()
    with pytest.raises(ValueError, match="auto, compiled, torch"):
        cpu_impl.cpu_kernel()


def test_cache_key_follows_source_isa_and_profile(monkeypatch, tmp_path):
    keys = {cpu_build.cache_key("avx512"), cpu_build.cache_key("avx2"), cpu_build.cache_key("generic"),
            cpu_build.cache_key("avx2", profile=True)}
    assert len(keys) == 4
    before = cpu_build.cache_key("avx2")
    for name in ("skip_attn_cpu.cpp", *cpu_build.HEADERS):  # an edit of the source or of a header
        for f in (cpu_build.SOURCE.parent / n for n in ("skip_attn_cpu.cpp", *cpu_build.HEADERS)):
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / f.name).write_bytes(f.read_bytes() + (b"\n// edit\n" if f.name == name else b""))
        monkeypatch.setattr(cpu_build, "SOURCE", tmp_path / name / "skip_attn_cpu.cpp")
        assert cpu_build.cache_key("avx2") != before, name


# --------------------------------------------------------------------------- layer features

FEATURES = {
    "window100": dict(window=100),
    "window160-cap20-sinks": dict(window=160, soft_cap=20.0, sinks=True),
    "cap3": dict(soft_cap=3.0),
    "sinks": dict(sinks=True),
}


FEATURE_CASES = {
    # long enough that windows leave tile 0 behind and tiles get skipped
    "mixed-gqa3-page16": ([700, 300, 5], [1, 200, 5], 6, 2, 32, 16),
    "decode-gqa3-page128-d64": ([900, 65, 1000], [1, 1, 1], 9, 3, 64, 128),
}


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2], ids=["same", "e4m3", "e5m2"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("case", list(FEATURE_CASES))
def test_layer_features_match_float64(case, feature, kv_dtype):
    kv_lens, q_lens, hq, hkv, d, page = FEATURE_CASES[case]
    batch = add_sink_token(make_batch(kv_lens, q_lens, hq, hkv, d, page, layout="cpu_packed", seed=1))
    k_scale = v_scale = 1.0
    if kv_dtype is not None:  # the cache holds x / scale in fp8, as vLLM's writer stores it
        k_scale, v_scale = 0.05, 0.02
        batch = dataclasses.replace(batch, key_cache=(batch.key_cache.float() / k_scale).to(kv_dtype),
                                    value_cache=(batch.value_cache.float() / v_scale).to(kv_dtype))
    kw = dict(FEATURES[feature])
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(5)) * 2 if kw.pop("sinks", False) else None
    spec = LayerSpec(0.5, sink_logits=sinks, k_scale=k_scale, v_scale=v_scale, **kw)
    meta = BatchMeta.from_host(batch.seq_lens, batch.query_start_loc)
    for lam in (0.0, 0.1, 0.8):
        lams = torch.full((len(kv_lens),), lam)
        out, sk, vis = cpu_impl.forward(batch, spec, meta, threshold=lams, count_thresholds=lams[None],
                                        out=torch.empty_like(batch.query))
        ref, ref_sk, ref_vis, _ = reference(batch, spec, lam)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
        assert sk[0].tolist() == ref_sk.tolist() and vis.tolist() == ref_vis.tolist()
    assert int(ref_sk.sum()) > 0


def test_tanh_approximation_accuracy():
    lib = cpu_impl._state["lib"]
    x = torch.cat([torch.linspace(-12.0, 12.0, 1 << 20), torch.tensor([0.0, -0.0, 1e-20, 0.3999, 0.4, 0.4001, 9.0, 30.0])])
    y = torch.empty_like(x)
    lib.sa_tanh(x.data_ptr(), y.data_ptr(), x.numel())
    err = (y.double() - x.double().tanh()).abs() / x.double().tanh().abs().clamp_min(1e-30)
    assert err.max().item() < 4e-7, err.max().item()  # a few ulp: logits are cap * tanh(x / cap)
