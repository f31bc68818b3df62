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


@pytest.mark.parametrize("features, reason", [
    pytest.param(LayerFeatures(sliding_window=512), "sliding window 512", id="window"),
    pytest.param(LayerFeatures(logits_soft_cap=50.0), "logits soft-cap 50.0", id="soft-cap"),
    pytest.param(LayerFeatures(has_sinks=True), "attention sinks", id="sinks"),
    pytest.param(LayerFeatures(kv_cache_dtype="fp8_e4m3"), "quantised KV cache (fp8_e4m3)", id="fp8"),
    pytest.param(LayerFeatures(alibi=True), "ALiBi", id="alibi"),
    pytest.param(LayerFeatures(kv_sharing=True), "KV sharing", id="kv-sharing"),
    pytest.param(LayerFeatures(attn_type="encoder"), "attention type encoder", id="encoder"),
    pytest.param(LayerFeatures(mla=True), "MLA", id="mla"),
])
def test_each_refusal_is_named(features, reason):
    assert support.unsupported(features) == (reason,)


def test_refusals_combine_in_a_fixed_order():
    features = LayerFeatures(sliding_window=128, has_sinks=True)
    assert support.unsupported(features) == ("sliding window 128", "attention sinks")
