"""The CUDA-graph contract against a real vLLM release (tox envs vllm0151 ... vllm0330).

``compat.graphs.restrict_cudagraph_support`` is installed on the release's real FlashInfer and
FlashAttention backend classes; their real ``get_cudagraph_support`` is called the way both model
runners call it (v1: through the builder class; v2: through a builder instance), and the level it
returns is handed to the release's own ``CompilationConfig.resolve_cudagraph_mode_and_sizes`` with
vLLM's GPU default ``FULL_AND_PIECEWISE`` (0.15.1 - 0.19.1, which lack it: the v1 runner's own
``_check_and_update_cudagraph_mode``, see ``resolve_in_v1_runner``).

The native answers on this CPU machine were read from each release's sources
(tests/matrix/FINDINGS.md, "CUDA graphs"): FlashAttention's class attribute is UNIFORM_BATCH without
FA3/FA4 (``get_flash_attn_version()`` is None on CPU); FlashInfer answers UNIFORM_SINGLE_TOKEN_DECODE
without TRTLLM support, except 0.33.0, where a device below SM90 (or none) takes its fa2 native decode
path, UNIFORM_BATCH for causal attention.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (tests/matrix runs in the tox vllm* envs)", allow_module_level=True)

import compat  # noqa: E402
from compat import envs, graphs  # noqa: E402

pytestmark = pytest.mark.vllm

DECODE, BATCH, NEVER = "UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_BATCH", "NEVER"
#: release -> (FLASHINFER causal, FLASHINFER non-causal or None where the config has no such field).
FLASHINFER_NATIVE = {
    "0.15.1": (DECODE, None),
    "0.16.0": (DECODE, None),
    "0.17.1": (DECODE, None),
    "0.18.1": (DECODE, None),
    "0.19.1": (DECODE, None),
    "0.20.2": (DECODE, None),
    "0.21.0": (DECODE, None),
    "0.22.1": (DECODE, None),
    "0.23.0": (DECODE, None),
    "0.24.0": (DECODE, None),
    "0.25.1": (DECODE, None),
    "0.26.0": (DECODE, DECODE),
    "0.27.1": (DECODE, DECODE),
    "0.28.0": (DECODE, DECODE),
    "0.29.0": (DECODE, DECODE),
    "0.30.0": (DECODE, DECODE),
    "0.31.0": (DECODE, DECODE),
    "0.32.0": (DECODE, DECODE),
    "0.33.0": (BATCH, DECODE),
    "0.34.0": (BATCH, DECODE),  # FlashInferMetadataBuilder.get_cudagraph_support unchanged from 0.33.0
}
FLASH_ATTN_NATIVE = BATCH
NUM_HEADS, NUM_KV_HEADS = 8, 2


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("SPARSE_ATTN_CUDAGRAPH", raising=False)
    compat.reset_for_tests()  # also undoes installs: every test starts from the release's own declarations
    yield
    compat.reset_for_tests()


@pytest.fixture(scope="module")
def release():
    version = compat.probe().vllm_version
    if version not in FLASHINFER_NATIVE:
        pytest.fail(f"no CUDA-graph expectations recorded for vLLM {version}: read its sources and add a row")
    return version


@pytest.fixture(scope="module")
def cpu_config():
    from vllm.config import DeviceConfig, VllmConfig

    # Plain VllmConfig() cannot infer a device on this machine (tests/matrix/tools/probe_release.py).
    return VllmConfig(device_config=DeviceConfig(device="cpu"))


class _Heads:
    """``model_config`` stand-in: a real ModelConfig needs a checkpoint; the builders ask it one thing."""

    def get_num_attention_heads(self, parallel_config):
        return NUM_HEADS


class _Config:
    """The real CPU VllmConfig with ``model_config`` (and, for the non-causal case, ``attention_config``) swapped."""

    def __init__(self, real, non_causal: bool):
        self._real = real
        self.model_config = _Heads()
        if non_causal:
            self.attention_config = dataclasses.replace(real.attention_config, use_non_causal=True)

    def __getattr__(self, name):
        return getattr(self._real, name)


def spec():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=NUM_KV_HEADS, head_size=64, dtype=torch.float16)


def backend(name: str) -> type:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def ask(name: str, real_config, non_causal: bool = False, via_instance: bool = False) -> str:
    """The level vLLM's runner would read: v1 calls it on the class, v2 on a builder instance."""
    from vllm.config import set_current_vllm_config

    builder = backend(name).get_builder_cls()
    target = object.__new__(builder) if via_instance else builder
    with set_current_vllm_config(real_config):  # FlashInfer's TRTLLM check reads the current config
        return target.get_cudagraph_support(_Config(real_config, non_causal), spec()).name


def native(name: str, release: str, non_causal: bool = False) -> str | None:
    if name == "FLASH_ATTN":
        return FLASH_ATTN_NATIVE
    return FLASHINFER_NATIVE[release][1 if non_causal else 0]


def min_level(a: str, b: str) -> str:
    order = [NEVER, DECODE, BATCH, "ALWAYS"]
    return order[min(order.index(a), order.index(b))]


class _Dispatcher:
    """``CudagraphDispatcher`` stand-in: records the keys the runner initialises after resolving."""

    def __init__(self):
        self.calls = []

    def initialize_cudagraph_keys(self, mode, uniform_decode_query_len):
        self.calls.append((mode, uniform_decode_query_len))


def resolve_in_v1_runner(real_config, compilation, query_len):
    """0.15.1-0.19.1: the release's own ``GPUModelRunner._check_and_update_cudagraph_mode`` on a stand-in runner.

    Those releases resolve inline in the v1 runner (``CompilationConfig.resolve_cudagraph_mode_and_sizes`` exists from
    0.20.2). The runner module cannot be imported here (it imports the n-gram proposer, hence numba, which the CPU
    closure lacks), so the method is compiled from the installed module's own source text; it asks the real builders
    itself (``builder_cls.get_cudagraph_support(self.vllm_config, spec)``) and takes the minimum, as it does on a GPU.
    """
    import ast
    import logging
    import types
    from pathlib import Path

    from vllm.config import set_current_vllm_config
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    source = Path(importlib.util.find_spec("vllm.v1.worker.gpu_model_runner").origin).read_text()
    runner_cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
    method = next(n for n in runner_cls.body if isinstance(n, ast.FunctionDef) and n.name == "_check_and_update_cudagraph_mode")
    for arg in method.args.args:
        arg.annotation = None  # names the module imports only for typing
    method.returns = None
    namespace = {"AttentionCGSupport": AttentionCGSupport, "CUDAGraphMode": CUDAGraphMode,
                 "CompilationMode": CompilationMode, "MambaSpec": MambaSpec, "logger": logging.getLogger("vllm")}
    exec(compile(ast.Module([method], type_ignores=[]), "gpu_model_runner.py", "exec"), namespace)
    runner = types.SimpleNamespace(
        vllm_config=_Config(real_config, non_causal=False), compilation_config=compilation,
        parallel_config=real_config.parallel_config, uniform_decode_query_len=query_len, speculative_config=None,
        kv_cache_config=None, cudagraph_batch_sizes=[], cudagraph_dispatcher=_Dispatcher(),
    )
    groups = [KVCacheGroupSpec(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=spec())]
    with set_current_vllm_config(real_config):
        namespace["_check_and_update_cudagraph_mode"](runner, [{backend("FLASHINFER"), backend("FLASH_ATTN")}], groups)
    resolved = compilation.cudagraph_mode
    assert runner.cudagraph_dispatcher.calls == [(resolved, query_len)]
    return resolved


CASES = [
    pytest.param("FLASHINFER", False, id="flashinfer-causal"),
    pytest.param("FLASHINFER", True, id="flashinfer-non-causal"),
    pytest.param("FLASH_ATTN", False, id="flash-attn"),
]


@pytest.mark.parametrize("name, non_causal", CASES)
@pytest.mark.parametrize("via_instance", [False, True], ids=["v1-class-call", "v2-instance-call"])
def test_declared_level_after_install(release, cpu_config, name, non_causal, via_instance):
    expected_native = native(name, release, non_causal)
    if expected_native is None:
        pytest.skip(f"vLLM {release}'s FlashInfer declaration does not read use_non_causal")
    assert ask(name, cpu_config, non_causal, via_instance) == expected_native
    decision = graphs.restrict_cudagraph_support(backend(name))
    assert decision.installed and decision.source == "probe"
    if name == "FLASH_ATTN":
        assert (decision.declared_by, decision.native, decision.sparse) == ("class-attribute", BATCH, DECODE)
    else:
        assert (decision.declared_by, decision.native, decision.sparse) == ("classmethod", None, None)
    assert ask(name, cpu_config, non_causal, via_instance) == min_level(expected_native, DECODE)


@pytest.mark.parametrize("name", ["FLASHINFER", "FLASH_ATTN"])
def test_env_never_declares_never(release, cpu_config, monkeypatch, name):
    monkeypatch.setenv("SPARSE_ATTN_CUDAGRAPH", "never")
    envs.reset_for_tests()
    decision = graphs.restrict_cudagraph_support(backend(name))
    assert (decision.source, decision.cap) == ("env", NEVER)
    assert ask(name, cpu_config) == NEVER


@pytest.mark.parametrize("installed, untouched", [
    pytest.param("FLASHINFER", "FLASH_ATTN", id="flashinfer-leaves-flash-attn"),
    pytest.param("FLASH_ATTN", "FLASHINFER", id="flash-attn-leaves-flashinfer"),
    pytest.param("FLASHINFER", "CPU_ATTN", id="flashinfer-leaves-cpu-attn"),
])
def test_backend_not_installed_is_untouched(release, cpu_config, installed, untouched):
    builder = backend(untouched).get_builder_cls()
    before_attrs = dict(vars(builder))
    before = ask(untouched, cpu_config)
    graphs.restrict_cudagraph_support(backend(installed))
    assert dict(vars(builder)) == before_attrs
    assert ask(untouched, cpu_config) == before
    assert set(graphs.installed()) == {installed}


@pytest.mark.parametrize("name", ["FLASHINFER", "FLASH_ATTN"])
def test_install_is_idempotent(release, cpu_config, name):
    first = graphs.restrict_cudagraph_support(backend(name))
    wrapper = vars(backend(name).get_builder_cls())["get_cudagraph_support"]
    for _ in range(3):
        assert graphs.restrict_cudagraph_support(backend(name)) is first
    assert vars(backend(name).get_builder_cls())["get_cudagraph_support"] is wrapper
    assert ask(name, cpu_config) == min_level(native(name, release), DECODE)


def test_reset_restores_the_release_declaration(release, cpu_config):
    fi = backend("FLASHINFER").get_builder_cls()
    own = vars(fi)["get_cudagraph_support"]
    graphs.restrict_cudagraph_support(backend("FLASHINFER"))
    assert vars(fi)["get_cudagraph_support"] is not own
    compat.reset_for_tests()
    assert vars(fi)["get_cudagraph_support"] is own
    assert ask("FLASHINFER", cpu_config) == native("FLASHINFER", release)


def test_probe_report_shows_the_decision_for_both_gpu_backends(release):
    report = compat.probe()
    for name in ("FLASHINFER", "FLASH_ATTN"):
        decision = report.backends[name].graphs
        assert decision is not None and decision.source == "probe" and not decision.installed
        assert decision.cap == DECODE and "get_cudagraph_support" in decision.detail
    assert report.backends["FLASH_ATTN"].graphs.declared_by == "class-attribute"
    assert report.backends["FLASHINFER"].graphs.declared_by == "classmethod"


@pytest.mark.parametrize("choice, query_len, mode", [
    pytest.param("auto", 1, "FULL_AND_PIECEWISE", id="decode-keeps-full-decode-graphs"),
    pytest.param("auto", 2, "PIECEWISE", id="spec-decode-drops-to-piecewise"),
    pytest.param("never", 1, "PIECEWISE", id="never-keeps-only-piecewise"),
])
def test_release_resolves_the_mode_from_the_declared_minimum(release, cpu_config, monkeypatch, choice, query_len, mode):
    # What both runners do next: the minimum over backends -> CompilationConfig.resolve_cudagraph_mode_and_sizes,
    # starting from vLLM's GPU default FULL_AND_PIECEWISE with attention as a splitting op (the CPU config's
    # mode is NONE, so the default is set here; splitting ops and compilation mode are the release's own).
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    monkeypatch.setenv("SPARSE_ATTN_CUDAGRAPH", choice)
    envs.reset_for_tests()
    for name in ("FLASHINFER", "FLASH_ATTN"):
        graphs.restrict_cudagraph_support(backend(name))
    compilation = copy.deepcopy(cpu_config.compilation_config)
    assert compilation.splitting_ops_contain_attention()
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    if hasattr(compilation, "resolve_cudagraph_mode_and_sizes"):
        levels = [AttentionCGSupport[ask(name, cpu_config)] for name in ("FLASHINFER", "FLASH_ATTN")]
        minimum = min(levels, key=lambda level: level.value)
        resolved = compilation.resolve_cudagraph_mode_and_sizes(minimum, "FLASHINFER", uniform_decode_query_len=query_len)
    else:
        resolved = resolve_in_v1_runner(cpu_config, compilation, query_len)
    assert resolved.name == mode
