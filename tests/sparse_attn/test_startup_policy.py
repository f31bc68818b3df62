"""One start-up policy (issue 18 item 5): ``sparse-attn serve --validate-only`` and the
plugin in a worker decide the same thing for the same section, and say the same words.

The worker is the attribute path compat.worker reads (``vllm_config.model_config``);
vLLM itself is not needed for ``_load_config``. The engine tests
(tests/engine/test_config_sources.py, test_http_serve.py) run both through a real server.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from types import SimpleNamespace

import pytest

import compat
from sparse_attn import plugin
from sparse_attn.cli import main

SKIP = {"config_groups": {"group_0": {
    "algorithm": "skip_softmax",
    "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                               "prefill": {"a": 7.93, "b": 8.61}, "decode": {"a": 0.12, "b": 9.85}},
    "target_sparsity": {"prefill": 0.5, "decode": 0.5},
}}}
NM = {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4}


def group(**extra):
    section = copy.deepcopy(SKIP)
    section["config_groups"]["group_0"].update(extra)
    return section


def never_skip():
    section = copy.deepcopy(SKIP)
    section["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"] = {"a": 1e6, "b": 4.0}
    return section


SECTIONS = [
    # id, section (None: absent), strict, expected decision: "sparse" | "native" | "error"
    ("absent", None, False, "native"),
    ("minimax_own", {"use_sparse_attention": True, "sparse_topk_blocks": 16}, False, "native"),
    ("config_groups_list", {"config_groups": [1]}, False, "native"),
    ("config_groups_list_strict", {"config_groups": [1]}, True, "error"),
    ("valid", SKIP, False, "sparse"),
    ("malformed_a", group(threshold_scale_factor={"formula": "a * exp(b * target_sparsity)", "prefill": {"a": -1, "b": 1}}),
     False, "error"),
    ("unserved_group", {"config_groups": {**SKIP["config_groups"], "group_1": NM}}, False, "sparse"),
    ("unserved_group_strict", {"config_groups": {**SKIP["config_groups"], "group_1": NM}}, True, "error"),
    ("only_nm_group", {"config_groups": {"group_1": NM}}, False, "native"),
    ("near_miss_key", group(ignor=["model.layers.0.*"]), False, "sparse"),
    ("near_miss_key_strict", group(ignor=["model.layers.0.*"]), True, "error"),
    ("never_skips_at_4096", never_skip(), False, "sparse"),
]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("SPARSE_ATTN_DISABLE", "SPARSE_ATTN_STRICT", "SPARSE_ATTN_CALIBRATION_SCALES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)
    compat.reset_for_tests()
    yield
    compat.reset_for_tests()


def _worker(hf: dict, model: str):
    return SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(
        model=model, hf_config=SimpleNamespace(**hf), max_model_len=hf["max_position_embeddings"])))


@pytest.mark.parametrize("section,strict,decision", [c[1:] for c in SECTIONS], ids=[c[0] for c in SECTIONS])
def test_serve_and_the_worker_decide_alike(tmp_path, capsys, caplog, monkeypatch, section, strict, decision):
    if strict:
        monkeypatch.setenv("SPARSE_ATTN_STRICT", "1")
    hf = {"model_type": "llama", "max_position_embeddings": 4096}
    if section is not None:
        hf["sparse_attention_config"] = section
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(hf))

    code = main(["serve", str(ckpt), "--validate-only"])
    served = capsys.readouterr().err
    normalise = lambda notes: [n.replace(f"the HF config of {ckpt}", "SRC").replace(str(ckpt / "config.json"), "SRC")
                               .replace(str(ckpt), "SRC") for n in notes]
    serve_warnings = sorted(line.split("warning: ", 1)[1] for line in served.splitlines() if "warning: " in line)

    caplog.set_level(logging.INFO, logger="sparse_attn")
    try:
        config, summary_warnings = plugin._load_config(_worker(hf, str(ckpt)))
        worker = "sparse" if config is not None else "native"
    except plugin.SparseAttentionStartupError as exc:
        worker, config, summary_warnings = "error", None, ()
        # the same refusal, word for word after each command's prefix (sources normalised)
        refused = [line.removeprefix("sparse-attn serve: error: ") for line in served.splitlines() if "error: " in line]
        assert normalise([str(exc).removeprefix("sparse-attn: ")]) == normalise(refused)
    worker_warnings = sorted(r.getMessage().removeprefix("sparse-attn: ") for r in caplog.records
                             if r.levelno == logging.WARNING)

    assert worker == decision
    assert (code == 2) is (decision == "error")
    if decision != "error":
        # the source each side names differs (a file, vLLM's HF config); the sentences do not
        assert normalise(worker_warnings) == normalise(serve_warnings)
        # what the install summary (the stats RPC) carries is what was logged
        assert normalise(sorted(summary_warnings)) == normalise(worker_warnings)
    if decision == "sparse":
        assert "validated" in served and config is not None
