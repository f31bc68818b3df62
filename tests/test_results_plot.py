"""``benchmarks/plot_results.py`` draws the README's results figure from measured numbers only:
the data file agrees with the pages that publish each number, and the script writes a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "benchmarks" / "results_data.json").read_text())


def _page(source: str) -> str:
    return (ROOT / source.split("#")[0]).read_text()


@pytest.mark.parametrize("row", DATA["speed"], ids=lambda r: r["label"])
def test_each_speed_point_is_the_ratio_its_page_publishes(row):
    sparse, dense = (row["sparse_per_s"], row["dense_per_s"]) if "sparse_per_s" in row else \
        (row["dense_ms"], row["sparse_ms"])          # times: dense / sparse; rates: sparse / dense
    assert row["speedup_vs_own_dense"] == pytest.approx(sparse / dense, abs=5e-4)
    page = _page(row["source"])
    assert f"{row['tile_sparsity'] * 100:.1f} %" in page
    for number in (sparse, dense):
        assert str(number) in page


def test_each_accuracy_point_is_in_its_page():
    acc = DATA["accuracy"]
    page = _page(acc["source"])
    assert f"dense {acc['dense_match'] * 100:.1f} %" in page
    for r in acc["rows"]:
        assert f"| {r['target']} | {r['match'] * 100:.1f} % |" in page
        assert f"{r['decode_sparsity'] * 100:.1f} %" in page


def test_the_script_writes_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results.png"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot_results.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list(tmp_path.glob("*.tmp"))
