"""Capture safety of ``paged_attention(..., check=False)`` (issue 12, kernel side).

The whole public call runs on ``meta``-device tensors shaped like vLLM's FlashInfer
metadata (one packed ``[num_blocks, Hkv, page, 2D]`` cache viewed as K / V, an int32 block
table with more columns than needed, seq_lens, query_start_loc, per-sequence lambdas).
Meta tensors have no data, so any host read of device data (``.item()``, ``.tolist()``,
``.cpu()``, ``bool(tensor)``, ``nonzero``, boolean-mask indexing) raises, and a tensor made
on the host and mixed in would show up with the wrong device.  (``FakeTensorMode`` catches
the same reads, but its fake CUDA tensors cannot be sliced on a CPU-only torch build.)
Only the final kernel launch is replaced, by a recorder that checks the prepared grid,
shapes and dtypes.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from sparse_attn.kernels import (SPLIT_K, TILE_Q, BatchMeta, LayerSpec, PagedBatch, paged_attention,  # noqa: E402
                                 paged_attention_counts)
from sparse_attn.kernels import triton_impl  # noqa: E402

HQ, HKV, D, PAGE, MAX_BLOCKS = 32, 8, 128, 16, 512       # KV upper bound 8192 tokens


def _flashinfer_batch(num_seqs, q_len, dtype=torch.bfloat16, max_query_len=None):
    """A batch of meta tensors shaped as vLLM's FlashInfer backend hands them to the
    attention impl, and per-sequence lambdas."""
    kv = torch.empty(num_seqs * MAX_BLOCKS, HKV, PAGE, 2 * D, dtype=dtype, device="meta")
    kv = kv.transpose(1, 2)                                       # logical [blocks, page, Hkv, 2D]
    key_cache, value_cache = kv[..., :D], kv[..., D:]
    query = torch.empty(num_seqs * q_len, HQ, D, dtype=dtype, device="meta")
    block_table = torch.empty(num_seqs, MAX_BLOCKS, dtype=torch.int32, device="meta")
    seq_lens = torch.empty(num_seqs, dtype=torch.int32, device="meta")
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device="meta") * q_len
    lam = torch.empty(num_seqs, dtype=torch.float32, device="meta")
    return PagedBatch(query, key_cache, value_cache, block_table, seq_lens, qsl, max_query_len=max_query_len), lam


class _Recorder:
    def __init__(self):
        self.plans = []

    def __call__(self, plan):
        for call in plan.calls:
            names = list(inspect.signature(call.kernel.fn).parameters)
            assert len(call.args) + len([n for n in call.constexprs if n in names]) == len(names), names
            for name, arg in zip(names, call.args):
                if isinstance(arg, torch.Tensor):
                    assert arg.device.type == "meta", (name, arg.device)
                else:  # scalars are host ints / floats derived from shapes and Python values
                    assert isinstance(arg, (int, float)) and not isinstance(arg, bool), (name, type(arg))
            assert all(isinstance(g, int) and g >= 1 for g in call.grid), call.grid
        self.plans.append(plan)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(triton_impl, "launch", rec)
    return rec


def _args(call):
    names = list(inspect.signature(call.kernel.fn).parameters)
    return {**dict(zip(names, call.args)), **call.constexprs}


@pytest.mark.parametrize("num_seqs", [1, 8, 64], ids=lambda n: f"batch{n}")
def test_uniform_decode_prepares_without_host_reads(recorder, num_seqs):
    batch, lam = _flashinfer_batch(num_seqs, 1, max_query_len=1)
    q, k = batch.query, batch.key_cache
    out, skipped, visited = paged_attention(batch, LayerSpec(D ** -0.5), threshold=lam, impl="triton",
                                            return_counts=True, check=False)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype
    for c in (skipped, visited):
        assert c.device.type == "meta" and c.dtype == torch.int64 and c.shape == (HQ,)
    (plan,) = recorder.plans
    attn = _args(plan.calls[0])
    heads = attn["HEADS"]
    assert heads == HQ // HKV                                           # the whole GQA group in one program
    n_splits = math.ceil(MAX_BLOCKS * PAGE / SPLIT_K)                  # KV upper bound from the table width
    kv_progs = plan.calls[0].grid[2]
    # Bounded split-KV: at most one program per split and per MAX_KV_PROGRAMS, fewer as the batch grows.
    assert 1 <= kv_progs <= min(n_splits, triton_impl.MAX_KV_PROGRAMS)
    assert num_seqs * HKV * kv_progs <= max(triton_impl.TARGET_PROGRAMS, num_seqs * HKV)
    assert plan.phase == "decode" and plan.calls[0].grid[:2] == (num_seqs, HKV * (HQ // HKV) // heads)
    assert attn["COUNT"] and attn["BLOCK_N"] == 64 and attn["HEADS"] * attn["BLOCK_M"] >= 16
    assert not attn["TILE_MAP"]                                         # decode: program s is sequence s
    assert attn["LAM"].shape == (num_seqs,) and attn["LAM"].dtype == torch.float32
    assert attn["SKIP_CNT"].shape[:3] == (num_seqs, kv_progs, HQ) and attn["SKIP_CNT"].dtype == torch.int32
    assert attn["K"].stride() == k.stride() and attn["BT"].dtype == torch.int32
    if kv_progs > 1:
        assert attn["SPLIT"] and len(plan.calls) == 2
        assert attn["O_PART"].shape == (num_seqs, kv_progs, HQ, 128) and attn["O_PART"].dtype == torch.float32
        merge = _args(plan.calls[1])
        assert plan.calls[1].grid == (num_seqs, HQ) and merge["BLOCK_S"] >= kv_progs and merge["O"] is out
    else:                                       # one program per sequence writes the output itself
        assert not attn["SPLIT"] and len(plan.calls) == 1 and attn["O"] is out
    cfg = triton_impl.tile_config(D, torch.bfloat16, "decode")
    assert (attn["num_warps"], attn["num_stages"]) == (cfg.num_warps, cfg.num_stages)


@pytest.mark.parametrize("num_seqs", [1, 8, 64, 512], ids=lambda n: f"batch{n}")
def test_capture_scratch_memory_does_not_grow_with_the_block_table(recorder, num_seqs):
    """Issue 18 item 2: a captured decode's device scratch (fp32 partials, counts,
    per-program arrays) is sized by the batch, never by the block table's width
    (``max_model_len``).  Before the bound, batch 512 at 128k tokens (8192 columns of 16)
    allocated ``S * splits * Hq * D * 4`` = 512 * 128 * 32 * 128 * 4 B = 1 GiB of partials."""
    sizes = {}
    for max_tokens in (8192, 131072, 1 << 20):
        batch, lam = _flashinfer_batch(num_seqs, 1, max_query_len=1)
        bt = torch.empty(num_seqs, max_tokens // PAGE, dtype=torch.int32, device="meta")
        paged_attention(dataclasses.replace(batch, block_table=bt), LayerSpec(D ** -0.5), threshold=lam,
                        return_counts=True, impl="triton", check=False)
        sizes[max_tokens] = recorder.plans[-1].scratch_bytes
    # Past the per-sequence program cap (64 splits of 1024 = 64k tokens) the width changes nothing ...
    assert sizes[131072] == sizes[1 << 20], sizes
    # ... and the scratch stays within a per-sequence constant: at most MAX_KV_PROGRAMS
    # programs' partials (fp32 accumulator + exp reference + row sum) and counts per head.
    per_seq = triton_impl.MAX_KV_PROGRAMS * HQ * ((128 + 2) * 4 + (2 + 1) * 4) + 64
    assert max(sizes.values()) <= num_seqs * per_seq, sizes
    if num_seqs == 512:
        assert sizes[131072] < 1 << 20, sizes              # was 1 GiB


def test_mixed_batch_prepares_without_host_reads(recorder):
    """Prefill-phase launch (max_query_len > 1): query tiles mapped to sequences on the
    device, the grid an upper bound (T / BLOCK_M + S programs)."""
    num_seqs, q_len = 4, 100
    batch, _ = _flashinfer_batch(num_seqs, q_len, max_query_len=q_len)
    q = batch.query
    out = paged_attention(batch, LayerSpec(D ** -0.5), threshold=0.01, check=False, impl="triton")
    assert out.device.type == "meta" and out.shape == q.shape
    (plan,) = recorder.plans
    assert plan.phase == "prefill" and len(plan.calls) == 1
    attn = _args(plan.calls[0])
    n_slots = math.ceil(num_seqs * q_len / TILE_Q) + num_seqs
    assert plan.calls[0].grid[0] == n_slots and plan.calls[0].grid[2] == 1
    assert attn["TILE_SEQ"].shape == (n_slots,) and attn["TILE_ROW0"].dtype == torch.int32
    assert not attn["SPLIT"] and not attn["COUNT"] and attn["BLOCK_M"] == TILE_Q


def test_checked_call_reads_the_host_and_meta_catches_it(recorder):
    """Control: the default check=True validates on the host, which meta tensors refuse;
    so the tests above would fail if the check=False path read device data."""
    batch, lam = _flashinfer_batch(2, 1)
    with pytest.raises((NotImplementedError, RuntimeError)):
        paged_attention(batch, LayerSpec(D ** -0.5), threshold=lam, return_counts=True, impl="triton")
    assert recorder.plans == []


# --------------------------------------------------------------------------- host copy of the batch (issue 18 item 1)

class _DeviceReads(TorchDispatchMode):
    """Records every op that brings device data to the host: ``.item()`` / ``bool()`` /
    ``.tolist()`` of a non-CPU tensor (``aten._local_scalar_dense``) and copies from a
    non-CPU tensor to a CPU one.  (Host values, e.g. a lambda list, are read freely.)"""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type != "cpu":
            self.reads.append(func.__name__)
        elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            if args[0].device.type != "cpu" and torch.device(kwargs["device"]).type == "cpu":
                self.reads.append(func.__name__)
        elif func is torch.ops.aten.copy_.default and args[1].device.type != "cpu" and args[0].device.type == "cpu":
            self.reads.append(func.__name__)
        return func(*args, **kwargs)


MIXED = dict(kv_lens=[500, 300, 9, 80], q_lens=[1, 100, 1, 37])


def _host_batch(kv_lens, q_lens, host=True):
    batch, _ = _flashinfer_batch(len(kv_lens), 1)
    t = sum(q_lens)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = BatchMeta.from_host(kv_lens, qsl) if host else None
    return dataclasses.replace(batch, query=torch.empty(t, HQ, D, dtype=batch.query.dtype, device="meta"), host=meta)


@pytest.mark.parametrize("kv_lens, q_lens", [pytest.param(MIXED["kv_lens"], MIXED["q_lens"], id="mixed"),
                                             pytest.param([700, 64], [300, 64], id="prefill"),
                                             pytest.param([700, 64, 1], [1, 1, 1], id="decode")])
def test_checked_call_with_host_copy_reads_no_device_data(recorder, kv_lens, q_lens):
    """check=True with ``batch.host``: validation uses the host lengths and the grid is
    exact; no op brings device data to the host (the tensors are meta: a read would raise)."""
    batch = _host_batch(kv_lens, q_lens)
    reads = _DeviceReads()
    with reads:
        lams = [0.01, 0.0, 0.2, 0.1][:len(kv_lens)]                # a host list: copied to the device, not read back
        out, skipped, visited = paged_attention(batch, LayerSpec(D ** -0.5), threshold=lams, return_counts=True,
                                                impl="triton")
        counts = paged_attention_counts(batch, LayerSpec(D ** -0.5), [0.0, 0.1], impl="triton")
    assert reads.reads == []
    assert out.device.type == skipped.device.type == counts[1].device.type == "meta"
    assert len(recorder.plans) == 2
    decode = max(q_lens) == 1
    for plan in recorder.plans:
        assert plan.phase == ("decode" if decode else "prefill")
        if not decode:     # the exact grid: one program per query tile
            block_m = _args(plan.calls[0])["BLOCK_M"]
            assert plan.calls[0].grid[0] == sum(math.ceil(n / block_m) for n in q_lens)


def test_checked_call_without_host_copy_reads_device_data():
    """Control: the same call without ``batch.host`` copies the lengths to the host (the
    recorder sees it; meta tensors then refuse), so the test above can fail."""
    reads = _DeviceReads()
    with pytest.raises((NotImplementedError, RuntimeError)):
        with reads:
            paged_attention(_host_batch(**MIXED, host=False), LayerSpec(D ** -0.5), threshold=0.1, impl="triton")
    assert reads.reads


def test_full_check_with_host_copy_reads_the_block_table():
    """``check="full"`` adds the block-id range check, a device reduction read on the host."""
    reads = _DeviceReads()
    with pytest.raises((NotImplementedError, RuntimeError)):
        with reads:
            paged_attention(_host_batch(**MIXED), LayerSpec(D ** -0.5), threshold=0.1, impl="triton", check="full")
    assert reads.reads == ["_local_scalar_dense.default"]
