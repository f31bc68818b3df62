"""Install-time warm-up: every kernel variant the installed layers will launch runs once, and
the stats' device counters exist, before vLLM profiles or captures anything.

The Triton kernel compiles one variant per set of constexprs and specialisations
(``triton_impl.variant_key``); the batch-shaped ints are not specialised
(``triton_kernels.PAGED_DO_NOT_SPECIALIZE``), so what varies between served launches of one
layer kind is: decode split or not (``SPLIT``), the prefill row block (``BLOCK_M``, one per
power of two of the longest query up to ``TILE_Q``), and whether an eager phase is sparse or
dense (every lambda 0). Each is launched here on a synthetic batch of the layer's shapes and dtype (a few
tokens: compiling is the point), so the first real request compiles nothing. The CPU kernels
compile nothing per shape: on CPU only the counters are allocated.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from sparse_attn.kernels import SPLIT_K, TILE_Q, LambdaRule, PagedBatch, paged_attention
from sparse_attn.kernels.support import FP8_KV_DTYPES, KERNEL_DTYPES
from sparse_attn.protocol import PHASE_COUNTERS, PHASES
from sparse_attn.stats import WorkerStats

logger = logging.getLogger("sparse_attn")

#: vLLM's default GPU page size; the kernels do not specialise on it.
PAGE = 16


def _batch(info, q_lens: list[int], kv_lens: list[int], width: int, dtype, kv_dtype, device) -> PagedBatch:
    hq, hkv, d = info.num_heads, info.num_kv_heads, info.head_size
    n_blocks = len(kv_lens) * width
    cache = dict(dtype=torch.float32, device=device)
    key_cache = torch.zeros(n_blocks, PAGE, hkv, d, **cache).to(kv_dtype)
    value_cache = torch.zeros(n_blocks, PAGE, hkv, d, **cache).to(kv_dtype)
    table = torch.arange(n_blocks, dtype=torch.int32, device=device).view(len(kv_lens), width)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedBatch(torch.zeros(sum(q_lens), hq, d, dtype=dtype, device=device), key_cache, value_cache, table,
                      torch.tensor(kv_lens, dtype=torch.int32, device=device), starts.to(device),
                      max_query_len=max(q_lens))


def _shapes() -> Iterable[tuple[str, list[int], list[int], int]]:
    """(phase, q_lens, kv_lens, block-table width) of each variant's synthetic batch."""
    yield "decode", [1], [1], 1                                   # one split: no partials, no merge
    yield "decode", [1], [1], 2 * SPLIT_K // PAGE + 1             # split-KV with the merge kernel
    q = 2
    while q <= TILE_Q:                                            # every prefill row block
        yield "prefill", [q], [q], -(-q // PAGE)
        q *= 2


def model_device_dtype(model: Any) -> tuple[torch.device, torch.dtype] | None:
    """Where ``model`` computes and in which dtype (its first parameter of a kernel dtype:
    quantised weights are not the activations' dtype), or ``None`` without such parameters."""
    params = model.parameters() if hasattr(model, "parameters") else ()
    for param in params:
        if param.dtype in KERNEL_DTYPES:
            return param.device, param.dtype
    return None


def warm_up(impls: Iterable[Any], stats: WorkerStats, *, device: torch.device, dtype: torch.dtype,
            impl: str = "auto") -> int:
    """Launch each kernel variant the sparse impls ``impls`` (``adapter.make_sparse``'s) will use
    once on ``device`` with queries of ``dtype``, and allocate ``stats``' device counters there.
    Returns the number of launches (0 on CPU, where nothing compiles per shape)."""
    for phase in PHASES:
        stats.device_counter(phase, device)
    if device.type == "cpu" and impl != "triton":
        return 0
    scratch = torch.zeros(len(PHASE_COUNTERS), dtype=torch.int64, device=device)   # not the served counts
    done, launches = set(), 0
    for sparse_impl in impls:
        info, spec, policy = sparse_impl._sa_info, sparse_impl._sa_spec, sparse_impl._sa_policy
        kv_dtype = FP8_KV_DTYPES.get(info.features.kv_cache_dtype, dtype)
        key = (info.num_heads, info.num_kv_heads, info.head_size, kv_dtype, spec.window is not None,
               spec.soft_cap is not None, spec.sink_logits is not None,
               isinstance(spec.k_scale, torch.Tensor) or isinstance(spec.v_scale, torch.Tensor),
               tuple(sorted(p for p, s in policy.scale_factors.items() if s is not None)))
        if key in done:
            continue
        done.add(key)
        for phase, q_lens, kv_lens, width in _shapes():
            batch = _batch(info, q_lens, kv_lens, width, dtype, kv_dtype, device)
            served = policy.scale_factors.get(phase) is not None
            if served:       # the sparse launch (lambda 0 here: the variant is what compiles)
                paged_attention(batch, spec, threshold=LambdaRule(0.0), counters=scratch, check=False, impl=impl)
                launches += 1
            # an eager phase whose lambdas are all 0 (short sequences) runs the dense kernel
            paged_attention(batch, spec, check=False, impl=impl)
            launches += 1
    logger.info("sparse-attn: warm-up launched %d kernel variant(s) on %s before serving", launches, device)
    return launches
