"""compat.graphs with fake backends shaped like vLLM's (no vLLM needed).

The fakes copy the declaration shapes read in the releases: the base builder's classmethod returning the
class attribute ``_cudagraph_support`` (FlashAttention overrides it the same way), and a classmethod that
answers per config (FlashInfer). That the real builders answer the same way after install is proven per
release in tests/matrix/test_graph_contract.py.
"""

from __future__ import annotations

import enum
import logging
import types

import pytest

import compat
from compat import envs, graphs
from compat.__main__ import render
from compat.probe import BackendReport, CompatReport


class CGSupport(enum.Enum):
    """Stand-in for vLLM's AttentionCGSupport (its own enum type: the wrapper must return this type)."""

    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


def make_backend(name: str, builder: type) -> type:
    return type(f"{name.title()}Backend", (), {
        "get_name": staticmethod(lambda: name),
        "get_builder_cls": staticmethod(lambda: builder),
    })


def fresh_classes():
    """A new class family per test, so installs never leak between tests."""

    class BaseBuilder:
        _cudagraph_support = CGSupport.NEVER

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            return cls._cudagraph_support

    class StaticBuilder(BaseBuilder):  # FlashAttention: attribute set at import, classmethod returns it
        _cudagraph_support = CGSupport.ALWAYS

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            return cls._cudagraph_support

    class ConfigBuilder(BaseBuilder):  # FlashInfer: decided per config when vLLM calls it
        calls = 0

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            cls.calls += 1
            if vllm_config.parallel_config.decode_context_parallel_size > 1:
                return CGSupport.UNIFORM_SINGLE_TOKEN_DECODE
            if vllm_config.attention_config.use_non_causal:
                return CGSupport.NEVER
            return CGSupport.UNIFORM_BATCH

    class InheritingBuilder(BaseBuilder):  # CPU_ATTN: no override, base default NEVER
        pass

    return types.SimpleNamespace(Base=BaseBuilder, Static=StaticBuilder, Config=ConfigBuilder, Inheriting=InheritingBuilder)


def config(dcp: int = 1, non_causal: bool = False):
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(decode_context_parallel_size=dcp),
                                 attention_config=types.SimpleNamespace(use_non_causal=non_causal))


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("SPARSE_ATTN_CUDAGRAPH", raising=False)
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


@pytest.fixture
def cls():
    return fresh_classes()


# Hand-written from the rule min(native, UNIFORM_SINGLE_TOKEN_DECODE), not computed by the code.
MIN_RULE = [
    pytest.param(CGSupport.ALWAYS, "UNIFORM_SINGLE_TOKEN_DECODE", id="always-to-decode"),
    pytest.param(CGSupport.UNIFORM_BATCH, "UNIFORM_SINGLE_TOKEN_DECODE", id="uniform-batch-to-decode"),
    pytest.param(CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, "UNIFORM_SINGLE_TOKEN_DECODE", id="decode-stays"),
    pytest.param(CGSupport.NEVER, "NEVER", id="never-stays-never"),
]


@pytest.mark.parametrize("native, expected", MIN_RULE)
def test_static_declaration_min_rule(cls, native, expected):
    cls.Static._cudagraph_support = native
    backend = make_backend("FLASH_ATTN", cls.Static)
    probed = graphs.decide(backend)
    assert (probed.declared_by, probed.native, probed.sparse, probed.source, probed.installed) == (
        "class-attribute", native.name, expected, "probe", False)
    assert "StaticBuilder._cudagraph_support = " + native.name in probed.detail

    decision = graphs.restrict_cudagraph_support(backend)
    assert decision.installed and decision.sparse == expected
    got = cls.Static.get_cudagraph_support(config(), object())
    assert got is CGSupport[expected]  # the release's own enum member, not compat's GraphLevel


@pytest.mark.parametrize("cfg, native, expected", [
    pytest.param(config(), CGSupport.UNIFORM_BATCH, CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, id="trtllm-like-uniform-batch"),
    pytest.param(config(dcp=2), CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, id="dcp-decode"),
    pytest.param(config(non_causal=True), CGSupport.NEVER, CGSupport.NEVER, id="config-says-never"),
])
def test_config_dependent_native_is_capped_at_call_time(cls, cfg, native, expected):
    backend = make_backend("FLASHINFER", cls.Config)
    probed = graphs.decide(backend)
    assert (probed.declared_by, probed.native, probed.sparse) == ("classmethod", None, None)
    assert cls.Config.calls == 0  # the probe never calls the release's declaration
    assert cls.Config.get_cudagraph_support(cfg, None) is native  # before install: native
    graphs.restrict_cudagraph_support(backend)
    assert cls.Config.get_cudagraph_support(cfg, None) is expected
    assert cls.Config.calls == 2  # the native answer is recomputed on every vLLM call


def test_call_through_instance_like_v2_runner(cls):
    # The v2 runner calls builder.get_cudagraph_support(...) on a builder instance.
    graphs.restrict_cudagraph_support(make_backend("FLASHINFER", cls.Config))
    assert cls.Config().get_cudagraph_support(config(), None) is CGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_install_is_idempotent(cls):
    backend = make_backend("FLASH_ATTN", cls.Static)
    first = graphs.restrict_cudagraph_support(backend)
    wrapper = vars(cls.Static)["get_cudagraph_support"]
    second = graphs.restrict_cudagraph_support(backend)
    assert second is first
    assert vars(cls.Static)["get_cudagraph_support"] is wrapper  # not wrapped twice
    assert cls.Static.get_cudagraph_support(config(), None) is CGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert dict(graphs.installed()) == {"FLASH_ATTN": first}


def test_backends_not_installed_are_untouched(cls):
    class SubOfStatic(cls.Static):  # another backend's builder inheriting the installed one's method
        _cudagraph_support = CGSupport.ALWAYS

    class SuperCaller(cls.Config):  # overrides and calls super(), like vLLM's ROCm DeepSeek builders
        @classmethod
        def get_cudagraph_support(cls_, vllm_config, kv_cache_spec):
            return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    graphs.restrict_cudagraph_support(make_backend("FLASH_ATTN", cls.Static))
    graphs.restrict_cudagraph_support(make_backend("FLASHINFER", cls.Config))
    assert SubOfStatic.get_cudagraph_support(config(), None) is CGSupport.ALWAYS
    assert SuperCaller.get_cudagraph_support(config(), None) is CGSupport.UNIFORM_BATCH
    assert cls.Base.get_cudagraph_support(config(), None) is CGSupport.NEVER
    assert "get_cudagraph_support" not in vars(SubOfStatic)
    assert set(graphs.installed()) == {"FLASH_ATTN", "FLASHINFER"}


def test_inherited_declaration_is_wrapped_and_restored(cls):
    cls.Inheriting._cudagraph_support = CGSupport.UNIFORM_BATCH
    decision = graphs.restrict_cudagraph_support(make_backend("CPU_ATTN", cls.Inheriting))
    assert (decision.declared_by, decision.native, decision.sparse) == ("class-attribute", "UNIFORM_BATCH", "UNIFORM_SINGLE_TOKEN_DECODE")
    assert cls.Inheriting.get_cudagraph_support(config(), None) is CGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    compat.reset_for_tests()
    assert "get_cudagraph_support" not in vars(cls.Inheriting)
    assert cls.Inheriting.get_cudagraph_support(config(), None) is CGSupport.UNIFORM_BATCH


def test_reset_restores_own_declaration(cls):
    original = vars(cls.Config)["get_cudagraph_support"]
    graphs.restrict_cudagraph_support(make_backend("FLASHINFER", cls.Config))
    compat.reset_for_tests()
    assert vars(cls.Config)["get_cudagraph_support"] is original
    assert cls.Config.get_cudagraph_support(config(), None) is CGSupport.UNIFORM_BATCH
    assert dict(graphs.installed()) == {}


@pytest.mark.parametrize("value, native, expected, source", [
    pytest.param("never", CGSupport.ALWAYS, "NEVER", "env", id="never-from-always"),
    pytest.param("never", CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, "NEVER", "env", id="never-from-decode"),
    pytest.param("decode", CGSupport.UNIFORM_BATCH, "UNIFORM_SINGLE_TOKEN_DECODE", "env", id="decode-pinned"),
    pytest.param("decode", CGSupport.NEVER, "NEVER", "env", id="decode-never-above-native"),
    pytest.param("auto", CGSupport.ALWAYS, "UNIFORM_SINGLE_TOKEN_DECODE", "probe", id="auto-explicit"),
])
def test_env_override(cls, monkeypatch, value, native, expected, source):
    monkeypatch.setenv("SPARSE_ATTN_CUDAGRAPH", value)
    envs.reset_for_tests()
    cls.Static._cudagraph_support = native
    decision = graphs.restrict_cudagraph_support(make_backend("FLASH_ATTN", cls.Static))
    assert (decision.sparse, decision.source) == (expected, source)
    assert (f"SPARSE_ATTN_CUDAGRAPH={value}" in decision.detail) == (source == "env")
    assert cls.Static.get_cudagraph_support(config(), None) is CGSupport[expected]


def test_env_never_applies_to_config_dependent_answers(cls, monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_CUDAGRAPH", "never")
    envs.reset_for_tests()
    graphs.restrict_cudagraph_support(make_backend("FLASHINFER", cls.Config))
    assert cls.Config.get_cudagraph_support(config(), None) is CGSupport.NEVER


def test_env_bad_value_lists_choices(cls, monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_CUDAGRAPH", "full")
    envs.reset_for_tests()
    with pytest.raises(compat.InvalidOverrideError) as info:
        graphs.decide(make_backend("FLASH_ATTN", cls.Static))
    assert "SPARSE_ATTN_CUDAGRAPH" in str(info.value) and "auto, decode, never" in str(info.value)


def test_absent_declaration_is_reported_not_installed(caplog):
    class OldBuilder:
        pass

    backend = make_backend("FLASH_ATTN", OldBuilder)
    with caplog.at_level(logging.WARNING, logger="compat"):
        decision = graphs.restrict_cudagraph_support(backend)
    assert (decision.declared_by, decision.installed, decision.sparse) == ("absent", False, None)
    assert "--enforce-eager" in decision.detail and "--enforce-eager" in caplog.text
    assert not hasattr(OldBuilder, "get_cudagraph_support") and dict(graphs.installed()) == {}


def test_unknown_level_at_call_time_raises_with_fix(cls):
    class Future(enum.Enum):
        PARTIAL = 7

    class FutureBuilder(cls.Base):
        @classmethod
        def get_cudagraph_support(cls_, vllm_config, kv_cache_spec):
            return Future.PARTIAL

    graphs.restrict_cudagraph_support(make_backend("FLASHINFER", FutureBuilder))
    with pytest.raises(compat.CompatError) as info:
        FutureBuilder.get_cudagraph_support(config(), None)
    assert "PARTIAL" in str(info.value) and "SPARSE_ATTN_CUDAGRAPH=never" in str(info.value)


def test_call_logs_once_per_answer(cls, caplog):
    graphs.restrict_cudagraph_support(make_backend("FLASHINFER", cls.Config))
    with caplog.at_level(logging.INFO, logger="compat"):
        for _ in range(3):
            cls.Config.get_cudagraph_support(config(), None)
    assert caplog.text.count("FLASHINFER CUDA-graph support UNIFORM_BATCH -> UNIFORM_SINGLE_TOKEN_DECODE") == 1


def test_report_and_cli_show_the_decision(cls):
    decisions = {
        "FLASHINFER": graphs.decide(make_backend("FLASHINFER", cls.Config)),
        "FLASH_ATTN": graphs.decide(make_backend("FLASH_ATTN", cls.Static)),
    }
    report = CompatReport("0.31.0", "vllm", "metadata:vllm", backends={
        name: BackendReport(name, True, graphs=d) for name, d in decisions.items()})
    text = render(report)
    fi = next(line for line in text.splitlines() if line.startswith("cuda graphs FLASHINFER"))
    fa = next(line for line in text.splitlines() if line.startswith("cuda graphs FLASH_ATTN"))
    assert "min(native, UNIFORM_SINGLE_TOKEN_DECODE)" in fi and "ConfigBuilder.get_cudagraph_support" in fi and "[probe]" in fi
    assert "declare UNIFORM_SINGLE_TOKEN_DECODE (native ALWAYS)" in fa and "[probe]" in fa
    as_dict = report.as_dict()["backends"]["FLASH_ATTN"]["graphs"]
    assert (as_dict["declared_by"], as_dict["native"], as_dict["sparse"]) == ("class-attribute", "ALWAYS", "UNIFORM_SINGLE_TOKEN_DECODE")

