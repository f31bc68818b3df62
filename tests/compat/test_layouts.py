"""The layout catalogue on plain tensors: every layout x stride order x dtype.

Each cache is built here from reference K/V ``[B, N, H, D]`` by an expression
written independently of ``compat.layouts`` (stack/cat/transposes of the
physical page), then re-laid in each stride order a release can allocate.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import compat
from compat import layouts
from compat.layouts import KVLayout

B, N, H, D = 5, 32, 3, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8-as-uint8": torch.uint8}


def random_kv(dtype: torch.dtype, gen: torch.Generator, shape=(B, N, H, D)) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype == torch.uint8:
        return (torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8) for _ in range(2))
    return (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))


def logical_cache(layout: KVLayout, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The logical cache tensor, built from K/V the way each release lays pages out."""
    if layout is KVLayout.BLOCKS_FIRST:
        return torch.stack([k, v], dim=1)
    if layout is KVLayout.KV_FIRST:
        return torch.stack([k, v], dim=0)
    if layout is KVLayout.PACKED:  # [B, H, N, 2D]: each token's K then V
        return torch.cat([k, v], dim=-1).permute(0, 2, 1, 3)
    # cpu-packed: page (b, h) = K as [D, N] flattened, then V as [N, D] flattened
    k_dim_major = k.permute(0, 2, 3, 1).reshape(B, H, N * D)
    v_token_major = v.permute(0, 2, 1, 3).reshape(B, H, N * D)
    return torch.cat([k_dim_major, v_token_major], dim=-1).reshape(B, H, N, 2 * D)


def with_stride_order(logical: torch.Tensor, order: tuple[int, ...], pad_layers: int = 1) -> torch.Tensor:
    """Same logical values, physically stored in ``order`` (axes of ``logical``).

    ``pad_layers > 1`` interleaves other layers' pages per block (block-outer
    layouts such as BLHNC): the block stride then spans several layers.
    """
    physical = logical.permute(order).contiguous()
    if pad_layers > 1:
        block_axis = order.index(0) if logical.dim() == 4 or logical.shape[0] != 2 else order.index(1)
        big = torch.zeros((*physical.shape[: block_axis + 1], pad_layers, *physical.shape[block_axis + 1 :]), dtype=logical.dtype)
        big.select(block_axis + 1, pad_layers - 1).copy_(physical)
        physical = big.select(block_axis + 1, pad_layers - 1)
    inverse = tuple(order.index(i) for i in range(len(order)))
    return physical.permute(inverse)


# (layout, name, physical axis order, layers interleaved per block)
STRIDE_ORDERS = [
    (KVLayout.BLOCKS_FIRST, "NHD", (0, 1, 2, 3, 4), 1),
    (KVLayout.BLOCKS_FIRST, "HND", (0, 1, 3, 2, 4), 1),
    (KVLayout.KV_FIRST, "NHD", (0, 1, 2, 3, 4), 1),
    (KVLayout.KV_FIRST, "HND", (0, 1, 3, 2, 4), 1),
    (KVLayout.PACKED, "LBHNC", (0, 1, 2, 3), 1),
    (KVLayout.PACKED, "LBNHC", (0, 2, 1, 3), 1),
    (KVLayout.PACKED, "LHBNC", (1, 0, 2, 3), 1),
    (KVLayout.PACKED, "BLHNC", (0, 1, 2, 3), 3),
    (KVLayout.PACKED, "BLNHC", (0, 2, 1, 3), 3),
    (KVLayout.CPU_PACKED, "LBHNC", (0, 1, 2, 3), 1),
    (KVLayout.CPU_PACKED, "LHBNC", (1, 0, 2, 3), 1),
    (KVLayout.CPU_PACKED, "BLHNC", (0, 1, 2, 3), 2),
]
CASES = [
    pytest.param(layout, order, pad, dtype, id=f"{layout.value}-{name}-{dname}")
    for (layout, name, order, pad), (dname, dtype) in itertools.product(STRIDE_ORDERS, DTYPES.items())
]


def view_kwargs(layout: KVLayout) -> dict:
    return {"isa": "vec"} if layout is KVLayout.CPU_PACKED else {}


@pytest.mark.parametrize("layout, order, pad, dtype", CASES)
def test_views_read_values_and_share_storage(layout, order, pad, dtype):
    gen = torch.Generator().manual_seed(0)
    k, v = random_kv(dtype, gen)
    cache = with_stride_order(logical_cache(layout, k, v), order, pad)
    assert torch.equal(cache, logical_cache(layout, k, v))

    key_view, value_view = layouts.views(layout, cache, D, **view_kwargs(layout))

    assert key_view.shape == value_view.shape == (B, N, H, D)
    assert torch.equal(key_view, k) and torch.equal(value_view, v)
    for view in (key_view, value_view):
        assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    # Writing through a view must land in the cache itself.
    marker = torch.tensor(7, dtype=dtype)
    key_view[2, 5, 1, 3] = marker
    value_view[4, 31, 2, 0] = marker
    rebuilt = logical_cache(layout, key_view.clone(), value_view.clone())
    assert torch.equal(cache, rebuilt)
    k2, v2 = layouts.views(layout, cache, D, **view_kwargs(layout))
    assert k2[2, 5, 1, 3] == marker and v2[4, 31, 2, 0] == marker


def reference_write(layout: KVLayout, cache: torch.Tensor, slot: int, k_tok: torch.Tensor, v_tok: torch.Tensor) -> None:
    """Store one token by addressing the logical cache directly (independent of compat)."""
    block, off = divmod(slot, N)
    if layout is KVLayout.BLOCKS_FIRST:
        cache[block, 0, off], cache[block, 1, off] = k_tok, v_tok
    elif layout is KVLayout.KV_FIRST:
        cache[0, block, off], cache[1, block, off] = k_tok, v_tok
    elif layout is KVLayout.PACKED:
        cache[block, :, off, :D], cache[block, :, off, D:] = k_tok, v_tok
    else:
        flat = cache[block].reshape(H, 2 * N * D)  # a page is contiguous, so reshape is a view
        assert flat.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        for h in range(H):
            flat[h, off : N * D : N] = k_tok[h]
            flat[h, N * D + off * D : N * D + (off + 1) * D] = v_tok[h]


@pytest.mark.parametrize("layout, order, pad, dtype", CASES)
def test_write_round_trip_over_decode_steps(layout, order, pad, dtype):
    gen = torch.Generator().manual_seed(1)
    zeros = torch.zeros(B, N, H, D, dtype=dtype)
    cache = with_stride_order(logical_cache(layout, zeros, zeros), order, pad)
    expected = cache.clone()
    written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    free = torch.randperm(B * N, generator=gen).tolist()
    for step in range(4):
        tokens = 1 + step * 3
        slots = torch.tensor([free.pop() for _ in range(tokens)] + [-1, -1])  # padding slots at the end
        slots = slots[torch.randperm(len(slots), generator=gen)]
        new_k, new_v = random_kv(dtype, gen, (len(slots), H, D))
        key_view, value_view = layouts.views(layout, cache, D, **view_kwargs(layout))
        layouts.write(new_k, new_v, key_view, value_view, slots)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                written[slot] = (new_k[i], new_v[i])
                reference_write(layout, expected, slot, new_k[i], new_v[i])
        assert torch.equal(cache, expected), f"step {step}: cache bytes differ from the reference writer"
        key_view, value_view = layouts.views(layout, cache, D, **view_kwargs(layout))
        for slot, (kt, vt) in written.items():
            assert torch.equal(key_view[slot // N, slot % N], kt)
            assert torch.equal(value_view[slot // N, slot % N], vt)


@pytest.mark.parametrize(
    "layout, shape",
    [
        pytest.param(KVLayout.BLOCKS_FIRST, (B, N, H, D), id="blocks-first-rank4"),
        pytest.param(KVLayout.BLOCKS_FIRST, (B, 3, N, H, D), id="blocks-first-kv-axis-3"),
        pytest.param(KVLayout.BLOCKS_FIRST, (B, 2, N, H, D + 1), id="blocks-first-head-size"),
        pytest.param(KVLayout.KV_FIRST, (3, B, N, H, D), id="kv-first-kv-axis-3"),
        pytest.param(KVLayout.KV_FIRST, (2, B, N, H, 2 * D), id="kv-first-head-size"),
        pytest.param(KVLayout.PACKED, (B, 2, N, H, D), id="packed-given-5d"),
        pytest.param(KVLayout.PACKED, (B, H, N, D), id="packed-last-dim-D"),
        pytest.param(KVLayout.CPU_PACKED, (B, H, N, 3 * D), id="cpu-packed-last-dim"),
        pytest.param(KVLayout.CPU_PACKED, (B, 2, N, H, D), id="cpu-packed-given-5d"),
    ],
)
def test_bad_shapes_raise_unsupported_layout(layout, shape):
    with pytest.raises(compat.UnsupportedLayoutError) as info:
        layouts.views(layout, torch.zeros(shape), D, isa="vec")
    message = str(info.value)
    assert str(list(shape)) in message and layout.expected_shape in message and "SPARSE_ATTN_KV_LAYOUT" in message
    assert isinstance(info.value, ValueError)


def test_cpu_packed_refuses_token_major_pages():
    # LBNHC strides: the (block, head) page is not one run, so vLLM's CPU view would fail too.
    zeros = torch.zeros(B, N, H, D)
    cache = with_stride_order(logical_cache(KVLayout.CPU_PACKED, zeros, zeros), (0, 2, 1, 3))
    with pytest.raises(compat.UnsupportedLayoutError, match="contiguous run"):
        layouts.views(KVLayout.CPU_PACKED, cache, D, isa="vec")


@pytest.mark.parametrize("isa", ["amx", "neon", None])
def test_cpu_packed_refuses_unverified_isa(isa):
    cache = torch.zeros(B, H, N, 2 * D)
    with pytest.raises(compat.UnsupportedLayoutError, match="ISA"):
        layouts.views(KVLayout.CPU_PACKED, cache, D, isa=isa)


def test_two_blocks_are_never_guessed_from_shape():
    # [2, 2, N, H, D] fits both 5-D layouts; only the selected layout decides.
    cache = torch.arange(2 * 2 * N * H * D, dtype=torch.float32).reshape(2, 2, N, H, D)
    k_bf, _ = layouts.views(KVLayout.BLOCKS_FIRST, cache, D)
    k_kf, _ = layouts.views(KVLayout.KV_FIRST, cache, D)
    assert torch.equal(k_bf, cache[:, 0]) and torch.equal(k_kf, cache[0])
    assert not torch.equal(k_bf, k_kf)


@pytest.mark.parametrize(
    "make, match",
    [
        pytest.param(lambda: (torch.zeros(2, H, D), torch.zeros(2, H, D), torch.tensor([0, B * N])), "out of range", id="slot-out-of-range"),
        pytest.param(lambda: (torch.zeros(2, H, D, dtype=torch.float16), torch.zeros(2, H, D), torch.tensor([0, 1])), "float16", id="dtype-mismatch"),
        pytest.param(lambda: (torch.zeros(2, H + 1, D), torch.zeros(2, H + 1, D), torch.tensor([0, 1])), "num_kv_heads", id="heads-mismatch"),
        pytest.param(lambda: (torch.zeros(3, H, D), torch.zeros(3, H, D), torch.tensor([0, 1])), "num_tokens", id="slot-count-mismatch"),
    ],
)
def test_bad_writes_raise(make, match):
    key, value, slots = make()
    cache = torch.zeros(B, 2, N, H, D)
    before = cache.clone()
    k_view, v_view = layouts.views(KVLayout.BLOCKS_FIRST, cache, D)
    with pytest.raises(compat.KVWriteError, match=match):
        layouts.write(key, value, k_view, v_view, slots)
    assert torch.equal(cache, before), "a refused write must leave the cache untouched"


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8")
def test_float8_values_store_into_uint8_cache():
    cache = torch.zeros(B, H, N, 2 * D, dtype=torch.uint8)
    key = torch.randn(1, H, D).to(torch.float8_e4m3fn)
    value = torch.randn(1, H, D).to(torch.float8_e4m3fn)
    k_view, v_view = layouts.views(KVLayout.PACKED, cache, D)
    layouts.write(key, value, k_view, v_view, torch.tensor([N + 3]))
    assert torch.equal(k_view[1, 3], key[0].view(torch.uint8)) and torch.equal(v_view[1, 3], value[0].view(torch.uint8))


@pytest.mark.parametrize("slots", [
    pytest.param([5, 17, 3], id="no-padding"),
    pytest.param([-1, 17, 3, -1], id="padding-first-and-last"),
    pytest.param([5, -1, -1, 30], id="padding-middle"),
    pytest.param([-1, -1], id="all-padding"),
    pytest.param([0, -1], id="real-slot-0-with-padding"),
])
def test_capture_safe_write_equals_a_per_token_reference(slots):
    """write(check=False) (no host reads, fixed shapes) stores exactly what a per-token loop stores."""
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, heads, dim = 4, 8, 2, 4
    key_cache, value_cache = torch.randn(2, num_blocks, block_size, heads, dim, generator=gen).unbind(0)
    key, value = torch.randn(2, len(slots), heads, dim, generator=gen).unbind(0)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    for i, slot in enumerate(slots):  # independent reference: skip padding, store the rest
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[i]
            expected_v[slot // block_size, slot % block_size] = value[i]
    layouts.write(key, value, key_cache, value_cache, torch.tensor(slots), check=False)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


# --------------------------------------------------------------------------- fp8 caches
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def reference_fp8_codes(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Independent of torch's float->fp8 cast: the uint8 code of the representable value nearest to
    ``x / scale`` (fp32 division, as vLLM's writer), ties to the even code, beyond the largest finite
    value saturated to it (``__NV_SATFINITE``). Decoding the 256 codes is exact."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).to(torch.float64)
    finite = torch.isfinite(values)
    codes, values = codes[finite], values[finite]
    top = values.abs().max()
    target = (x.float() / scale).to(torch.float64).flatten().clamp(-top, top)
    distance = (target[:, None] - values[None, :]).abs()
    best = distance.min(dim=1, keepdim=True).values
    ties = distance == best
    # among equally near codes (ties, and +0/-0), the even mantissa wins; then the code matching x's sign
    even = (codes % 2 == 0)[None, :]
    sign_ok = (codes >= 128)[None, :] == torch.signbit(target)[:, None]
    score = ties.to(torch.int32) * 4 + (ties & even).to(torch.int32) * 2 + (ties & sign_ok).to(torch.int32)
    return codes[score.argmax(dim=1)].view(x.shape)


@pytest.mark.parametrize("name", list(FP8))
@pytest.mark.parametrize("scale", [1.0, 0.05, 3.7], ids=["scale-1", "scale-0.05", "scale-3.7"])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fp8_quantisation_matches_a_nearest_even_saturating_reference(name, scale, src):
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(4000, generator=gen) * 30, torch.tensor([0.0, -0.0, 1e9, -1e9, 448.0, 449.0, 57344.0])]).to(src)
    got = layouts.quantise_fp8(x, scale, FP8[name]).view(torch.uint8)
    assert torch.equal(got, reference_fp8_codes(x, scale, FP8[name]))


def reference_fp8_codes_toward_zero(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Independent of torch's casts: vLLM's CPU writer's rule as its source states it, on the 256
    decoded codes in float64: ``v = x * (1 / scale)`` (fp32), clamped to the largest finite value
    (NaN -> +max), then the code of largest magnitude not above ``|v|`` with ``v``'s sign; ``+0`` for
    ``v == 0`` (either sign), ``-0`` for a negative ``v`` below the smallest subnormal."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).to(torch.float64)
    finite = torch.isfinite(values)
    codes, values = codes[finite], values[finite]
    top = values.abs().max()
    v = (x.float() * (1.0 / scale)).to(torch.float64).flatten()
    v = torch.where(torch.isnan(v), top, v.clamp(-top, top))
    negative_code = (codes >= 128)[None, :]
    fits = (values.abs()[None, :] <= v.abs()[:, None]) & (negative_code == (v < 0)[:, None])
    best = torch.where(fits, values.abs()[None, :], -1.0).argmax(dim=1)     # largest fitting magnitude
    out = codes[best]
    return torch.where(v == 0, torch.zeros_like(out), out).view(x.shape)


@pytest.mark.parametrize("name", list(FP8))
@pytest.mark.parametrize("scale", [1.0, 0.05, 0.37, 3.7], ids=["scale-1", "scale-0.05", "scale-0.37", "scale-3.7"])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cpu_fp8_quantisation_matches_a_toward_zero_saturating_reference(name, scale, src):
    gen = torch.Generator().manual_seed(6)
    magnitudes = torch.exp2(torch.empty(4000).uniform_(-22, 18, generator=gen)) * scale   # subnormals .. saturation
    x = torch.cat([magnitudes * torch.randn(4000, generator=gen).sign(),
                   torch.tensor([0.0, -0.0, 1e9, -1e9, 448.0, 449.0, 57344.0, float("nan"), float("inf"), -1e-30])])
    x = x.to(src)
    got = layouts.quantise_fp8_toward_zero(x, scale, FP8[name]).view(torch.uint8)
    assert torch.equal(got, reference_fp8_codes_toward_zero(x, scale, FP8[name]))
    assert not torch.equal(got, layouts.quantise_fp8(x, scale, FP8[name]).view(torch.uint8)), "the two rules coincide here"


@pytest.mark.parametrize("backend, layout, rounding", [
    pytest.param("CPU_ATTN", "cpu-packed", "toward-zero", id="CPU_ATTN-truncates"),
    pytest.param("FLASH_ATTN", "packed", "nearest", id="FLASH_ATTN-rounds-to-nearest"),
])
def test_write_kv_cache_quantises_as_the_backends_own_writer(monkeypatch, backend, layout, rounding):
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", f"{backend}={layout}")
    compat.reset_for_tests()
    try:
        gen = torch.Generator().manual_seed(12)
        cache = torch.zeros(B, H, N, 2 * D, dtype=torch.uint8)
        key, value = (torch.randn(2, 2, H, D, generator=gen) * 40).unbind(0)
        compat.write_kv_cache(key, value, cache, torch.tensor([1, N + 2]), head_size=D, backend=backend, isa="vec",
                              kv_cache_dtype="fp8", k_scale=torch.tensor(0.37), v_scale=torch.tensor(1.5))
        k_view, v_view = compat.kv_cache_views(cache, head_size=D, backend=backend, isa="vec", kv_cache_dtype="fp8")
        reference = reference_fp8_codes_toward_zero if rounding == "toward-zero" else reference_fp8_codes
        assert torch.equal(k_view[1 // N, 1 % N].view(torch.uint8), reference(key[0], 0.37, torch.float8_e4m3fn))
        assert torch.equal(v_view[(N + 2) // N, 2].view(torch.uint8), reference(value[1], 1.5, torch.float8_e4m3fn))
    finally:
        compat.reset_for_tests()


@pytest.mark.parametrize("check", [True, False], ids=["checked", "capture-safe"])
@pytest.mark.parametrize("layout", [KVLayout.PACKED, KVLayout.BLOCKS_FIRST, KVLayout.CPU_PACKED], ids=lambda l: l.value)
@pytest.mark.parametrize("name", list(FP8))
def test_fp8_writes_quantise_into_the_uint8_cache_through_typed_views(name, layout, check):
    gen = torch.Generator().manual_seed(9)
    shape = {KVLayout.PACKED: (B, H, N, 2 * D), KVLayout.CPU_PACKED: (B, H, N, 2 * D), KVLayout.BLOCKS_FIRST: (B, 2, N, H, D)}[layout]
    cache = torch.zeros(shape, dtype=torch.uint8)
    typed = layouts.typed_cache(cache, name if name != "fp8_e4m3" else "fp8")  # vLLM's "fp8" is e4m3
    assert typed.dtype == FP8[name] and typed.data_ptr() == cache.data_ptr()
    k_view, v_view = layouts.views(layout, typed, D, isa="vec")
    key, value = torch.randn(2, 3, H, D, generator=gen).unbind(0)
    k_scale, v_scale = torch.tensor(0.25), torch.tensor(2.0)  # 0-d fp32, as the layer keeps them
    slots = torch.tensor([N + 3, -1, 2 * N])
    layouts.write(key, value, k_view, v_view, slots, check=check, k_scale=k_scale, v_scale=v_scale)
    k_bytes, v_bytes = (v.view(torch.uint8) for v in (k_view, v_view))
    for i, slot in ((0, N + 3), (2, 2 * N)):
        assert torch.equal(k_bytes[slot // N, slot % N], reference_fp8_codes(key[i], 0.25, FP8[name]))
        assert torch.equal(v_bytes[slot // N, slot % N], reference_fp8_codes(value[i], 2.0, FP8[name]))
    assert int((k_bytes != 0).sum()) <= 2 * H * D, "nothing written for the padding slot"


def test_fp8_write_without_scales_is_refused():
    k_view, v_view = layouts.views(KVLayout.PACKED, layouts.typed_cache(torch.zeros(B, H, N, 2 * D, dtype=torch.uint8), "fp8"), D)
    with pytest.raises(compat.KVWriteError, match="no scale"):
        layouts.write(torch.zeros(1, H, D), torch.zeros(1, H, D), k_view, v_view, torch.tensor([0]))


def test_typed_cache_refuses_a_non_byte_fp8_cache():
    with pytest.raises(compat.KVWriteError, match="not uint8"):
        layouts.typed_cache(torch.zeros(2, 2), "fp8_e5m2")
    plain = torch.zeros(2, 2)
    assert layouts.typed_cache(plain, "auto") is plain
