"""sparse_attn.plugin without vLLM: install over fake attention layers (what stays
native and why, the install summary the stats RPC returns) and logger etiquette."""

from __future__ import annotations

import enum
import logging
import sys
import types

import pytest
import torch

import compat
from compat import model as cmodel
from sparse_attn import plugin
from sparse_attn.adapter import Policy, SparseAttentionMixin
from sparse_attn.stats import WorkerStats


class Attention(torch.nn.Module):
    def __init__(self, impl):
        super().__init__()
        self.impl = impl
        self.isa = "vec"
        self.attn_backend = type("CPUBackend", (), {"get_name": staticmethod(lambda: "CPU_ATTN")})


class Impl:
    def __init__(self, **attrs):
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = 4, 2, 32, 0.125
        self.__dict__.update(attrs)

    def forward(self, *args, **kwargs):
        return "native"


class FinalImpl(Impl):
    def __init_subclass__(cls, **kwargs):
        raise TypeError("no subclasses")


class SelfAttn(torch.nn.Module):
    def __init__(self, impl):
        super().__init__()
        self.attn = Attention(impl)


class Model(torch.nn.Module):
    def __init__(self, impls):
        super().__init__()
        self.layers = torch.nn.ModuleList(SelfAttn(i) for i in impls)


@pytest.fixture(autouse=True)
def fake_vllm(monkeypatch):
    module = types.ModuleType("fake_vllm_attention")
    module.Attention = Attention
    monkeypatch.setitem(sys.modules, "fake_vllm_attention", module)
    monkeypatch.setattr(cmodel, "ATTENTION_CLASS_PATHS", ("fake_vllm_attention:Attention",))
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "CPU_ATTN=cpu-packed")
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "adapter")
    monkeypatch.setattr(plugin, "STATS", WorkerStats())
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


POLICY = Policy(scale_factors={"prefill": 2.0, "decode": 2.0}, stats_interval_s=0)


def test_install_replaces_what_it_can_and_says_why_the_rest_stays_native():
    model = Model([Impl(), Impl(alibi_slopes=torch.ones(4)), FinalImpl(), Impl()])
    summary = plugin.install(model, None, POLICY, rank=1)
    impls = [layer.attn.impl for layer in model.layers]
    assert [isinstance(i, SparseAttentionMixin) for i in impls] == [True, False, False, True]
    assert summary["installed"] == 2 and summary["total"] == 4 and summary["rank"] == 1
    assert summary["backends"] == ["CPU_ATTN"] and summary["layout"] == {"CPU_ATTN": "cpu-packed"}
    assert summary["cache_writer"] == {"CPU_ATTN": "adapter"} and summary["mode"] == "serving"
    (why_window, n1), (why_final, n2) = sorted(summary["native"].items())
    assert (n1, n2) == (1, 1)
    assert "cannot replace the attention impl" in why_window + why_final and "no subclasses" in why_window + why_final
    assert "ALiBi" in why_window + why_final
    snap = plugin.sparsity_stats()
    assert snap["install"] == summary and snap["layers_installed"] == 2 and snap["owner_classes"] == ["SelfAttn"]


def test_strict_mode_refuses_layers_it_cannot_serve(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_STRICT", "1")
    compat.reset_for_tests()
    with pytest.raises(plugin.SparseAttentionStartupError, match="KV sharing"):
        plugin.install(Model([Impl(), Impl(kv_sharing_target_layer_name="layers.0.attn")]), None, POLICY)


def test_summary_groups_sparse_layers_by_the_features_they_use():
    model = Model([Impl(), Impl(kv_cache_dtype="bfloat16"), Impl(kv_cache_dtype="bfloat16"), Impl(sliding_window=(127, 0)),
                   Impl(sliding_window=512, logits_soft_cap=50.0, sinks=torch.zeros(4)),
                   Impl(alibi_slopes=torch.ones(4)), Impl(kv_cache_dtype="fp8")])
    summary = plugin.install(model, None, POLICY)
    assert summary["installed"] == 6
    assert summary["sparse_features"] == {
        "none": 1, "kv_cache_dtype=bfloat16": 2, "sliding_window=128": 1,
        "sliding_window=512, logits_soft_cap=50.0, has_sinks=True": 1, "kv_cache_dtype=fp8_e4m3": 1}
    # fp8 CPU_ATTN pages are served (byte-checked against vLLM's writer in the matrix); ALiBi is not.
    assert summary["native"] == {"ALiBi": 1}
    assert plugin.sparsity_stats()["install"]["sparse_features"] == summary["sparse_features"]


WINDOW_CURVE_SECTION = {"config_groups": {"group_0": {
    "algorithm": "skip_softmax",
    "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 3.0, "b": 2.0},
                               "decode": {"a": 5.0, "b": 2.0}},
    "sliding_window_threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 7.0, "b": 2.0}},
    "target_sparsity": {"prefill": 0.5, "decode": 0.5},
}}}


def _policies(model):
    return [layer.attn.impl._sa_policy for layer in model.layers]


def test_windowed_layers_get_the_window_curve_over_min_of_kv_len_and_window():
    """The checkpoint's window curve serves each windowed layer with its own window as the normaliser
    cap; global layers keep the main curve; a window curve without decode runs windowed decode dense."""
    from sparse_attn.config import parse_sparse_attention_config

    config = parse_sparse_attention_config(WINDOW_CURVE_SECTION)
    base = Policy(scale_factors={p: config.scale_factor(p) for p in ("prefill", "decode")}, stats_interval_s=0)
    model = Model([Impl(), Impl(sliding_window=512), Impl(sliding_window=(127, 0))])
    summary = plugin.install(model, config, base)
    glob, w512, w128 = _policies(model)
    e = 2.718281828459045
    assert glob is base and glob.window is None
    assert (w512.window, w128.window) == (512, 128)
    assert w512.scale_factors["prefill"] == pytest.approx(7.0 * e) and w512.scale_factors["decode"] is None
    assert w512.lambda_for("prefill", 4096) == pytest.approx(7.0 * e / 512)
    assert w128.lambda_for("prefill", 100) == pytest.approx(7.0 * e / 100)
    assert glob.lambda_for("prefill", 4096) == pytest.approx(3.0 * e / 4096)
    assert summary["lambda"] == {"scale / kv_len": 1, "scale_window / min(kv_len, 512)": 1,
                                 "scale_window / min(kv_len, 128)": 1}


def test_a_window_curve_whose_scale_reaches_the_window_is_reported_dense(caplog):
    """scale 700 * e^1 >= 512: lambda = scale / min(kv_len, w) >= 1 at every length, so the windowed
    prefill runs dense; the install says so once per window, with the fix. The 4096-token window and the
    global layer are not affected."""
    from sparse_attn.config import parse_sparse_attention_config

    section = {"config_groups": {"group_0": dict(WINDOW_CURVE_SECTION["config_groups"]["group_0"])}}
    section["config_groups"]["group_0"]["sliding_window_threshold_scale_factor"] = {
        "formula": "a * exp(b * target_sparsity)", "prefill": {"a": 700.0, "b": 2.0}, "decode": {"a": 0.5, "b": 2.0}}
    config = parse_sparse_attention_config(section)
    assert config.never_skip_warnings(32768) == ()  # the config alone cannot see it: it does not know the windows
    base = Policy(scale_factors={p: config.scale_factor(p) for p in ("prefill", "decode")}, stats_interval_s=0)
    with caplog.at_level(logging.WARNING, logger="sparse_attn"):
        summary = plugin.install(Model([Impl(), Impl(sliding_window=512), Impl(sliding_window=512),
                                        Impl(sliding_window=(4095, 0))]), config, base)
    assert summary["window_curve_never_skips"] == {"prefill, window 512": 2}
    (record,) = [r for r in caplog.records if "never skip" in r.getMessage()]
    assert "2 sliding-window layer(s) with a 512-token window never skip a tile in prefill" in record.getMessage()
    assert "Fix: lower target_sparsity" in record.getMessage()


def test_without_a_window_curve_windowed_layers_are_served_as_before():
    from sparse_attn.config import parse_sparse_attention_config

    section = {"config_groups": {"group_0": {k: v for k, v in WINDOW_CURVE_SECTION["config_groups"]["group_0"].items()
                                             if k != "sliding_window_threshold_scale_factor"}}}
    config = parse_sparse_attention_config(section)
    base = Policy(scale_factors={p: config.scale_factor(p) for p in ("prefill", "decode")}, stats_interval_s=0)
    model = Model([Impl(), Impl(sliding_window=512)])
    summary = plugin.install(model, config, base)
    assert all(p is base for p in _policies(model))
    assert summary["lambda"] == {"scale / kv_len": 2}


def test_calibration_counts_windowed_layers_for_the_window_curve():
    counting = Policy(calibration_scales=(1.0, 10.0), stats_interval_s=0)
    model = Model([Impl(), Impl(sliding_window=512)])
    summary = plugin.install(model, None, counting)
    glob, windowed = _policies(model)
    assert (glob.kind, glob.window) == ("global", None)
    assert (windowed.kind, windowed.window) == ("windowed", 512)
    assert summary["lambda"] == {"c / kv_len": 1, "c / min(kv_len, 512)": 1}


def _layer_with_backend(name):
    layer = SelfAttn(Impl())
    layer.attn.attn_backend = type("B", (), {"get_name": staticmethod(lambda: name)})
    return layer


def test_every_reason_a_layer_stays_native_is_joined_in_one_place():
    model = Model([Impl(num_heads=5), Impl(sliding_window=-7), Impl(alibi_slopes=torch.ones(4), attn_type="encoder")])
    model.layers.append(_layer_with_backend("FOO_ATTN"))
    summary = plugin.install(model, None, POLICY)
    assert summary["installed"] == 0 and summary["total"] == 4
    assert summary["native"] == {
        "5 query heads are not a multiple of 2 KV heads": 1,
        "sliding_window -7 is a window spelling compat does not know": 1,
        "ALiBi, attention type encoder": 1,
        f"backend FOO_ATTN is not served (served: {', '.join(compat.probe().backends)})": 1,
    }
    assert not any(isinstance(layer.attn.impl, SparseAttentionMixin) for layer in model.layers)


def test_the_kernels_limits_keep_a_layer_native_with_their_reason(monkeypatch):
    """Head size 512: the torch CPU kernel takes it, the Triton kernel (GPU backends) does not,
    so that layer stays native with the reason instead of failing at its first forward."""
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "CPU_ATTN=cpu-packed,FLASH_ATTN=packed")
    compat.reset_for_tests()
    model = Model([Impl(head_size=512), Impl(head_size=256)])
    model.layers.append(_layer_on("FLASH_ATTN", Builder))
    model.layers.append(_layer_on("FLASH_ATTN", Builder))
    model.layers[2].attn.impl.head_size = 512
    model.layers[3].attn.impl.head_size = 256
    summary = plugin.install(model, None, POLICY)
    assert [isinstance(layer.attn.impl, SparseAttentionMixin) for layer in model.layers] == [True, True, False, True]
    assert summary["native"] == {"head size 512 on cuda (the Triton kernel takes head sizes <= 256)": 1}


CGSupport = enum.Enum("AttentionCGSupport", {"NEVER": 0, "UNIFORM_SINGLE_TOKEN_DECODE": 1, "UNIFORM_BATCH": 2, "ALWAYS": 3})


class Builder:
    """A metadata builder with a build and a CUDA-graph declaration, as vLLM's have."""

    _cudagraph_support = CGSupport.UNIFORM_BATCH

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return types.SimpleNamespace()

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        return cls._cudagraph_support


def _layer_on(name, builder):
    layer = SelfAttn(Impl())
    layer.attn.attn_backend = type("B", (), {"get_name": staticmethod(lambda: name),
                                             "get_builder_cls": staticmethod(lambda: builder)})
    return layer


def test_install_twice_then_uninstall_restores_the_native_classes(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "CPU_ATTN=cpu-packed,FLASHINFER=packed")
    compat.reset_for_tests()
    flashinfer_builder = type("FlashInferBuilder", (Builder,), {})
    own_build, own_declaration = vars(Builder)["build"], vars(Builder)["get_cudagraph_support"]
    model = Model([Impl()])
    model.layers.append(_layer_on("CPU_ATTN", Builder))
    model.layers.append(_layer_on("FLASHINFER", flashinfer_builder))
    first = plugin.install(model, None, POLICY)
    assert Builder.get_cudagraph_support(None, None).name == "UNIFORM_SINGLE_TOKEN_DECODE", "declaration patched"
    assert getattr(flashinfer_builder.build, "_sparse_attn_capture", False), "batch capture patched"
    again = Policy(scale_factors={"prefill": 5.0, "decode": 5.0}, stats_interval_s=0)
    second = plugin.install(model, None, again)  # no MRO TypeError, and the summary is true
    assert first["installed"] == second["installed"] == 3 and second["native"] == {}
    for layer in model.layers:
        impl = layer.attn.impl
        assert impl._sa_policy is again and [c for c in type(impl).__mro__ if c is SparseAttentionMixin] == [SparseAttentionMixin]
    assert plugin.uninstall(model) == 3
    assert [type(layer.attn.impl) for layer in model.layers] == [Impl, Impl, Impl]
    assert not any(k.startswith("_sa_") for layer in model.layers for k in vars(layer.attn.impl))
    assert vars(Builder)["build"] is own_build and vars(Builder)["get_cudagraph_support"] is own_declaration
    assert "build" not in vars(flashinfer_builder) and "get_cudagraph_support" not in vars(flashinfer_builder)
    assert Builder.get_cudagraph_support(None, None).name == "UNIFORM_BATCH"
    assert plugin.sparsity_stats()["install"]["installed"] == 0


def test_a_second_install_that_leaves_a_layer_native_really_runs_it_native():
    model = Model([Impl(), Impl()])
    plugin.install(model, None, POLICY)
    config = types.SimpleNamespace(matches=lambda name, classes: name.startswith("layers.0."),
                                   group=types.SimpleNamespace(targets=("re:layers.0",)))
    summary = plugin.install(model, config, POLICY)
    assert summary["installed"] == 1 and summary["native"] == {plugin.NOT_TARGETED: 1}
    assert [isinstance(layer.attn.impl, SparseAttentionMixin) for layer in model.layers] == [True, False]


def test_register_probes_nothing_and_imports_no_worker(monkeypatch):
    from compat import worker as cworker

    monkeypatch.setattr(cworker, "WORKER_CLASS_PATHS", ("fake_vllm_unimported_worker:Worker",))
    monkeypatch.setattr(compat, "run_probe", lambda: pytest.fail("register() must not probe"))
    plugin.register()
    assert "fake_vllm_unimported_worker" not in sys.modules
    assert compat._report is None and cworker.hook_state()["hooked"] is None


def test_register_fails_on_a_bad_variable_with_its_fix(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "sometimes")
    compat.reset_for_tests()
    with pytest.raises(compat.InvalidOverrideError, match="SPARSE_ATTN_CACHE_WRITER"):
        plugin.register()


def test_disable_is_the_way_out_even_with_a_bad_variable(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "sometimes")
    monkeypatch.setenv("SPARSE_ATTN_DISABLE", "1")
    compat.reset_for_tests()
    plugin.register()
    from compat import worker as cworker

    assert cworker.hook_state()["hooked"] is None


@pytest.fixture
def clean_loggers():
    saved = {}
    for name in ("sparse_attn", "compat", ""):
        log = logging.getLogger(name)
        saved[name] = (list(log.handlers), log.level, log.propagate)
        log.handlers = []
    yield
    for name, (handlers, level, propagate) in saved.items():
        log = logging.getLogger(name)
        log.handlers, log.level, log.propagate = handlers, level, propagate


def test_logging_gets_a_handler_only_where_nothing_would_print(clean_loggers):
    logging.getLogger().handlers = []  # pytest's capture handler joins the root logger after fixtures
    plugin._log_to_stderr()
    for name in ("sparse_attn", "compat"):
        log = logging.getLogger(name)
        assert len(log.handlers) == 1 and log.level == logging.INFO and log.propagate
    plugin._log_to_stderr()
    assert len(logging.getLogger("sparse_attn").handlers) == 1, "idempotent"


def test_logging_configured_by_the_application_is_left_alone(clean_loggers):
    logging.getLogger().handlers = [logging.NullHandler()]  # e.g. logging.basicConfig() in the user's process
    logging.getLogger("compat").setLevel(logging.WARNING)
    plugin._log_to_stderr()
    for name, level in (("sparse_attn", logging.NOTSET), ("compat", logging.WARNING)):
        log = logging.getLogger(name)
        assert log.handlers == [] and log.level == level and log.propagate


def test_summary_says_which_cpu_kernel_serves(monkeypatch, tmp_path):
    from sparse_attn.kernels import cpu_impl

    model = Model([Impl()])
    model.weight = torch.nn.Parameter(torch.zeros(1))  # on the CPU
    monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL", "torch")
    compat.reset_for_tests()
    assert plugin.install(model, None, POLICY)["cpu_kernel"] == "torch (SPARSE_ATTN_CPU_KERNEL=torch)"
    # auto without a compiler (and an empty cache): the torch kernel, and the summary says why
    monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL", "auto")
    monkeypatch.setenv("SPARSE_ATTN_CPU_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nowhere/c++")
    monkeypatch.setattr(cpu_impl, "_state", {})
    monkeypatch.setattr(cpu_impl, "_warned", set())
    compat.reset_for_tests()
    kernel = plugin.install(Model([Impl()]), None, POLICY)["cpu_kernel"]
    assert kernel is None  # no weights on the CPU: no CPU kernel to name
    kernel = plugin.install(model, None, POLICY)["cpu_kernel"]
    assert kernel.startswith("torch (compiled kernel unavailable: ") and "/nowhere/c++" in kernel


@pytest.mark.parametrize("setting,pairs,dtype,kv_dtype,expected", [
    ("auto", True, torch.bfloat16, "auto", ("own", "auto: bf16 pair products on CPU")),
    ("auto", True, torch.bfloat16, "fp8", ("native", "auto")),
    ("auto", False, torch.bfloat16, "auto", ("native", "auto")),
    ("auto", True, torch.float32, "auto", ("native", "auto")),
    ("native", True, torch.bfloat16, "auto", ("native", "SPARSE_ATTN_DENSE_STEPS=native")),
    ("own", False, torch.float32, "auto", ("own", "SPARSE_ATTN_DENSE_STEPS=own")),
], ids=["auto-bf16-pairs", "auto-fp8-cache", "auto-bf16-no-pairs", "auto-fp32", "pinned-native", "pinned-own"])
def test_steps_that_cannot_skip_run_where_dense_is_fastest(monkeypatch, setting, pairs, dtype, kv_dtype, expected):
    """plugin.dense_steps joins the model's device and dtype, the layer's cache dtype and the kernel's pair products
    (cpu_impl.bf16_prefill_on_pairs, tested against the library in test_kernels_cpu) into each layer's policy, and the
    summary says which and why."""
    from sparse_attn.kernels import cpu_impl

    heads_seen = []
    monkeypatch.setattr(cpu_impl, "bf16_prefill_on_pairs", lambda head_size: heads_seen.append(head_size) or pairs)
    monkeypatch.setenv("SPARSE_ATTN_DENSE_STEPS", setting)
    compat.reset_for_tests()
    model = Model([Impl(kv_cache_dtype=kv_dtype), Impl(kv_cache_dtype=kv_dtype)])
    model.weight = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
    summary = plugin.install(model, None, POLICY)
    where, why = expected
    assert summary["dense_steps"] == {f"{where} ({why})": 2}
    assert [p.dense_native for p in _policies(model)] == [where == "native"] * 2
    assert set(heads_seen) <= {32}


def test_a_bad_dense_steps_value_fails_with_the_choices(monkeypatch):
    monkeypatch.setenv("SPARSE_ATTN_DENSE_STEPS", "fast")
    compat.reset_for_tests()
    with pytest.raises(ValueError, match="auto, native, own"):
        plugin.install(Model([Impl()]), None, POLICY)
