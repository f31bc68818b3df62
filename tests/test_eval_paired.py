"""``benchmarks/eval_paired.py``: two eval work directories paired prompt by prompt, against KLs worked by hand."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("eval_paired", ROOT / "benchmarks" / "eval_paired.py")
paired = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired)

LOG = math.log
HALF = {"1": LOG(0.5), "2": LOG(0.5)}


def _cell(answer_tops, generated):
    """One eval cell of teacher-forced answer positions only (no greedy steps), one entry per prompt."""
    return {"text": ["x"] * len(answer_tops), "answer_top": answer_tops, "generated": generated}


def _workdir(path: Path, dense_cells, sparse_cells, target="0.5"):
    path.mkdir()
    (path / "out-dense.json").write_text(json.dumps({"cells": dense_cells, "top_k": 2}))
    (path / f"out-target-{target}.json").write_text(json.dumps({"cells": sparse_cells, "top_k": 2}))
    return path


def _kl(p, q):  # two tokens, no rest bucket
    return sum(pi * LOG(pi / qi) for pi, qi in zip(p, q))


def test_the_paired_difference_is_each_prompts_kl_difference(tmp_path, capsys):
    # Two prompts of one position each; dense is (0.5, 0.5). A: (0.75, 0.25) and (0.5, 0.5); B: (0.75, 0.25) twice.
    q = {"1": LOG(0.75), "2": LOG(0.25)}
    dense = [_cell([[HALF], [HALF]], [[7], [8]])]
    a = _workdir(tmp_path / "a", dense, [_cell([[q], [HALF]], [[7], [8]])])
    b = _workdir(tmp_path / "b", dense, [_cell([[q], [q]], [[7], [9]])])
    assert paired.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    k = _kl((0.5, 0.5), (0.75, 0.25))  # 0.1438 nats
    assert "prompts paired: 2 (of 2)" in out
    assert f"A: {k / 2:.4f} +-" in out and f"B: {k:.4f} +- 0.0000" in out
    # differences (0, k): sample sd k / sqrt(2), so the interval is 1.96 (k / sqrt(2)) / sqrt(2) = 0.98 k
    assert f"paired B - A: {k / 2:.4f} +- {0.98 * k:.4f}" in out


@pytest.mark.parametrize("problem, message", [("missing", "not found"), ("dense-differs", "cannot be paired")],
                         ids=["no-outputs", "different-dense-tokens"])
def test_runs_that_cannot_be_paired_are_refused(tmp_path, capsys, problem, message):
    dense = [_cell([[HALF]], [[7]])]
    a = _workdir(tmp_path / "a", dense, [_cell([[HALF]], [[7]])])
    if problem == "missing":
        b = tmp_path / "b"
        b.mkdir()
    else:
        b = _workdir(tmp_path / "b", [_cell([[HALF]], [[6]])], [_cell([[HALF]], [[6]])])
    with pytest.raises(SystemExit) as exc:
        paired.main([str(a), str(b)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
