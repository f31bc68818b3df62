"""sparse_attn.kernels.support: the kernels' answer per layer feature, read by attribute name
from any object shaped like compat.model.LayerFeatures (the real one is used here)."""

from __future__ import annotations

import pytest

from compat.model import LayerFeatures
from sparse_attn.kernels import support


def test_plain_decoder_attention_is_served():
    assert support.unsupported(LayerFeatures()) == ()


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16", "float32"])
def test_unquantised_caches_are_served(dtype):
    assert support.unsupported(LayerFeatures(kv_cache_dtype=dtype)) == ()


@pytest.mark.parametrize("features", [
    pytest.param(LayerFeatures(sliding_window=512), id="window"),
    pytest.param(LayerFeatures(logits_soft_cap=50.0), id="soft-cap"),
    pytest.param(LayerFeatures(has_sinks=True), id="sinks"),
    pytest.param(LayerFeatures(kv_cache_dtype="fp8_e4m3"), id="fp8-e4m3"),
    pytest.param(LayerFeatures(kv_cache_dtype="fp8_e5m2"), id="fp8-e5m2"),
    pytest.param(LayerFeatures(sliding_window=128, logits_soft_cap=30.0, has_sinks=True, kv_cache_dtype="fp8_e4m3"),
                 id="all-four"),
])
def test_the_features_real_models_have_are_served(features):
    assert support.unsupported(features) == ()


@pytest.mark.parametrize("features, reason", [
    pytest.param(LayerFeatures(kv_cache_dtype="fp8_inc"), "quantised KV cache (fp8_inc)", id="fp8-inc"),
    pytest.param(LayerFeatures(alibi=True), "ALiBi", id="alibi"),
    pytest.param(LayerFeatures(kv_sharing=True), "KV sharing", id="kv-sharing"),
    pytest.param(LayerFeatures(attn_type="encoder"), "attention type encoder", id="encoder"),
    pytest.param(LayerFeatures(attn_type="encoder_decoder"), "attention type encoder_decoder", id="cross"),
    pytest.param(LayerFeatures(mla=True), "MLA", id="mla"),
])
def test_each_refusal_is_named(features, reason):
    assert support.unsupported(features) == (reason,)


def test_refusals_combine_in_a_fixed_order():
    features = LayerFeatures(sliding_window=128, alibi=True, kv_sharing=True)
    assert support.unsupported(features) == ("ALiBi", "KV sharing")


@pytest.fixture
def none_served(monkeypatch):
    monkeypatch.setattr(support, "SERVED", {k: False for k in support.SERVED})


def test_a_feature_switched_off_is_refused_by_name(none_served):
    features = LayerFeatures(sliding_window=128, logits_soft_cap=50.0, has_sinks=True, kv_cache_dtype="fp8_e5m2")
    assert support.unsupported(features) == (
        "sliding window 128", "logits soft-cap 50.0", "attention sinks", "quantised KV cache (fp8_e5m2)")


# --------------------------------------------------------------------------- spec_for: features -> LayerSpec

@pytest.fixture
def all_served(monkeypatch):
    monkeypatch.setattr(support, "SERVED", {k: True for k in support.SERVED})


def test_served_features_are_accepted_and_mapped(all_served):
    import torch

    features = LayerFeatures(sliding_window=512, logits_soft_cap=50.0, has_sinks=True, kv_cache_dtype="fp8_e4m3")
    assert support.unsupported(features) == ()
    sinks, k_scale, v_scale = torch.zeros(4), torch.tensor(0.5), torch.tensor(2.0)
    spec = support.spec_for(features, scale=0.0625, sink_logits=sinks, k_scale=k_scale, v_scale=v_scale)
    assert (spec.scale, spec.causal, spec.window, spec.soft_cap) == (0.0625, True, 512, 50.0)
    assert spec.sink_logits is sinks and spec.k_scale is k_scale and spec.v_scale is v_scale
    # Scales belong to an fp8 cache only: an unquantised layer ignores vLLM's (1.0) scales.
    plain = support.spec_for(LayerFeatures(), scale=0.1, k_scale=k_scale, v_scale=v_scale)
    assert (plain.k_scale, plain.v_scale, plain.sink_logits, plain.window) == (1.0, 1.0, None, None)
    for other in ("fp8_inc", "nvfp4", "fp8_ds_mla"):
        assert support.unsupported(LayerFeatures(kv_cache_dtype=other)) == (f"quantised KV cache ({other})",)


def test_spec_for_a_served_layer_computes_what_the_reference_says(all_served):
    import torch

    from sparse_attn.kernels import paged_attention

    from .kernel_reference import make_batch, reference

    batch = make_batch([300, 130], [1, 130], 4, 2, 16, 16, seed=2)
    spec = support.spec_for(LayerFeatures(sliding_window=100, logits_soft_cap=5.0, has_sinks=True), scale=0.5,
                            sink_logits=torch.tensor([1.0, -2.0, 0.5, 3.0]))
    out = paged_attention(batch, spec, impl="torch")
    torch.testing.assert_close(out.double(), reference(batch, spec)[0], atol=2e-5, rtol=1e-5)


def test_spec_for_refuses_what_is_not_served():
    with pytest.raises(ValueError, match="ALiBi"):
        support.spec_for(LayerFeatures(alibi=True), scale=0.1)


def test_spec_for_needs_the_sinks_tensor(all_served):
    with pytest.raises(ValueError, match="sinks"):
        support.spec_for(LayerFeatures(has_sinks=True), scale=0.1)
