"""compat.model.cpu_page_isa against vLLM's own CPU attention ISA choice: a layer whose pages vLLM will pack
for an ISA compat does not read (``amx``: bfloat16 on a CPU with AMX) gets vLLM's ``vec`` pages from its
metadata builder instead (``readable_cpu_pages``; served end to end in tests/engine/test_layer_features.py), or,
where compat may not steer that (``SPARSE_ATTN_CPU_PAGE_ISA=vllm``, no builder), stays native from install,
instead of failing at the first request inside the engine."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]


@pytest.fixture(autouse=True)
def clean():
    import compat

    compat.reset_for_tests()  # the parsed environment and every patch of vLLM, before and after
    yield
    compat.reset_for_tests()


def _loading(monkeypatch, dtype, block_size=128):
    from compat import worker

    config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=dtype),
                                   cache_config=types.SimpleNamespace(block_size=block_size, cache_dtype="auto"))
    monkeypatch.setitem(worker._state, "loading", types.SimpleNamespace(vllm_config=config))


def _layer_and_info(backend=None):
    from compat import model as cmodel

    info = cmodel.LayerInfo(name="model.layers.0.self_attn.attn", owner_class="LlamaAttention", backend="CPU_ATTN",
                            num_heads=9, num_kv_heads=3, head_size=64, scale=0.125, cpu_isa=None,
                            features=cmodel.LayerFeatures())
    layer = types.SimpleNamespace(impl=types.SimpleNamespace(), layer_name=info.name)
    if backend is not None:
        layer.attn_backend = backend
    return layer, info


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_page_isa_is_vllms_own_choice(monkeypatch, dtype):
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from compat import model as cmodel

    _loading(monkeypatch, dtype)
    layer, info = _layer_and_info()
    isa, how = cmodel.cpu_page_isa(layer, info)
    assert isa == cpu_attn._get_attn_isa(dtype, 128, 64) and "at install" in how
    layer.isa = "vec"  # once vLLM has chosen, its choice is read as is
    assert cmodel.cpu_page_isa(layer, info) == ("vec", "the layer's isa")


@pytest.fixture
def amx_bf16(monkeypatch):
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM packs bfloat16 pages for vec here")
    from compat import model as cmodel

    _loading(monkeypatch, torch.bfloat16)
    isa, how = cmodel.cpu_page_isa(*_layer_and_info())
    if isa != "amx":  # a release that picks the ISA elsewhere, or not amx for bf16
        pytest.skip(f"this vLLM's page ISA for bfloat16 at install: {isa} ({how})")


def test_a_layer_vllm_packs_for_amx_gets_vec_pages_from_its_builder(amx_bf16):
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from compat import model as cmodel
    from compat import patches

    builder = cpu_attn.CPUAttentionBackend.get_builder_cls()
    original = builder.__init__
    layer, info = _layer_and_info(cpu_attn.CPUAttentionBackend)
    if not callable(getattr(builder, "_set_isa_to_layers", None)):
        # a release whose builder does not choose the ISA per group (before 0.32): compat cannot steer it
        refused = cmodel.prepare_layer(layer, info).compat_refusal
        assert "does not set the ISA per layer group" in refused and builder.__init__ is original
        return
    try:
        assert cmodel.prepare_layer(layer, info).compat_refusal is None
        assert builder.__init__ is not original and info.name in cmodel._READABLE_PAGE_LAYERS
    finally:
        patches.undo_all("layers")
    assert builder.__init__ is original and not cmodel._READABLE_PAGE_LAYERS


@pytest.mark.parametrize("why", ["env", "no-builder"])
def test_a_layer_vllm_packs_for_amx_stays_native_where_compat_may_not_steer(amx_bf16, monkeypatch, why):
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from compat import model as cmodel

    if why == "env":
        monkeypatch.setenv("SPARSE_ATTN_CPU_PAGE_ISA", "vllm")
        layer, info = _layer_and_info(cpu_attn.CPUAttentionBackend)
    else:
        layer, info = _layer_and_info()
    refused = cmodel.prepare_layer(layer, info)
    assert "'amx'" in refused.compat_refusal and "float32" in refused.compat_refusal
    assert ("SPARSE_ATTN_CPU_PAGE_ISA=vllm" in refused.compat_refusal) == (why == "env")
    assert cpu_attn.CPUAttentionBackend.get_builder_cls().__init__.__module__ != "compat.model"
