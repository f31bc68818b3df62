"""compat against the installed real release: the probe equals the expected
table's row exactly, the seed regression stays fixed, and a forced wrong layout
fails loudly at the first view. Runs in the tox matrix / engine envs."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (tests/matrix runs in the tox vllm*/engine* envs)", allow_module_level=True)

import torch

import compat
from tests.matrix.expected_table import EXPECTED, release, row

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    for name in ("SPARSE_ATTN_KV_LAYOUT", "SPARSE_ATTN_CACHE_WRITER"):
        monkeypatch.delenv(name, raising=False)
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


def test_probe_equals_the_expected_row_exactly():
    report = compat.probe()
    if release(report) not in EXPECTED:
        pytest.fail(
            f"{release(report)} has no row in tests/matrix/expected_table.py. Run this env with "
            f"`-- tests/matrix --record-expected -s`, check the printed row against the release's sources, and add it "
            f"(with the env's tox factor) in one change. Probe said: {row(report)}"
        )
    assert row(report) == EXPECTED[release(report)]


def test_probe_has_no_side_effects():
    compat.probe()
    assert not torch.cuda.is_initialized()
    from vllm.config import get_current_vllm_config_or_none

    assert get_current_vllm_config_or_none() is None


def test_seed_regression_packed_flashinfer_views():
    """0.30/0.31 FlashInfer hands the impl [B, H, N, 2D]; adapters that assumed
    [B, 2, N, H, D] failed at warm-up. compat must give [B, N, H, D] views of it."""
    report = compat.probe()
    entry = report.backends["FLASHINFER"]
    if not entry.importable:
        pytest.skip(f"FlashInfer not importable here: {entry.import_error}")
    B, N, H, D = 6, 16, 4, 8
    if entry.layout is compat.KVLayout.PACKED:
        cache = torch.randn(B, N, H, 2 * D).permute(0, 2, 1, 3)  # LBNHC, vLLM's default
        k, v = compat.kv_cache_views(cache, head_size=D, backend="FLASHINFER")
        assert torch.equal(k, cache.transpose(1, 2)[..., :D]) and torch.equal(v, cache.transpose(1, 2)[..., D:])
    else:
        assert entry.layout is compat.KVLayout.BLOCKS_FIRST
        cache = torch.randn(B, 2, N, H, D)
        k, v = compat.kv_cache_views(cache, head_size=D, backend="FLASHINFER")
        assert torch.equal(k, cache[:, 0]) and torch.equal(v, cache[:, 1])
    assert k.shape == v.shape == (B, N, H, D)
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    # FlashInfer writes inside forward up to 0.16.0 (the adapter writes there); the
    # recorded row says which, so the regression check does not assume one.
    assert (compat.cache_writer("FLASHINFER") is None) == (EXPECTED[release(report)]["FLASHINFER"][2] == "vllm")


WRONG = {"blocks-first": "packed", "kv-first": "packed", "packed": "blocks-first", "cpu-packed": "kv-first"}


@pytest.mark.parametrize("backend", ["FLASHINFER", "FLASH_ATTN", "CPU_ATTN"])
def test_forced_wrong_layout_fails_at_the_first_view(backend, monkeypatch):
    entry = compat.probe().backends[backend]
    if entry.layout is None:
        pytest.skip(f"{backend}: no layout to contradict ({entry.import_error or entry.layout_detail})")
    B, N, H, D = 11, 32, 3, 40  # the shapes vLLM itself allocates in the contract tests
    shapes = {"blocks-first": (B, 2, N, H, D), "kv-first": (2, B, N, H, D), "packed": (B, H, N, 2 * D), "cpu-packed": (B, H, N, 2 * D)}
    cache = torch.zeros(shapes[entry.layout.value])
    wrong = WRONG[entry.layout.value]
    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", f"{backend}={wrong}")
    compat.reset_for_tests()
    assert compat.probe().backends[backend].layout_source == "env"
    with pytest.raises(compat.UnsupportedLayoutError) as info:
        compat.kv_cache_views(cache, head_size=D, backend=backend, isa="vec")
    assert str(list(cache.shape)) in str(info.value) and wrong in str(info.value) and "env" in str(info.value)
