"""``benchmarks/adapter_overhead.py`` runs the sparse decode layer it times (not the native impl) and says both
times; a smoke run on a short cache, so the benchmark cannot rot unnoticed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sparse_attn.kernels import cpu_impl

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("adapter_overhead", ROOT / "benchmarks" / "adapter_overhead.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.skipif(not cpu_impl.status().available, reason="compiled CPU kernel unavailable")
@pytest.mark.parametrize("extra", [[], ["--adapter-writes"]], ids=["vllm-writes", "adapter-writes"])
def test_times_the_sparse_layer_and_the_kernel_alone(extra, capsys, monkeypatch):
    import compat

    monkeypatch.setenv("SPARSE_ATTN_KV_LAYOUT", "CPU_ATTN=cpu-packed")
    monkeypatch.setenv("SPARSE_ATTN_CACHE_WRITER", "adapter")
    try:
        assert bench.main(["--kv", "300", "--repeats", "2", *extra]) == 0
    finally:
        compat.reset_for_tests()
    out = capsys.readouterr().out
    assert "layer forward (adapter + kernel)" in out and "kernel call alone" in out and "per layer" in out
