"""The trained-model demo's accuracy table: dense beside sparse per task, and which tasks dense gets right."""

from __future__ import annotations

from types import SimpleNamespace

from sparse_attn.demo.run import _accuracy_table


def test_accuracy_table_names_the_tasks_dense_gets_right():
    s = lambda task, answers, length: SimpleNamespace(task=task, answers=answers, length=length)
    samples = [s("niah_single", ("4821937",), 768), s("niah_single", ("1234567",), 1536),
               s("qa", ("Oslo",), 768), s("qa", ("Lima",), 1536)]
    dense = {"texts": ["4821937", "1234567.", "Paris", "Lima"]}
    sparse = {"texts": ["4821937", "1234560", "Paris", "Lima"]}
    tokens_d = [[1, 2], [3, 4], [5, 6], [7, 8]]
    tokens_s = [[1, 2], [3, 9], [5, 6], [7, 8]]
    text = _accuracy_table(samples, sparse, dense, tokens_s, tokens_d)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["niah_single"], ["qa"], ["all"])}
    assert rows["niah_single"][1:5] == ["2", "100%", "50%", "3/4"]
    assert rows["qa"][1:5] == ["2", "50%", "50%", "4/4"]
    assert rows["all"][1:4] == ["4", "75%", "50%"]
    assert "dense gets these right (their sparse column measures what skipping costs): niah_single (2/2)" in text
    assert "dense fails these at this model size (a sparse score there says nothing about sparsity): qa (1/2)" in text
    assert "768 and 1536 tokens" in text
