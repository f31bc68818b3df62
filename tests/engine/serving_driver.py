"""Start a real vLLM engine on a checkpoint, generate greedily, report as JSON.

    python tests/engine/serving_driver.py CKPT OUT.json [--max-tokens 24]

A script (not a test) because vLLM's engine processes need the ``__main__``
guard. The sparse-attn plugin is loaded by vLLM itself through its
``vllm.general_plugins`` entry point; nothing here installs it.
"""

import argparse
import json
import math


PROMPTS = [
    # long, repetitive prompts: prefill spans many KV tiles, retrieval heads have targets
    " ".join(["the river runs north of the old stone bridge and the king reads a letter"] * 40),
    " ".join(["in the morning the small village near the harbor opens its market"] * 25),
    "red green blue " * 60,
    "Once upon a time",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    try:
        stats = llm.collective_rpc("sparse_attn_stats")
    except Exception as exc:  # SPARSE_ATTN_DISABLE=1: the plugin added no RPC
        stats = {"unavailable": str(exc)}
    report = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs_finite": all(
            math.isfinite(lp.logprob) for o in outputs for step in o.outputs[0].logprobs for lp in step.values()
        ),
        "prompt_lens": [len(o.prompt_token_ids) for o in outputs],
        "stats": stats,
    }
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
