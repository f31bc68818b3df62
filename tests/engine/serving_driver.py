"""Start a real vLLM engine on a checkpoint, generate greedily, report as JSON.

    python tests/engine/serving_driver.py CKPT OUT.json [--max-tokens 24] [--then-native]
        [--pipeline-parallel-size N] [--tensor-parallel-size N] [--distributed-executor-backend mp|ray]

A script (not a test) because vLLM's engine processes need the ``__main__``
guard. The sparse-attn plugin is loaded by vLLM itself through its
``vllm.general_plugins`` entry point; nothing here installs it.

``--then-native``: after the first generate (and its stats), switch every layer
back to vLLM's own impl (tests/engine/native_switch.py) and generate the same
prompts again in the same engine: ``native_tokens``, ``native_stats`` and the
layers as the workers hold them (``layers``: impl class, allocated KV-cache shape).
"""

import argparse
import json
import math
import os
import time


PROMPTS = [
    # long, repetitive prompts: prefill spans many KV tiles, retrieval heads have targets
    " ".join(["the river runs north of the old stone bridge and the king reads a letter"] * 40),
    " ".join(["in the morning the small village near the harbor opens its market"] * 25),
    "red green blue " * 60,
    "Once upon a time",
]


def stats_or_reason(llm, **kwargs):
    try:
        return llm.collective_rpc("sparse_attn_stats", kwargs=kwargs)
    except Exception as exc:  # SPARSE_ATTN_DISABLE=1: the plugin added no RPC
        return {"unavailable": str(exc)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--then-native", action="store_true")
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--distributed-executor-backend", default="mp", choices=("mp", "ray"))
    args = ap.parse_args()

    started = time.monotonic()
    from compat import launch

    os.environ.update(launch.cpu_parallel_env(args.tensor_parallel_size * args.pipeline_parallel_size))
    from vllm import LLM, SamplingParams

    kwargs = {}
    if args.then_native:
        kwargs["worker_extension_cls"] = "tests.engine.native_switch.NativeSwitch"
    if args.pipeline_parallel_size > 1 or args.tensor_parallel_size > 1:
        kwargs.update(pipeline_parallel_size=args.pipeline_parallel_size, tensor_parallel_size=args.tensor_parallel_size,
                      distributed_executor_backend=args.distributed_executor_backend)
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, seed=0, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
    timing = {"engine_start_s": round(time.monotonic() - started, 1)}

    def generate():
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], outputs

    t0 = time.monotonic()
    tokens, outputs = generate()
    timing["generate_s"] = round(time.monotonic() - t0, 1)
    report = {
        "tokens": tokens,
        "logprobs_finite": all(
            math.isfinite(lp.logprob) for o in outputs for step in o.outputs[0].logprobs for lp in step.values()
        ),
        "prompt_lens": [len(o.prompt_token_ids) for o in outputs],
        "stats": stats_or_reason(llm, reset=True) if args.then_native else stats_or_reason(llm),
    }
    if args.then_native:
        report["switched"] = llm.collective_rpc("native_switch_restore")
        t0 = time.monotonic()
        report["native_tokens"], _ = generate()
        timing["generate_native_s"] = round(time.monotonic() - t0, 1)
        report["native_stats"] = stats_or_reason(llm)
        report["layers"] = llm.collective_rpc("native_switch_describe")
    report["timing"] = timing
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
