"""``benchmarks/plot_serving.py``: reading a bench_serving summary into the series it draws, and the PNG."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plot_serving", ROOT / "benchmarks" / "plot_serving.py")
plot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot)


def _row(workload, phase, s, **kw):
    return {"workload": workload, "phase": phase, "s": s, "native": 10.0, "plugin-dense": 12.0, "plugin-sparse": 14.0,
            "attention_bound": 2 / (2 - s), "attention_achieved": 1.1, "step_bound": 1.05, "step_achieved": 1.02, **kw}


SUMMARY = {"bound_table": [_row("8000 tok x 1", "decode", 0.47), _row("2048 tok x 1", "decode", 0.37),
                           _row("2048 tok x 4", "decode", 0.38), _row("2048 tok x 1", "prefill", 0.46)]}


@pytest.mark.parametrize("name, parsed", [("2048 tok x 1", (2048, 1)), ("8000 tok x 16", (8000, 16))], ids=["x1", "x16"])
def test_a_workload_name_is_its_length_and_batch(name, parsed):
    assert plot.parse_workload(name) == parsed


def test_a_summary_of_another_timing_mode_is_refused():
    with pytest.raises(ValueError, match="LEN tok x N"):
        plot.parse_workload("2 prompts")


def test_series_are_per_batch_and_sorted_by_length():
    got = plot.series(SUMMARY["bound_table"], "decode")
    assert list(got) == [1, 4]
    assert [(r["length"], r["s"]) for r in got[1]] == [(2048, 0.37), (8000, 0.47)]
    assert [r["length"] for r in got[4]] == [2048]
    assert list(plot.series(SUMMARY["bound_table"], "prefill")) == [1]


def test_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot.draw(SUMMARY, tmp_path / "sub" / "serving.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_empty_summary_is_an_error_not_an_empty_figure(tmp_path):
    assert plot.main([str(tmp_path / "missing.json"), str(tmp_path / "o.png")]) == 2
    (tmp_path / "s.json").write_text('{"bound_table": []}')
    assert plot.main([str(tmp_path / "s.json"), str(tmp_path / "o.png")]) == 2
